"""ProPD's dynamic tree size (section 4.2), the "adaptive" strategy: each step, the budget with
the most expected tokens per second under the measured costs and the request's own profile,

    alone:    budget = argmax_n E_request(n) / T_bucket(n),   n = 0 .. max_nodes, 0 = plain
    batched:  budget = argmax_n (E_others + E_request(n)) / (V(R_others + 1 + n) + D_others + D(n))

T, V (the verifier's pass over its rows), D (drafting): `cost.py`; E: `acceptance.py`; the
others' rows, drafting and tokens: their current plans; the batched cost with the round trip
a tree's step no longer spreads over plain runs (`TreeSizing.batch_cost`). Deviations from ProPD
(docs/decisions/adaptive-tree-size.md):
- each request chooses every step knowing the others' plans, not one size per batch change.
- T is the router's wall time of a step (drafting included), not the verifier's forward alone.
- probes: a neighbouring size every `probe_every` steps; off, rarer 2-node probes that could pay,
  rarer still in a batch (the arm's prior is shared: the batch probes at a lone request's rate).
- bootstrap: the default size, then plain, until two sizes are timed (batched: one at a time).
- a lone request's confidence-stopped chain gets the full depth whenever ProPD drafts.
"""
from __future__ import annotations

from specmesh_services.router.sizing.acceptance import best_size
from specmesh_services.router.sizing.choice import (ChoiceInputs, SizeStrategy, StepChoice,
                                                    StepCosts, doubled)

OFF_PROBE_SPACING = 4  # an off request probes every 4 * probe_every steps (times the batch)
OFF_PROBE_SIZE = 2
BOOTSTRAP_TIMEOUT = 64  # choices after which a batch bootstrap draft that never came back is retried


class AdaptiveSize(SizeStrategy):
    """ProPD's choice with its bootstrap and probes. `default_size`: the bootstrap's size;
    `max_depth`: the chain a `self_sized` arm (one draft model's chain under a confidence stop)
    is asked for (`_full_chain`)."""

    prices = True

    def __init__(self, max_nodes: int, default_size: int = 8, max_depth: int = 8,
                 probe_every: int = 16, self_sized: bool = False) -> None:
        super().__init__(max_nodes)
        self.default_size = default_size
        self.chain_depth = min(max_depth, max_nodes)
        self.probe_every = probe_every
        self.self_sized = self_sized
        self.choices = 0  # choices made on this arm (its clock)
        self.bootstrap_until = 0  # a batch bootstrap draft is out until this choice

    def choose(self, inputs: ChoiceInputs) -> StepChoice:
        curve = inputs.profile.expected_tokens(self.max_nodes)
        choice = self._choose(inputs, curve)
        if choice.budget > 0 and self.self_sized and not inputs.costs.batched:
            return self._full_chain(curve, choice)
        return choice

    def _choose(self, inputs: ChoiceInputs, curve: list[float]) -> StepChoice:
        top = len(curve) - 1
        self.choices += 1
        size = self._optimum(curve, inputs.costs)
        if size is None:
            return self._bootstrap(curve, inputs.costs)
        every = self._off_every(inputs) if size == 0 else self.probe_every
        probe = False
        # off from its first step on the arm's prior alone (the requests before it): it probes
        # at once, as its own text may be predictable where theirs was not
        starts_off = size == 0 and inputs.trees == 0 and inputs.choices == 1
        if every and (inputs.choices % every == 0 or starts_off):
            neighbour = self._neighbour(inputs.choices, size, top)
            if size or self._could_pay(neighbour, inputs.costs):
                size, probe = neighbour, True
        return StepChoice(size, curve[size], probe)

    def _optimum(self, curve: list[float], costs: StepCosts) -> int | None:
        """The best size now (the module's argmax); None before the costs can tell."""
        if costs.seconds is None:
            return None
        choice = best_size(curve, costs.seconds, costs.other_tokens)
        return choice.size if choice is not None else self.default_size

    def _bootstrap(self, curve: list[float], costs: StepCosts) -> StepChoice:
        """The choice before the costs can tell. With others in flight one request of the arm
        at a time drafts the default size (measuring D and a second pass size for V), the
        others decode plainly; alone, the default size, then plain, then the fit exists."""
        top = len(curve) - 1
        if costs.batched:
            if self.choices < self.bootstrap_until:
                return StepChoice(0, 1.0)
            self.bootstrap_until = self.choices + BOOTSTRAP_TIMEOUT
            size = min(self.default_size, top)
            return StepChoice(size, curve[size], probe=True)
        seen = costs.measured_sizes
        size = min(self.default_size if not seen or 0 in seen else 0, top)
        return StepChoice(size, curve[size], probe=True)

    def _full_chain(self, curve: list[float], choice: StepChoice) -> StepChoice:
        """The configured depth (within the node budget) for a chain whose confidence stop,
        per step and per node, sizes it better than the request's averaged profile; ProPD
        still decides whether the step drafts at all."""
        depth = self.chain_depth
        if choice.budget >= depth:
            return choice
        return StepChoice(depth, curve[min(depth, len(curve) - 1)], choice.probe)

    def _off_every(self, inputs: ChoiceInputs) -> int:
        """Steps between an off request's probes: `OFF_PROBE_SPACING` times `probe_every`,
        times the requests in flight. A probe teaches the arm's shared prior as much as the
        request's own profile, and in a batch its rows cost every request's step: b requests
        probing as one would probe b times as often as one alone."""
        return self.probe_every * OFF_PROBE_SPACING * inputs.in_flight

    def _could_pay(self, n: int, costs: StepCosts) -> bool:
        """Whether an n-node tree whose every node were accepted (n + 1 tokens) would beat
        plain decoding at the current costs."""
        if costs.seconds is None:
            return True
        base = costs.other_tokens + 1.0
        return (base + n) * costs.seconds(0) > base * costs.seconds(n)

    def _neighbour(self, choices: int, size: int, top: int) -> int:
        if size == 0:
            return min(OFF_PROBE_SIZE, top)
        # in turn one node more, one less, double, half: the adjacent sizes keep a cost that
        # grows in steps measured around the choice, double and half the line's slope
        turn = (choices // self.probe_every) % 4
        other = min((size + 1, size - 1, 2 * size, size // 2)[turn], top)
        return other if other != size else size - 1  # at the top: one less

    def would_speculate(self, inputs: ChoiceInputs) -> bool:
        """Before the costs can tell it says no: the bootstrap's few draft steps prefill when
        they draft, rather than every request prefilling every drafter it might be sent to."""
        curve = inputs.profile.expected_tokens(self.max_nodes)
        return bool(self._optimum(curve, inputs.costs))

    def runs_plain(self, inputs: ChoiceInputs) -> bool:
        """False while the costs are still being bootstrapped."""
        curve = inputs.profile.expected_tokens(self.max_nodes)
        return self._optimum(curve, inputs.costs) == 0

    def ahead_budget(self, inputs: ChoiceInputs, budget: int) -> int:
        """0 for a request decoding plainly, unless its next step is a probe."""
        if self.runs_plain(inputs) and not self._probes_next(inputs):
            return 0
        return doubled(budget, self.max_nodes)

    def _probes_next(self, inputs: ChoiceInputs) -> bool:
        """Whether the next choice of a request decoding plainly is a probe step."""
        every = self._off_every(inputs)
        return bool(every) and (inputs.choices + 1) % every == 0

    def observe(self, choice: StepChoice, emitted: int, step_seconds: float,
                timed_draft: bool) -> None:
        if timed_draft:
            self.bootstrap_until = 0  # a bootstrap draft came back
