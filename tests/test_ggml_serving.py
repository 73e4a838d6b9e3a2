"""The target served by llama.cpp (`target_runner=ggml`) in an embedded mesh on the default
model's GGUF: trees drafted by the draft model (the target's full depth, so most of each tree
is accepted) and plain decoding, 4 requests in flight, every output is llama.cpp's own plain
greedy decoding of the same file or leaves it only at a near-tie (test_ggml_engine.py says
why). A GGUF file given as the model is served by it; draft heads draft from its hidden states.
Settings that the backend cannot serve are refused with a message. Skipped where llama-cpp-python is not installed."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from specmesh_services.common import models
from specmesh_services.common.device import check
from specmesh_services.common.config import PLAIN_DECODING, Settings, SettingsError
from specmesh_services.launch.embedded import EmbeddedMesh
from specmesh_services.common import ggml_model
from specmesh_services.common.ggml_model import GgmlModel, available
from specmesh_services.verifier.server import served_runner

from test_ggml_engine import assert_plain_or_tie, plain_decoding  # tests/ is on the path

QUESTIONS = 4
MAX_TOKENS = 32
COSINE = 0.98  # llama.cpp's hidden states against the float32 forward, each prompt row


@pytest.fixture(scope="module")
def reference(chat_prompt_ids):
    if (why := available()) is not None:
        pytest.skip(why)
    gguf = models.gguf_inputs(models.REGISTRY["smollm2-135m"])[0]
    return plain_decoding(gguf, {i: chat_prompt_ids(i) for i in range(QUESTIONS)}, MAX_TOKENS)


def serve(settings, questions, compute, engines: list | None = None,
          meshes: list | None = None):
    """The questions' responses from an embedded mesh of `settings` (its verifier engine
    appended to `engines`, the mesh to `meshes`, where given)."""
    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            if engines is not None:
                engines.append(mesh.worker.engine)
            if meshes is not None:
                meshes.append(mesh)
            return await asyncio.gather(*(
                mesh.generate(messages=[{"role": "user", "content": q["turns"][0]}],
                              max_tokens=MAX_TOKENS) for q in questions))
    return asyncio.run(run())


@pytest.mark.parametrize("depth", [3, 0])
def test_served_on_llama_cpp_gives_its_own_greedy_decoding(base_settings, questions, compute,
                                                          reference, depth):
    settings = base_settings.with_overrides(
        target_runner="ggml", drafters=["layers:30"],
        **{"speculation.depth": depth, "speculation.width": 2})
    responses = serve(settings, questions[:QUESTIONS], compute)
    outputs = {i: list(r.token_ids) for i, r in enumerate(responses)}
    assert assert_plain_or_tie(outputs, reference) >= 1
    for r in responses:
        assert len(r.token_ids) == MAX_TOKENS or r.finish_reason == 1  # 1: stop (EOS)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    if depth:
        assert drafted > 0 and accepted > 0.3 * drafted, (accepted, drafted)
    else:
        assert drafted == 0


def test_a_draft_model_with_a_gguf_drafts_on_llama_cpp(base_settings, questions, compute,
                                                      reference):
    """`draft_runner=ggml` runs a draft model that has a GGUF file on llama.cpp beside the
    llama.cpp target (here the target's own file: every drafted token is the target's guess):
    the outputs are still the plain decoding up to a near-tie, and nearly every drafted token
    is accepted."""
    from specmesh_services.drafter.ggml_lm import GgmlDraftLM

    settings = base_settings.with_overrides(
        target_runner="ggml", draft_runner="ggml", drafters=["smollm2-135m"],
        **{"speculation.depth": 4, "speculation.width": 1, "speculation.source": "model"})
    meshes = []
    responses = serve(settings, questions[:QUESTIONS], compute, meshes=meshes)
    assert isinstance(meshes[0].drafter.default.lm, GgmlDraftLM)
    assert_plain_or_tie({i: list(r.token_ids) for i, r in enumerate(responses)}, reference)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert drafted > 0 and accepted > 0.8 * drafted, (accepted, drafted)


def test_a_kv_budget_smaller_than_the_requests_still_serves_them(base_settings, questions,
                                                               compute, reference):
    """llama.cpp's context as small as the KV budget, which holds about two of the four requests:
    the others wait for room or are evicted and prefilled again (measured: 2 evictions), and
    every output is still the plain decoding up to a near-tie (the re-prefilled rows are
    computed in other calls than before, so more of them meet one)."""
    settings = base_settings.with_overrides(
        target_runner="ggml", drafters=["layers:30"],
        **{"speculation.depth": 3, "verifier.kv_budget_tokens": 256})
    engines = []
    responses = serve(settings, questions[:QUESTIONS], compute, engines)
    assert_plain_or_tie({i: list(r.token_ids) for i, r in enumerate(responses)}, reference)
    assert all(len(r.token_ids) == MAX_TOKENS or r.finish_reason == 1 for r in responses)
    assert engines[0].evictions > 0


def test_a_gguf_file_is_a_model_served_by_llama_cpp(questions, compute, reference, tmp_path):
    """`--model PATH.gguf`: converted once for its tokenizer, `auto` serves it on llama.cpp, and
    one request decoded plainly is llama.cpp's own greedy decoding, token for token."""
    gguf = models.gguf_inputs(models.REGISTRY["smollm2-135m"])[0]
    settings = Settings(model=str(gguf), cache_dir=tmp_path).with_overrides(
        **PLAIN_DECODING)
    assert served_runner(settings) == "ggml"
    assert served_runner(settings.with_overrides(dtype="float32")) == "auto"
    # the registry's choice for the default model: llama.cpp
    assert served_runner(Settings(cache_dir=tmp_path)) == "ggml"
    assert models.gguf_file(str(gguf), tmp_path) == gguf.resolve()
    response = serve(settings, questions[:1], compute)[0]
    assert list(response.token_ids) == reference[0][0][:len(response.token_ids)]
    assert (tmp_path / "models").is_dir()  # the tokenizer's directory, converted once


def test_draft_heads_draft_from_llama_cpp_hidden_states(base_settings, questions, compute,
                                                        reference, hf_target, chat_prompt_ids,
                                                        gguf):
    """llama.cpp's per-token embeddings are the final hidden states the heads read: close to
    the torch target's `last_hidden_state` (Q4_1 weights against their float32 dequantization),
    the logits beside them unchanged; served with the llama.cpp target, the heads' trees are
    drafted and accepted, every output plain decoding or a near-tie."""
    prompt = chat_prompt_ids(0)
    n = len(prompt)
    rows = (prompt, list(range(n)), [[0]] * n, [True] * n)
    with_states = GgmlModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, threads=2,
                            embeddings=True)
    logits = with_states.decode(*rows)
    hidden = torch.from_numpy(with_states.hidden)
    with_states.seq_remove(0)  # the last row alone asked for: its logits and state, the same
    last = with_states.decode(*rows[:3], [False] * (n - 1) + [True])
    assert (last == logits[-1:]).all() and (with_states.hidden == hidden[-1:].numpy()).all()
    with_states.close()
    # a prompt over several calls, the first without outputs: the last row's state
    chunked = GgmlModel(gguf, n_ctx=512, n_batch=16, n_seq_max=1, threads=2, embeddings=True)
    chunked.decode(*rows[:3], [False] * (n - 1) + [True])
    state = torch.from_numpy(chunked.hidden)
    chunked.close()
    assert state.shape == (1, hidden.shape[1]) and n > 16
    assert torch.nn.functional.cosine_similarity(state, hidden[-1:]).item() > 0.999
    plain = GgmlModel(gguf, n_ctx=512, n_batch=512, n_seq_max=1, threads=2)
    assert (plain.decode(*rows) == logits).all() and plain.hidden is None
    plain.close()
    with torch.inference_mode():
        want = hf_target.model(input_ids=torch.tensor([prompt])).last_hidden_state[0]
    assert hidden.shape == want.shape
    assert torch.nn.functional.cosine_similarity(hidden, want, dim=-1).min() > COSINE

    settings = base_settings.with_overrides(target_runner="ggml", drafters=["heads"],
                                            **{"speculation.max_nodes": 8})
    engines = []
    responses = serve(settings, questions[:QUESTIONS], compute, engines)
    assert engines[0].heads is not None
    assert_plain_or_tie({i: list(r.token_ids) for i, r in enumerate(responses)}, reference)
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    steps = sum(r.stats.steps for r in responses)
    assert drafted > 0 and accepted > 0.2 * steps, (drafted, accepted, steps)


def test_what_llama_cpp_cannot_serve_is_refused(base_settings, monkeypatch):
    ggml = base_settings.with_overrides(target_runner="ggml")
    monkeypatch.setattr(ggml_model, "available", lambda: None)  # as where it is installed
    assert check(ggml).type == "cpu"
    with pytest.raises(SettingsError, match="verifier.exact needs the torch target"):
        check(ggml.with_overrides(**{"verifier.exact": True}))
    with pytest.raises(SettingsError, match="target_runner=ggml runs no early pruning"):
        check(ggml.with_overrides(**{"verifier.prune": "on"}))
    assert check(ggml.with_overrides(drafters=["heads"])).type == "cpu"  # heads: served
    with pytest.raises(models.ModelNotFound, match="has no GGUF file"):
        models.gguf_file("/nonexistent/model-dir", ggml.cache_dir)
    monkeypatch.setattr(ggml_model, "available", lambda: "llama-cpp-python is not installed")
    with pytest.raises(SettingsError, match="target_runner=ggml: llama-cpp-python is not"):
        check(ggml)


def test_amx_kernels_only_from_the_patched_build(monkeypatch, caplog):
    """An unpatched llama.cpp built by GCC 12 raises SIGILL in its AMX product: on an AMX CPU
    only a build of deploy/install-ggml.sh (+specmesh) repacks the weights; elsewhere any may."""
    monkeypatch.setattr(ggml_model, "_has_amx", lambda: True)
    assert ggml_model.extra_buffers_safe("0.3.36+specmesh.1")
    assert not ggml_model.extra_buffers_safe("0.3.36")
    assert "make setup" in caplog.text
    monkeypatch.setattr(ggml_model, "_has_amx", lambda: False)
    assert ggml_model.extra_buffers_safe("0.3.36")


def test_auto_serves_the_default_model_on_llama_cpp(monkeypatch, tmp_path):
    """SmolLM2's registry entry measured llama.cpp's kernels faster than the torch target
    (ggml): auto picks them on the CPU wherever llama-cpp-python imports, and keeps the torch
    target where it does not, on a GPU and where the torch target is asked for (float32,
    --exact); an entry with ggml-amx takes them only where the AMX kernels run; the Qwen
    1.5B's entry says ggml too, the 0.5B's keeps the torch target."""
    settings = Settings(cache_dir=tmp_path)
    monkeypatch.setattr(ggml_model, "available", lambda: "llama-cpp-python is not installed")
    assert served_runner(settings) == "auto"
    monkeypatch.setattr(ggml_model, "available", lambda: None)
    assert served_runner(settings) == "ggml"
    assert served_runner(settings.with_overrides(dtype="float32")) == "auto"
    assert served_runner(settings.with_overrides(**{"verifier.exact": True})) == "auto"
    assert served_runner(settings.with_overrides(model="qwen2.5-coder-1.5b")) == "ggml"
    assert served_runner(settings.with_overrides(model="qwen2.5-coder-0.5b")) == "auto"
    amx_only = dataclasses.replace(models.REGISTRY["smollm2-135m"], auto_runner="ggml-amx")
    monkeypatch.setitem(models.REGISTRY, "smollm2-135m", amx_only)
    for amx, runner in ((True, "ggml"), (False, "auto")):
        monkeypatch.setattr(ggml_model, "amx_kernels", lambda amx=amx: amx)
        assert served_runner(settings) == runner
