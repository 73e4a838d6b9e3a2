"""What one step of a request decides and what the verifier reports of it: the values the
tree-size policy (`policy.py`, `sizing.py`) and the request loop pass between them."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specmesh_services.router.tree_size import StepTimeModel


@dataclass(frozen=True)
class StepChoice:
    budget: int  # node budget for the draft sources, 0 = speculation off
    expected_length: float  # E(budget), bonus included, under the request's profile
    probe: bool = False


@dataclass(frozen=True)
class BatchShare:
    """What a request's step shares its time with: the other requests' plans for their current
    step, and its own drafter prefill still to pay."""

    nodes: int = 0  # draft nodes of their trees
    tokens: float = 0.0  # tokens their steps are expected to emit, bonus included
    requests: int = 0  # how many they are (one root row each in the verify pass)
    draft_seconds: float = 0.0  # drafter time their trees take
    # the request's own prefill on the arm's drafters, not yet done: a tree now waits for it
    # (SPIN's switching cost, eq. 6, charged to the step that pays it)
    switch_seconds: float = 0.0


@dataclass(frozen=True)
class VerifyStep:
    """What the verifier reported of the forward pass a tree was verified in."""

    seconds: float  # the forward pass and walk
    rows: int  # rows of the pass
    trees: int  # trees verified in it
    nodes: int  # their draft nodes
    verifier: str = ""  # who ran it

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

    def observe_pass(self, step: VerifyStep) -> None:
        key = (step.verifier, step.seconds, step.rows)
        if key not in self._seen_keys:
            self._seen.append(key)
            self._seen_keys.add(key)
            if len(self._seen) > 256:
                self._seen_keys.discard(self._seen.popleft())
            self.observe(step.rows, step.seconds)


def bucket_of(in_flight: int) -> int:
    """1, 2, 4, 8, ...: the concurrency bucket of a step-time model."""
    return 1 << max(in_flight - 1, 0).bit_length()
