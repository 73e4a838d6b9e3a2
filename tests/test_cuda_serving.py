"""Serving on a GPU, end to end on the real model (skipped without CUDA): the embedded mesh with
`device=cuda`, float32 with TF32 off, gives the target's own greedy tokens (CPU `generate`) with
trees drafted by the truncated draft model (wider than a chain; its steps replayed from CUDA
graphs) and by the shipped draft heads, both verified on the device. The engine-level CUDA cases (batches of 8, sampled chi-square) are
test_batch_verify's `cuda` parameter."""
import pytest
import torch

from test_lossless_greedy import assert_lossless_with_drafts, assert_target_tokens  # tests/

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUESTIONS = 8


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False


def test_embedded_on_cuda_with_draft_model_trees(base_settings, questions, hf_greedy_reference,
                                                 compute):
    settings = base_settings.with_overrides(
        device="cuda", drafters=["layers:24"],
        **{"speculation.depth": 3, "speculation.width": 2})
    assert_lossless_with_drafts(settings, questions[:QUESTIONS],
                                hf_greedy_reference[:QUESTIONS], compute)


def test_draft_models_on_cuda_replay_graphs_unless_told_not_to(base_settings):
    from specmesh_services.drafter.lean import LeanLM
    from specmesh_services.drafter.models import build_draft_models
    from specmesh_services.drafter.paged import PagedLM

    settings = base_settings.with_overrides(device="cuda", drafters=["layers:4"])
    (draft,) = build_draft_models(settings)
    assert isinstance(draft.lm, PagedLM)
    assert draft.lm.graphs.captured == len(draft.lm.graphs.buckets) and draft.level_seconds > 0
    (draft,) = build_draft_models(settings.with_overrides(draft_graph_rows=0))
    assert type(draft.lm) is LeanLM


def test_embedded_on_cuda_with_heads_trees(base_settings, questions, hf_greedy_reference,
                                           compute):
    import asyncio

    from test_lossless_greedy import generate_all
    from specmesh_services.launch.embedded import EmbeddedMesh

    settings = base_settings.with_overrides(device="cuda", target_runner="lean",
                                            drafters=["heads"])

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            return await generate_all(mesh, questions[:QUESTIONS])
    responses = asyncio.run(run())
    assert_target_tokens(responses, hf_greedy_reference[:QUESTIONS])
    assert sum(r.stats.accepted_tokens for r in responses) > 0
