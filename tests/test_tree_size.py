"""Dynamic tree size (ProPD 4.2; router/sizing/cost.py, acceptance.py): cost fit, acceptance
EMAs, greedy trees vs brute force, the adaptive choice vs the brute-force optimum, and
speculation off when it cannot pay."""
import itertools

import pytest

from specmesh_services.common.tree import TokenTree
from specmesh_services.router.sizing import RequestSizing, StepChoice, TreeSizing
from specmesh_services.router.sizing.acceptance import AcceptanceProfile, best_size
from specmesh_services.router.sizing.cost import LinearCost, StepTimeModel
from specmesh_services.router.sizing.request import SizingConfig

# per-depth, per-rank acceptance probabilities p[d-1][k-1] for the hand/brute-force checks
P = [[0.7, 0.15], [0.6, 0.15], [0.5, 0.1]]


def slot_tree(depth: int, ranks: int) -> list[tuple[int, int, int]]:
    """Every (parent, depth, rank) slot of the full tree, parents first."""
    slots: list[tuple[int, int, int]] = []
    frontier = [-1]
    for d in range(1, depth + 1):
        nxt = []
        for parent in frontier:
            for k in range(1, ranks + 1):
                slots.append((parent, d, k))
                nxt.append(len(slots) - 1)
        frontier = nxt
    return slots


def brute_force_expected(p) -> list[float]:
    """E(n) = 1 + max over every ancestor-closed n-node subtree of the sum of path products."""
    slots = slot_tree(len(p), len(p[0]))
    value = []
    for parent, d, k in slots:
        value.append((1.0 if parent < 0 else value[parent]) * p[d - 1][k - 1])
    best = [0.0] * (len(slots) + 1)
    for mask in range(1 << len(slots)):
        chosen = [i for i in range(len(slots)) if mask >> i & 1]
        if all(slots[i][0] < 0 or mask >> slots[i][0] & 1 for i in chosen):
            best[len(chosen)] = max(best[len(chosen)], sum(value[i] for i in chosen))
    return [1.0 + b for b in best]


def adaptive(max_nodes: int, max_depth: int, profile: AcceptanceProfile,
             **config) -> tuple[TreeSizing, RequestSizing]:
    """An adaptive arm without probes and a request of it whose acceptance profile is
    `profile`."""
    sizing = TreeSizing(max_nodes, max_depth, probe_every=0, config=SizingConfig(**config))
    request = sizing.for_request()
    request.profile = profile
    return sizing, request


def test_figure6_expected_length():
    # Figure 6 is an image; its text quotes 'b' in 'ab' worth 0.6, 'e' in 'abe' worth 0.06 and
    # the tree 'abd' + 'ac' worth 1.88. Top-2 head probabilities consistent with all three:
    # head 1 (0.6, 0.1), head 2 (0.3, 0.1); root 'a' is the last accepted token.
    profile = AcceptanceProfile.from_probabilities([[0.6, 0.1], [0.3, 0.1]])
    b, c, d, e = 2, 3, 4, 5
    abe = TokenTree(tokens=(b, e), parents=(-1, 0), scores=(0.6, 0.1))
    abe_with_d = TokenTree(tokens=(b, d, e), parents=(-1, 0, 0), scores=(0.6, 0.3, 0.1))
    assert profile.node_values(abe_with_d)[2] == pytest.approx(0.06)
    assert profile.node_values(abe)[0] == pytest.approx(0.6)
    tree = TokenTree(tokens=(b, d, c), parents=(-1, 0, -1), scores=(0.6, 0.3, 0.1))
    assert 1 + sum(profile.node_values(tree)) == pytest.approx(1.88)
    # and the greedy best 3-node tree is exactly that tree
    shape = profile.best_tree(3)
    assert shape.parents == (-1, 0, -1) and shape.depths == (1, 2, 1) and shape.ranks == (1, 1, 2)
    assert profile.expected_tokens(3)[3] == pytest.approx(1.88)


def test_greedy_tree_is_the_best_tree_of_every_size():
    profile = AcceptanceProfile.from_probabilities(P)
    greedy = profile.expected_tokens(14)
    assert greedy == pytest.approx(brute_force_expected(P))
    shape = profile.best_tree(14)
    assert all(parent < i for i, parent in enumerate(shape.parents))
    assert list(shape.values) == sorted(shape.values, reverse=True)


def test_picks_the_brute_force_optimum_for_a_linear_cost():
    cost = LinearCost(1.0, 0.1)
    expected = brute_force_expected(P)
    speeds = [expected[n] / cost(n) for n in range(len(expected))]
    optimum = max(range(len(speeds)), key=lambda n: speeds[n])
    assert 0 < optimum < 14  # interior: the test means something
    # by hand: the best trees grow along the rank-1 chain .7, .7*.6, .7*.6*.5, then .15, ...
    # E/T for n = 2, 3, 4: 2.12/1.2 = 1.767, 2.33/1.3 = 1.792, 2.48/1.4 = 1.771
    assert optimum == 3 and expected[3] == pytest.approx(1 + 0.7 + 0.42 + 0.21)
    sizing, request = adaptive(14, 3, AcceptanceProfile.from_probabilities(P), max_rank=2)
    model = sizing.time_model(1)
    # the cost is learned from exact measurements at a few sizes, not handed over
    for _ in range(3):
        for n in (0, 3, 6, 12):
            model.observe(n, cost(n))
    fit = model.fit()
    assert (fit.b0, fit.b1) == (pytest.approx(1.0), pytest.approx(0.1))
    choice = request.choose(1)
    assert choice.budget == optimum
    assert choice.expected_length == pytest.approx(expected[optimum])
    best = best_size(request.profile.expected_tokens(14), model.curve())
    assert best.size == optimum and best.expected_tokens == pytest.approx(expected[optimum])
    assert best.tokens_per_second == pytest.approx(max(speeds))
    # a cheaper node moves the optimum up, to what brute force says
    cheap = LinearCost(1.0, 0.01)
    want = max(range(15), key=lambda n: expected[n] / cheap(n))
    assert want > optimum and best_size(expected, cheap).size == want
    sizing, request = adaptive(14, 3, AcceptanceProfile.from_probabilities(P), max_rank=2)
    for n in (0, 3, 6, 12):
        sizing.time_model(1).observe(n, cheap(n))
    assert request.choose(1).budget == want


def test_speculation_off_when_it_cannot_pay():
    low = [[0.2, 0.05], [0.2, 0.05], [0.2, 0.05]]
    steep = LinearCost(1.0, 0.5)
    expected = brute_force_expected(low)
    assert all(expected[n] / steep(n) <= 1 / steep(0) for n in range(1, 15))
    off = best_size(expected, steep)
    assert off.size == 0 and off.expected_tokens == 1.0
    # eight in flight (no batched pass times: the step time of their bucket)
    sizing, request = adaptive(14, 3, AcceptanceProfile.from_probabilities(low), max_rank=2)
    for n in (0, 4, 8, 14):
        sizing.time_model(8).observe(n, steep(n))
    assert request.choose(8) == StepChoice(0, 1.0)
    # exactly break-even is still off: n must beat plain decoding
    assert best_size([1.0, 1.5], LinearCost(1.0, 0.5)).size == 0
    assert best_size([1.0, 1.5001], LinearCost(1.0, 0.5)).size == 1


def test_no_fit_drafts_the_default_size_then_measures_plain():
    """Before the time model has a line the choice is the bootstrap's: the default size, then
    (one size measured, still no line) a plain step for the second point."""
    sizing, request = adaptive(16, 8, AcceptanceProfile(), default_size=5)
    assert request.choose(1).budget == 5
    sizing.time_model(1).observe(5, 0.1)
    sizing.time_model(1).observe(5, 0.1)  # one size only: no line
    assert sizing.time_model(1).fit() is None and sizing.time_model(1).curve() is None
    assert request.choose(1) == StepChoice(0, 1.0, probe=True)


# ---------------------------------------------------------------------------------------------
# 4.2.1 the time model
def test_step_time_ema_and_recency_weighting():
    m = StepTimeModel(alpha=0.5, decay=0.0)
    m.observe(4, 1.0)
    m.observe(4, 2.0)
    assert m._perf[4] == pytest.approx(1.5)  # (1 - 0.5) * 1.0 + 0.5 * 2.0
    # line A at sizes 2, 4, 6; then the batch grows and only sizes 4, 6 are seen on line B
    line_a, line_b = LinearCost(1.0, 0.1), LinearCost(2.0, 0.3)
    for decay, close_to_b in ((1.0, True), (0.0, False)):
        m = StepTimeModel(alpha=1.0, decay=decay)
        for n in (2, 4, 6):
            m.observe(n, line_a(n))
        for _ in range(20):
            for n in (4, 6):
                m.observe(n, line_b(n))
        fit = m.fit()
        near_b = fit.b0 == pytest.approx(2.0, rel=1e-6) and fit.b1 == pytest.approx(0.3, rel=1e-6)
        assert near_b == close_to_b


def test_negative_slope_is_clamped():
    m = StepTimeModel(alpha=1.0, decay=0.0)
    m.observe(2, 1.2)
    m.observe(8, 1.0)
    fit = m.fit()
    assert fit.b1 == 0.0 and fit.b0 == pytest.approx(1.1)


def staircase(n: int) -> float:
    """A verify step whose kernel takes rows in blocks of 6 (FBGEMM's fp16 GEMM on AVX2): n
    nodes + the root = n + 1 rows, one block up to 5 nodes, two from 6 to 11."""
    return 0.18 + 0.01 * n + 0.15 * (n // 6)


def test_curve_takes_measured_sizes_as_measured():
    m = StepTimeModel(alpha=1.0, decay=0.02)
    assert m.curve() is None
    for n in (0, 2, 4, 5, 8, 11):
        m.observe(n, staircase(n))
    cost, line = m.curve(), m.fit()
    for n in (0, 2, 4, 5, 8, 11):
        assert cost(n) == pytest.approx(staircase(n))
    for n in (1, 3, 7, 9):  # never measured: the line, never below a smaller measured size
        below = max(staircase(i) for i in (0, 2, 4, 5, 8, 11) if i < n)
        assert cost(n) == pytest.approx(max(line(n), below))
    # a size not updated for a long time falls back to the line
    for _ in range(100):
        m.observe(4, staircase(4))
        m.observe(5, staircase(5))
    assert m.curve()(8) == pytest.approx(m.fit()(8))
    assert m.curve()(5) == pytest.approx(staircase(5))


def test_a_larger_tree_is_never_priced_below_a_smaller_one():
    """Sizes measured at different moments (a batch's contexts grow between them) can come out
    with the larger one cheaper; the curve lifts it to the smaller one's time."""
    m = StepTimeModel(alpha=1.0)
    for n, seconds in ((8, 0.0698), (9, 0.0639), (10, 0.0792), (7, 0.0652)):
        m.observe(n, seconds)
    cost = m.curve()
    assert cost(9) == pytest.approx(0.0698)
    assert cost(8) == pytest.approx(0.0698)
    assert cost(7) == pytest.approx(0.0652)
    assert cost(10) == pytest.approx(0.0792)
    assert all(cost(n + 1) >= cost(n) for n in range(0, 16))


def test_the_choice_finds_the_cheap_side_of_a_step():
    """Chain acceptance 0.8 per level: under the staircase the best size is 5 (the most nodes
    in one block of rows); the line through the measured sizes prices 5 above what it costs
    and chooses 4. The adaptive choice, over `curve`, chooses 5."""
    chain = AcceptanceProfile.from_probabilities([[0.8]] * 8)
    curve = chain.expected_tokens(8)
    exact = best_size(curve, staircase).size
    assert exact == 5
    sizing, request = adaptive(8, 8, chain, time_alpha=1.0)
    for n in (0, 2, 4, 5, 8, 11):
        sizing.time_model(1).observe(n, staircase(n))
    assert best_size(curve, sizing.time_model(1).fit()).size == 4
    assert request.choose(1).budget == exact


# ---------------------------------------------------------------------------------------------
# 4.2.2 acceptance EMAs from verified trees
def test_acceptance_updates_from_the_accepted_nodes_by_hand():
    profile = AcceptanceProfile(max_depth=2, max_rank=2, alpha=0.5, prior_top1=0.5)
    assert profile.cumulative == [[0.5, 0.75], [0.5, 0.75]]  # P^k = 1 - 0.5^k
    # root -> a(10, .9), b(11, .8); a -> c(12); b -> d(13)
    tree = TokenTree(tokens=(10, 11, 12, 13), parents=(-1, -1, 0, 1), scores=(0.9, 0.8, 0.7, 0.6))
    profile.observe_tree(tree, [10, 12, 99])  # a, c accepted, 99 the bonus
    # depth 1: 2 candidates, rank 1 drawn: P^1 = .5*.5 + .5, P^2 = .5*.75 + .5
    # depth 2: a has 1 candidate, rank 1 drawn: P^1 = .5*.5 + .5, and the top-2 of one
    # candidate is that candidate: P^2 = .5*.75 + .5
    assert profile.cumulative == [[0.75, 0.875], [0.75, 0.875]]
    assert profile.p(1, 1) == pytest.approx(0.75) and profile.p(1, 2) == pytest.approx(0.125)
    profile.observe_tree(tree, [11, 55])  # b (rank 2) accepted, then none of b's children
    assert profile.cumulative == [[0.375, 0.9375], [0.375, 0.4375]]
    profile.observe_tree(tree, [77])  # nothing accepted at depth 1
    assert profile.cumulative == [[0.1875, 0.46875], [0.375, 0.4375]]


def test_a_chain_drafter_never_makes_wider_trees_look_valuable():
    profile = AcceptanceProfile(max_depth=2, max_rank=3, alpha=0.1)
    chain = TokenTree.chain([10, 11])
    for _ in range(100):
        profile.observe_tree(chain, [99])  # the one candidate always misses
    assert profile.p(1, 1) < 0.01 and profile.p(1, 2) < 0.01 and profile.p(1, 3) < 0.01
    assert profile.expected_tokens(8)[-1] < 1.05


def test_ranks_follow_scores_then_tree_order():
    unscored = TokenTree(tokens=(10, 11), parents=(-1, -1))
    rescored = TokenTree(tokens=(10, 11), parents=(-1, -1), scores=(0.1, 0.9))
    a = AcceptanceProfile(max_depth=1, max_rank=2, alpha=1.0)
    a.observe_tree(unscored, [11])  # rank 2 in tree order
    assert a.cumulative == [[0.0, 1.0]]
    b = AcceptanceProfile(max_depth=1, max_rank=2, alpha=1.0)
    b.observe_tree(rescored, [11])  # rank 1 by score
    assert b.cumulative == [[1.0, 1.0]]


def test_learned_profile_converges_to_the_acceptance_rates():
    profile = AcceptanceProfile(max_depth=1, max_rank=2, alpha=0.02)
    tree = TokenTree(tokens=(10, 11), parents=(-1, -1))
    pattern = [10, 10, 10, 11, 99] * 400  # rank 1: 60 %, rank 2: 20 %, neither: 20 %
    for token in pattern:
        profile.observe_tree(tree, [token])
    assert profile.p(1, 1) == pytest.approx(0.6, abs=0.03)
    assert profile.p(1, 2) == pytest.approx(0.2, abs=0.03)


def test_a_fresh_profile_weighs_the_prior_as_a_few_observations():
    prior = AcceptanceProfile(max_depth=1, max_rank=1, alpha=0.05, prior_top1=0.8)
    tree = TokenTree(tokens=(10,), parents=(-1,))
    fresh, slow = prior.fresh(prior_weight=4.0), prior.fresh(prior_weight=20.0)
    for _ in range(4):  # a request whose text the drafter cannot guess
        fresh.observe_tree(tree, [99])
        slow.observe_tree(tree, [99])
    # weights 1/5, 1/6, 1/7, 1/8: the prior's 0.8 is now 0.8 * 4/8
    assert fresh.p(1, 1) == pytest.approx(0.4)
    assert slow.p(1, 1) == pytest.approx(0.8 * 0.95 ** 4)
    assert prior.p(1, 1) == pytest.approx(0.8), "the prior itself is not touched"
    for _ in range(200):  # past 1 / alpha observations the EMA weighs alpha
        fresh.observe_tree(tree, [10])
    assert fresh.weights[0] == 208 and fresh.p(1, 1) == pytest.approx(1.0, abs=1e-4)


def test_prune_keeps_the_most_valuable_nodes():
    profile = AcceptanceProfile.from_probabilities(P)
    # root -> x(1), y(2); x -> z(3); z -> w(4): values .7, .15, .42, .21
    tree = TokenTree(tokens=(1, 2, 3, 4), parents=(-1, -1, 0, 2), scores=(0.9, 0.1, 0.8, 0.7),
                     sources=(0, 1, 0, 0), source_names=("d1", "d2"))
    assert profile.node_values(tree) == pytest.approx([0.7, 0.15, 0.42, 0.21])
    pruned = profile.prune(tree, 3)
    assert pruned.tokens == (1, 3, 4) and pruned.parents == (-1, 0, 1)
    assert pruned.scores == (0.9, 0.8, 0.7) and pruned.sources == (0, 0, 0)
    assert profile.prune(tree, 0).tokens == () and len(profile.prune(tree, 10)) == 4


# ---------------------------------------------------------------------------------------------
# when to recompute
def test_the_choice_is_recomputed_every_step():
    """ProPD recomputes the size when the batch size or the context length changed; the router
    recomputes it every step (docs/decisions/adaptive-tree-size.md): with the same batch, a
    request whose profile moved gets the new choice at once."""
    sizing, request = adaptive(14, 3, AcceptanceProfile.from_probabilities(P), max_rank=2)
    for n in (0, 4, 8, 12):
        sizing.time_model(4).observe(n, LinearCost(1.0, 0.05)(n))
    assert request.choose(4).budget > 0
    request.profile = AcceptanceProfile.from_probabilities([[0.01, 0.0]] * 3)
    assert request.choose(4) == StepChoice(0, 1.0)


def test_exhaustive_small_check_of_best_size():
    # best_size against a plain argmax on random-ish curves and costs
    for b0, b1 in itertools.product((0.5, 1.0), (0.0, 0.1, 2.0)):
        curve = [1.0, 1.6, 2.0, 2.2, 2.3]
        cost = LinearCost(b0, b1)
        speeds = [c / cost(n) for n, c in enumerate(curve)]
        want = max(range(len(curve)), key=lambda n: (speeds[n], -n))
        assert best_size(curve, cost).size == want
