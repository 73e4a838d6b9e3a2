"""Per-request speculation counters; the figures people quote are computed here only."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from specmesh.v1 import common_pb2


@dataclass
class RequestStats:
    prompt_tokens: int
    started: float = field(default_factory=time.perf_counter)
    completion_tokens: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0
    plain_steps: int = 0  # steps after the first that verified no tree
    expected_tokens: float = 0.0  # the router's expectation, summed over steps
    first_token_at: float | None = None

    def observe_step(self, tree_size: int, accepted: int, expected: float = 1.0) -> None:
        """One verification step: `tree_size` drafted nodes, `accepted` of them kept, `expected`
        tokens (bonus counted) expected by the router."""
        if self.steps and not tree_size:
            self.plain_steps += 1
        self.steps += 1
        self.draft_tokens += tree_size
        self.accepted_tokens += accepted
        self.expected_tokens += expected

    def observe_emitted(self, count: int) -> None:
        if count and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.completion_tokens += count

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification step, bonus counted: 1 + accepted / steps."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    def to_pb(self) -> common_pb2.GenerationStats:
        now = time.perf_counter()
        ttft = (self.first_token_at or now) - self.started
        return common_pb2.GenerationStats(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            draft_tokens=self.draft_tokens, accepted_tokens=self.accepted_tokens,
            steps=self.steps, mean_accepted_length=self.mean_accepted_length,
            plain_steps=self.plain_steps,
            mean_expected_length=self.expected_tokens / self.steps if self.steps else 0.0,
            time_to_first_token_s=ttft, total_time_s=now - self.started)
