"""Plain runs decoded ahead (`verifier.run_ahead`): a round of one plain row a request replays
several steps back to back, each step's draws fed to the next on the device, one copy to the
host for them all (engine.py `_ahead_round`, common/graphs.py `StepGraphs.ahead`). On the CPU
the same buffers run eagerly, Triton's attention in the interpreter; tests/test_cuda.py replays
them from graphs. Checked against the target's own greedy tokens and against a run of one step
a sync: the same tokens, stops and KV rows, sampled ones too; penalized sampling never runs
ahead."""
from __future__ import annotations

import os
import random

import pytest
import torch

from specmesh_services.common.graphs import StepGraphs
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from test_batch_verify import state  # tests/ is on the path
from test_plain_runs import entry
from test_step_graphs import VOCAB, bucketed, greedy_reference, tiny_qwen2_lean

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="CPU Triton runs only under TRITON_INTERPRET=1 (conftest)")


@pytest.fixture(scope="module")
def tiny_lean():
    return tiny_qwen2_lean()


def engine(lean, ahead: int, **split) -> VerifierEngine:
    """An engine stepping through the graphs' buffers (captured on CUDA), drawing rows where
    the logits are (as on a GPU), plain runs without lookup or heads."""
    limits = EngineLimits(kv_budget_tokens=1024, block_size=8, graph_rows=64, run_lookup=0,
                          run_heads=0, run_ahead=ahead)
    out = VerifierEngine(lean, limits=limits)
    if lean.device.type != "cuda":
        out = bucketed(out, 64, **split)
    elif split:
        out.target.graphs = StepGraphs(lean, out.store, 64, **split)
    out.row_parallel_walk = True
    return out


def prompts(seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {rid: [rng.randrange(VOCAB) for _ in range(n)] for rid, n in
            (("a", 30), ("b", 9), ("c", 50))}


def run(eng: VerifierEngine, asks: dict[str, tuple[int, list[int]]], params=SamplingParams()
        ) -> dict[str, list[int]]:
    """One pool step of plain entries (`plain_tokens`, stop ids) from the prompt on: each
    request's tokens."""
    for rid, prompt in prompts().items():
        if rid in asks:
            eng.load(state(rid, prompt, params, seed=7), [])
    done = eng.step_entries([entry(rid, 0, n, stops) for rid, (n, stops) in asks.items()])
    return {rid: tokens for rid, (_, tokens) in zip(asks, done)}


@pytest.mark.parametrize("split", [{}, {"split_min": 24, "chunk": 8}])
def test_greedy_runs_ahead_are_the_targets_tokens_and_end_at_stops(tiny_lean, split):
    """Three requests ahead 8 steps a round (4 in the first, where one has 4 tokens left): the
    target's greedy tokens; one stops at its 12th token, inside a round, and the engine holds
    and caches what it answered, the same KV rows as runs of one step a sync; split, the KV
    of b crosses into chunks within a round."""
    refs = {rid: greedy_reference(tiny_lean, p, 24) for rid, p in prompts().items()}
    asks = {"a": (21, []), "b": (21, [refs["b"][11]]), "c": (5, [])}
    ahead, one = engine(tiny_lean, 8, **split), engine(tiny_lean, 0, **split)
    got, plain = run(ahead, asks), run(one, asks)
    assert got == plain
    assert got["a"] == refs["a"][:21] and got["c"] == refs["c"][:5]
    stop = refs["b"].index(refs["b"][11]) + 1  # the first time the stop token comes
    assert got["b"] == refs["b"][:stop]
    assert ahead.ahead_rounds >= 3 and one.ahead_rounds == 0
    assert ahead.ahead_tokens == sum(map(len, got.values())) - len(got)  # but the first steps'
    for rid, prompt in prompts().items():
        req = ahead.requests[rid]
        assert req.tokens == prompt + got[rid]
        assert ahead.store.length(rid) == len(req.tokens) - 1
        slots = ahead.store.slots(rid, 0, len(req.tokens) - 1)
        torch.testing.assert_close(ahead.store.k[:, slots],
                                   one.store.k[:, one.store.slots(rid, 0, len(req.tokens) - 1)],
                                   atol=1e-5, rtol=0)
    assert ahead.store.used_blocks == one.store.used_blocks  # what ran past a stop went back


def test_sampled_runs_ahead_draw_what_one_step_a_sync_draws(tiny_lean):
    """Temperature, top-k and top-p with the request's seed: the draw at each position is the
    same whether its step ran ahead or alone."""
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)
    asks = {"a": (17, []), "c": (17, [])}
    ahead, one = engine(tiny_lean, 4), engine(tiny_lean, 0)
    got = run(ahead, asks, params)
    assert got == run(one, asks, params)
    assert ahead.ahead_rounds == 4
    assert len(set(got["a"])) > 4, "sampled, not stuck on one token"


def test_penalized_sampling_and_short_runs_do_not_run_ahead(tiny_lean):
    """A repetition penalty reads the history a step wrote: one step a sync, the same tokens;
    runs with fewer tokens left than two steps, too."""
    params = SamplingParams(temperature=0.9, repetition_penalty=1.3)
    ahead, one = engine(tiny_lean, 8), engine(tiny_lean, 0)
    assert run(ahead, {"a": (9, [])}, params) == run(one, {"a": (9, [])}, params)
    assert ahead.ahead_rounds == 0
    assert run(ahead, {"b": (2, [])}) == run(one, {"b": (2, [])})
    assert ahead.ahead_rounds == 0
