"""Minions' adaptive speculation length (section 3.3): the node budget s of the "length" strategy.

s_opt = argmin_s t_LLM(b, s) / vl(s) (eq. 4) is watched, not searched: an online monitor records
each verification step's time over its requests' average verified length; once
`decision_threshold` records have come in since s last changed, the slope of a line through them
moves s (positive: s -= s_punish, negative: s += s_reward), within [s_min, s_max]. The router
asks for `selector.s` nodes and calls `observe` after each step. Plain module, no gRPC.
Defaults and deviations (docs/decisions/speculation-length.md):
- s_punish = 2 > s_reward = 1, s_init = 4: the paper gives none; a literal rule never settles.
- the bonus token is counted in vl (`count_bonus`): a step that accepted nothing still emitted.
- the fit keeps records from before a change, and probes when there is no change to judge.
- after a decrease that made t/vl worse, s goes back up (`undo_harmful_decrease`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LengthConfig:
    s_init: int = 4
    s_min: int = 1
    s_max: int = 12  # figure 12 sweeps fixed lengths 2..12
    s_reward: int = 1
    s_punish: int = 2
    decision_threshold: int = 16  # records needed since the last change before deciding again
    # Deviation: the paper's vl counts drafted tokens verified as correct, without the bonus
    # token. A step that accepted nothing has vl = 0 and t/vl = inf, which no line fits, and the
    # step still produced a token; with the bonus counted, N / (vl + 1) is the true number of
    # verification rounds in eq. 3. With count_bonus=False (the paper's vl), steps whose
    # average verified length is 0 are not recorded.
    count_bonus: bool = True
    # Deviation (see `SpeculationLengthSelector._step`): after a decrease of s that made
    # t/vl worse, increase s again instead of punishing once more. False = the paper's rule.
    undo_harmful_decrease: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.s_min <= self.s_init <= self.s_max:
            raise ValueError("need 1 <= s_min <= s_init <= s_max")
        if self.s_reward < 1 or self.s_punish < 1:
            raise ValueError("s_reward and s_punish must be >= 1")
        if self.decision_threshold < 2:
            raise ValueError("decision_threshold must be >= 2 (a line needs two points)")


@dataclass(frozen=True)
class LengthDecision:
    s_before: int
    s_after: int
    slope: float | None  # fitted slope of t/vl per record; None for a probing decision
    samples: int  # records the line was fitted to


def slope(values: Sequence[float]) -> float:
    """Least-squares slope of values[i] against i."""
    n = len(values)
    mean_x = (n - 1) / 2
    mean_y = sum(values) / n
    sxy = sum((i - mean_x) * (y - mean_y) for i, y in enumerate(values))
    sxx = sum((i - mean_x) ** 2 for i in range(n))
    return sxy / sxx


@dataclass
class SpeculationLengthSelector:
    """Online monitor of t_verify / vl and the slope rule that moves s."""

    config: LengthConfig = field(default_factory=LengthConfig)

    def __post_init__(self) -> None:
        self.s: int = self.config.s_init
        self.decisions: list[LengthDecision] = []
        self._before: list[float] = []  # the last records before the last change (state 1)
        self._recent: list[float] = []  # records since the last change (states 2 and 3)
        self._probe = True  # no change of s to judge yet
        self._last_step = 0  # the last change of s

    def observe(self, t_verify: float, verified: Sequence[float]) -> LengthDecision | None:
        """One verification step: its time in seconds and each request's accepted draft tokens.
        Returns the decision if this record triggered one."""
        if not verified:
            return None
        vl = sum(verified) / len(verified) + (1.0 if self.config.count_bonus else 0.0)
        if vl <= 0:
            return None  # paper's vl (no bonus) and nothing verified: t/vl undefined
        return self.observe_ratio(t_verify / vl)

    def observe_ratio(self, t_per_verified: float) -> LengthDecision | None:
        """One monitored value t_LLM / vl."""
        self._recent.append(float(t_per_verified))
        if len(self._recent) < self.config.decision_threshold:
            return None
        return self._decide()

    def _decide(self) -> LengthDecision:
        cfg = self.config
        before = self.s
        data = self._before + self._recent
        if self._probe:
            # Deviation: at start-up, and after a decision that left s where it was (slope 0, or
            # s held at a bound), all records were taken at one s: there is no change to judge
            # and the fitted slope would be noise. We then probe: the paper's default move
            # (s += s_reward), or s -= s_punish when s is already at s_max, so that the next fit
            # sees a transition again.
            fitted = None
            self.s = self.s + cfg.s_reward if self.s < cfg.s_max else max(self.s - cfg.s_punish,
                                                                          cfg.s_min)
        else:
            # The fit must see the transition from the old s (state 1 in figure 6) to the new one
            # (state 3). In the paper requests drafted with the old s linger in the pool and fill
            # the first records after a change; our pool may drain at once, so we also prepend
            # the last decision_threshold // 2 records from before the change (all at the old s
            # as long as the backlog is shorter than the other half).
            fitted = slope(data)
            self.s = self._step(fitted)
        decision = LengthDecision(before, self.s, fitted, len(data))
        self.decisions.append(decision)
        self._probe = self.s == before
        self._last_step = self.s - before
        self._before = self._recent[len(self._recent) - cfg.decision_threshold // 2:]
        self._recent = []
        return decision

    def _step(self, fitted: float) -> int:
        """The paper's rule: slope > 0 -> s - s_punish, slope < 0 -> s + s_reward, 0 -> s."""
        cfg = self.config
        if fitted > 0 and (self._last_step > 0 or not cfg.undo_harmful_decrease):
            return max(self.s - cfg.s_punish, cfg.s_min)
        if fitted > 0:
            # Deviation (undo_harmful_decrease): the paper reads an upward trend as "s is past
            # the optimum, the last change was too aggressive", which holds when the last change
            # was an increase. When it was a decrease (a punishment) that made t/vl worse, s is
            # now *below* the optimum; punishing again would walk s down to s_min, and under
            # measurement noise one wrong punishment starts that spiral (tests/test_length.py
            # compares both rules). We undo the decrease instead: s + s_reward.
            return min(self.s + cfg.s_reward, cfg.s_max)
        if fitted < 0:
            return min(self.s + cfg.s_reward, cfg.s_max)
        return self.s
