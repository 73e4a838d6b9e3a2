"""The tree-size strategies (`speculation.tree_size`): how each step of a request chooses its
node budget, behind one interface (`SizeStrategy`), one instance per arm, chosen once when the
arm's sizing is made (`make_strategy`).

- `FixedSize` ("fixed"): the configured tree every step.
- `AdaptiveSize` ("adaptive", ProPD section 4.2): the budget with the most expected tokens per
  second under the measured costs and the request's acceptance profile, 0 = a plain step;
  `policy.py` describes the choice and its deviations.
- `LengthSize` ("length", Minions section 3.3): every request of the arm drafts the arm's
  speculation length s, which moves with the slope of step time / emitted tokens (`length.py`).
- `NoSpeculation`: an arm without trees (depth 0), whatever the mode.

A strategy reads the arm-wide costs and prior from the request's `TreeSizing` (`shared`) and
the request's profile and counters from its `RequestSizing`; it keeps only what is its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from specmesh_services.router.length import LengthConfig, SpeculationLengthSelector
from specmesh_services.router.steps import BatchShare, StepChoice, bucket_of
from specmesh_services.router.tree_size import best_size

if TYPE_CHECKING:
    from specmesh_services.router.policy import RequestSizing, TreeSizing

OFF_PROBE_SPACING = 4  # an off request probes every 4 * probe_every steps
OFF_PROBE_SIZE = 2
BOOTSTRAP_TIMEOUT = 64  # choices after which a batch bootstrap draft that never came back is retried


class SizeStrategy:
    """How a request's steps on one arm choose their node budget."""

    # the budget shapes the draft (a model's depth, the lookup's nodes, pruning to the budget);
    # False: the configured tree is drafted whatever the budget
    sizes_draft = True

    def choose(self, request: RequestSizing, in_flight: int, others: BatchShare) -> StepChoice:
        """This step's budget (counted as a step of the request)."""
        raise NotImplementedError

    def would_speculate(self, request: RequestSizing, in_flight: int,
                        others: BatchShare) -> bool:
        """Whether a step now would draft (probes and the bootstrap aside), without counting
        as a step: the router prefills a drafter ahead of time only for requests that use it."""
        return True

    def runs_plain(self, request: RequestSizing, in_flight: int, others: BatchShare) -> bool:
        """Whether no tree of this arm pays now (the choice would be 0, probes aside): the
        selection does not explore an arm where the request would only decode plainly."""
        return False

    def ahead_budget(self, request: RequestSizing, budget: int, in_flight: int,
                     others: BatchShare) -> int:
        """The node limit of a tree drafted for the request's next step before it is chosen
        (the verifier's heads draft it with this step's result), given this step's `budget`;
        0 where the next step would not draft."""
        return request.shared.max_nodes

    def observe(self, choice: StepChoice, emitted: int, step_seconds: float,
                timed_draft: bool) -> None:
        """One finished step after the prefill: `emitted` tokens in `step_seconds` (a drafter
        switch left out); `timed_draft`: its tree's drafting time came back."""


class NoSpeculation(SizeStrategy):
    """No trees on this arm (speculation depth 0): every step decodes plainly."""

    sizes_draft = False

    def choose(self, request: RequestSizing, in_flight: int, others: BatchShare) -> StepChoice:
        return StepChoice(0, 1.0)

    def would_speculate(self, request: RequestSizing, in_flight: int,
                        others: BatchShare) -> bool:
        return False

    def runs_plain(self, request: RequestSizing, in_flight: int, others: BatchShare) -> bool:
        return True


class FixedSize(SizeStrategy):
    """The whole configured tree every step."""

    sizes_draft = False

    def choose(self, request: RequestSizing, in_flight: int, others: BatchShare) -> StepChoice:
        curve = request.profile.expected_tokens(request.shared.max_nodes)
        return StepChoice(request.shared.max_nodes, curve[-1])


def _doubled(budget: int, top: int) -> int:
    """Twice this step's budget, at least 2 (a tree grows a probe at a time), at most `top`:
    a tree drafted ahead costs with both its nodes and its levels."""
    return min(top, max(2, 2 * budget))


class LengthSize(SizeStrategy):
    """Minions' adaptive speculation length: every request of the arm drafts s nodes."""

    def __init__(self, max_nodes: int) -> None:
        self.selector = SpeculationLengthSelector(LengthConfig(s_init=min(4, max_nodes),
                                                               s_max=max_nodes))

    def choose(self, request: RequestSizing, in_flight: int, others: BatchShare) -> StepChoice:
        curve = request.profile.expected_tokens(request.shared.max_nodes)
        s = min(self.selector.s, len(curve) - 1)
        return StepChoice(s, curve[s])

    def ahead_budget(self, request: RequestSizing, budget: int, in_flight: int,
                     others: BatchShare) -> int:
        return _doubled(budget, request.shared.max_nodes)

    def observe(self, choice: StepChoice, emitted: int, step_seconds: float,
                timed_draft: bool) -> None:
        if choice.budget > 0:
            self.selector.observe(step_seconds, [emitted - 1])


class AdaptiveSize(SizeStrategy):
    """ProPD's choice (`policy.py`): budget = argmax_n E_request(n) / T(n), 0 = plain, with its
    bootstrap and probes. `self_sized`: the arm's tree is one draft model's chain under a
    confidence stop (`_full_chain`)."""

    def __init__(self, probe_every: int = 16, self_sized: bool = False) -> None:
        self.probe_every = probe_every
        self.self_sized = self_sized
        self.choices = 0  # choices made on this arm (its clock)
        self.bootstrap_until = 0  # a batch bootstrap draft is out until this choice

    def choose(self, request: RequestSizing, in_flight: int, others: BatchShare) -> StepChoice:
        choice = self._choose(request, in_flight, others)
        if choice.budget > 0 and self.self_sized and not self.batched(request.shared, in_flight):
            return self._full_chain(request, choice)
        return choice

    def _choose(self, request: RequestSizing, in_flight: int, others: BatchShare) -> StepChoice:
        shared = request.shared
        curve = request.profile.expected_tokens(shared.max_nodes)
        top = len(curve) - 1
        self.choices += 1
        size = self._optimum(request, curve, in_flight, others)
        if size is None:
            return self._bootstrap(shared, curve, in_flight)
        every = self.probe_every * (OFF_PROBE_SPACING if size == 0 else 1)
        probe = False
        # off from its first step on the arm's prior alone (the requests before it): it probes
        # at once, as its own text may be predictable where theirs was not
        starts_off = size == 0 and request.trees == 0 and request.choices == 1
        if every and (request.choices % every == 0 or starts_off):
            neighbour = self._neighbour(request, size, top)
            if size or self._could_pay(request, neighbour, in_flight, others):
                size, probe = neighbour, True
        return StepChoice(size, curve[size], probe)

    def _bootstrap(self, shared: TreeSizing, curve: list[float], in_flight: int) -> StepChoice:
        """The choice before the costs can tell. With others in flight one request of the arm
        at a time drafts the default size (measuring D and a second pass size for V), the
        others decode plainly; alone, the default size, then plain, then the fit exists."""
        top = len(curve) - 1
        if self.batched(shared, in_flight):
            if self.choices < self.bootstrap_until:
                return StepChoice(0, 1.0)
            self.bootstrap_until = self.choices + BOOTSTRAP_TIMEOUT
            size = min(shared.config.default_size, top)
            return StepChoice(size, curve[size], probe=True)
        seen = set(shared.time_model(bucket_of(in_flight))._perf)
        size = shared.config.default_size if not seen or 0 in seen else 0
        return StepChoice(min(size, top), curve[min(size, top)], probe=True)

    def _full_chain(self, request: RequestSizing, choice: StepChoice) -> StepChoice:
        """Deviation from ProPD: a confidence-stopped chain of a request alone (not a batched
        choice: with others in flight each level costs a drafting forward and a verified row of
        the batch's pass, and ProPD's size holds) is asked for the configured depth (within the
        node budget) whenever ProPD chooses to draft. The stop is per step and per node (the
        draft's own certainty at each level), which the request's averaged acceptance profile
        is not; cut at the ProPD size, confident chains stopped short and the router lost to
        the fixed chain (docs/decisions/adaptive-tree-size.md). ProPD still decides whether a
        step drafts at all (0 = plain) and sizes datastore, voted and wide trees."""
        shared = request.shared
        depth = min(shared.config.max_depth, shared.max_nodes)
        if choice.budget >= depth:
            return choice
        curve = request.profile.expected_tokens(depth)
        return StepChoice(depth, curve[min(depth, len(curve) - 1)], choice.probe)

    def _could_pay(self, request: RequestSizing, n: int, in_flight: int,
                   others: BatchShare) -> bool:
        """Whether an n-node tree whose every node were accepted (n + 1 tokens) would beat
        plain decoding at the current cost model."""
        shared = request.shared
        if self.batched(shared, in_flight):
            cost = shared.batch_cost(others)
            base = others.tokens + 1.0
        else:
            cost = shared.time_model(bucket_of(in_flight)).curve()
            base = 1.0
        if cost is None:
            return True
        return (base + n) * cost(0) > base * cost(n)

    @staticmethod
    def batched(shared: TreeSizing, in_flight: int) -> bool:
        """Whether the choice now is the batch's (others in flight, V measured per pass)."""
        return in_flight > 1 and shared.verify_times is not None

    def _optimum(self, request: RequestSizing, curve: list[float], in_flight: int,
                 others: BatchShare) -> int | None:
        """The best size now; None before the time models can tell (bootstrap).

        Alone: argmax E(n) / T_bucket(n) (ProPD). With others in flight: argmax
        (E_others + E(n)) / T_batch(n), the batch's rate."""
        shared = request.shared
        if self.batched(shared, in_flight):
            cost = shared.batch_cost(others)
            if cost is None:
                return None
            choice = best_size(curve, cost, 0, others.tokens)
        else:
            cost = shared.time_model(bucket_of(in_flight)).curve()
            if cost is None:
                return None
            choice = best_size(curve, cost)
        return choice.size if choice is not None else shared.config.default_size

    def would_speculate(self, request: RequestSizing, in_flight: int,
                        others: BatchShare) -> bool:
        """Before the time model can tell it says no: the bootstrap's few draft steps prefill
        when they draft, rather than every request prefilling every drafter it might be sent
        to."""
        curve = request.profile.expected_tokens(request.shared.max_nodes)
        return bool(self._optimum(request, curve, in_flight, others))

    def runs_plain(self, request: RequestSizing, in_flight: int, others: BatchShare) -> bool:
        """False while the costs are still being bootstrapped."""
        curve = request.profile.expected_tokens(request.shared.max_nodes)
        return self._optimum(request, curve, in_flight, others) == 0

    def ahead_budget(self, request: RequestSizing, budget: int, in_flight: int,
                     others: BatchShare) -> int:
        """0 for a request decoding plainly, unless its next step is a probe."""
        if self.runs_plain(request, in_flight, others) and not self._probes_next(request):
            return 0
        return _doubled(budget, request.shared.max_nodes)

    def _probes_next(self, request: RequestSizing) -> bool:
        """Whether the next choice of a request decoding plainly is a probe step."""
        every = self.probe_every * OFF_PROBE_SPACING
        return bool(every) and (request.choices + 1) % every == 0

    def _neighbour(self, request: RequestSizing, size: int, top: int) -> int:
        if size == 0:
            return min(OFF_PROBE_SIZE, top)
        # in turn one node more, one less, double, half: the adjacent sizes keep a cost that
        # grows in steps measured around the choice (the int4 kernel takes rows in blocks of
        # 4), double and half the line's slope
        turn = (request.choices // self.probe_every) % 4
        other = min((size + 1, size - 1, 2 * size, size // 2)[turn], top)
        return other if other != size else size - 1  # at the top: one less

    def observe(self, choice: StepChoice, emitted: int, step_seconds: float,
                timed_draft: bool) -> None:
        if timed_draft:
            self.bootstrap_until = 0  # a bootstrap draft came back


def make_strategy(mode: str, max_nodes: int, probe_every: int = 16,
                  self_sized: bool = False) -> SizeStrategy:
    """The strategy of `speculation.tree_size` = `mode` for an arm whose trees have at most
    `max_nodes` nodes (0: no trees)."""
    strategies = {"fixed": FixedSize, "adaptive": lambda: AdaptiveSize(probe_every, self_sized),
                  "length": lambda: LengthSize(max_nodes)}
    if mode not in strategies:
        raise ValueError(f"unknown tree-size mode {mode!r}")
    return strategies[mode]() if max_nodes > 0 else NoSpeculation()
