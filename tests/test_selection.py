"""Draft-source selection (selection.py): the slot clock, LBSS through it on a synthetic goodput
table, and SPIN's two baselines (greedy by prompt length, epsilon-greedy). No mesh."""
from __future__ import annotations

from collections import Counter

import pytest

from specmesh_services.router.selection import (Arm, EpsilonGreedy, GreedyByPromptLength, LBSSSelection,
                                       make_selection)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


ARMS = [Arm("datastore", 16), Arm("small", 4), Arm("large", 4)]


def test_a_plan_holds_for_a_slot_and_is_redrawn_after():
    clock = Clock()
    sel = make_selection("epsilon-greedy", ARMS, slot_s=1.0)
    sel._clock = clock
    sel._slot_started = 0.0
    live = {f"r{i}": 10 for i in range(6)}
    first = {rid: sel.arm_for(rid, live) for rid in live}
    clock.now = 0.5
    assert {rid: sel.arm_for(rid, live) for rid in live} == first
    plans = set()
    for t in range(1, 30):
        clock.now = float(t)
        plans.add(tuple(sel.arm_for(rid, live) for rid in live))
    assert len(plans) > 1


def test_lbss_through_the_selection_learns_the_best_arm():
    """Goodput table: the large model is best for every request; capacities 16/4/4 bind."""
    clock = Clock()
    sel = LBSSSelection(ARMS, slot_s=1.0, seed=1, clock=clock)
    table = {"datastore": 3.0, "small": 5.0, "large": 9.0}
    live = {f"r{i}": 10 + i for i in range(4)}
    late = Counter()
    for t in range(200):
        clock.now = float(t)
        for rid in live:
            arm = sel.arm_for(rid, live)
            assert arm is not None
            sel.observe(rid, arm, table[arm], 1.0)
            if t >= 150 and sel.lbss.stage == "exploit":
                late[arm] += 1
    assert late["large"] >= 0.9 * sum(late.values()), late


def test_the_next_steps_arms_hold_this_slots_arm_beside_the_next_slots():
    """LBSS's likely arm is where a request drafts at the next change of plan; its next step,
    far shorter than a slot, mostly drafts on this slot's arm: both are the next step's arms
    (what asks the verifier's heads for a tree ahead)."""
    clock = Clock()
    sel = LBSSSelection(ARMS, slot_s=1.0, seed=3, clock=clock)
    live = {f"r{i}": 10 + i for i in range(4)}
    differed = 0
    for t in range(60):
        clock.now = float(t)
        for rid in live:
            arm = sel.arm_for(rid, live)
            sel.observe(rid, arm, 3.0, 1.0)
            nxt = sel.next_arms(rid)
            assert arm in nxt and sel.likely_arm(rid) in nxt | {None}
            differed += sel.likely_arm(rid) != arm
    assert differed  # the case the next slot's arm alone would miss


def test_greedy_puts_short_prompts_on_cheap_arms_within_capacities():
    sel = GreedyByPromptLength(ARMS)
    live = {f"r{i}": length for i, length in enumerate([5, 500, 50, 5000, 20, 2000])}
    plan = {rid: sel.arm_for(rid, live) for rid in live}
    assert plan["r0"] == plan["r4"] == "datastore"  # the two shortest
    assert plan["r2"] == plan["r1"] == "small"
    assert plan["r5"] == plan["r3"] == "large"  # the two longest
    crowded = GreedyByPromptLength([Arm("a", 1), Arm("b", 1)])
    live = {f"r{i}": i for i in range(3)}
    plan = {rid: crowded.arm_for(rid, live) for rid in live}
    assert sorted(map(str, plan.values())) == ["None", "a", "b"]


@pytest.mark.parametrize("exploit", [0.0, 1.0])
def test_epsilon_greedy_exploits_with_its_probability(exploit):
    clock = Clock()
    sel = EpsilonGreedy(ARMS, slot_s=1.0, exploit_probability=exploit, seed=3, clock=clock)
    sel.observe("x", "small", 10, 1.0)  # the best arm so far
    sel.observe("x", "large", 2, 1.0)
    live = {f"r{i}": 1 for i in range(4)}
    seen = Counter()
    for t in range(1, 40):
        clock.now = float(t)
        for rid in live:
            seen[sel.arm_for(rid, live)] += 1
    if exploit == 1.0:
        assert seen["small"] >= 4 * 38, seen  # all on the best arm (capacity 4 = 4 requests)
    else:
        assert len(seen) == 3, seen  # random draws over every arm


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown drafter selection"):
        make_selection("round-robin", ARMS)


def test_lbss_explores_only_arms_that_would_draft_and_baselines_ignore_idle():
    """The router's `idle(request, arm)` (that arm's sizing says no tree pays for the request)
    reaches LBSS's exploration; the SPIN baselines keep their definitions."""
    clock = Clock()
    sel = LBSSSelection(ARMS, slot_s=1.0, seed=2, clock=clock)
    live = {"r0": 10, "r1": 10}
    idle = {"r0": {"small", "large"}, "r1": set()}
    seen = {rid: Counter() for rid in live}
    for t in range(40):
        clock.now = float(t)
        plan = {rid: sel.arm_for(rid, live, lambda r, a: a in idle[r]) for rid in live}
        if sel.lbss.stage == "explore":
            for rid, arm in plan.items():
                seen[rid][arm] += 1
    assert set(seen["r0"]) == {"datastore"}
    assert len(seen["r1"]) > 1
    greedy = GreedyByPromptLength(ARMS)
    assert greedy.arm_for("r0", {"r0": 1}, lambda r, a: True) == "datastore"
