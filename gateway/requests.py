"""Validation and tokenization of gateway requests into router requests.

The checks the router's own API applies too are services/common/request_checks.py's; here are
the gateway's: the model name, chat messages, this gateway's max_tokens limit and the room left
in the context. Every rejection is a ValueError whose message says what to fix; the servicer
maps it to INVALID_ARGUMENT.
"""
from __future__ import annotations

from dataclasses import dataclass

from specmesh_services.common.request_checks import check_request
from specmesh_services.common.sampling import SamplingParams
from specmesh.v1 import gateway_pb2, router_pb2

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ServedModel:
    name: str
    tokenizer: object
    context_length: int
    max_tokens_default: int
    max_tokens_limit: int

    @classmethod
    def from_settings(cls, settings, tokenizer, context_length: int) -> "ServedModel":
        """The model `settings` serve (a Settings), with its tokenizer and context length."""
        return cls(settings.model, tokenizer, context_length, settings.max_tokens_default,
                   settings.max_tokens_limit)

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
    sampling = SamplingParams.from_pb(request.sampling)
    stop = list(request.stop)
    requested = (request.max_tokens if request.HasField("max_tokens")
                 else model.max_tokens_default)
    check_request(prompt_ids, requested, sampling, stop, model.context_length)
    return router_pb2.RouteRequest(request_id=request_id, prompt_ids=prompt_ids,
                                   max_tokens=_max_tokens(request, model, len(prompt_ids)),
                                   sampling=sampling.to_pb(), stop=stop)


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
    return ids


def _max_tokens(request: gateway_pb2.GenerateRequest, model: ServedModel, prompt_len: int) -> int:
    """The request's max_tokens within this gateway's limit and the room the prompt leaves in
    the context (the default shortened to fit)."""
    room = model.context_length - prompt_len
    if not request.HasField("max_tokens"):
        return min(model.max_tokens_default, room)
    value = request.max_tokens
    if value > model.max_tokens_limit:
        raise ValueError(f"max_tokens={value} is too large: this gateway allows at most "
                         f"{model.max_tokens_limit}")
    if value > room:
        raise ValueError(f"max_tokens={value} does not fit: the prompt has {prompt_len} tokens and "
                         f"the model's context is {model.context_length}, so use max_tokens <= {room}")
    return value
