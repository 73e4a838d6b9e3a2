"""Prompt lookup of plain runs (services/verifier/lookup.py) against a loop over the tokens: the
continuation of the latest earlier occurrence of the last n tokens, as the tokens grow."""
from __future__ import annotations

import random

import pytest

from specmesh_services.verifier.lookup import LookupGate, NgramLookup


def reference(tokens: list[int], n: int, limit: int) -> list[int]:
    """The tokens after the latest occurrence of tokens[-n:] that ends before the last token."""
    if len(tokens) <= n:
        return []
    key = tokens[-n:]
    for start in range(len(tokens) - 1, n - 1, -1):
        if tokens[start - n:start] == key:
            return tokens[start:start + limit]
    return []


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_lookup_drafts_what_followed_the_latest_earlier_occurrence(n):
    rng = random.Random(n)
    for _ in range(20):
        lookup, tokens = NgramLookup(n), []
        for _ in range(120):
            tokens.extend(rng.randrange(4) for _ in range(rng.choice([1, 1, 2, 5])))
            limit = rng.randrange(0, 7)
            assert lookup.draft(tokens, limit) == reference(tokens, n, limit), (tokens, limit)


def test_no_lookup_before_n_tokens_and_no_empty_ngrams():
    assert NgramLookup(3).draft([1, 2, 3], 5) == []
    assert NgramLookup(1).draft([7, 8, 7], 5) == [8, 7]
    with pytest.raises(ValueError):
        NgramLookup(0)


def gate_with(costs: dict[int, float], accepted: float, chains: int = 200) -> LookupGate:
    """A gate that measured round seconds `costs` by rows and chains of 5 whose every token
    was accepted with probability `accepted` (given the ones before)."""
    gate, rng = LookupGate(5), random.Random(0)
    for rows, seconds in costs.items():
        gate.observe_round(rows, seconds)
    for _ in range(chains):
        kept = 0
        while kept < 5 and rng.random() < accepted:
            kept += 1
        gate.observe_chain(5, kept)
    return gate


def test_the_gate_takes_long_chains_where_rows_are_cheap_and_tokens_accepted():
    gate = gate_with({r: 1.0 + 0.1 * (r - 1) for r in range(1, 7)}, accepted=0.9)
    k, gain = gate.length(1, 1.0, 5)
    assert k == 5 and 3.0 < gain < 4.2  # 0.9 + 0.81 + ... + 0.59 = 3.69
    assert gate.length(1, 1.0, 2)[0] == 2  # no more than the lookup found


def test_the_gate_keeps_rounds_plain_where_a_row_costs_a_step_but_probes_now_and_then():
    gate = gate_with({r: 1.0 + 0.9 * (r - 1) for r in range(1, 7)}, accepted=0.5)
    lengths = [gate.length(1, 1.0, 5)[0] for _ in range(64)]
    assert lengths.count(1) == 64 // gate.probe_every and set(lengths) == {0, 1}


def test_rows_never_measured_are_priced_to_be_tried():
    gate = LookupGate(5)
    gate.observe_round(1, 0.010)
    assert gate.round_seconds(3) == pytest.approx(0.010 + 2 * gate.explore * 0.010)
    assert gate.length(1, 1.0, 5)[0] >= 1  # untried acceptance is 1/2 a token
    gate.observe_round(4, 0.020)
    assert gate.round_seconds(2) == pytest.approx(0.010 + 0.010 / 3)  # between measured ones
