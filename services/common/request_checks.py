"""The checks every door that takes a generation request applies to it: the gateway's, on the
tokenized request (gateway/requests.py), and the router's own gRPC API (router/engine.py).

Each rejection is a ValueError whose message says what to fix; the servicers map it to
INVALID_ARGUMENT (HTTP 400 on the gateway's HTTP API).
"""
from __future__ import annotations

from collections.abc import Sequence

from specmesh_services.common.sampling import SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256


def check_request(prompt_ids: Sequence[int], max_tokens: int, sampling: SamplingParams,
                  stop: Sequence[str], context_length: int, vocab_size: int | None = None) -> None:
    """Raises ValueError unless the prompt has tokens (each in [0, vocab_size) when given) and
    fits the context, max_tokens >= 1, the sampling parameters are valid (finite included) and
    the stop sequences are within their limits."""
    _check_prompt(prompt_ids, context_length, vocab_size)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    sampling.validate()
    _check_stop(stop)


def _check_prompt(prompt_ids: Sequence[int], context_length: int, vocab_size: int | None) -> None:
    if not prompt_ids:
        raise ValueError("prompt is empty: it has no tokens")
    if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt_ids):
        raise ValueError(f"prompt_ids must be in [0, {vocab_size})")
    if len(prompt_ids) >= context_length:
        raise ValueError(f"prompt is too long: {len(prompt_ids)} tokens, but the model's context "
                         f"is {context_length} tokens (prompt + max_tokens must fit)")


def _check_stop(stop: Sequence[str]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
    for s in stop:
        if not s:
            raise ValueError("stop sequences must be non-empty")
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"stop sequences must be at most {MAX_STOP_LENGTH} characters")
