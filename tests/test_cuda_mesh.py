"""The mesh on a GPU, where the CPU suite cannot go: the embedded mesh on SmolLM2's real weights
in float32 (TF32 off) gives the target's own greedy tokens with trees drafted by the shipped
heads and by the draft model, verified through the CUDA-graph step; a sampled run's tokens
follow the target's softmax. Skipped without CUDA. SmolLM2 comes from its package or from the
GGUF that TEST_SMOLLM2_GGUF names (bench/device.sh sets it to the file it joined)."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common import models
from specmesh_services.common.config import Settings
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.common.tree import TokenTree
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from test_batch_verify import binned, sampled_round  # tests/ is on the path
from test_lean_target import chain

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs CUDA with compiled Triton (set CUDA_VISIBLE_DEVICES)")

MODEL = "smollm2-135m"
DEVICE = "cuda"
PROMPTS, TOKENS = 4, 32
TEMPERATURE = 0.05  # the tiny random model's softmax is nearly flat over its 512 tokens at 1


@pytest.fixture(scope="module")
def smollm2(target_path) -> Path:
    return target_path


@pytest.fixture(scope="module")
def cuda_reference(smollm2, chat_prompt_ids) -> list[list[int]]:
    """transformers' greedy `generate` of the target in float32 on CUDA."""
    model = models.load_model(smollm2, torch.float32, linear="torch", device=DEVICE)
    out = []
    with torch.inference_mode():
        for i in range(PROMPTS):
            ids = torch.tensor([chat_prompt_ids(i)], device=DEVICE)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=TOKENS)
            out.append(seq[0, ids.shape[1]:].tolist())
    del model
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("draft", ["heads", "layers:24"])
def test_embedded_mesh_on_cuda_gives_the_target_greedy_tokens(draft, smollm2, cuda_reference,
                                                             questions, compute):
    from specmesh_services.launch.embedded import EmbeddedMesh

    assert not torch.backends.cuda.matmul.allow_tf32
    settings = Settings(model=MODEL, dtype="float32", device=DEVICE, drafters=[draft],
                        speculation={"tree_size": "fixed", "source": "model"})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            engine = mesh.worker.engine
            assert engine.lm.device.type == DEVICE and engine.target.graphs is not None
            responses = await asyncio.gather(*(
                mesh.generate(messages=[{"role": "user", "content": questions[i]["turns"][0]}],
                              max_tokens=TOKENS)
                for i in range(PROMPTS)))
            return responses, engine.target.graphs.replays
    responses, replays = asyncio.run(run())
    for i, (r, ref) in enumerate(zip(responses, cuda_reference)):
        assert list(r.token_ids) == ref[:len(r.token_ids)] and len(r.token_ids) >= min(
            TOKENS, len(ref)), f"prompt {i}"
    drafted = sum(r.stats.draft_tokens for r in responses)
    accepted = sum(r.stats.accepted_tokens for r in responses)
    assert replays > 0 and drafted > 0 and accepted > 0, (replays, drafted, accepted)


def test_plain_runs_through_the_heads_trees_on_cuda_give_the_target_greedy_tokens(
        smollm2, cuda_reference, chat_prompt_ids, compute):
    """The verifier's runs whose every round verifies the served heads' tree (drafted on the
    device from the round before's hidden state) through the graph-replayed step."""
    from test_plain_runs import entry
    from test_run_heads import heads_engine

    settings = Settings(model=MODEL, dtype="float32", device=DEVICE, drafters=["heads"],
                        verifier={"run_lookup": 0})

    def run():
        prompts = {f"r{i}": chat_prompt_ids(i) for i in range(PROMPTS)}
        engine = heads_engine(settings, prompts)
        done = engine.step_entries([entry(rid, 0, TOKENS) for rid in prompts])
        return ([tokens for _, tokens in done], engine.run_heads_accepted,
                engine.target.graphs.replays)
    got, accepted, replays = compute.submit(run).result()
    for tokens, ref in zip(got, cuda_reference):
        assert tokens[:len(ref)] == ref[:len(tokens)] and len(tokens) >= min(TOKENS, len(ref))
    assert accepted > 0 and replays > 0


def test_sampling_on_cuda_follows_the_softmax():
    """Sampling (a temperature that spreads the tiny model's tokens over a few dozen) through
    the graph-replayed step and the device draws: 2 contexts x 4
    requests a step, 250 steps; each context's first tokens pass a chi-square test against the
    target's softmax, and nearly every draw is the host sampler's own (the same seed) on the
    same logits (a rare near-tie may round the other way on the device)."""
    from test_step_graphs import VOCAB, tiny_qwen2_lean

    lean = tiny_qwen2_lean(DEVICE, torch.float32)
    hot = SamplingParams(temperature=TEMPERATURE)
    gen = torch.Generator().manual_seed(3)
    contexts = {c: torch.randint(0, VOCAB, (40,), generator=gen).tolist() for c in "ab"}
    engine = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=4096))
    assert engine.target.graphs is not None
    logits, probs, trees = {}, {}, {}
    for name, prompt in contexts.items():  # the next token's logits, eagerly, alone
        eager = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=1024, graph_rows=0))
        assert eager.store.reserve("r", len(prompt))
        logits[name] = eager.target.forward([chain("r", prompt, 0, True)])[0][-1].cpu()
        probs[name] = torch.softmax(logits[name] / TEMPERATURE, dim=-1)
        ranked = torch.argsort(probs[name], descending=True).tolist()
        trees[name] = TokenTree((ranked[0], ranked[1]), (-1, -1)) if name == "a" else \
            TokenTree((ranked[40], ranked[0]), (-1, 0))
    rounds, per, same = 250, 4, 0
    counts = {name: torch.zeros_like(p) for name, p in probs.items()}
    for r in range(rounds):
        for rid, token, alone in sampled_round(engine, contexts, trees, logits, hot, r, per):
            same += token == alone
            counts[rid[0]][token] += 1
    assert same >= 0.99 * rounds * per * len(contexts), same
    for name in contexts:
        obs, exp = binned(counts[name], probs[name] * rounds * per)
        assert chisquare(obs, exp).pvalue > 0.001, f"context {name}"
