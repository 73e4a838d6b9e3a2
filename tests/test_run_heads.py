"""Draft heads inside plain runs (services/verifier/run_heads.py): the gate takes a tree where
rows are cheap and the heads' tokens pay for them, refuses it where a row costs a step but for a
probe, and learns the heads' tokens; on the real SmolLM2 target (lean forward, float32) with its
shipped heads, runs whose every round verifies the heads' tree are the target's own greedy
tokens, the trees drafted and some of their tokens kept."""
from __future__ import annotations

import pytest

from specmesh_services.heads.draft import load_for_target
from specmesh_services.verifier.lookup import LookupGate
from specmesh_services.verifier.run_heads import HeadsGate
from specmesh_services.verifier.server import build_engine, load_target

from test_batch_verify import state  # tests/ is on the path
from test_plain_runs import entry

PROMPTS, RUN = 3, 24


def gate_over(seconds_by_rows: dict[int, float], nodes: int = 16) -> HeadsGate:
    rounds = LookupGate(5)
    for rows, seconds in seconds_by_rows.items():
        rounds.observe_round(rows, seconds)
    return HeadsGate(rounds, nodes)


def test_the_gate_takes_trees_where_rows_are_cheap():
    gate = gate_over({1: 2.0e-3, 17: 2.7e-3})  # a GPU: 17 rows 1.35x one
    assert gate.take(1, 1.0) == pytest.approx(1.0)
    for _ in range(50):  # the heads keep nothing: no longer worth 16 more rows
        gate.observe(0)
    taken = [gate.take(1, 1.0) for _ in range(16)]
    assert taken[0] > 0 and not any(taken[1:])  # the first refusal probes, then 15 plain


def test_the_gate_refuses_trees_where_a_row_costs_a_step_but_probes():
    gate = gate_over({1: 6e-3, 17: 60e-3})  # two CPU cores
    taken = [gate.take(1, 1.0) for _ in range(48)]
    assert [i for i, gain in enumerate(taken) if gain] == [0, 16, 32]
    assert HeadsGate(LookupGate(5), 0).take(1, 1.0) == 0.0  # run_heads = 0: off


def heads_engine(settings, prompts: dict[str, list[int]]):
    """The verifier engine of `settings` serving its heads, every run's round verifying their
    tree (the gate always takes it), `prompts` loaded."""
    engine = build_engine(load_target(settings), settings, "verifier")
    engine.heads = load_for_target(settings, "heads")
    engine.heads_gate.take = lambda rows, tokens: 1.0
    for rid, prompt in prompts.items():
        engine.load(state(rid, prompt), [])
    return engine


def test_runs_through_the_heads_trees_are_the_targets_greedy_tokens(
        base_settings, chat_prompt_ids, hf_greedy_reference, compute):
    settings = base_settings.with_overrides(drafters=["heads"],
                                            **{"verifier.run_lookup": 0})

    def run():
        prompts = {f"r{i}": chat_prompt_ids(i) for i in range(PROMPTS)}
        engine = heads_engine(settings, prompts)
        got = {rid: [] for rid in prompts}
        for _ in range(2):  # the first step's run, then a run after its answer
            done = engine.step_entries([entry(rid, len(got[rid]), RUN) for rid in prompts])
            for rid, (result, tokens) in zip(prompts, done):
                assert not result.error
                got[rid] += tokens
        return got, engine.run_heads_drafted, engine.run_heads_accepted
    got, drafted, accepted = compute.submit(run).result()
    for i, tokens in enumerate(got.values()):
        ref = hf_greedy_reference[i]
        assert tokens[:len(ref)] == ref[:len(tokens)] and len(tokens) >= RUN
    assert drafted > 0 and accepted > 0, (drafted, accepted)

