"""OpenAI-compatible request bodies, validated and mapped onto the gateway's GenerateRequest.

Defaults follow OpenAI's API (temperature 1, top_p 1), not the gRPC API's greedy default.
Fields the API defines that specmesh does not serve are refused with a 400 naming the field
(`n` > 1, logprobs, echo, tools...) rather than silently ignored; fields it does not know are
ignored and logged, as vLLM does. `top_k`, `repetition_penalty` and `speculation_metrics` are
extra fields (the openai client's `extra_body`), the way vLLM accepts its sampling extras.
"""
from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specmesh.v1 import common_pb2, gateway_pb2

log = logging.getLogger(__name__)

OPENAI_DEFAULT_TEMPERATURE = 1.0
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class UnsupportedField(ValueError):
    """A request field specmesh does not serve (400 naming the field)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    """The sampling fields completions and chat completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras, as vLLM takes them
    top_k: int | None = None
    repetition_penalty: float | None = None
    speculation_metrics: Literal["summary", "detailed"] | None = Field(
        None, description="per-request speculation statistics in the response's `metrics`")

    def check(self) -> None:
        """Refuses what the API defines but specmesh does not serve; logs unknown fields."""
        if self.n != 1:
            raise UnsupportedField("n", f"n={self.n} is not supported: specmesh returns one "
                                        "choice per request (n=1); send several requests instead")
        if self.logit_bias:
            raise UnsupportedField("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise UnsupportedField("stream_options", "stream_options is only allowed with "
                                                     "stream=true")
        for name in self._refused():
            raise UnsupportedField(name, f"{name} is not supported by this server")
        if self.model_extra:
            log.warning("ignoring unknown request fields: %s", ", ".join(sorted(self.model_extra)))

    def _refused(self) -> list[str]:
        return []

    def limit(self) -> int | None:
        return self.max_tokens

    def to_generate(self) -> gateway_pb2.GenerateRequest:
        request = gateway_pb2.GenerateRequest(model=self.model or "", stop=self._stops(),
                                              sampling=self._sampling())
        self.set_input(request)
        if self.limit() is not None:
            request.max_tokens = self.limit()
        return request

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        raise NotImplementedError

    def _stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _sampling(self) -> common_pb2.SamplingParams:
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        sampling = common_pb2.SamplingParams(temperature=temperature, top_k=self.top_k or 0)
        optional = {"top_p": self.top_p, "seed": self.seed,
                    "repetition_penalty": self.repetition_penalty,
                    "presence_penalty": self.presence_penalty,
                    "frequency_penalty": self.frequency_penalty}
        for name, value in optional.items():
            if value is not None:
                setattr(sampling, name, value)
        return sampling


class CompletionRequest(_Body):
    """POST /v1/completions."""

    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def _refused(self) -> list[str]:
        refused = [name for name, on in (("echo", self.echo), ("logprobs", self.logprobs is not None),
                                         ("suffix", self.suffix is not None),
                                         ("best_of", (self.best_of or 1) > 1)) if on]
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise UnsupportedField("prompt", f"a list of {len(self.prompt)} prompts is not "
                                             "supported: send one prompt per request")
        return refused

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        request.prompt = self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Body):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def _refused(self) -> list[str]:
        kind = (self.response_format or {}).get("type", "text")
        return [name for name, on in (("logprobs", self.logprobs),
                                      ("top_logprobs", self.top_logprobs is not None),
                                      ("tools", bool(self.tools)),
                                      ("tool_choice", self.tool_choice not in (None, "none")),
                                      ("response_format", kind != "text")) if on]

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def set_input(self, request: gateway_pb2.GenerateRequest) -> None:
        request.messages.messages.extend(
            gateway_pb2.ChatMessage(role=ROLE_ALIASES.get(m.role, m.role), content=m.text())
            for m in self.messages)
