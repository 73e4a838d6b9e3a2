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
    first_token_at: float | None = None

    def observe_step(self, tree_size: int, accepted: int) -> None:
        """One verification step: `tree_size` drafted nodes, `accepted` of them kept."""
        self.steps += 1
        self.draft_tokens += tree_size
        self.accepted_tokens += accepted

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
            time_to_first_token_s=ttft, total_time_s=now - self.started)
