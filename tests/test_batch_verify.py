"""Batched verification on the real model, engine level: trees of 8 requests of
different prompt lengths verified in one packed forward per step give each request exactly the
target's greedy output (== the request alone == `generate`), with tree sizes that differ between
requests and change between steps; at temperature 1 the emitted tokens of batched requests follow
the target's softmax; a KV budget too small for the batch evicts and re-prefills without changing
a token."""
from __future__ import annotations

import os
import random

import pytest
import torch
from scipy.stats import chisquare

from specmesh_services.common.sampling import Sampler, SamplingParams
from specmesh_services.common.tree import TokenTree
from specmesh_kernels.backend import select_attention_backend
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh.v1 import pool_pb2

BATCH = 8
MAX_TOKENS = 64  # hf_greedy_reference's length
TRITON_TOKENS = 24  # the interpreted Triton path is slow: a 4-layer target, a few steps


def draft_tree(reference: list[int], generated: int, key: str, vocab: int) -> TokenTree:
    """A tree whose shape and size depend on (request, step): the reference's next tokens up to
    a random point, then a wrong token, plus random side branches; sometimes empty."""
    rng = random.Random(f"{key}:{generated}")
    if rng.random() < 0.1:
        return TokenTree()
    truth = reference[generated:generated + rng.randint(1, 8)]
    chain = truth[:rng.randint(0, len(truth))] + [rng.randrange(vocab)]
    tokens, parents = list(chain), list(range(-1, len(chain) - 1))
    for _ in range(rng.randint(0, 12)):
        tokens.append(rng.randrange(vocab))
        parents.append(rng.randint(-1, len(tokens) - 2))
    return TokenTree(tuple(tokens), tuple(parents))


def state(request_id: str, prompt: list[int], params=SamplingParams(), seed: int = 0):
    return pool_pb2.RequestState(request_id=request_id, prompt_ids=prompt,
                                 sampling=params.to_pb(), seed=seed)


def run_batch(engine: VerifierEngine, prompts: dict[str, list[int]],
              references: dict[str, list[int]], key: str) -> tuple[dict, list[list[int]]]:
    """Steps all requests together until each has MAX_TOKENS; returns outputs and tree sizes
    per step."""
    for rid, prompt in prompts.items():
        engine.load(state(rid, prompt), [])
    sizes = []
    while True:
        todo = [rid for rid in prompts if engine.requests[rid].generated < MAX_TOKENS]
        if not todo:
            break
        items = [(rid, draft_tree(references[rid], engine.requests[rid].generated, key + rid,
                                  engine.lm.vocab_size)) for rid in todo]
        results = engine.step(items)
        assert all(r.error is None for r in results), [r.error for r in results]
        outcomes = [r.outcome for r in results if r.outcome is not None]
        for o in outcomes:  # what the router's batch-aware sizing regresses on
            assert (o.batch_size, o.batch_nodes) == (len(outcomes),
                                                     sum(x.tree_size for x in outcomes))
            assert o.batch_rows >= o.batch_nodes + o.batch_size
        sizes.append([len(t) for _, t in items])
    out = {rid: engine.requests[rid].tokens[len(p):len(p) + MAX_TOKENS]
           for rid, p in prompts.items()}
    for rid in prompts:
        engine.release(rid)
    return out, sizes


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def verify_lm(request, target_lm, target_path):
    """The target the engine serves: the CPU one, and on a GPU machine the same float32 weights
    on CUDA (TF32 off: float32 products as on the CPU), whose engine walks row-parallel."""
    if request.param == "cpu":
        return target_lm
    from specmesh_services.common import models
    from specmesh_services.common.lm import CausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    return CausalLM(models.load_model(target_path, torch.float32, device="cuda"), target_lm.name)


@pytest.fixture(scope="module")
def batch_prompts(chat_prompt_ids, hf_greedy_reference):
    prompts = {f"q{i}": chat_prompt_ids(i) for i in range(BATCH)}
    references = {f"q{i}": hf_greedy_reference[i] for i in range(BATCH)}
    assert len({len(p) for p in prompts.values()}) >= 6, "prompt lengths should differ"
    return prompts, references


def test_batch_of_8_equals_alone_and_target_generate(verify_lm, batch_prompts):
    prompts, references = batch_prompts
    engine = VerifierEngine(verify_lm, limits=EngineLimits(kv_budget_tokens=4096))
    batched, sizes = run_batch(engine, prompts, references, "t")
    assert any(len(set(step)) > 1 for step in sizes), "tree sizes should differ within a step"
    assert len({tuple(step) for step in sizes}) > 1, "tree sizes should change between steps"
    assert max(len(step) for step in sizes) == BATCH
    alone = {}
    for rid in prompts:
        out, _ = run_batch(engine, {rid: prompts[rid]}, references, "t")
        alone.update(out)
    for rid in prompts:
        assert batched[rid] == references[rid], f"{rid}: batched output differs from generate"
        assert alone[rid] == references[rid], f"{rid}: output alone differs from generate"
    assert engine.store.used_blocks == 0, "released requests must free their KV"


def test_row_parallel_walk_gives_the_targets_tokens(target_lm, batch_prompts):
    """The walk a GPU runs (every row drawn at once, one copy to the host a step), here on the
    CPU through the same code: the target's greedy output, batched, trees of any shape."""
    prompts, references = batch_prompts
    some = dict(list(prompts.items())[:4])
    engine = VerifierEngine(target_lm, limits=EngineLimits(kv_budget_tokens=4096))
    engine.row_parallel_walk = True
    batched, _ = run_batch(engine, some, references, "r")
    for rid in some:
        assert batched[rid] == references[rid], f"{rid}: row-parallel walk differs from generate"


def test_small_token_budget_prefills_in_chunks(target_lm, batch_prompts):
    """max_batch_tokens below the prompt lengths: prompts are prefilled over several steps,
    requests join as their prefill completes, outputs unchanged."""
    prompts, references = batch_prompts
    few = dict(list(prompts.items())[:3])
    engine = VerifierEngine(target_lm, limits=EngineLimits(kv_budget_tokens=4096,
                                                           max_batch_tokens=24))
    for rid, prompt in few.items():
        engine.load(state(rid, prompt), [])
    deferred = 0
    while any(engine.requests[rid].generated < 16 for rid in few):
        items = [(rid, draft_tree(references[rid], engine.requests[rid].generated, rid,
                                  engine.lm.vocab_size)) for rid in few
                 if engine.requests[rid].generated < 16]
        deferred += sum(r.deferred for r in engine.step(items))
    assert deferred > 0
    for rid, prompt in few.items():
        assert engine.requests[rid].tokens[len(prompt):len(prompt) + 16] == references[rid][:16]


def binned(counts, expected, min_expected=5.0):
    big = expected >= min_expected
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    return obs.numpy(), exp.numpy()


def sampled_round(engine, contexts: dict[str, list[int]], trees: dict[str, TokenTree],
                  logits: dict[str, torch.Tensor], params: SamplingParams, r: int, per: int
                  ) -> list[tuple[str, int, int]]:
    """One step of `per` requests per context (seeds r * per + j), each re-registered at its
    prompt (its KV rows kept: no re-prefill): (request, its first emitted token, the loop-based
    sampler's draw from the context's logits with the same seed)."""
    items = []
    for name, prompt in contexts.items():
        for j in range(per):
            engine.load(state(f"{name}{j}", prompt, params, seed=r * per + j), [])
            items.append((f"{name}{j}", trees[name]))
    out = []
    for (rid, _), result in zip(items, engine.step(items)):
        w = result.outcome.walk
        prompt = contexts[rid[0]]
        alone = Sampler(params, engine.requests[rid].sampler.seed, len(prompt)).sample(
            logits[rid[0]], len(prompt), prompt)
        out.append((rid, w.tokens[0] if w.tokens else w.bonus, alone))
    return out


def test_sampling_distribution_with_batching(verify_lm, chat_prompt_ids):
    """Temperature 1: 2 contexts x 4 requests (distinct seeds) per step, 250 steps. Each
    request's first emitted token is the loop-based sampler's draw from the target's own
    (unbatched) logits with the same seed, and each context's tokens pass a chi-square test
    against the target's softmax.

    The chi-square threshold is 0.001: the draws are deterministic (seeds 0..999), and for context
    b those seeds happen to give p = 0.005 with the plain sampler alone, without any engine
    (100k seeds: p = 0.99, so the sampler is unbiased); the exact-draw assertion is what ties the
    batched engine to the reference."""
    hot = SamplingParams(temperature=1.0)
    contexts = {"a": chat_prompt_ids(3), "b": chat_prompt_ids(6)}
    engine = VerifierEngine(verify_lm, limits=EngineLimits(kv_budget_tokens=8192,
                                                           max_batch_tokens=8192))
    probs, logits, trees = {}, {}, {}
    for name, prompt in contexts.items():
        logits[name] = verify_lm.prefill(verify_lm.new_cache(), prompt)
        probs[name] = torch.softmax(logits[name], dim=-1).cpu()
        ranked = torch.argsort(probs[name], descending=True).tolist()
        # a: the likeliest token and a branch; b: an unlikely guess with children
        trees[name] = (TokenTree((ranked[0], ranked[1]), (-1, -1)) if name == "a" else
                       TokenTree((ranked[40], ranked[0]), (-1, 0)))
    rounds, per = 250, 4
    counts = {name: torch.zeros_like(p) for name, p in probs.items()}
    for r in range(rounds):
        for rid, token, alone in sampled_round(engine, contexts, trees, logits, hot, r, per):
            assert token == alone, f"{rid} round {r}: batched draw differs from the reference"
            counts[rid[0]][token] += 1
    for name in contexts:
        obs, exp = binned(counts[name], probs[name] * rounds * per)
        assert chisquare(obs, exp).pvalue > 0.001, f"context {name}"


def test_triton_path_gives_the_torch_paths_tokens(target_path, chat_prompt_ids):
    """The Triton kernels (tree attention + KV compaction, in the interpreter on CPU) serving
    the whole generation of a batch of 2 requests give the torch path's tokens, drafts accepted
    and rejected. The target's first 4 layers, whose own greedy tokens seed the drafts: the
    interpreter runs every kernel program in numpy (the kernels' values against torch's:
    test_kernels.py; the torch path against `generate`: the tests above)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU Triton runs only under TRITON_INTERPRET=1 (set by conftest)")
    from specmesh_services.common import models
    from specmesh_services.common.lm import CausalLM

    lm = CausalLM(models.load_model(target_path, torch.float32, num_layers=4), "layers:4")
    prompts = {f"q{i}": chat_prompt_ids(i) for i in range(2)}
    references = {}
    with torch.inference_mode():
        for rid, prompt in prompts.items():
            ids = torch.tensor([prompt])
            seq = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=TRITON_TOKENS, pad_token_id=0)
            references[rid] = seq[0, len(prompt):].tolist()
    outputs, steps = {}, {}
    for name in ("torch", "triton"):
        backend = select_attention_backend(lm.device, name)
        engine = VerifierEngine(lm, limits=EngineLimits(kv_budget_tokens=2048), backend=backend)
        assert engine.backend.name == name
        for rid, prompt in prompts.items():
            engine.load(state(rid, prompt), [])
        steps[name] = 0
        while any(engine.requests[rid].generated < TRITON_TOKENS for rid in prompts):
            items = [(rid, draft_tree(references[rid], engine.requests[rid].generated, rid,
                                      engine.lm.vocab_size)) for rid in prompts
                     if engine.requests[rid].generated < TRITON_TOKENS]
            assert all(r.error is None for r in engine.step(items))
            steps[name] += 1
        outputs[name] = {rid: engine.requests[rid].tokens[len(p):len(p) + TRITON_TOKENS]
                         for rid, p in prompts.items()}
    assert outputs["triton"] == outputs["torch"]
    assert steps["triton"] < TRITON_TOKENS, "drafted tokens should be accepted"
