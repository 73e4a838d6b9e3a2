"""Verify-cost model: the measured cost of one verifier step as a function of its shape.

    seconds ~= b0 + b_rows * rows + b_context * context + b_segments * segments

rows = new rows in the pass (tree nodes + roots + prefill chunks), context = KV positions read by
attention (sum over segments of prefix + new rows), segments = requests in the batch; fitted by
a regression with exponentially decaying weights, so the curve follows load changes. After SSSD
3.2 (time quasi-linear in new rows, plus a context term) and ProPD 4.2 (recency-weighted fit of
b0 + b1 * n), over three features (docs/verifier.md, Cost model). The engine feeds it every
step; Info, Prometheus and bench.verify_cost report it; the router fits its own (router/sizing/).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

FEATURES = ("rows", "context", "segments")


@dataclass(frozen=True)
class CostFit:
    intercept_s: float
    per_row_s: float
    per_context_s: float
    per_segment_s: float
    samples: int

    def predict(self, rows: float, context: float, segments: float) -> float:
        return (self.intercept_s + self.per_row_s * rows + self.per_context_s * context
                + self.per_segment_s * segments)


class VerifyCostModel:
    """Recency-weighted ridge regression of step seconds on (rows, context, segments)."""

    def __init__(self, decay: float = 0.99, window: int = 1024, min_samples: int = 8,
                 ridge: float = 1e-9) -> None:
        assert 0 < decay <= 1 and window > 0
        self.decay = decay
        self.min_samples = min_samples
        self.ridge = ridge
        self._samples: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._fit: CostFit | None = None
        self._stale = 0  # observations since the last fit

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, rows: int, context: int, segments: int, seconds: float) -> None:
        self._samples.append((float(rows), float(context), float(segments), float(seconds)))
        self._stale += 1

    def fit(self, stale: int = 0) -> CostFit | None:
        """The current fit, or None before `min_samples` observations; `stale`: a fit made at
        most that many observations ago will do (a hot path refits once per `stale` steps, not
        every step: the solve costs a fraction of a millisecond)."""
        if len(self._samples) >= self.min_samples and (self._fit is None or self._stale > stale):
            self._fit, self._stale = self._solve(), 0
        return self._fit

    def predict(self, rows: int, context: int, segments: int) -> float | None:
        fit = self.fit()
        return None if fit is None else fit.predict(rows, context, segments)

    def _solve(self) -> CostFit:
        data = np.array(self._samples)  # [n, 4]
        n = data.shape[0]
        weights = self.decay ** np.arange(n - 1, -1, -1)  # newest weighs 1
        x = np.column_stack([np.ones(n), data[:, :3]])
        y = data[:, 3]
        scale = np.maximum(np.abs(x).max(axis=0), 1.0)  # condition the normal equations
        xs = x / scale
        w = np.sqrt(weights)[:, None]
        a = (xs * w).T @ (xs * w) + self.ridge * n * np.eye(4)
        b = (xs * w).T @ (y * w[:, 0])
        coef = np.linalg.solve(a, b) / scale
        return CostFit(float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), n)
