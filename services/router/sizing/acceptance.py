"""Dynamic token tree size (ProPD, section 4.2: dynamic token tree generation).

Three parts, as in the paper:
- 4.2.1 verification overhead: per tree size i an EMA of measured step times,
  T_perf^i <- (1 - alpha) T_perf^i + alpha t_i, and a weighted regression
  T_est(i) = b0 + b1 i over the sizes seen, weight W_i = exp(-lambda o_i) with o_i the time
  since T_perf^i was last updated (recent sizes count most) -> `StepTimeModel`.
- 4.2.2 acceptance probabilities: per depth d and rank k, P_d^k = EMA of "the target's token
  was among the top-k candidates at depth d", p_d^k = P_d^k - P_d^(k-1) the chance that the
  rank-k candidate is the one; a node's expected contribution is the product of p over its path
  (l(seq) = prod p_i^{k_i}) -> `AcceptanceProfile`.
- 4.2.3 efficiency: the best tree of each size is built greedily from those products (always
  the highest-valued candidate next; a child never outvalues its parent, so the first n picks
  are the best n-node tree), its expected length E(n) counts the bonus token (figure 6: a
  tree 'abd', 'ac' under root 'a' is worth 1 + 0.6 + 0.18 + 0.1 = 1.88), and the size with
  the largest E(n) / T_est(n) is taken, scanning the list once. It is recomputed only when the
  batch size or the sequence length changed significantly -> `TreeSizeSelector`.

Our additions: n = 0 is a candidate (E(0) = 1, plain decoding), so the selector returns 0 =
speculation off when no tree beats E(0) / T_est(0); and `prune` cuts a drafted tree down to
the n nodes the probabilities value most. Deviations, each explained where made: o_i counted in
steps rather than seconds, a negative fitted slope clamped to 0, T_est(i) = T_perf^i for the
sizes measured recently and the line only for the others (`StepTimeModel.curve`: costs that grow
in steps), `default_size` until two sizes have been measured, P initialised to a prior rather
than 0, and the EMA's weight at depth d max(alpha, 1 / (prior_weight + observations at d))
(`AcceptanceProfile.fresh`): the prior counts as `prior_weight` observations and the first walks
of a request move its profile faster than alpha alone would. Measured reasons:
docs/decisions/adaptive-tree-size.md. Note that with size 0 chosen no tree is verified, so the
acceptance EMAs stop learning until the router drafts again.

Mapping to our trees (ProPD's heads are Medusa heads): depth d = a node's depth below the root
(the last accepted token), rank k = its position among its siblings by score (highest first;
unscored: tree order). The verifier's walk reveals, at each depth it reached, which child (if
any) the target drew, which is exactly the "in top-k" event of 4.2.2 conditioned on reaching
that depth. Ranks past a node's number of children count as what the offered candidates gave
(the top-k of c < k candidates is the top-c): a drafter that offers one candidate per level
thus keeps p_d^2 = 0 and the best trees it is asked for stay chains (left at their prior, a
request the drafters could not guess still looked worth a wide tree).

Where it sits: router. `policy.py` composes `StepTimeModel`, `AcceptanceProfile` and
`best_size` per request and step; `TreeSizeSelector` is the paper's selector as one object
(`observe_step` with every verify step's tree size and time, `observe_tree` with every verified
tree and the emitted tokens, `choose` when `should_recompute(batch, context)`), exercised by
tests/test_tree_size.py. Plain module: no gRPC, no Redis; it does not import the verifier's
`cost.py` (roles share no modules), but `choose` accepts any cost function.
"""
from __future__ import annotations

import copy
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specmesh_services.common.tree import TokenTree


@dataclass(frozen=True)
class TreeSizeConfig:
    """The paper names alpha and lambda but gives no values; these defaults are ours."""

    max_size: int = 64  # largest tree considered (nodes below the root)
    max_depth: int = 8  # depths with tracked probabilities (ProPD: number of heads)
    max_rank: int = 4  # ranks tracked per depth (ProPD: top-K)
    time_alpha: float = 0.3  # alpha of the T_perf EMA
    age_decay: float = 0.02  # lambda of W_i = exp(-lambda o_i), o_i counted in observed steps
    prob_alpha: float = 0.05  # alpha of the P EMA
    prior_weight: float = 4.0  # observations the prior counts as in a request's profile
    # initial P_d^k = 1 - (1 - prior_top1)^k. The paper does not say how P starts; from 0 every
    # tree would be worth nothing and the first choice would switch speculation off for good.
    prior_top1: float = 0.5
    default_size: int = 8  # used until the time model has two sizes to fit a line through
    context_tolerance: float = 0.25  # relative context change that calls for a recompute

    def __post_init__(self) -> None:
        if self.max_size < 0 or self.max_depth < 1 or self.max_rank < 1:
            raise ValueError("need max_size >= 0, max_depth >= 1, max_rank >= 1")
        for name in ("time_alpha", "prob_alpha"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")
        if not 0 <= self.prior_top1 <= 1 or self.age_decay < 0 or self.prior_weight < 1:
            raise ValueError("need 0 <= prior_top1 <= 1, age_decay >= 0, prior_weight >= 1")


# ---------------------------------------------------------------------------------------------
# 4.2.1 verification overhead
@dataclass(frozen=True)
class LinearCost:
    """T_est(n) = b0 + b1 * n seconds per verify step with an n-node tree."""

    b0: float
    b1: float

    def __call__(self, n: int) -> float:
        return self.b0 + self.b1 * n


@dataclass(frozen=True)
class MeasuredCost:
    """T_est(n) = T_perf^n where size n has been measured recently, the fitted line elsewhere
    (`StepTimeModel.curve`)."""

    line: LinearCost
    measured: Mapping[int, float]

    def __call__(self, n: int) -> float:
        seconds = self.measured.get(n)
        return self.line(n) if seconds is None else seconds


@dataclass
class StepTimeModel:
    """Per-size EMA of step times and their recency-weighted linear regression."""

    alpha: float = 0.3
    decay: float = 0.02
    # `curve` trusts a size's own T_perf while its regression weight is at least this
    # (exp(-0.02 o) >= 0.25: updated within the last 69 steps)
    fresh_weight: float = 0.25
    _perf: dict[int, float] = field(default_factory=dict, init=False, repr=False)  # size -> T_perf
    # size -> step of its last update. o_i is counted in observed steps, not seconds: the
    # router's steps are its clock, and it keeps the weights deterministic.
    _updated: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _step: int = field(default=0, init=False, repr=False)

    def observe(self, size: int, seconds: float) -> None:
        """One verify step over trees of `size` nodes (per request) that took `seconds`."""
        size = int(size)
        old = self._perf.get(size)
        # the first measurement of a size sets T_perf (an EMA from 0 would be biased low)
        self._perf[size] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        self._updated[size] = self._step
        self._step += 1

    def estimate(self) -> LinearCost | None:
        """`fit`, or with one size seen a constant at its time; None before any."""
        if len(self._perf) == 1:
            return LinearCost(next(iter(self._perf.values())), 0.0)
        return self.fit()

    def _weight(self, size: int) -> float:
        """W_i = exp(-lambda o_i), o_i = observed steps since size i was last updated."""
        return math.exp(-self.decay * (self._step - 1 - self._updated[size]))

    def curve(self) -> MeasuredCost | None:
        """T_est(n) for the choice: a recently measured size's own T_perf, the fitted line for
        the others; None before two distinct sizes.

        Deviation from ProPD, which takes the line everywhere: the line is right where the
        cost grows by a constant per node (a GPU below saturation, ProPD's setting) and
        wrong where it grows in steps (FBGEMM's fp16 GEMM takes rows in blocks of 6 on AVX2:
        docs/decisions/adaptive-tree-size.md). With the measured sizes taken as measured, the
        choice sees the step, and a size the line misprices is corrected as soon as it has
        been run (every chosen size is measured)."""
        line = self.fit()
        if line is None:
            return None
        measured = {i: t for i, t in self._perf.items() if self._weight(i) >= self.fresh_weight}
        return MeasuredCost(line, measured)

    def fit(self) -> LinearCost | None:
        """Weighted least squares over the sizes seen; None before two distinct sizes.

        Deviation: a negative slope (noise, or stale sizes) is clamped to 0 and the intercept
        refitted as the weighted mean: a larger tree is never cheaper than a smaller one."""
        if len(self._perf) < 2:
            return None
        sizes = list(self._perf)
        w = [self._weight(i) for i in sizes]
        y = [self._perf[i] for i in sizes]
        sw = sum(w)
        mx = sum(wi * i for wi, i in zip(w, sizes)) / sw
        my = sum(wi * yi for wi, yi in zip(w, y)) / sw
        sxx = sum(wi * (i - mx) ** 2 for wi, i in zip(w, sizes))
        sxy = sum(wi * (i - mx) * (yi - my) for wi, i, yi in zip(w, sizes, y))
        b1 = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
        return LinearCost(my - b1 * mx, b1)


# ---------------------------------------------------------------------------------------------
# 4.2.2 acceptance probabilities
@dataclass(frozen=True)
class TreeShape:
    """The best tree of a size, as (depth, rank) slots; node i's parent comes before it."""

    parents: tuple[int, ...]  # [n], -1 = child of the root
    depths: tuple[int, ...]  # [n], 1 = child of the root
    ranks: tuple[int, ...]  # [n], 1 = most likely sibling
    values: tuple[float, ...]  # [n] product of p along the path: expected count of this node


class AcceptanceProfile:
    """P_d^k, the EMA rate at which the target's token at depth d was among the top-k
    candidates (given depth d - 1 was accepted); depths and ranks are 1-based."""

    def __init__(self, max_depth: int = 8, max_rank: int = 4, alpha: float = 0.05,
                 prior_top1: float = 0.5) -> None:
        self.max_depth, self.max_rank, self.alpha = max_depth, max_rank, alpha
        prior = [1 - (1 - prior_top1) ** k for k in range(1, max_rank + 1)]
        self.cumulative = [list(prior) for _ in range(max_depth)]  # [depth - 1][k - 1] = P_d^k
        # per depth: the weight the current values stand for (observations, the prior's
        # weight included); the EMA never weighs a new observation below alpha
        self.weights = [1.0 / alpha] * max_depth

    def fresh(self, prior_weight: float) -> "AcceptanceProfile":
        """A copy for a new request: the same values, worth `prior_weight` observations."""
        out = copy.deepcopy(self)
        out.weights = [prior_weight] * self.max_depth
        return out

    @classmethod
    def from_probabilities(cls, p: Sequence[Sequence[float]], alpha: float = 0.05
                           ) -> "AcceptanceProfile":
        """A profile whose p_d^k are `p[d - 1][k - 1]` (each row summing to at most 1)."""
        profile = cls(len(p), max(len(row) for row in p), alpha)
        for d, row in enumerate(p):
            total = 0.0
            for k in range(profile.max_rank):
                total += row[k] if k < len(row) else 0.0
                profile.cumulative[d][k] = total
        return profile

    def p(self, depth: int, rank: int) -> float:
        """p_d^k = P_d^k - P_d^(k-1): the chance the rank-k candidate at depth d is accepted,
        given its parent was. Clipped at 0: ranks updated on different steps (trees with
        different widths) can leave P_d^k slightly below P_d^(k-1)."""
        if not (1 <= depth <= self.max_depth and 1 <= rank <= self.max_rank):
            return 0.0
        row = self.cumulative[depth - 1]
        return max(row[rank - 1] - (row[rank - 2] if rank > 1 else 0.0), 0.0)

    def observe_level(self, depth: int, candidates: int, accepted_rank: int | None) -> None:
        """At a reached node of depth `depth` - 1 with `candidates` children, the target drew
        the child of rank `accepted_rank` (None: none of them; the token became the bonus)."""
        if not 1 <= depth <= self.max_depth:
            return
        row = self.cumulative[depth - 1]
        self.weights[depth - 1] += 1
        alpha = max(self.alpha, 1.0 / self.weights[depth - 1])
        for k in range(1, self.max_rank + 1):
            hit = 1.0 if accepted_rank is not None and accepted_rank <= k else 0.0
            row[k - 1] = (1 - alpha) * row[k - 1] + alpha * hit

    def observe_tree(self, tree: TokenTree, emitted: Sequence[int]) -> None:
        """Updates from one verified tree and the tokens the verifier emitted for it (the
        accepted tokens then the bonus token), walking from the root as the verifier did."""
        children = _ranked_children(tree)
        row, depth = 0, 1  # row 0 = root, row i + 1 = node i
        while children[row] and depth <= len(emitted):
            kids = children[row]
            rank = next((r for r, c in enumerate(kids, 1) if tree.tokens[c] == emitted[depth - 1]),
                        None)
            self.observe_level(depth, len(kids), rank)
            if rank is None:
                return
            row, depth = kids[rank - 1] + 1, depth + 1

    # 4.2.3: the best tree of each size -----------------------------------------------------
    def best_tree(self, size: int) -> TreeShape:
        """Greedy: start from the root (value 1), repeatedly add the candidate child with the
        largest value (parent's value * p(depth, rank)); ties go to the earlier candidate."""
        parents: list[int] = []
        depths: list[int] = []
        ranks: list[int] = []
        values: list[float] = []
        heap: list[tuple[float, int, int, int, int]] = []  # (-value, order, parent, depth, rank)
        order = 0

        def push_children(parent: int, depth: int, value: float) -> None:
            nonlocal order
            if depth > self.max_depth:
                return
            for rank in range(1, self.max_rank + 1):
                heapq.heappush(heap, (-value * self.p(depth, rank), order, parent, depth, rank))
                order += 1

        push_children(-1, 1, 1.0)
        while heap and len(parents) < size:
            neg, _, parent, depth, rank = heapq.heappop(heap)
            parents.append(parent)
            depths.append(depth)
            ranks.append(rank)
            values.append(-neg)
            push_children(len(parents) - 1, depth + 1, -neg)
        return TreeShape(tuple(parents), tuple(depths), tuple(ranks), tuple(values))

    def expected_tokens(self, max_size: int) -> list[float]:
        """E(n) for n = 0 .. max_size (fewer if the tracked slots run out): expected tokens
        emitted by a step over the best n-node tree, the bonus token included (E(0) = 1)."""
        values = self.best_tree(max_size).values
        curve = [1.0]
        for v in values:
            curve.append(curve[-1] + v)
        return curve

    def node_values(self, tree: TokenTree) -> list[float]:
        """Each node's value (product of p along its path) under this profile."""
        depths = tree.depths()
        values = [0.0] * len(tree)
        for row, kids in enumerate(_ranked_children(tree)):  # rows in order: parents first
            base = 1.0 if row == 0 else values[row - 1]
            for rank, c in enumerate(kids, 1):
                values[c] = base * self.p(depths[c], rank)
        return values

    def prune(self, tree: TokenTree, size: int) -> TokenTree:
        """The `size` nodes of `tree` with the largest values (ancestors always kept, as a
        child never outvalues its parent; ties keep tree order), in tree order."""
        values, depths = self.node_values(tree), tree.depths()
        # value ties broken by depth: an ancestor always sorts before its descendants
        order = sorted(range(len(tree)), key=lambda i: (-values[i], depths[i], i))
        keep = sorted(order[:max(size, 0)])
        index = {old: new for new, old in enumerate(keep)}
        return TokenTree(
            tokens=tuple(tree.tokens[i] for i in keep),
            parents=tuple(-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep),
            scores=tuple(tree.scores[i] for i in keep) if tree.scores else (),
            sources=tuple(tree.sources[i] for i in keep) if tree.sources else (),
            source_names=tree.source_names if tree.sources else ())


def _ranked_children(tree: TokenTree) -> list[list[int]]:
    """Children of each row (row 0 = root, row i + 1 = node i), highest score first (ties and
    unscored trees: tree order)."""
    children: list[list[int]] = [[] for _ in range(len(tree) + 1)]
    for i, parent in enumerate(tree.parents):
        children[parent + 1].append(i)
    if tree.scores:
        for kids in children:
            kids.sort(key=lambda c: (-tree.scores[c], c))
    return children


# ---------------------------------------------------------------------------------------------
# 4.2.3 the choice
@dataclass(frozen=True)
class SizeChoice:
    size: int  # 0 = speculation off (plain decoding)
    expected_tokens: float  # E(size), bonus included
    step_seconds: float  # T_est(size)

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.step_seconds


def best_size(curve: Sequence[float], cost: Callable[[int], float], other_nodes: int = 0,
              other_tokens: float = 0.0) -> SizeChoice | None:
    """argmax_n curve[n] / cost(n) over n with cost(n) > 0; ties (and n = 0 when nothing beats
    it) go to the smaller size. None if no size has a positive cost.

    Batched (our extension; ProPD picks one size for the whole batch): with other trees of
    `other_nodes` nodes in total verified in the same step, expected to emit `other_tokens`
    tokens, `cost` is the step's time as a function of the batch's total nodes and the choice
    maximizes the batch's rate, argmax_n (other_tokens + curve[n]) / cost(other_nodes + n). A
    saturated verifier (each node costs as much as a row of plain decoding) thus makes a
    request's tree pay for the time it adds to every request of the batch, not only its own;
    with no others it is the single-request choice."""
    best: SizeChoice | None = None
    best_rate = 0.0
    for n, tokens in enumerate(curve):
        seconds = cost(other_nodes + n)
        if seconds <= 0:
            continue
        rate = (other_tokens + tokens) / seconds
        if best is None or rate > best_rate:
            best, best_rate = SizeChoice(n, tokens, seconds), rate
    return best


class TreeSizeSelector:
    """Tree size for the next steps from measured step times and acceptance."""

    def __init__(self, config: TreeSizeConfig | None = None) -> None:
        self.config = config or TreeSizeConfig()
        cfg = self.config
        self.time_model = StepTimeModel(cfg.time_alpha, cfg.age_decay)
        self.profile = AcceptanceProfile(cfg.max_depth, cfg.max_rank, cfg.prob_alpha,
                                         cfg.prior_top1)
        self.size = min(cfg.default_size, cfg.max_size)
        self.last_choice: SizeChoice | None = None
        self._condition: tuple[int, int] | None = None  # (batch, context) of the last choice

    def observe_step(self, size: int, seconds: float) -> None:
        """A verify step: tree nodes per request (0 for plain decoding) and its time."""
        self.time_model.observe(size, seconds)

    def observe_tree(self, tree: TokenTree, emitted: Sequence[int]) -> None:
        self.profile.observe_tree(tree, emitted)

    def should_recompute(self, batch: int, context: int) -> bool:
        """True before the first choice, when the batch size changed, or when the context
        length moved by more than `context_tolerance` of what it was at the last choice."""
        if self._condition is None:
            return True
        last_batch, last_context = self._condition
        moved = abs(context - last_context)
        return batch != last_batch or moved > self.config.context_tolerance * max(last_context, 1)

    def choose(self, batch: int, context: int,
               cost: Callable[[int], float] | None = None) -> int:
        """Recomputes the size for this (batch, context) and returns it. `cost` (seconds per
        step as a function of tree size) defaults to T_est (`StepTimeModel.curve`); before two
        sizes have been measured,
        or if it predicts T_est(0) <= 0, the size stays at `default_size`."""
        self._condition = (batch, context)
        if cost is None:
            cost = self.time_model.curve()
            if cost is None:
                return self.size
        if cost(0) <= 0:
            return self.size
        curve = self.profile.expected_tokens(self.config.max_size)
        choice = best_size(curve, cost)
        if choice is not None:
            self.last_choice = choice
            self.size = choice.size
        return self.size

    def update(self, batch: int, context: int) -> int:
        """The size to use now: recomputed if `should_recompute`, else the current one."""
        return self.choose(batch, context) if self.should_recompute(batch, context) else self.size
