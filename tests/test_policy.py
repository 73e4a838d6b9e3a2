"""The router's tree sizing (router/sizing/: `TreeSizing`, `RequestSizing` and the strategies):
fixed sizing, the adaptive choice over measured step times and a per-request acceptance profile
(ProPD 4.2 wired), its bootstrap, probing, "off", and the per-step records. Plain objects, no
mesh."""
from __future__ import annotations

import pytest

from specmesh_services.common.tree import TokenTree
from specmesh_services.router.sizing import (BatchShare, PassTimes, StepChoice, TreeSizing,
                                             VerifyStep, bucket_of)
from specmesh_services.router.sizing.acceptance import AcceptanceProfile, best_size
from specmesh_services.router.sizing.cost import LinearCost


def feed(sizing: TreeSizing, cost: LinearCost, sizes=(0, 4, 8, 16), bucket: int = 1) -> None:
    model = sizing.time_model(bucket)
    for size in sizes:
        model.observe(size, cost(size))


def chain(n: int) -> TokenTree:
    return TokenTree.chain(list(range(100, 100 + n)), [1.0] * n, "datastore")


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [1, 1, 2, 4, 4, 8, 8, 16]


def test_fixed_sizing_always_asks_for_the_whole_tree():
    sizing = TreeSizing(max_nodes=10, max_depth=10, mode="fixed")
    request = sizing.for_request()
    feed(sizing, LinearCost(0.01, 1.0))  # speculation could never pay: fixed ignores it
    choices = {request.choose(1).budget for _ in range(40)}
    assert choices == {10}


def test_no_speculation_configured_means_budget_zero():
    request = TreeSizing(max_nodes=0, max_depth=0).for_request()
    assert request.choose(1) == StepChoice(0, 1.0)


def test_bootstrap_measures_the_default_size_then_plain_then_fits():
    sizing = TreeSizing(max_nodes=16, max_depth=8, probe_every=0)
    request = sizing.for_request()
    first = request.choose(1)
    assert first.budget == 8 and first.probe
    request.observe(1, first, chain(8), [100, 101, 5], 0.050, 1, ["datastore"])
    second = request.choose(1)
    assert second.budget == 0 and second.probe
    request.observe(2, second, TokenTree.chain([]), [7], 0.030, 1, [])
    assert sizing.cost(1) is not None
    assert not request.choose(1).probe


@pytest.mark.parametrize("b0,b1", [(0.030, 0.001), (0.030, 0.004), (0.030, 0.012)])
def test_adaptive_choice_is_the_analytic_optimum(b0, b1):
    """Known linear cost and acceptance profile: the budget is argmax E(n) / T(n) over n."""
    sizing = TreeSizing(max_nodes=24, max_depth=4, probe_every=0)
    cost = LinearCost(b0, b1)
    feed(sizing, cost, sizes=range(0, 25, 4))
    request = sizing.for_request()
    request.profile = AcceptanceProfile.from_probabilities(
        [[0.6, 0.2, 0.1, 0.05], [0.5, 0.2, 0.1], [0.4, 0.2], [0.3, 0.1]])
    curve = request.profile.expected_tokens(24)
    # brute force over every n
    want = max(range(len(curve)), key=lambda n: (curve[n] / cost(n), -n))
    got = request.choose(1)
    assert got.budget == want and got.expected_length == pytest.approx(curve[want])
    assert want == best_size(curve, sizing.cost(1)).size


def test_speculation_is_switched_off_when_it_cannot_pay_and_probed_again():
    sizing = TreeSizing(max_nodes=10, max_depth=10, probe_every=4)
    feed(sizing, LinearCost(0.030, 0.010))
    request = sizing.for_request()
    request.profile = AcceptanceProfile.from_probabilities([[0.05]] * 10)
    budgets = [request.choose(1) for _ in range(32)]
    # off from its first step on the prior alone: a 2-node probe at once (its own text may be
    # predictable), then one every 4 x probe_every steps (cheap: ~2 rows over a plain step)
    assert [c.budget for c in budgets] == [2] + [0] * 14 + [2] + [0] * 15 + [2]
    assert [c.probe for c in budgets] == [True] + [False] * 14 + [True] + [False] * 15 + [True]
    assert budgets[1].expected_length == 1.0


def test_an_off_request_in_a_batch_probes_as_rarely_as_the_batch_alone():
    """Off, a request probes every 4 x probe_every steps times the requests in flight: the
    arm's prior is shared, and a probe's rows cost every request of the batch its step."""
    sizing = TreeSizing(max_nodes=10, max_depth=10, probe_every=4)
    feed(sizing, LinearCost(0.030, 0.010), bucket=4)
    request = sizing.for_request()
    request.profile = AcceptanceProfile.from_probabilities([[0.05]] * 10)
    budgets = [request.choose(4).budget for _ in range(128)]
    assert [i for i, b in enumerate(budgets) if b] == [0, 63, 127]


def test_probes_visit_the_adjacent_sizes_then_half_and_double():
    sizing = TreeSizing(max_nodes=32, max_depth=8, probe_every=2)
    cost = LinearCost(0.030, 0.0005)
    feed(sizing, cost, sizes=range(0, 33, 4))
    request = sizing.for_request()
    request.profile = AcceptanceProfile.from_probabilities([[0.8, 0.1]] * 8)
    chosen = best_size(request.profile.expected_tokens(32), cost).size
    probes = [c.budget for c in (request.choose(1) for _ in range(8)) if c.probe]
    assert 1 < chosen < 32
    assert set(probes) == {chosen + 1, chosen - 1, chosen // 2, min(2 * chosen, 32)}


def test_each_request_learns_its_own_profile_from_its_walks():
    sizing = TreeSizing(max_nodes=8, max_depth=8, probe_every=0)
    feed(sizing, LinearCost(0.030, 0.002), bucket=2)
    code, chat = sizing.for_request(), sizing.for_request()
    tree = chain(8)
    for step in range(1, 80):
        code.observe(step, StepChoice(8, 1.0), tree, list(tree.tokens) + [1], 0.046, 2, ["ds"])
        chat.observe(step, StepChoice(8, 1.0), tree, [7], 0.046, 2, ["ds"])
    assert code.profile.p(1, 1) > 0.9 and chat.profile.p(1, 1) < 0.1
    assert code.choose(2).budget == 8
    assert chat.choose(2).budget == 0
    assert 0.1 < sizing.prior.p(1, 1) < 0.9, "the prior learns from every request"
    assert sizing.for_request().profile.p(1, 1) == sizing.prior.p(1, 1)


def batched(verify: LinearCost, draft: LinearCost, max_nodes: int = 8) -> TreeSizing:
    """A sizing whose verifier pass time over rows and drafting time over budgets are known."""
    sizing = TreeSizing(max_nodes=max_nodes, max_depth=4, probe_every=0,
                        verify_times=PassTimes())
    for rows in range(1, 73, 8):
        sizing.verify_times.observe(rows, verify(rows))
    for budget in range(1, max_nodes + 1):
        sizing.draft_times.observe(budget, draft(budget))
    return sizing


def test_batch_aware_choice_maximizes_the_batch_rate():
    """Eight in flight: the choice is the batch's rate, argmax (E_others + E(n)) /
    (V(others' rows + 1 + n) + D_others + D(n)). On a saturated verifier (a row costs a good
    part of a pass) the profile that pays alone is switched off; on one whose rows are nearly
    free it still speculates."""
    profile = AcceptanceProfile.from_probabilities([[0.6, 0.1]] * 4)
    curve = profile.expected_tokens(8)
    draft = LinearCost(0.002, 0.001)
    others = BatchShare(nodes=0, tokens=7.0, requests=7)  # seven requests decoding plainly
    for verify, on in [(LinearCost(0.100, 0.0125), False), (LinearCost(0.100, 0.0005), True)]:
        request = batched(verify, draft).for_request()
        request.profile = profile
        cost = [verify(8 + n) + (draft(n) if n else 0.0) for n in range(len(curve))]
        want = max(range(len(curve)), key=lambda n: ((7.0 + curve[n]) / cost[n], -n))
        assert request.choose(8, others).budget == want
        assert (want > 0) == on
        # alone, with the same costs, it speculates: the batch is what switches it off
        assert best_size(curve, lambda n: verify(1 + n) + (draft(n) if n else 0.0)).size > 0
    # the others' plans count: their trees' rows and their drafting are on the step already
    verify = LinearCost(0.100, 0.004)
    request = batched(verify, draft).for_request()
    request.profile = profile
    share = BatchShare(nodes=28, tokens=7 * 1.9, requests=7, draft_seconds=0.05)
    cost = [verify(36 + n) + 0.05 + (draft(n) if n else 0.0) for n in range(len(curve))]
    want = max(range(len(curve)), key=lambda n: ((share.tokens + curve[n]) / cost[n], -n))
    assert request.choose(8, share).budget == want
    assert request.would_speculate(8, share) == (want > 0)


def test_a_tree_in_a_batch_pays_for_the_plain_runs_it_breaks_and_its_rows():
    """Seven others decoding plain runs of 4 tokens a round trip: a tree makes the step one
    round for all, so it pays the round trip the runs share four ways, and each node at least
    the verifier's fitted seconds per row, even where the passes timed at 9 rows came out
    cheaper than those at 8 (timed at different contexts)."""
    draft = LinearCost(0.002, 0.0)
    others = BatchShare(nodes=0, tokens=7.0, requests=7)
    profile = AcceptanceProfile.from_probabilities([[0.45]] * 4)
    curve = profile.expected_tokens(4)

    def sizing_of(plain_tokens: int, row: float, trip: float) -> TreeSizing:
        sizing = TreeSizing(max_nodes=4, max_depth=4, probe_every=0, verify_times=PassTimes(),
                            plain_tokens=plain_tokens)
        for rows, seconds in ((8, 0.066), (9, 0.064), (10, 0.070), (12, 0.079)):
            sizing.verify_times.observe_pass(VerifyStep(seconds, rows, 8, rows - 8, "v", row,
                                                        trip))
        sizing.draft_times.observe(1, draft(1))
        return sizing

    naive = sizing_of(1, 0.0, 0.0)  # no runs, no per-row fit: the timed passes alone
    cost = naive.batch_cost(others)
    assert cost(1) == pytest.approx(0.066 + 0.002), "9 rows priced as 8, never below them"
    request = naive.for_request()
    request.profile = profile
    assert request.choose(8, others).budget > 0

    sizing = sizing_of(4, 0.0045, 0.008)
    cost = sizing.batch_cost(others)
    assert cost(0) == pytest.approx(0.066 + 0.008 / 4)
    assert cost(1) == pytest.approx(0.066 + 0.0045 + 0.002 + 0.008)
    assert cost(2) == pytest.approx(0.066 + 0.009 + 0.002 + 0.008), "the fit: dearer than 10 rows"
    assert cost(4) == pytest.approx(0.066 + 0.018 + 0.002 + 0.008)
    request = sizing.for_request()
    request.profile = profile
    want = max(range(5), key=lambda n: ((7.0 + curve[n]) / cost(n), -n))
    assert want == 0 and request.choose(8, others).budget == 0
    # others with trees: no runs to break, the round trip is every option's
    trees = BatchShare(nodes=8, tokens=7 * 1.5, requests=7, draft_seconds=0.01)
    assert sizing.batch_cost(trees)(0) == pytest.approx(
        sizing.verify_times.curve()(16) + 0.01 + 0.008)


def test_the_verifiers_row_cost_spares_the_batch_bootstrap_of_the_pass_time():
    """One pass size timed and the verifier's per-row fit known: the batch prices trees from
    them without bootstrapping a second pass size."""
    sizing = TreeSizing(max_nodes=4, max_depth=4, probe_every=0, verify_times=PassTimes(),
                        plain_tokens=4)
    sizing.draft_times.observe(2, 0.001)
    sizing.verify_times.observe_pass(VerifyStep(0.066, 8, 8, 0, "v"))
    others = BatchShare(tokens=7.0, requests=7)
    assert sizing.batch_cost(others) is None
    sizing.verify_times.observe_pass(VerifyStep(0.067, 8, 8, 0, "v", 0.004, 0.006))
    base = sizing.verify_times.estimate()(8)
    assert sizing.batch_cost(others)(2) == pytest.approx(base + 0.008 + 0.001 + 0.006)
    assert not sizing.for_request().choose(8, others).probe


def test_batch_choice_waits_for_both_costs_and_alone_uses_the_step_time():
    sizing = TreeSizing(max_nodes=8, max_depth=4, probe_every=0, verify_times=PassTimes())
    request = sizing.for_request()
    others = BatchShare(tokens=3.0, requests=3)
    # nothing measured: the bucket's bootstrap (default size first), and no prefill ahead
    assert request.choose(4, others) == StepChoice(8, pytest.approx(request.profile
                                                   .expected_tokens(8)[8]), probe=True)
    assert not request.would_speculate(4, others)
    # one bootstrap draft at a time per arm: the others decode plainly until it is back
    assert sizing.for_request().choose(4, others) == StepChoice(0, 1.0)
    step = VerifyStep(seconds=0.1, rows=12, trees=4, nodes=8)
    request.observe(1, StepChoice(8, 2.0), chain(8), [100, 5], 0.3, 4, ["datastore"], "",
                    step, draft_seconds=0.02)
    assert sizing.verify_times._perf == {12: 0.1}
    # the same pass reported by another tree of it is not counted again
    sizing.for_request().observe(1, StepChoice(8, 2.0), chain(8), [100, 5], 0.3, 4,
                                 ["datastore"], "", step)
    assert sizing.verify_times._step == 1
    assert sizing.draft_times._perf == {8: 0.02}
    assert sizing.batch_cost(others) is None, "one pass size: no verify line yet"
    assert sizing.for_request().choose(4, others).probe, "the next bootstrap may go"
    sizing.verify_times.observe(4, 0.09)
    assert sizing.batch_cost(others)(2) == pytest.approx(
        sizing.verify_times.fit()(3 + 1 + 2) + 0.02)
    # a pass that also prefilled someone is not a decoding step's time
    request.observe(2, StepChoice(0, 1.0), TokenTree.chain([]), [5], 0.9, 4, [], "",
                    VerifyStep(seconds=0.8, rows=300, trees=4, nodes=0))
    assert 300 not in sizing.verify_times._perf and 0 not in sizing.time_model(4)._perf
    # alone, the bucket's step-time model decides (wall time over own tree size)
    sizing.time_model(1).observe(0, 0.05)
    sizing.time_model(1).observe(8, 0.06)
    request.profile = AcceptanceProfile.from_probabilities([[0.9]] * 4)
    assert request.choose(1).budget > 0


def test_a_drafters_measured_cost_spares_the_batch_bootstrap():
    """With the drafter's own timing as D until drafts are timed, an arm whose drafting cannot
    pay in the batch is never bootstrapped: no draft, no drafter prefill ahead."""
    verify = LinearCost(0.100, 0.019)  # Qwen 1.5B bf16 on two cores: ~19 ms per row
    others = BatchShare(tokens=7.0, requests=7)

    def arm(prior):
        sizing = TreeSizing(max_nodes=4, max_depth=4, probe_every=0, verify_times=PassTimes(),
                            draft_prior=prior)
        for rows in (6, 8):
            sizing.verify_times.observe(rows, verify(rows))
        return sizing.for_request()

    level = 0.060  # the 0.5B draft: one forward of one request
    request = arm(lambda n: min(n, 4) * level)
    assert request.choose(8, others) == StepChoice(0, 1.0)
    assert not request.would_speculate(8, others)
    assert request.shared.batch_cost(others)(4) == pytest.approx(verify(12) + 4 * level)
    # without it: the bootstrap drafts the default size to measure D
    assert arm(None).choose(8, others).probe
    # a cheap drafter still speculates on a profile that pays
    request = arm(lambda n: min(n, 4) * 0.001)
    request.profile = AcceptanceProfile.from_probabilities([[0.95]] * 4)
    assert request.choose(8, others).budget > 0
    # timed drafts replace the estimate
    request.shared.draft_times.observe(4, 0.5)
    assert request.shared.batch_cost(others)(4) == pytest.approx(verify(12) + 0.5)


def test_a_pending_drafter_prefill_is_charged_to_a_batched_tree():
    """SPIN's switching cost in the batch's choice: a tree that would wait for the request's
    drafter prefill pays for it in that step; alone, the request's own step time decides."""
    verify = LinearCost(0.080, 0.001)
    sizing = TreeSizing(max_nodes=4, max_depth=4, probe_every=0, verify_times=PassTimes(),
                        draft_prior=lambda n: min(n, 4) * 0.002)
    for rows in (6, 8):
        sizing.verify_times.observe(rows, verify(rows))
    request = sizing.for_request()
    request.profile = AcceptanceProfile.from_probabilities([[0.9]] * 4)
    others = BatchShare(tokens=5.0, requests=5)
    assert request.choose(6, others).budget > 0 and request.would_speculate(6, others)
    pending = BatchShare(tokens=5.0, requests=5, switch_seconds=0.12)  # 150 tokens to prefill
    assert sizing.batch_cost(pending)(0) == pytest.approx(verify(6))
    assert sizing.batch_cost(pending)(2) == pytest.approx(verify(8) + 0.004 + 0.12)
    assert request.choose(6, pending) == StepChoice(0, 1.0)
    assert not request.would_speculate(6, pending), "no prefill ahead for a plain request"


def test_an_off_request_skips_probes_that_could_not_pay():
    """A probe only teaches acceptance: when even a fully accepted probe tree would not beat a
    plain step at the current costs, an off request does not probe."""
    sizing = TreeSizing(max_nodes=10, max_depth=10, probe_every=4)
    feed(sizing, LinearCost(0.030, 0.040))  # each node costs more than a plain step
    request = sizing.for_request()
    request.profile = AcceptanceProfile.from_probabilities([[0.05]] * 10)
    assert all(request.choose(1) == StepChoice(0, 1.0) for _ in range(64))
    # batched: the same rule over the batch's rate
    sizing = TreeSizing(max_nodes=4, max_depth=4, probe_every=1, verify_times=PassTimes(),
                        draft_prior=lambda n: min(n, 4) * 0.060)
    for rows in (6, 8):
        sizing.verify_times.observe(rows, LinearCost(0.100, 0.019)(rows))
    request = sizing.for_request()
    others = BatchShare(tokens=7.0, requests=7)
    assert all(request.choose(8, others) == StepChoice(0, 1.0) for _ in range(16))
    # where a fully accepted probe would pay, it probes as before
    sizing.draft_prior = lambda n: min(n, 4) * 0.001
    assert any(request.choose(8, others).probe for _ in range(16))


def test_runs_plain_says_whether_the_choice_would_be_off():
    """What the selection asks before exploring an arm: measured costs and the request's
    profile say no tree pays (True), or they cannot tell yet / the sizing always drafts
    (False). It counts as no step."""
    sizing = TreeSizing(max_nodes=10, max_depth=10, probe_every=4)
    request = sizing.for_request()
    assert not request.runs_plain(1), "costs not measured yet: the bootstrap decides"
    feed(sizing, LinearCost(0.030, 0.010))
    request.profile = AcceptanceProfile.from_probabilities([[0.05]] * 10)
    assert request.runs_plain(1)
    request.profile = AcceptanceProfile.from_probabilities([[0.9]] * 10)
    assert not request.runs_plain(1)
    assert request.decisions == [] and request.choices == 0 and sizing.strategy.choices == 0
    for mode in ("fixed", "length"):
        other = TreeSizing(max_nodes=10, max_depth=10, mode=mode)
        feed(other, LinearCost(0.030, 0.010))
        assert not other.for_request().runs_plain(1)
    assert TreeSizing(max_nodes=0, max_depth=0).for_request().runs_plain(1)


def test_records_every_step_and_skips_the_prefill_time():
    sizing = TreeSizing(max_nodes=8, max_depth=4)
    request = sizing.for_request()
    record = request.observe(0, StepChoice(0, 1.0), TokenTree.chain([]), [5], 2.0, 1, [])
    assert sizing.time_model(1)._perf == {}, "a prefill is not a verify step"
    assert (record.step, record.budget, record.tree_size, record.emitted) == (0, 0, 0, 1)
    tree = TokenTree.union([chain(3), TokenTree.chain([100, 7], [0.5, 0.5], "layers:8")])
    record = request.observe(1, StepChoice(4, 2.5, probe=True), tree, [100, 101, 9], 0.04, 1,
                             ["datastore", "layers:8"])
    assert (record.budget, record.tree_size, record.expected_length, record.emitted,
            record.probe, list(record.drafters)) == (4, 4, 2.5, 3, True,
                                                     ["datastore", "layers:8"])
    assert sizing.time_model(1)._perf == {4: 0.04}
    assert len(request.decisions) == 2


def test_an_arms_prior_learns_from_a_few_requests():
    """The arm's prior starts as a guess worth `prior_weight` observations: after ten trees
    of an arm the target never followed, a new request expects little of the arm."""
    sizing = TreeSizing(max_nodes=4, max_depth=4, probe_every=0)
    assert sizing.for_request().profile.expected_tokens(1)[1] == pytest.approx(1.5)
    for step in range(1, 11):
        sizing.for_request().observe(step, StepChoice(4, 2.0), chain(4), [7], 0.2, 1, ["m"])
    assert sizing.for_request().profile.expected_tokens(1)[1] < 1.2


def test_a_drafter_prefill_wait_is_recorded_but_not_learnt_as_step_time():
    """The first step on a draft model waits for the drafter's prefill of the request (a
    switching cost): the record keeps the wall time and the wait, the step-time model learns
    the step without it."""
    sizing = TreeSizing(max_nodes=8, max_depth=4)
    request = sizing.for_request()
    record = request.observe(1, StepChoice(4, 2.5), chain(4), [100, 101, 9], 0.640, 1,
                             ["m"], switch_seconds=0.400)
    assert record.seconds == pytest.approx(0.640)
    assert record.switch_seconds == pytest.approx(0.400)
    assert sizing.time_model(1)._perf == {4: pytest.approx(0.240)}


def test_length_mode_follows_the_minions_selector():
    """mode="length": every request drafts the arm's s, which moves with the slope of
    step time / emitted tokens (here: longer is always better, so s climbs to its maximum)."""
    sizing = TreeSizing(max_nodes=8, max_depth=8, mode="length")
    request = sizing.for_request()
    assert request.choose(1).budget == 4  # Minions' default length
    for step in range(1, 400):
        choice = request.choose(1)
        s = choice.budget
        # emitted grows with s faster than the time does: t / emitted falls with s
        request.observe(step, choice, chain(s), list(chain(s).tokens) + [1], 0.03 + 0.001 * s,
                        1, ["ds"])
    assert sizing.strategy.selector.s == 8 and request.choose(1).budget == 8
    assert not TreeSizing(max_nodes=8, max_depth=8, mode="fixed").adaptive
    with pytest.raises(ValueError, match="unknown tree-size mode"):
        TreeSizing(max_nodes=8, max_depth=8, mode="magic")


def test_router_prices_each_arm_from_its_models_measured_cost():
    """The prior of an arm: one forward per level (depth min(n, depth)) of each model it drafts
    with; none for the datastore or where a model did not report a cost."""
    from specmesh_services.common.config import Settings
    from specmesh_services.router.engine import Router, TargetInfo

    spec = Settings().with_overrides(**{
        "speculation.source": "both", "speculation.depth": 4, "speculation.selection": "lbss",
        "speculation.voting": True})

    def router(costs, names=("a", "b"), speculation=spec.speculation):
        return Router(None, None, None, TargetInfo("t", 10, 100, (0,)), speculation,
                      spec.router, datastore=object(), drafter_names=list(names),
                      drafter_costs=costs)

    r = router({"a": 0.05, "b": 0.01})
    assert r.arms.get("a").draft_prior(2) == pytest.approx(0.10)
    assert r.arms.get("b").draft_prior(9) == pytest.approx(0.04), \
        "no deeper than the configured depth"
    assert r.arms.get("vote").draft_prior(8) == pytest.approx(4 * 0.06), "every model drafts"
    assert r.arms.get("datastore").draft_prior is None
    assert router({"a": 0.05, "b": 0.0}).arms.get("vote").draft_prior is None
    assert r.sizing_for("a").draft_prior(3) == pytest.approx(0.15)
    # one configured drafter ("" = its first model)
    fixed = spec.with_overrides(**{"speculation.selection": "fixed", "speculation.voting": False,
                                   "speculation.source": "model"}).speculation
    assert router({"m": 0.02}, names=(), speculation=fixed).arms.get(
        "configured").draft_prior(4) == pytest.approx(0.08)


def test_drafting_time_is_recorded_at_the_size_drafted():
    """A confidence-stopped chain asked for 8 nodes that stopped at 3 ran 3 draft forwards:
    its time is D(3), not D(8) (timed at the budget, every size of a self-sized chain looked
    like the full chain's cost and a batch never found a short chain worth drafting)."""
    sizing = TreeSizing(max_nodes=8, max_depth=8, probe_every=0, verify_times=PassTimes())
    request = sizing.for_request()
    request.observe(1, StepChoice(8, 3.0), chain(3), [100, 101, 102, 5], 0.3, 1, ["m"], "",
                    draft_seconds=0.06)
    request.observe(2, StepChoice(8, 3.0), chain(6), [100, 5], 0.3, 1, ["m"], "",
                    draft_seconds=0.12)
    assert sizing.draft_times._perf == {3: 0.06, 6: 0.12}
    assert sizing.draft_times.fit()(1) == pytest.approx(0.02, abs=1e-6)
