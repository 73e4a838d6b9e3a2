"""Client and AsyncClient: the Python API of a specmesh gateway (gRPC).

    from specmesh import Client
    out = Client("localhost:50051").generate("def add(a, b):", max_tokens=32)
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc

from specmesh.errors import from_rpc_error
from specmesh.types import Chunk, Generation, Stats, finish_reason_name
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

Message = Mapping[str, str] | tuple[str, str]

# ---------------------------------------------------------------------------------------------
# request building, shared by both clients


def build_request(
    *,
    prompt: str | None = None,
    messages: Iterable[Message] | None = None,
    model: str = "",
    max_tokens: int | None = None,
    temperature: float = 0.0,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] | str | None = None,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
) -> gateway_pb2.GenerateRequest:
    """Builds the gateway request; the gateway validates the values and explains what is wrong.

    Penalties (unset = off) apply to the target's logits before temperature / top-k / top-p,
    also at temperature 0: repetition_penalty (> 0, 1 = off; HF semantics over prompt +
    generated tokens), presence_penalty and frequency_penalty (in [-2, 2], 0 = off; OpenAI
    semantics over generated tokens only)."""
    sampling = common_pb2.SamplingParams(temperature=temperature, top_k=top_k)
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if presence_penalty is not None:
        sampling.presence_penalty = presence_penalty
    if frequency_penalty is not None:
        sampling.frequency_penalty = frequency_penalty
    if isinstance(stop, str):
        stop = [stop]
    request = gateway_pb2.GenerateRequest(model=model, sampling=sampling, stop=list(stop or []))
    if max_tokens is not None:
        request.max_tokens = max_tokens
    if messages is not None:
        request.messages.CopyFrom(gateway_pb2.ChatMessages(messages=[_message(m) for m in messages]))
    else:
        request.prompt = prompt if prompt is not None else ""
    return request


def _message(m: Message) -> gateway_pb2.ChatMessage:
    if isinstance(m, tuple):
        role, content = m
    else:
        role, content = m["role"], m["content"]
    return gateway_pb2.ChatMessage(role=role, content=content)


def _generation(pb: gateway_pb2.GenerateResponse) -> Generation:
    return Generation(text=pb.text, token_ids=list(pb.token_ids),
                      finish_reason=finish_reason_name(pb.finish_reason),
                      stats=Stats.from_pb(pb.stats), model=pb.model, request_id=pb.request_id)


def _chunk(pb: gateway_pb2.GenerateChunk) -> Chunk:
    return Chunk(text=pb.text, token_ids=list(pb.token_ids),
                 finish_reason=finish_reason_name(pb.finish_reason),
                 stats=Stats.from_pb(pb.stats), request_id=pb.request_id)


def _channel_args(options: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    return list((options or {}).items())


# ---------------------------------------------------------------------------------------------
# blocking client


class Client:
    """Blocking client of a specmesh gateway at `address` ("host:port").

    `generate(prompt, ...)` takes raw text (no chat template); `chat(messages, ...)` formats
    messages with the model's chat template; `stream(...)` yields chunks as tokens are accepted.
    Keyword arguments: model, max_tokens, temperature (0 = greedy), top_p, top_k, seed, stop,
    repetition_penalty, presence_penalty, frequency_penalty (see `build_request`).
    """

    def __init__(self, address: str, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Mapping[str, Any] | None = None):
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=_channel_args(options))
        else:
            self._channel = grpc.secure_channel(address, credentials, options=_channel_args(options))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._timeout = timeout

    def generate(self, prompt: str, **kwargs: Any) -> Generation:
        return self._unary(build_request(prompt=prompt, **kwargs))

    def chat(self, messages: Iterable[Message], **kwargs: Any) -> Generation:
        return self._unary(build_request(messages=messages, **kwargs))

    def stream(self, prompt: str, **kwargs: Any) -> Iterator[Chunk]:
        return self._stream(build_request(prompt=prompt, **kwargs))

    def stream_chat(self, messages: Iterable[Message], **kwargs: Any) -> Iterator[Chunk]:
        return self._stream(build_request(messages=messages, **kwargs))

    def models(self) -> gateway_pb2.ListModelsResponse:
        try:
            return self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=self._timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _unary(self, request: gateway_pb2.GenerateRequest) -> Generation:
        try:
            return _generation(self._stub.Generate(request, timeout=self._timeout))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _stream(self, request: gateway_pb2.GenerateRequest) -> Iterator[Chunk]:
        call = self._stub.GenerateStream(request, timeout=self._timeout)
        try:
            for pb in call:
                yield _chunk(pb)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()  # no-op when the stream ended; stops generation when the caller broke off

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# asyncio client


class AsyncClient:
    """asyncio client of a specmesh gateway; same methods as `Client`, as coroutines."""

    def __init__(self, address: str, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Mapping[str, Any] | None = None):
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=_channel_args(options))
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=_channel_args(options))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._timeout = timeout

    async def generate(self, prompt: str, **kwargs: Any) -> Generation:
        return await self._unary(build_request(prompt=prompt, **kwargs))

    async def chat(self, messages: Iterable[Message], **kwargs: Any) -> Generation:
        return await self._unary(build_request(messages=messages, **kwargs))

    def stream(self, prompt: str, **kwargs: Any) -> AsyncIterator[Chunk]:
        return self._stream(build_request(prompt=prompt, **kwargs))

    def stream_chat(self, messages: Iterable[Message], **kwargs: Any) -> AsyncIterator[Chunk]:
        return self._stream(build_request(messages=messages, **kwargs))

    async def models(self) -> gateway_pb2.ListModelsResponse:
        try:
            return await self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=self._timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def _unary(self, request: gateway_pb2.GenerateRequest) -> Generation:
        try:
            return _generation(await self._stub.Generate(request, timeout=self._timeout))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def _stream(self, request: gateway_pb2.GenerateRequest) -> AsyncIterator[Chunk]:
        call = self._stub.GenerateStream(request, timeout=self._timeout)
        try:
            async for pb in call:
                yield _chunk(pb)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
