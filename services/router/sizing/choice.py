"""What a step's tree-size choice is made from and what it is: the interface every strategy of
`speculation.tree_size` implements (`SizeStrategy`), one instance per arm.

A strategy is handed the values it chooses from (`ChoiceInputs`: the request's acceptance
profile and counters, and the step's costs where the strategy prices trees) and keeps only what
is its own; it never reads the request's or the arm's state itself.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specmesh_services.router.sizing.acceptance import AcceptanceProfile


@dataclass(frozen=True)
class StepChoice:
    budget: int  # node budget for the draft sources, 0 = speculation off
    expected_length: float  # E(budget), bonus included, under the request's profile
    probe: bool = False


@dataclass(frozen=True)
class StepCosts:
    """A step's seconds as a function of the request's tree size n, and the rate it prices:
    alone E(n) / seconds(n), batched (other_tokens + E(n)) / seconds(n)."""

    seconds: Callable[[int], float] | None  # None: not measured yet (the bootstrap decides)
    batched: bool = False  # others in flight, the verifier's pass time measured per pass
    other_tokens: float = 0.0  # what the others' steps are expected to emit (batched)
    measured_sizes: frozenset[int] = frozenset()  # sizes the request's bucket has timed (alone)


@dataclass(frozen=True)
class ChoiceInputs:
    """What a request's step chooses from."""

    profile: AcceptanceProfile  # the request's own, E(n) = profile.expected_tokens(n)[n]
    choices: int  # steps it chose a size for on this arm (the one being chosen included)
    trees: int  # its own trees verified on this arm
    costs: StepCosts | None = None  # only for a strategy that prices trees (`prices`)
    in_flight: int = 1  # requests in flight, this one included


class SizeStrategy:
    """How a request's steps on one arm choose their node budget (at most `max_nodes`)."""

    # the budget shapes the draft (a model's depth, the lookup's nodes, pruning to the budget);
    # False: the configured tree is drafted whatever the budget
    sizes_draft = True
    prices = False  # the choice needs the step's costs (`ChoiceInputs.costs`)

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes

    def choose(self, inputs: ChoiceInputs) -> StepChoice:
        """This step's budget (counted as a step of the request)."""
        raise NotImplementedError

    def would_speculate(self, inputs: ChoiceInputs) -> bool:
        """Whether a step now would draft (probes and the bootstrap aside), without counting
        as a step: the router prefills a drafter ahead of time only for requests that use it."""
        return True

    def runs_plain(self, inputs: ChoiceInputs) -> bool:
        """Whether no tree of this arm pays now (the choice would be 0, probes aside): the
        selection does not explore an arm where the request would only decode plainly."""
        return False

    def ahead_budget(self, inputs: ChoiceInputs, budget: int) -> int:
        """The node limit of a tree drafted for the request's next step before it is chosen
        (the verifier's heads draft it with this step's result), given this step's `budget`;
        0 where the next step would not draft."""
        return self.max_nodes

    def observe(self, choice: StepChoice, emitted: int, step_seconds: float,
                timed_draft: bool) -> None:
        """One finished step after the prefill: `emitted` tokens in `step_seconds` (a drafter
        switch left out); `timed_draft`: its tree's drafting time came back."""


def doubled(budget: int, top: int) -> int:
    """Twice this step's budget, at least 2 (a tree grows a probe at a time), at most `top`:
    the budget of a tree drafted ahead, which costs with both its nodes and its levels."""
    return min(top, max(2, 2 * budget))
