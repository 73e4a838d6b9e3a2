"""OpenAI-shaped responses, stream chunks, usage and per-request speculation metrics.

`usage.completion_tokens_details` reports speculation the way OpenAI reports predicted outputs:
draft tokens the target accepted and those it rejected. `metrics.speculative_decoding` (on
request) has the shape vLLM uses for its per-request speculative-decoding metrics, computed
over the steps that verified a draft: mean acceptance length (bonus token counted), draft
acceptance rate, a histogram of accepted draft tokens per step, and with "detailed" every
step's accepted count and the router's decision.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from google.protobuf.json_format import MessageToDict

from specmesh.types import finish_reason_name
from specmesh.v1 import common_pb2


def usage(stats: common_pb2.GenerationStats) -> dict:
    accepted = int(stats.accepted_tokens)
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "completion_tokens_details": {
                "accepted_prediction_tokens": accepted,
                "rejected_prediction_tokens": max(0, int(stats.draft_tokens) - accepted)}}


def speculation_metrics(stats: common_pb2.GenerationStats, level: str) -> dict:
    """vLLM's `metrics.speculative_decoding` object from a request's final statistics."""
    steps = [d for d in stats.decisions if d.tree_size > 0]
    accepted = [max(0, d.emitted - 1) for d in steps]
    widest = max((d.tree_size for d in steps), default=0)
    histogram = [0] * (widest + 1)
    for count in accepted:
        histogram[min(count, widest)] += 1
    metrics = {
        "mean_acceptance_length": 1.0 + sum(accepted) / len(steps) if steps else 1.0,
        "draft_acceptance_rate": (stats.accepted_tokens / stats.draft_tokens
                                  if stats.draft_tokens else 0.0),
        "acceptance_histogram": histogram,
        "num_spec_steps": len(steps),
        "num_accepted_draft_tokens": int(stats.accepted_tokens),
        "num_draft_tokens": int(stats.draft_tokens),
        "num_spec_tokens": widest,
        "num_plain_steps": stats.plain_steps,
        "mean_expected_length": stats.mean_expected_length,
    }
    if level == "detailed":
        metrics["per_step_accepted"] = accepted
        metrics["decisions"] = [MessageToDict(d, preserving_proto_field_name=True,
                                              always_print_fields_with_no_presence=True)
                                for d in stats.decisions]
    return {"speculative_decoding": metrics}


@dataclass
class Reply:
    """One request's response, assembled from the router's chunks (whole or as SSE events)."""

    chat: bool
    model: str
    request_id: str
    metrics_level: str | None = None
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    texts: list[str] = field(default_factory=list)
    finish: str | None = None
    stats: common_pb2.GenerationStats = field(default_factory=common_pb2.GenerationStats)

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.request_id

    def add(self, chunk) -> None:
        self.texts.append(chunk.text)
        self.stats = chunk.stats
        if chunk.finish_reason:
            self.finish = finish_reason_name(chunk.finish_reason)

    def _head(self, stream: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + \
            (".chunk" if stream and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, text: str | None, finish: str | None, stream: bool, first: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if stream:
            delta = {"role": "assistant", "content": text or ""} if first else \
                ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": None, "finish_reason": finish}

    def _metrics(self, body: dict) -> dict:
        if self.metrics_level:
            body["metrics"] = speculation_metrics(self.stats, self.metrics_level)
        return body

    def whole(self) -> dict:
        body = {**self._head(False),
                "choices": [self._choice("".join(self.texts), self.finish, False, False)],
                "usage": usage(self.stats)}
        return self._metrics(body)

    def event(self, chunk, first: bool) -> list[str]:
        """SSE events for one router chunk: its text (the chat stream's first event names the
        role), and after the last chunk the usage event (stream_options.include_usage)."""
        self.add(chunk)
        if not (chunk.text or first or self.finish):
            return []
        body = {**self._head(True), "choices": [self._choice(chunk.text, self.finish, True, first)]}
        events = [sse(self._metrics(body) if self.finish else body)]
        if self.finish and self.include_usage:
            events.append(sse(self._metrics({**self._head(True), "choices": [],
                                             "usage": usage(self.stats)})))
        return events


def sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
