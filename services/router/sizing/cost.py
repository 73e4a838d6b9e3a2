"""ProPD's step-time cost model (section 4.2.1): what a step costs as a function of its tree.

Per size an EMA of measured times, T_perf^i <- (1 - alpha) T_perf^i + alpha t_i, and a
weighted line T_est(i) = b0 + b1 i, weight W_i = exp(-lambda o_i), o_i the age of T_perf^i
(`StepTimeModel`). The router keeps one per concurrency bucket (`bucket_of`) and per arm, one
over the verifier's pass rows (`PassTimes`, V) and one over drafting budgets (D).
Deviations (docs/decisions/adaptive-tree-size.md):
- o_i is counted in observed steps, not seconds: the router's steps are its clock.
- a negative fitted slope is clamped to 0: a larger tree is never cheaper.
- T_est(n) is a recently measured size's own T_perf, the line only elsewhere (`curve`): costs
  that grow in steps; never below a smaller size's.
"""
from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


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
    measured: Mapping[int, float]  # size -> its time, lifted to the dearest smaller size's
    sizes: tuple[int, ...] = ()  # the measured sizes, ascending

    @classmethod
    def of(cls, line: LinearCost, measured: Mapping[int, float]) -> "MeasuredCost":
        """A larger tree is never cheaper: a smaller size measured dearer (at a longer
        context, or by noise) bounds each larger one from below."""
        lifted, dearest = {}, 0.0
        for size in sorted(measured):
            dearest = lifted[size] = max(dearest, measured[size])
        return cls(line, lifted, tuple(lifted))

    def __call__(self, n: int) -> float:
        seconds = self.measured.get(n)
        if seconds is not None:
            return seconds
        below = bisect.bisect_left(self.sizes, n)
        return max(self.line(n), self.measured[self.sizes[below - 1]]) if below else self.line(n)


@dataclass
class StepTimeModel:
    """Per-size EMA of step times and their recency-weighted linear regression."""

    alpha: float = 0.3
    decay: float = 0.02
    # `curve` trusts a size's own T_perf while its regression weight is at least this
    # (exp(-0.02 o) >= 0.25: updated within the last 69 steps)
    fresh_weight: float = 0.25
    _perf: dict[int, float] = field(default_factory=dict, init=False, repr=False)  # size -> T_perf
    # size -> step of its last update (o_i in observed steps keeps the weights deterministic)
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

    def sizes(self) -> frozenset[int]:
        """The sizes measured so far."""
        return frozenset(self._perf)

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
        the others; None before two distinct sizes. (ProPD takes the line everywhere; a size
        the line misprices is corrected as soon as it has been run.)"""
        line = self.fit()
        if line is None:
            return None
        measured = {i: t for i, t in self._perf.items() if self._weight(i) >= self.fresh_weight}
        return MeasuredCost.of(line, measured)

    def fit(self) -> LinearCost | None:
        """Weighted least squares over the sizes seen; None before two distinct sizes. A
        negative slope (noise, or stale sizes) is clamped to 0 and the intercept refitted as
        the weighted mean."""
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


@dataclass(frozen=True)
class VerifyStep:
    """What the verifier reported of the forward pass a tree was verified in."""

    seconds: float  # the forward pass and walk
    rows: int  # rows of the pass
    trees: int  # trees verified in it
    nodes: int  # their draft nodes
    verifier: str = ""  # who ran it
    row_seconds: float = 0.0  # what a row adds to its passes (its fit; 0: not fitted yet)
    turnaround_seconds: float = 0.0  # a result's round trip to the next entry (0: unknown)

    @property
    def prefilled(self) -> bool:
        """The pass also prefilled (or caught up) a request: rows beyond one per tree + nodes."""
        return self.rows > self.nodes + self.trees


@dataclass
class PassTimes(StepTimeModel):
    """The verifier's pass time over its rows (V). Every tree of a pass reports the same pass;
    it is counted once, so a pass of 8 trees neither outweighs a pass of 1 nor ages the other
    sizes 8 steps at a time."""

    _seen: deque = field(default_factory=deque, init=False, repr=False)  # the last 256 passes
    _seen_keys: set = field(default_factory=set, init=False, repr=False)  # the same, to look up
    # the verifier's latest word on a row's seconds and on the round trip (0: not said yet)
    row_seconds: float = field(default=0.0, init=False)
    turnaround_seconds: float = field(default=0.0, init=False)

    def observe_pass(self, step: VerifyStep) -> None:
        if step.row_seconds > 0:
            self.row_seconds = step.row_seconds
        if step.turnaround_seconds > 0:
            self.turnaround_seconds = step.turnaround_seconds
        key = (step.verifier, step.seconds, step.rows)
        if key not in self._seen_keys:
            self._seen.append(key)
            self._seen_keys.add(key)
            if len(self._seen) > 256:
                self._seen_keys.discard(self._seen.popleft())
            self.observe(step.rows, step.seconds)


def bucket_of(in_flight: int) -> int:
    """1, 2, 4, 8, ...: the concurrency bucket of a step-time model (a step's time depends on
    how many trees share the verifier's pass)."""
    return 1 << max(in_flight - 1, 0).bit_length()
