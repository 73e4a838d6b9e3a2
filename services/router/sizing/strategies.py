"""The strategies of `speculation.tree_size`, one per arm, chosen once (`make_strategy`):

- "fixed" (`FixedSize`): the configured tree every step.
- "adaptive" (`adaptive.AdaptiveSize`, ProPD section 4.2): the budget with the most expected
  tokens per second, 0 = a plain step.
- "length" (`LengthSize`, Minions section 3.3): every request of the arm drafts the arm's
  speculation length s, which moves with the slope of step time / emitted tokens (`length.py`).
- `NoSpeculation`: an arm without trees (depth 0), whatever the mode.
"""
from __future__ import annotations

from specmesh_services.router.sizing.adaptive import AdaptiveSize
from specmesh_services.router.sizing.choice import (ChoiceInputs, SizeStrategy, StepChoice,
                                                    doubled)
from specmesh_services.router.sizing.length import LengthConfig, SpeculationLengthSelector


class NoSpeculation(SizeStrategy):
    """No trees on this arm (speculation depth 0): every step decodes plainly."""

    sizes_draft = False

    def choose(self, inputs: ChoiceInputs) -> StepChoice:
        return StepChoice(0, 1.0)

    def would_speculate(self, inputs: ChoiceInputs) -> bool:
        return False

    def runs_plain(self, inputs: ChoiceInputs) -> bool:
        return True


class FixedSize(SizeStrategy):
    """The whole configured tree every step."""

    sizes_draft = False

    def choose(self, inputs: ChoiceInputs) -> StepChoice:
        curve = inputs.profile.expected_tokens(self.max_nodes)
        return StepChoice(self.max_nodes, curve[-1])


class LengthSize(SizeStrategy):
    """Minions' adaptive speculation length: every request of the arm drafts s nodes."""

    def __init__(self, max_nodes: int) -> None:
        super().__init__(max_nodes)
        self.selector = SpeculationLengthSelector(LengthConfig(s_init=min(4, max_nodes),
                                                               s_max=max_nodes))

    def choose(self, inputs: ChoiceInputs) -> StepChoice:
        curve = inputs.profile.expected_tokens(self.max_nodes)
        s = min(self.selector.s, len(curve) - 1)
        return StepChoice(s, curve[s])

    def ahead_budget(self, inputs: ChoiceInputs, budget: int) -> int:
        return doubled(budget, self.max_nodes)

    def observe(self, choice: StepChoice, emitted: int, step_seconds: float,
                timed_draft: bool) -> None:
        if choice.budget > 0:
            self.selector.observe(step_seconds, [emitted - 1])


def make_strategy(mode: str, max_nodes: int, default_size: int = 8, max_depth: int = 8,
                  probe_every: int = 16, self_sized: bool = False) -> SizeStrategy:
    """The strategy of `speculation.tree_size` = `mode` for an arm whose trees have at most
    `max_nodes` nodes (0: no trees); the rest configures "adaptive" (`AdaptiveSize`)."""
    strategies = {
        "fixed": lambda: FixedSize(max_nodes),
        "adaptive": lambda: AdaptiveSize(max_nodes, default_size, max_depth, probe_every,
                                         self_sized),
        "length": lambda: LengthSize(max_nodes)}
    if mode not in strategies:
        raise ValueError(f"unknown tree-size mode {mode!r}")
    return strategies[mode]() if max_nodes > 0 else NoSpeculation(max_nodes)
