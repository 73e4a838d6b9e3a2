"""The bucketed verify step (common/graphs.py) on the CPU, where it runs eagerly over the same
padded buffers a GPU replays from CUDA graphs: padded steps give the unpadded step's logits, a
request's tokens are the same whichever bucket its steps land in (or none: eager steps between
them), and what the bucketed path takes or leaves to the eager one. Its Triton attention runs
in the interpreter here; tests/test_cuda.py replays the graphs on a GPU."""
from __future__ import annotations

import os
import random

import pytest
import torch
import transformers

from specmesh_services.common.graphs import StepGraphs, buckets
from specmesh_services.common.lean import LeanDecoder
from specmesh_services.common.tree import TokenTree
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from test_batch_verify import state  # tests/ is on the path
from test_lean_target import chain, tree

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU Triton runs only under TRITON_INTERPRET=1 (conftest)")

VOCAB = 512


def tiny_qwen2_lean(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LeanDecoder:
    """A 2-layer Qwen2 of random weights (GQA 4 / 2 heads, q/k/v biases)."""
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0.0, 0.5)
    return LeanDecoder(model.to(device, dtype), "tiny-qwen2")


@pytest.fixture(scope="module")
def tiny_lean() -> LeanDecoder:
    return tiny_qwen2_lean()


def bucketed(engine: VerifierEngine, max_rows: int, **split) -> VerifierEngine:
    engine.target.graphs = StepGraphs(engine.lm, engine.store, max_rows, capture=False, **split)
    return engine


def test_buckets_cover_every_row_count():
    assert buckets(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert buckets(1) == (1,)
    graphs = buckets(48)
    assert [next(b for b in graphs if b >= r) for r in (1, 3, 17, 33, 48)] == [1, 4, 32, 48, 48]


@pytest.mark.parametrize("split", [{}, {"split_min": 16, "chunk": 16}])
def test_padded_step_gives_the_unpadded_logits(tiny_lean, split):
    """Three requests (a one-row step, a tree, a chain with logits) padded from 12 rows to a
    bucket of 16: the same logits and final hidden states as the eager packed forward; split
    (a threshold and chunks of 16 positions here, 4096 and 1024 served), each request's KV in
    1, 2 and 4 chunks, their partial states merged: the same again."""
    limits = EngineLimits(kv_budget_tokens=512, block_size=8)
    plain, padded = VerifierEngine(tiny_lean, limits=limits), \
        bucketed(VerifierEngine(tiny_lean, limits=limits), 64 if split else 16, **split)
    rng = random.Random(0)
    prompts = {rid: [rng.randrange(VOCAB) for _ in range(n)]
               for rid, n in (("a", 30), ("b", 9), ("c", 50))}
    outputs = {}
    for name, engine in (("eager", plain), ("padded", padded)):
        for rid, prompt in prompts.items():  # the prefixes, eagerly (chains without logits)
            assert engine.store.reserve(rid, len(prompt) + 8)
            engine.target.forward([chain(rid, prompt, 0, False)])
            engine.store.set_length(rid, len(prompt))
        step = [chain("a", [7], 30, True),
                tree("b", [3, 17, 99, 250, 8], [-1, 0, 0, 1, 1], 9),
                chain("c", [5, 6, 7, 8, 9, 10], 50, True)]
        assert padded.target.graphs.covers(step) and not padded.target.graphs.covers(
            [chain("a", [1, 2], 30, False)]), "prefill chunks run eagerly"
        if split:  # 64 rows a bucket of 64 cut in 4 chunks: more items than the table holds
            assert not padded.target.graphs.covers([chain("c", list(range(64)), 50, True)])
        logits = engine.target.forward(step)
        outputs[name] = (logits, engine.target.hidden, engine.target.last_bucket)
    (eager, eager_hidden, none), (ours, our_hidden, bucket) = outputs["eager"], outputs["padded"]
    assert (none, bucket) == (0, 16)
    assert padded.target.graphs.last_chunks == (4 if split else 0)  # c: 56 positions
    assert [x.shape for x in ours] == [x.shape for x in eager] == [(1, VOCAB), (5, VOCAB),
                                                                  (6, VOCAB)]
    for x, y in zip(ours, eager):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
        assert torch.equal(x.argmax(-1), y.argmax(-1))
    for x, y in zip(our_hidden, eager_hidden):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
    scratch = padded.store.scratch_slot  # padding rows wrote there, real rows where eager did
    used = [s for rid in prompts for s in padded.store.slots(rid, 0, padded.store.length(rid)
                                                             + 6).tolist()]
    assert scratch not in used
    torch.testing.assert_close(padded.store.k[:, used], plain.store.k[:, used], atol=1e-5,
                               rtol=0)


def greedy_reference(lean: LeanDecoder, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy tokens: one-row steps of an eager engine."""
    engine = VerifierEngine(lean, limits=EngineLimits(kv_budget_tokens=512, block_size=8,
                                                      graph_rows=0))
    engine.load(state("ref", prompt), [])
    while engine.requests["ref"].generated < n:
        engine.step([("ref", TokenTree())])
    return engine.requests["ref"].tokens[len(prompt):len(prompt) + n]


def step_tree(truth: list[int], rng: random.Random) -> TokenTree:
    """Up to 4 of the reference's next tokens and a wrong one, sometimes under a wrong sibling
    subtree (the accepted rows are then not the first ones: compaction moves them), plus 0, 1
    or 8 random side nodes: 1 .. 16 rows."""
    tokens, parents = [], []
    if rng.random() < 0.5:
        for _ in range(rng.randint(1, 2)):
            tokens.append(rng.randrange(VOCAB))
            parents.append(len(tokens) - 2)
    chain = truth[:rng.randint(0, 4)] + [rng.randrange(VOCAB)] * rng.randint(0, 1)
    for i, token in enumerate(chain):
        tokens.append(token)
        parents.append(-1 if i == 0 else len(tokens) - 2)
    for _ in range(rng.choice([0, 0, 1, 8])):
        tokens.append(rng.randrange(VOCAB))
        parents.append(rng.randint(-1, len(tokens) - 2))
    return TokenTree(tuple(tokens), tuple(parents))


def stream(engine: VerifierEngine, lean: LeanDecoder, seed: int = 1
           ) -> tuple[dict, dict, set[int]]:
    """Two requests stepped together, then one alone, with `step_tree` trees; returns their
    tokens, the target's greedy tokens and the buckets the steps used (0: eager)."""
    rng = random.Random(seed)
    prompts = {"x": [rng.randrange(VOCAB) for _ in range(20)],
               "y": [rng.randrange(VOCAB) for _ in range(35)]}
    ns = {"x": 40, "y": 8}
    references = {rid: greedy_reference(lean, p, ns[rid]) for rid, p in prompts.items()}
    for rid, prompt in prompts.items():
        engine.load(state(rid, prompt), [])
    seen = set()
    while any(engine.requests[rid].generated < ns[rid] for rid in prompts):
        items = [(rid, step_tree(references[rid][done:], rng)) for rid in prompts
                 if (done := engine.requests[rid].generated) < ns[rid]]
        assert all(r.error is None for r in engine.step(items))
        seen.add(engine.last_step.bucket)
    outputs = {rid: engine.requests[rid].tokens[len(p):len(p) + ns[rid]]
               for rid, p in prompts.items()}
    return outputs, references, seen


@pytest.mark.parametrize("split", [{}, {"split_min": 24, "chunk": 8}])
def test_stream_is_the_same_whichever_bucket(tiny_lean, split):
    """Trees of 1 .. 16 rows (side branches, the right path behind a wrong sibling): buckets of
    1 .. 16 rows, and eager steps where a step has more rows than the largest bucket (16 here,
    or its items more than the table) or a prefill chunk; split, KV past 24 positions cut into
    chunks of 8 (the right path's rows then cross chunk ends); every token is the target's own
    greedy one."""
    engine = bucketed(VerifierEngine(tiny_lean, limits=EngineLimits(kv_budget_tokens=512,
                                                                    block_size=8)),
                      128 if split else 16, **split)
    outputs, references, seen = stream(engine, tiny_lean)
    assert outputs == references
    assert 0 in seen and len(seen - {0}) >= 3, f"buckets used: {sorted(seen)}"
