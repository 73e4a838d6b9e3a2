"""SPIN's micro-batch split (section V.B): the draft items of the requests that are ready
together are cut into micro-batches sent one after the other, so that the verifier starts on
the first micro-batch's trees while the drafter drafts the next one.

The number of micro-batches is SPIN's heuristic: starting at b0 = 2, split into one more while
the verifier's throughput over the batch's rows does not drop by more than `tolerance` against
verifying them in one pass; where even b0 drops, the batch stays whole. SPIN profiles the
target offline; here the throughput comes from the router's measured verify-pass cost (the
intercept and per-row slope of `PassTimes`), which the split's extra passes pay in intercepts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")
B0 = 2
TOLERANCE = 0.1  # "no obvious throughput drop": at most 10% fewer rows verified per second


def micro_batches(items: int, rows_per_item: float, pass_seconds: Callable[[float], float] | None,
                  b0: int = B0, tolerance: float = TOLERANCE) -> int:
    """How many micro-batches `items` draft items go out in. `pass_seconds(rows)`: the
    verifier's measured pass time (None: not measured yet, no split)."""
    if pass_seconds is None or items < b0:
        return 1
    rows = items * max(rows_per_item, 1.0)
    whole = pass_seconds(rows)
    if whole <= 0:
        return 1
    parts = 1
    for m in range(b0, items + 1):
        split = m * pass_seconds(rows / m)  # the same rows in m passes
        if whole / split < 1.0 - tolerance:
            break
        parts = m
    return parts


def split(items: Sequence[T], parts: int) -> list[list[T]]:
    """`items` in `parts` consecutive runs of near-equal size (the larger first)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (i < extra)
        out.append(list(items[at:at + n]))
        at += n
    return out
