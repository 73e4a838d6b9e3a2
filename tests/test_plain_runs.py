"""Plain runs: a plain step (an empty tree) with `plain_tokens` > 1 decodes several tokens in the
verifier, one forward each, and answers once. On the real SmolLM2 target (float32): the engine's
runs are the target's own greedy decoding, end after a stop token, give way to trees (a step
with a tree runs nothing more) and to the heads; through an embedded mesh at depth 0 the outputs
equal the target's greedy decoding with fewer steps than tokens, the first step one token, the
last run cut at max_tokens."""
from __future__ import annotations

import asyncio

import pytest

from specmesh.v1 import pool_pb2
from specmesh_services.common.config import PLAIN_DECODING
from specmesh_services.launch.embedded import EmbeddedMesh
from specmesh_services.verifier.engine import VerifierEngine

from test_batch_verify import state  # tests/ is on the path
from test_lossless_greedy import assert_target_tokens, generate_all

PROMPTS = 3


def entry(request_id: str, base_len: int, plain_tokens: int, stops=(), tree=None):
    out = pool_pb2.DraftEntry(request_id=request_id, step=1, base_len=base_len,
                              plain_tokens=plain_tokens, stop_token_ids=list(stops))
    if tree is not None:
        out.tree.tokens.extend(tree)
        out.tree.parents.extend(range(-1, len(tree) - 1))
    return out


def test_runs_decode_the_targets_greedy_tokens_and_end_at_stops(target_lm, chat_prompt_ids,
                                                                hf_greedy_reference, compute):
    def run():
        engine = VerifierEngine(target_lm)
        prompts = {f"r{i}": chat_prompt_ids(i) for i in range(PROMPTS)}
        for rid, prompt in prompts.items():
            engine.load(state(rid, prompt), [])
        ref = {f"r{i}": hf_greedy_reference[i] for i in range(PROMPTS)}
        # r0 runs 6 tokens; r1 stops after its 3rd token; r2 asks for one token only
        first = engine.step_entries([entry("r0", 0, 6), entry("r1", 0, 6, stops=[ref["r1"][2]]),
                                     entry("r2", 0, 1)])
        got = {rid: tokens for (_, tokens), rid in zip(first, prompts)}
        assert got["r0"] == ref["r0"][:6] and list(first[0][0].continued) == ref["r0"][1:6]
        assert got["r1"] == ref["r1"][:3]
        assert got["r2"] == ref["r2"][:1] and not first[2][0].continued
        for rid, tokens in got.items():  # the engine holds what it answered
            assert engine.requests[rid].tokens == prompts[rid] + tokens
        # a step with a tree decodes nothing more for the plain entries beside it
        tree = ref["r0"][6:8]  # r0's next two tokens, both accepted
        mixed = engine.step_entries([entry("r0", 6, 1, tree=tree), entry("r2", 1, 6)])
        assert mixed[0][1] == ref["r0"][6:9] and mixed[1][1] == ref["r2"][1:2]
        # the heads draft below the step's bonus: no run for an entry asking for them
        asked = entry("r2", 2, 6)
        asked.heads_nodes = 4
        assert engine.step_entries([asked])[0][1] == ref["r2"][2:3]
    compute.submit(run).result()


@pytest.mark.parametrize("run_seconds", [0.0, 1e-6, 60.0])
def test_plain_mesh_equals_the_target_in_fewer_steps(base_settings, questions,
                                                     hf_greedy_reference, compute, run_seconds):
    """Runs of `plain_tokens`; with `plain_run_seconds` longer where the request's measured
    plain tokens fit in it (60 s: the whole output after the first run), never shorter."""
    settings = base_settings.with_overrides(**PLAIN_DECODING, **{
        "speculation.plain_tokens": 5, "speculation.plain_run_seconds": run_seconds})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            return await generate_all(mesh, questions[:8], concurrency=4)
    responses = asyncio.run(run())
    assert_target_tokens(responses, hf_greedy_reference[:8])
    for r in responses:
        emitted = [d.emitted for d in r.stats.decisions]
        assert sum(emitted) >= r.stats.completion_tokens == len(r.token_ids)
        assert emitted[0] == 1  # the first step's token streams at once
        if run_seconds < 1:
            assert max(emitted) == 5 and len(emitted) < len(r.token_ids) / 3
        elif len(r.token_ids) > 6:  # the first token, a run of 5, then the rest at once
            assert emitted[:3] == [1, 5, len(r.token_ids) - 6], emitted
