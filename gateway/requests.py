"""Validation and tokenization of gateway requests into router requests.

Every rejection is a ValueError whose message says what to fix; the servicer maps it to
INVALID_ARGUMENT.
"""
from __future__ import annotations

from dataclasses import dataclass

from specmesh_services.common.sampling import SamplingParams
from specmesh.v1 import gateway_pb2, router_pb2

MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: object
    context_length: int
    max_tokens_default: int
    max_tokens_limit: int

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def info(self) -> gateway_pb2.ModelInfo:
        return gateway_pb2.ModelInfo(name=self.name, context_length=self.context_length,
                                     max_tokens_limit=self.max_tokens_limit,
                                     has_chat_template=self.has_chat_template)


def to_route_request(request: gateway_pb2.GenerateRequest, model: ServedModel,
                     request_id: str) -> router_pb2.RouteRequest:
    if request.model and request.model != model.name:
        raise ValueError(f"unknown model '{request.model}': this gateway serves '{model.name}' "
                         f"(leave model empty for the default)")
    prompt_ids = _tokenize(request, model)
    max_tokens = _max_tokens(request, model, len(prompt_ids))
    sampling = SamplingParams.from_pb(request.sampling)
    sampling.validate()  # NaN and infinities included
    _check_stop(list(request.stop))
    return router_pb2.RouteRequest(request_id=request_id, prompt_ids=prompt_ids,
                                   max_tokens=max_tokens, sampling=sampling.to_pb(),
                                   stop=list(request.stop))


def _tokenize(request: gateway_pb2.GenerateRequest, model: ServedModel) -> list[int]:
    which = request.WhichOneof("input")
    tokenizer = model.tokenizer
    if which == "messages":
        messages = [{"role": m.role, "content": m.content} for m in request.messages.messages]
        if not messages:
            raise ValueError("messages is empty: give at least one chat message")
        bad = [m["role"] for m in messages if m["role"] not in ROLES]
        if bad:
            raise ValueError(f"unknown chat role '{bad[0]}': use one of {', '.join(ROLES)}")
        if not model.has_chat_template:
            raise ValueError(f"model '{model.name}' has no chat template: send a raw prompt")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False).input_ids
    else:
        if not request.prompt:
            raise ValueError("prompt is empty: give a non-empty prompt or chat messages")
        ids = tokenizer(request.prompt).input_ids
    if not ids:
        raise ValueError("prompt is empty after tokenization")
    if len(ids) >= model.context_length:
        raise ValueError(f"prompt is too long: {len(ids)} tokens, but the model's context is "
                         f"{model.context_length} tokens (prompt + max_tokens must fit)")
    return ids


def _max_tokens(request: gateway_pb2.GenerateRequest, model: ServedModel, prompt_len: int) -> int:
    room = model.context_length - prompt_len
    if not request.HasField("max_tokens"):
        return min(model.max_tokens_default, room)
    value = request.max_tokens
    if value < 1:
        raise ValueError(f"max_tokens must be >= 1, got {value}")
    if value > model.max_tokens_limit:
        raise ValueError(f"max_tokens={value} is too large: this gateway allows at most "
                         f"{model.max_tokens_limit}")
    if value > room:
        raise ValueError(f"max_tokens={value} does not fit: the prompt has {prompt_len} tokens and "
                         f"the model's context is {model.context_length}, so use max_tokens <= {room}")
    return value


def _check_stop(stop: list[str]) -> None:
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stop)}")
    for s in stop:
        if not s:
            raise ValueError("stop sequences must be non-empty")
        if len(s) > MAX_STOP_LENGTH:
            raise ValueError(f"stop sequences must be at most {MAX_STOP_LENGTH} characters")
