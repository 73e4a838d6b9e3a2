"""The router's adaptive mechanisms end to end (ProPD tree size, LBSS drafter selection, majority
voting, micro-batched drafting), in an embedded mesh on the default model in float32: outputs
stay the target's own greedy output with them all on (20 MT-Bench questions, 4 concurrent), and
every step's decision is returned in the request's stats."""
from __future__ import annotations

import asyncio

from specmesh_services.embedded import EmbeddedMesh
from test_lossless_greedy import assert_target_tokens  # noqa: E402  (tests/ is on the path)

NUM_QUESTIONS = 20
CONCURRENCY = 4
MAX_TOKENS = 32  # a prefix of the 64-token references keeps the suite short


def test_lossless_with_every_mechanism_on(base_settings, small_datastore, questions,
                                          hf_greedy_reference, compute):
    """Adaptive tree size + LBSS over four arms (the datastore, two layer-truncated drafts, and
    the majority vote of all three) with short slots, so requests switch drafters (and prefill
    where they land) mid-answer; micro-batched drafting and back-pressure (on by default)."""
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
    assert len(budgets) > 2, f"the budget adapts: {sorted(budgets)}"
    assert arms == {"datastore", "smollm2-135m:layers=6", "smollm2-135m:layers=16", "vote"}, arms
    # every arm was chosen, a draft model's trees were verified and the lookup service was asked
    # for trees. Whether an arm's trees reach the verifier depends on the host's speed: once an
    # arm's trees stop paying its sizing keeps it to plain steps (the 16-layer draft on a slow
    # host; the datastore, whose small test corpus matches little). Each source's trees are
    # verified on their own in test_lossless_greedy.py and test_datastore_service.py.
    assert drafters & {"smollm2-135m:layers=6", "smollm2-135m:layers=16"}, drafters
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
