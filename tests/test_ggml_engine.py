"""The verifier engine on llama.cpp's kernels, on the default model's GGUF: requests batched 1
and 4 at a time, trees of any shape that change every step (right guesses, wrong ones, side
branches, chains, empty trees): every output is llama.cpp's
own plain greedy decoding of the same file (one token a call), or leaves it only at a near-tie.

ggml computes a row's logits differently in a one-row call and in a many-row one (other
kernels: AMX tiles or per-row dot products, and attention over 256-cell blocks once the context
passes 256 cells; measured on SmolLM2 Q4_1 on the top-5 logits of 8 windows of 24 rows, on an
AMX Xeon: up to 0.6 apart with the plain kernels and 1.0 with the AMX ones, on logits near
7-25, 0 below 256 cells); where
the target's top logits are that close the argmax can flip. So: identical up to the first
divergence, and there the engine's token is one the plain decoding ranks within TIE of its top.
Skipped where llama-cpp-python is not installed."""
from __future__ import annotations

import numpy as np
import pytest

from specmesh.v1 import pool_pb2
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh_services.verifier.ggml_engine import GgmlEngine, GgmlLM
from specmesh_services.common.ggml_model import GgmlModel

from test_batch_verify import draft_tree, state  # tests/ is on the path

TOKENS = 24
PROMPTS = 4
TIE = 0.5  # logit margin within which one-row and many-row calls may rank two tokens apart
NEAR = 8  # tokens of each plain step kept as possible near-ties


@pytest.fixture(scope="module")
def prompts(chat_prompt_ids):
    return {f"q{i}": chat_prompt_ids(i) for i in range(PROMPTS)}


def plain_decoding(gguf, prompts: dict, tokens: int = TOKENS) -> dict:
    """llama.cpp decoding each prompt alone, one token a call, argmax (the reference): per
    request its tokens and, per token, {token: its logit's distance to the top} for the NEAR
    likeliest tokens."""
    model = GgmlModel(gguf, n_ctx=1024, n_batch=512, n_seq_max=1, threads=2)
    out = {}
    for rid, prompt in prompts.items():
        model.seq_remove(-1)
        logits = model.decode(prompt, list(range(len(prompt))), [[0]] * len(prompt),
                              [False] * (len(prompt) - 1) + [True])[0]
        generated, ties = [], []
        while len(generated) < tokens:
            ranked = np.argsort(logits)[::-1][:NEAR]
            generated.append(int(ranked[0]))
            ties.append({int(t): float(logits[ranked[0]] - logits[t]) for t in ranked[1:]})
            logits = model.decode([generated[-1]], [len(prompt) + len(generated) - 1], [[0]],
                                  [True])[0]
        out[rid] = (generated, ties)
    model.close()
    return out


@pytest.fixture(scope="module")
def plain_greedy(gguf, prompts):
    return plain_decoding(gguf, prompts)


def assert_plain_or_tie(outputs: dict, plain: dict) -> int:
    """Every output is the plain decoding, or leaves it first for a token the plain decoding
    ranks within TIE of its top; returns how many are identical."""
    same = 0
    for rid, got in outputs.items():
        want, ties = plain[rid]
        i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if i is None:
            same += 1
            continue
        gap = ties[i].get(got[i], float("inf"))
        assert gap < TIE, f"{rid}: token {i} is {got[i]}, plain decoding {want[i]}, {gap:.3f} " \
                          f"below it (near: {ties[i]})"
    return same


def run(engine: GgmlEngine, prompts: dict, references: dict, key: str) -> dict:
    for rid, prompt in prompts.items():
        engine.load(state(rid, prompt), [])
    while todo := [rid for rid in prompts if engine.requests[rid].generated < TOKENS]:
        items = [(rid, draft_tree(references[rid][0], engine.requests[rid].generated, key + rid,
                                  engine.lm.vocab_size)) for rid in todo]
        results = engine.step(items)
        assert all(r.error is None for r in results), [r.error for r in results]
    out = {rid: engine.requests[rid].tokens[len(p):len(p) + TOKENS] for rid, p in prompts.items()}
    for rid in prompts:
        engine.release(rid)
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_trees_through_llama_cpp_give_its_own_greedy_decoding(gguf, prompts, plain_greedy,
                                                             batch):
    model = GgmlModel(gguf, n_ctx=4096, n_batch=1024, n_seq_max=256, threads=2)
    engine = GgmlEngine(GgmlLM(model, "smollm2-135m", 8192),
                        limits=EngineLimits(kv_budget_tokens=3072, max_batch_trees=8))
    names = list(prompts)
    outputs = {}
    for i in range(0, len(names), batch):
        group = {rid: prompts[rid] for rid in names[i:i + batch]}
        outputs.update(run(engine, group, plain_greedy, f"b{batch}"))
    assert assert_plain_or_tie(outputs, plain_greedy) >= 1  # measured: 2 of 4 at batch 1
    assert engine.store.used_blocks == 0 and sorted(engine.store.free_seqs) == list(range(256))
    model.close()


def plain_runs(engine: GgmlEngine, prompts: dict, params=SamplingParams()) -> dict:
    """Every request decoded by plain runs (empty trees, `plain_tokens` up to 8) to TOKENS."""
    for rid, prompt in prompts.items():
        engine.load(state(rid, prompt, params, seed=7), [])
    got = {rid: [] for rid in prompts}
    while todo := [rid for rid in prompts if len(got[rid]) < TOKENS]:
        entries = [pool_pb2.DraftEntry(request_id=rid, step=1, base_len=len(got[rid]),
                                       plain_tokens=min(8, TOKENS - len(got[rid])))
                   for rid in todo]
        for rid, done in zip(todo, engine.step_entries(entries)):
            assert done is not None and not done[0].error
            got[rid] += done[1]
    for rid, prompt in prompts.items():
        assert engine.requests[rid].tokens == prompt + got[rid]
        assert engine.store.length(rid) == len(prompt) + TOKENS - 1  # the last token: next step
        engine.release(rid)
    return got


def test_plain_runs_decode_in_one_call_a_round_as_the_step_does(gguf, prompts, plain_greedy,
                                                               monkeypatch):
    """A plain run's rounds, its first token's included, go straight to llama_decode (no
    generic step but the prefill): at batch 1 and 3 llama.cpp's own greedy decoding (or a
    near-tie); a sampled, penalized request draws the same tokens as through the generic step
    (same rows, same sampler)."""
    model = GgmlModel(gguf, n_ctx=4096, n_batch=512, n_seq_max=256, threads=2)
    engine = GgmlEngine(GgmlLM(model, "smollm2-135m", 8192),
                        limits=EngineLimits(kv_budget_tokens=3072, run_lookup=0))
    generic, generic_step = VerifierEngine._chain_round, VerifierEngine.step
    monkeypatch.setattr(VerifierEngine, "_chain_round", lambda *a: pytest.fail("generic round"))
    steps = []
    monkeypatch.setattr(VerifierEngine, "step", lambda self, items: steps.append(items)
                        or generic_step(self, items))
    names = list(prompts)
    outputs = plain_runs(engine, {names[0]: prompts[names[0]]})
    outputs.update(plain_runs(engine, {rid: prompts[rid] for rid in names[1:]}))
    assert assert_plain_or_tie(outputs, plain_greedy) >= 1
    sampled = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3)
    lean = plain_runs(engine, {"s": prompts[names[0]]}, sampled)
    # generic steps: only the prefills (one step per request, its first token)
    assert len(steps) == 3 and all(not len(tree) for items in steps for _, tree in items)
    monkeypatch.setattr(VerifierEngine, "step", generic_step)
    monkeypatch.setattr(VerifierEngine, "_chain_round", generic)
    monkeypatch.setattr(GgmlEngine, "_chain_round", generic)
    monkeypatch.setattr(GgmlEngine, "step", generic_step)
    assert plain_runs(engine, {"s": prompts[names[0]]}, sampled) == lean
    assert engine.store.used_blocks == 0 and sorted(engine.store.free_seqs) == list(range(256))
    model.close()


def test_prompt_lookup_in_plain_runs_changes_no_token(gguf, prompts, plain_greedy, tokenizer,
                                                     monkeypatch):
    """Plain runs with prompt lookup (chains of what followed a request's last 3 tokens before,
    verified in the runs' rounds, every one the lookup finds, in one llama_decode a round):
    greedy outputs are llama.cpp's plain decoding (or a near-tie); a sampled, penalized request
    draws what it draws with the generic step's walk and without lookup (where a row's logits
    do not depend on the rows beside it: the patched kernels without AMX); on a prompt that
    repeats itself chains are drafted and tokens of them accepted."""
    import llama_cpp as lc

    from specmesh_services.common import ggml_model

    model = GgmlModel(gguf, n_ctx=4096, n_batch=512, n_seq_max=256, threads=2)
    engine = GgmlEngine(GgmlLM(model, "smollm2-135m", 8192),
                        limits=EngineLimits(kv_budget_tokens=3072))
    engine.lookup_gate.length = lambda rows, tokens, available: (available, 0.0)  # every chain
    chains, direct = [], GgmlEngine._chain_round

    def chain_round(self, request_ids, found):
        out = direct(self, request_ids, found)
        chains.extend((len(c), len(t) - 1) for c, t in zip(found, out) if c and t)
        return out
    monkeypatch.setattr(GgmlEngine, "_chain_round", chain_round)
    assert assert_plain_or_tie(plain_runs(engine, prompts), plain_greedy) >= 1
    counting = tokenizer("one two three four five six seven eight nine ten. " * 3).input_ids
    assert_plain_or_tie(plain_runs(engine, {"count": counting}),
                        plain_decoding(gguf, {"count": counting}))
    assert chains and any(accepted for _, accepted in chains), chains
    sampled = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.3)
    looked = plain_runs(engine, {"s": prompts["q0"]}, sampled)
    monkeypatch.setattr(GgmlEngine, "_chain_round", VerifierEngine._chain_round)
    walked = plain_runs(engine, {"s": prompts["q0"]}, sampled)
    engine.limits = EngineLimits(kv_budget_tokens=3072, run_lookup=0)
    if "+specmesh" in lc.__version__ and not ggml_model._has_amx():
        assert plain_runs(engine, {"s": prompts["q0"]}, sampled) == walked == looked
    assert engine.store.used_blocks == 0 and sorted(engine.store.free_seqs) == list(range(256))
    model.close()


class _Sequences:
    """The part of GgmlModel a GgmlStore edits: sequence ids and their removal."""

    n_seq_max = 8

    def __init__(self) -> None:
        self.removed: list[int] = []

    def seq_remove(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        self.removed.append(seq)


def test_requests_beyond_their_sequences_wait_instead_of_failing():
    """Requests hold at most half of llama.cpp's sequence ids (the other half is the trees'
    leaves): one more is deferred (reserve False, so the engine waits or evicts), and gets a
    sequence once another request frees its own."""
    from specmesh_services.verifier.ggml_engine import GgmlStore

    store = GgmlStore(_Sequences(), capacity=1000)
    assert all(store.reserve(f"r{i}", 10) for i in range(4))
    assert not store.reserve("r4", 10) and "r4" not in store.seq
    store.free("r0")
    assert store.reserve("r4", 10) and len(store.seq) == 4
    assert len(store.free_seqs) == 4  # the trees' half, untouched
