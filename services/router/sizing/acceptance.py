"""ProPD's acceptance profile and best trees (sections 4.2.2-4.2.3): what a step over the best
tree of n nodes is expected to emit, E(n), and the size with the most tokens per second.

P_d^k = EMA of "the target's token at depth d was among the top-k candidates" (d: depth below
the last accepted token, k: rank among siblings by score); p_d^k = P_d^k - P_d^(k-1); a node is
worth the product of p along its path. The best n-node tree is built greedily, E(n) counts the
bonus token, and `best_size` scans argmax_n E(n) / T(n) once. `prune` cuts a drafted tree to the
n nodes worth most. Deviations (docs/decisions/adaptive-tree-size.md):
- n = 0 is a candidate (E(0) = 1): when no tree beats plain decoding, speculation is off.
- P starts at a prior, not 0, worth `prior_weight` observations in a request's profile (`fresh`).
- ranks past a node's children count as what the offered candidates gave: chains stay chains.
"""
from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specmesh_services.common.tree import TokenTree


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


@dataclass(frozen=True)
class RatedSize:
    """A tree size with what a step over it is expected to emit and to cost."""

    size: int  # 0 = speculation off (plain decoding)
    expected_tokens: float  # E(size), bonus included
    step_seconds: float  # T_est(size)

    @property
    def tokens_per_second(self) -> float:
        return self.expected_tokens / self.step_seconds


def best_size(curve: Sequence[float], cost: Callable[[int], float],
              other_tokens: float = 0.0) -> RatedSize | None:
    """argmax_n (other_tokens + curve[n]) / cost(n) over n with cost(n) > 0; ties (and n = 0
    when nothing beats it) go to the smaller size. None if no size has a positive cost.
    `other_tokens`: what the other requests of a batched step are expected to emit, `cost` then
    the whole step's time: the batch's rate (0: ProPD's single-request choice)."""
    best: RatedSize | None = None
    best_rate = 0.0
    for n, tokens in enumerate(curve):
        seconds = cost(n)
        if seconds <= 0:
            continue
        rate = (other_tokens + tokens) / seconds
        if best is None or rate > best_rate:
            best, best_rate = RatedSize(n, tokens, seconds), rate
    return best
