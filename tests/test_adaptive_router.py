"""The router's adaptive mechanisms end to end (ProPD tree size, LBSS drafter selection, majority
voting, micro-batched drafting), in an embedded mesh on the default model in float32: outputs
stay the target's own greedy output with them all on (8 MT-Bench questions, 4 concurrent), and
every step's decision is returned in the request's stats."""
from __future__ import annotations

import asyncio
import itertools

from specmesh_services.router import engine
from specmesh_services.router.selection import LBSSSelection
from specmesh_services.router.sizing import StepChoice, TreeSizing
from specmesh_services.launch.embedded import EmbeddedMesh
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

NUM_QUESTIONS = 8  # every arm is visited by each request's first steps: eight requests suffice
CONCURRENCY = 4
MAX_TOKENS = 32  # a prefix of the 64-token references keeps the suite short
FIRST_BUDGETS = (2, 5, 12)  # what the first steps of the requests on an arm draft, in turn


class EveryArmFirst(LBSSSelection):
    """LBSS, except that each request's first asks go to every arm in turn (request i starting
    at arm i): every arm is used whatever the host's timing makes of the bandit's estimates."""

    def __init__(self, arms, slot_s, **kw) -> None:
        super().__init__(arms, slot_s)
        self.asks: dict[str, int] = {}  # request -> its asks so far
        self.starts: dict[str, int] = {}  # request -> the arm its turns start at

    def arm_for(self, request_id, live, idle=None, contexts=None):
        chosen = super().arm_for(request_id, live, idle, contexts)
        start = self.starts.setdefault(request_id, len(self.starts))
        ask = self.asks[request_id] = self.asks.get(request_id, -1) + 1
        # one ask more than there are arms: the first is the drafter warmed before step 1
        return self.names[(start + ask) % len(self.names)] if ask <= len(self.names) else chosen


class FirstStepDrafts:
    """An arm's strategy, except that a request's first step on the arm drafts (budgets from
    `FIRST_BUDGETS` in turn, within the arm's limit): every source's trees are verified
    whatever the host's timing makes of the costs. The adaptive strategy decides the rest."""

    def __init__(self, strategy, max_nodes: int) -> None:
        self.strategy = strategy
        self.budgets = itertools.cycle([min(b, max_nodes) for b in FIRST_BUDGETS])

    def __getattr__(self, name):
        return getattr(self.strategy, name)

    def choose(self, inputs) -> StepChoice:
        if inputs.choices > 1 or not self.strategy.max_nodes:
            return self.strategy.choose(inputs)
        budget = next(self.budgets)
        return StepChoice(budget, inputs.profile.expected_tokens(budget)[-1], probe=True)


class FirstStepsSized(TreeSizing):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.strategy = FirstStepDrafts(self.strategy, self.max_nodes)


def test_lossless_with_every_mechanism_on(base_settings, small_datastore, questions,
                                          hf_greedy_reference, compute, monkeypatch):
    """Adaptive tree size + LBSS over four arms (the datastore, two layer-truncated drafts, and
    the majority vote of all three) with short slots, so requests switch drafters (and prefill
    where they land) mid-answer; micro-batched drafting and back-pressure (on by default). What
    timing would decide is scripted: each request's first steps visit every arm
    (`EveryArmFirst`) and its first step on an arm drafts (`FirstStepDrafts`); LBSS and the
    adaptive sizing choose the rest."""
    monkeypatch.setattr(engine, "make_selection",
                        lambda kind, arms, slot_s, **kw: EveryArmFirst(arms, slot_s))
    monkeypatch.setattr(engine, "TreeSizing", FirstStepsSized)
    settings = base_settings.with_overrides(drafters=["layers:6", "layers:16"], **{
        "speculation.source": "both", "speculation.depth": 4, "speculation.max_nodes": 12,
        "speculation.tree_size": "adaptive", "speculation.probe_every": 4,
        "speculation.selection": "lbss", "speculation.slot_s": 0.3, "speculation.voting": True,
        "speculation.drafter_capacity": 2, "datastore.path": small_datastore})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            gate = asyncio.Semaphore(CONCURRENCY)

            async def one(q):
                async with gate:
                    return await mesh.generate(
                        messages=[{"role": "user", "content": q["turns"][0]}],
                        max_tokens=MAX_TOKENS)
            return await asyncio.gather(*(one(q) for q in questions[:NUM_QUESTIONS]))
    outputs = asyncio.run(run())
    assert_target_tokens(outputs, hf_greedy_reference, MAX_TOKENS)

    budgets, drafters, arms, lookups = set(), set(), set(), 0
    for out in outputs:
        stats = out.stats
        decisions = list(stats.decisions)
        assert len(decisions) == stats.steps, "one record per step"
        assert [d.step for d in decisions] == list(range(stats.steps))
        assert decisions[0].budget == 0 and decisions[0].tree_size == 0  # the prefill step
        assert sum(d.emitted for d in decisions) >= stats.completion_tokens
        assert sum(d.tree_size for d in decisions) == stats.draft_tokens
        assert stats.plain_steps == sum(1 for d in decisions[1:] if d.tree_size == 0)
        for d in decisions[1:]:
            assert d.tree_size <= d.budget <= 12 and d.expected_length >= 1.0 and d.seconds > 0
            assert bool(d.drafters) == bool(d.tree_size)
            drafters.update(d.drafters)
            arms.add(d.arm)
            budgets.add(d.budget)
            lookups += d.arm in ("datastore", "vote") and d.budget > 0
        assert stats.mean_expected_length >= 1.0
    assert len(budgets) > 2, f"trees of several sizes: {sorted(budgets)}"
    # every arm was chosen, both draft models' trees were verified and the lookup service was
    # asked for trees (the scripted first steps; later ones are the sizing's)
    assert arms == {"datastore", "smollm2-135m:layers=6", "smollm2-135m:layers=16", "vote"}, arms
    assert {"smollm2-135m:layers=6", "smollm2-135m:layers=16"} <= drafters, drafters
    assert lookups > 0, "the datastore drafted"
    drafted = sum(o.stats.draft_tokens for o in outputs)
    accepted = sum(o.stats.accepted_tokens for o in outputs)
    print(f"budgets {sorted(budgets)}, drafted {drafted}, accepted {accepted}")
    assert accepted > 0


def test_a_confidence_stopped_chain_is_asked_for_its_whole_depth(base_settings, questions,
                                                                  hf_greedy_reference, compute):
    """One draft model's chain under a confidence stop sizes itself: whenever ProPD drafts, the
    budget is the configured depth (the drafter stops where it is unsure), never a shorter
    chain; ProPD still turns steps off (budget 0). Outputs stay the target's. (The stop itself:
    test_kv_rollback.py.)"""
    depth = 5
    settings = base_settings.with_overrides(drafters=["layers:16"], **{
        "speculation.source": "model", "speculation.depth": depth, "speculation.max_nodes": 12,
        "speculation.tree_size": "adaptive", "speculation.min_probability": 0.3})

    async def run():
        async with EmbeddedMesh.start(settings, compute) as mesh:
            return [await mesh.generate(messages=[{"role": "user", "content": q["turns"][0]}],
                                        max_tokens=MAX_TOKENS) for q in questions[:3]]
    outputs = asyncio.run(run())
    assert_target_tokens(outputs, hf_greedy_reference, MAX_TOKENS)
    budgets = set()
    for out in outputs:
        for d in list(out.stats.decisions)[1:]:
            budgets.add(d.budget)
            assert d.tree_size <= d.budget
    assert budgets <= {0, depth} and depth in budgets, budgets
