"""Majority-voted speculator (Minions, section 3.2 and figure 5); a plain module, no gRPC or Redis.

In the router, after the drafters answered and before the tree goes to the pool: the drafters'
sequences merge into one weighted tree and its heaviest path from the root is the majority
output, its drafter the *voted* one (`MajorityVoter.vote`). After verification the voted
drafter's acceptance rate is recorded (`observe`); once per verified batch each drafter's ACR
(eq. 1) rewards or punishes its weight (`update`; `BatchedVoter` does both for a router's
requests). The algorithm in full: docs/router.md, Majority vote. Beyond Minions, each off by
default (docs/decisions/majority-vote.md): `Vote.union` verifies every drafter's path when
`verify_union` finds the extra nodes nearly free; weights are clamped; `credit_all`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from specmesh_services.common.tree import TokenTree


@dataclass(frozen=True)
class VotingConfig:
    """The paper names the thresholds and factors but gives no values; these are ours."""

    reward_threshold: float = 0.7  # ACR above this: weight *= reward_factor
    punish_threshold: float = 0.3  # ACR below this: weight *= punish_factor
    reward_factor: float = 1.25
    punish_factor: float = 0.8
    initial_weight: float = 1.0
    # Deviation: the paper does not bound weights. Under repeated punishment a drafter that is
    # never voted again is never measured again (only voted outputs are credited), so its
    # weight would decay toward 0 for good; the clamp keeps every weight finite and recoverable.
    min_weight: float = 1e-3
    max_weight: float = 1e3
    # Deviation, off by default (paper: only the voted drafter is credited). When on, every
    # drafter is credited with how many of its own tokens the target's draws would have taken
    # (see `Vote.judge`), so drafters outvoted for a while can still earn their weight back.
    credit_all: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.punish_threshold <= self.reward_threshold <= 1:
            raise ValueError("need 0 <= punish_threshold <= reward_threshold <= 1")
        if not (self.reward_factor >= 1 and 0 < self.punish_factor <= 1):
            raise ValueError("need reward_factor >= 1 and 0 < punish_factor <= 1")
        if not 0 < self.min_weight <= self.initial_weight <= self.max_weight:
            raise ValueError("need 0 < min_weight <= initial_weight <= max_weight")


# ---------------------------------------------------------------------------------------------
# the vote: one request, one drafting round
@dataclass(frozen=True)
class Vote:
    """Weighted tree of all drafters' sequences and the majority path through it."""

    union: TokenTree  # every drafter's sequence once; scores = node weights, sources = 1st drafter
    supporters: tuple[tuple[str, ...], ...]  # [n] drafters whose sequence passes through node i
    sequences: Mapping[str, tuple[int, ...]]  # drafter -> its proposed tokens
    path: tuple[int, ...]  # node indices (into union) of the majority path, root's child first
    voted: str | None  # the drafter whose sequence the majority path is (None: nothing drafted)

    @property
    def tokens(self) -> tuple[int, ...]:
        """The majority-approved output S_final."""
        return tuple(self.union.tokens[i] for i in self.path)

    @property
    def extra_nodes(self) -> int:
        """Nodes the union verifies beyond the voted path."""
        return len(self.union) - len(self.path)

    def path_tree(self) -> TokenTree:
        """The voted path as a chain, scored with its node weights, sourced to the voted drafter."""
        return TokenTree.chain(self.tokens, [self.union.scores[i] for i in self.path], self.voted)

    def judge(self, emitted: Sequence[int]) -> dict[str, tuple[int, int]]:
        """drafter -> (accepted, judged) of its own sequence, given the verifier's emitted tokens
        (accepted tokens + the bonus token).

        The verifier draws one target token y per position and descends while y is a child, so
        a drafter's token at position k is accepted iff it equals the k-th emitted token and all
        before it were. `judged` is the speculation length of the sequence, except that tokens
        past the emitted ones that no draw ever judged (only possible for a drafter longer than
        what was verified) are not counted. For the voted drafter after verifying its path this
        is the paper's (correctly verified length, speculation length)."""
        out: dict[str, tuple[int, int]] = {}
        for name, seq in self.sequences.items():
            accepted = 0
            while accepted < min(len(seq), len(emitted)) and seq[accepted] == emitted[accepted]:
                accepted += 1
            # a mismatch (or the sequence's end) inside the emitted tokens judges the whole
            # sequence; a match of every emitted token leaves the sequence's tail unjudged
            judged = len(seq) if accepted < len(emitted) else min(len(seq), len(emitted))
            out[name] = (accepted, judged)
        return out


def merge(sequences: Mapping[str, Sequence[int]], weights: Mapping[str, float]
          ) -> tuple[TokenTree, tuple[tuple[str, ...], ...]]:
    """The weighted tree: node weight = sum of weights of the drafters passing through it.

    Node order is that of `TokenTree.union` over the drafters' chains in `sequences` order (a
    node appears when its first drafter is merged), so `union` equals `TokenTree.union` of the
    chains in tokens and parents. Each node's source is the first drafter through it."""
    names = tuple(sequences)
    tokens: list[int] = []
    parents: list[int] = []
    node_weights: list[float] = []
    sources: list[int] = []
    supporters: list[list[str]] = []
    index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for j, name in enumerate(names):
        parent = -1
        for token in sequences[name]:
            key = (parent, int(token))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
                node_weights.append(0.0)
                sources.append(j)
                supporters.append([])
            node = index[key]
            node_weights[node] += float(weights[name])
            supporters[node].append(name)
            parent = node
    tree = TokenTree(tuple(tokens), tuple(parents), tuple(node_weights),
                     tuple(sources), names if tokens else ())
    return tree, tuple(tuple(s) for s in supporters)


def majority_path(tree: TokenTree) -> tuple[int, ...]:
    """Descends from the root to the heaviest child (tree.scores) at each level until a leaf.

    Ties go to the child created first, i.e. the one of the earliest drafter in input order
    (the paper does not say how ties break; this keeps the vote deterministic)."""
    children: list[list[int]] = [[] for _ in range(len(tree) + 1)]  # row 0 = root
    for i, parent in enumerate(tree.parents):
        children[parent + 1].append(i)
    path: list[int] = []
    row = 0
    while children[row]:
        best = max(children[row], key=lambda c: (tree.scores[c], -c))
        path.append(best)
        row = best + 1
    return tuple(path)


def majority_vote(sequences: Mapping[str, Sequence[int]], weights: Mapping[str, float]) -> Vote:
    """Merges `sequences` (drafter -> tokens) weighted by `weights` and picks the majority path.

    The voted drafter is the one whose sequence *is* the path (its leaf is v_n). If several
    drafters proposed that same sequence, the heaviest of them is voted (ties: input order)."""
    tree, supporters = merge(sequences, weights)
    path = majority_path(tree)
    tokens = tuple(tree.tokens[i] for i in path)
    owners = [n for n, seq in sequences.items() if tuple(int(t) for t in seq) == tokens and seq]
    voted = max(owners, key=lambda n: weights[n]) if owners else None  # max keeps the first tie
    seqs = {n: tuple(int(t) for t in seq) for n, seq in sequences.items()}
    return Vote(union=tree, supporters=supporters, sequences=seqs, path=path, voted=voted)


def verify_union(vote: Vote, seconds_per_node: float, max_extra_seconds: float) -> bool:
    """True if verifying the whole union instead of the voted path costs at most
    `max_extra_seconds` more, by the verify-cost model's marginal `seconds_per_node`.

    Not in Minions (which verifies only the voted path so the LLM's load does not grow); this
    is the escape hatch for when the verifier is memory-bound and extra rows are nearly free.
    The router gets `seconds_per_node` from the verifier's cost fit (per_row_s + per_context_s:
    one more tree row adds one row and one attended position); it is a float here because the
    router does not import the verifier's modules."""
    return vote.extra_nodes > 0 and vote.extra_nodes * seconds_per_node <= max_extra_seconds


def choose_tree(vote: Vote, seconds_per_node: float, max_extra_seconds: float) -> TokenTree:
    """The tree to send: the union when `verify_union` allows it, else the voted path."""
    if verify_union(vote, seconds_per_node, max_extra_seconds):
        return vote.union
    return vote.path_tree()


# ---------------------------------------------------------------------------------------------
# drafter weights across requests
@dataclass
class _Acceptance:
    """Sum and count of per-output acceptance rates (eq. 1's numerator and |o_SSM_i|)."""

    total: float = 0.0
    count: int = 0

    def add(self, rate: float) -> None:
        self.total += rate
        self.count += 1

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class MajorityVoter:
    """Drafter weights, the vote, and the reward/punish update from verification results."""

    drafters: Sequence[str]
    config: VotingConfig = field(default_factory=VotingConfig)

    def __post_init__(self) -> None:
        if len(set(self.drafters)) != len(self.drafters):
            raise ValueError("drafter names must be unique")
        self.weights: dict[str, float] = {d: self.config.initial_weight for d in self.drafters}
        self._batch: dict[str, _Acceptance] = {d: _Acceptance() for d in self.drafters}

    def vote(self, sequences: Mapping[str, Sequence[int]]) -> Vote:
        unknown = set(sequences) - set(self.weights)
        if unknown:
            raise ValueError(f"unknown drafters: {sorted(unknown)}")
        return majority_vote(sequences, self.weights)

    def record(self, drafter: str, accepted: int, speculated: int) -> None:
        """One verified output o_i of `drafter`: acceptance rate = accepted / speculated."""
        if speculated <= 0:
            return  # nothing was speculated: no rate to record
        if not 0 <= accepted <= speculated:
            raise ValueError(f"accepted {accepted} outside [0, speculated={speculated}]")
        rate = accepted / speculated
        self._batch[drafter].add(rate)

    def observe(self, vote: Vote, emitted: Sequence[int]) -> None:
        """Credits `vote`'s voted drafter (every drafter with `credit_all`) from the verifier's
        emitted tokens (accepted + bonus) for this request."""
        judged = vote.judge(emitted)
        for name, (accepted, speculated) in judged.items():
            if name == vote.voted or self.config.credit_all:
                self.record(name, accepted, speculated)

    def update(self) -> dict[str, float]:
        """After a verified batch: ACR of each drafter over this batch's outputs (eq. 1), weight
        multiplied by reward_factor above reward_threshold / punish_factor below
        punish_threshold. Drafters with no output in the batch keep their weight. Returns the
        batch ACRs and starts a new batch."""
        cfg = self.config
        acrs: dict[str, float] = {}
        for name, acc in self._batch.items():
            rate = acc.mean
            if rate is None:
                continue
            acrs[name] = rate
            if rate > cfg.reward_threshold:
                self.weights[name] *= cfg.reward_factor
            elif rate < cfg.punish_threshold:
                self.weights[name] *= cfg.punish_factor
            self.weights[name] = min(max(self.weights[name], cfg.min_weight), cfg.max_weight)
        self._batch = {d: _Acceptance() for d in self.drafters}
        return acrs


class BatchedVoter:
    """A router's voter across its requests: Minions updates the weights after each verified
    batch; the router sees requests, not batches, so it updates them once per batch's worth of
    outputs (`batch_size()`: the requests in flight)."""

    def __init__(self, voter: MajorityVoter, batch_size: Callable[[], int]) -> None:
        self.voter = voter
        self.batch_size = batch_size
        self._since_update = 0

    def vote(self, sequences: Mapping[str, Sequence[int]]) -> Vote:
        return self.voter.vote(sequences)

    def observe(self, vote: Vote, emitted: Sequence[int]) -> None:
        """Credits the voted drafter; every batch's worth of outputs, updates the weights."""
        self.voter.observe(vote, emitted)
        self._since_update += 1
        if self._since_update >= max(self.batch_size(), 1):
            self.voter.update()
            self._since_update = 0
