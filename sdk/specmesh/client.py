"""Client and AsyncClient: the Python API of a specmesh gateway (gRPC).

    from specmesh import Client
    out = Client("localhost:50051").generate("def add(a, b):", max_tokens=32)
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

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
    """Builds the gateway request from raw `prompt` text or chat `messages`; the other
    parameters are described in `Client.generate`. The gateway validates every value and says
    what is wrong (`InvalidRequest`)."""
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


def _call(args: dict[str, Any]) -> tuple[gateway_pb2.GenerateRequest, float | None]:
    """The request and the call's deadline from a client method's `locals()`: each method
    spells its parameters once, in its signature, and passes them on whole. A timeout of None
    is the client's."""
    timeout = args["timeout"] if args["timeout"] is not None else args["self"]._timeout
    args = {name: value for name, value in args.items() if name not in ("self", "timeout")}
    return build_request(**args), timeout


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


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that carries an API key (the gateway's `gateway.api_keys`)."""
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def _channel_args(options: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    return list((options or {}).items())


# ---------------------------------------------------------------------------------------------
# the generation methods, shared by both clients

Result = TypeVar("Result")  # what generate / chat return: a Generation, or an awaitable of one
Chunks = TypeVar("Chunks")  # what stream / stream_chat return: an iterator of Chunks, or an async one


class _Generating(Generic[Result, Chunks]):
    """generate / chat / stream / stream_chat, written once for `Client` and `AsyncClient`:
    each builds the request (keyword parameters: see `generate`) and hands it to the client's
    `_unary` or `_stream`."""

    _timeout: float | None = None  # the client's deadline of a call (seconds), None = none

    def generate(self, prompt: str, *, model: str = "", max_tokens: int | None = None,
                 temperature: float = 0.0, top_p: float | None = None, top_k: int = 0,
                 seed: int | None = None, stop: Sequence[str] | str | None = None,
                 repetition_penalty: float | None = None, presence_penalty: float | None = None,
                 frequency_penalty: float | None = None, timeout: float | None = None) -> Result:
        """Completes raw `prompt` (tokenized as is, no chat template); returns the whole
        generation.

        Args:
            model: model name; "" selects the gateway's default.
            max_tokens: new tokens at most (>= 1); None selects the gateway's default.
            temperature: softmax temperature (>= 0); 0 decodes greedily.
            top_p: nucleus sampling mass in (0, 1]; None = 1 (off).
            top_k: keep only the k most likely tokens (>= 0); 0 = off.
            seed: seed of the request's random stream (same seed, same output); None = random.
            stop: stop sequence(s) (at most 16, non-empty), left out of the returned text.
            repetition_penalty: > 0, HF semantics over prompt + generated tokens; None or 1 = off.
            presence_penalty: in [-2, 2], OpenAI semantics over generated tokens; None or 0 = off.
            frequency_penalty: in [-2, 2], OpenAI semantics over generated tokens; None or 0 = off.
            timeout: seconds this call may take; None = the client's timeout.

        Penalties apply to the target's logits before temperature / top-k / top-p, also at
        temperature 0. Every number must be finite (NaN and infinities are refused)."""
        return self._unary(*_call(locals()))

    def chat(self, messages: Iterable[Message], *, model: str = "",
             max_tokens: int | None = None, temperature: float = 0.0, top_p: float | None = None,
             top_k: int = 0, seed: int | None = None, stop: Sequence[str] | str | None = None,
             repetition_penalty: float | None = None, presence_penalty: float | None = None,
             frequency_penalty: float | None = None, timeout: float | None = None) -> Result:
        """Answers chat `messages` ({"role": ..., "content": ...} or (role, content)),
        formatted with the model's chat template. Keyword parameters: as `generate`."""
        return self._unary(*_call(locals()))

    def stream(self, prompt: str, *, model: str = "", max_tokens: int | None = None,
               temperature: float = 0.0, top_p: float | None = None, top_k: int = 0,
               seed: int | None = None, stop: Sequence[str] | str | None = None,
               repetition_penalty: float | None = None, presence_penalty: float | None = None,
               frequency_penalty: float | None = None, timeout: float | None = None) -> Chunks:
        """`generate`, yielding chunks as the target accepts tokens; the last one has
        `finish_reason` set. Breaking off the iteration cancels the generation. Keyword
        parameters: as `generate`."""
        return self._stream(*_call(locals()))

    def stream_chat(self, messages: Iterable[Message], *, model: str = "",
                    max_tokens: int | None = None, temperature: float = 0.0,
                    top_p: float | None = None, top_k: int = 0, seed: int | None = None,
                    stop: Sequence[str] | str | None = None,
                    repetition_penalty: float | None = None,
                    presence_penalty: float | None = None,
                    frequency_penalty: float | None = None,
                    timeout: float | None = None) -> Chunks:
        """`chat`, streamed like `stream`. Keyword parameters: as `generate`."""
        return self._stream(*_call(locals()))

    def _unary(self, request: gateway_pb2.GenerateRequest, timeout: float | None) -> Result:
        raise NotImplementedError

    def _stream(self, request: gateway_pb2.GenerateRequest, timeout: float | None) -> Chunks:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------
# blocking client


class Client(_Generating[Generation, Iterator[Chunk]]):
    """Blocking client of a specmesh gateway at `address` ("host:port").

    `generate(prompt, ...)` takes raw text (no chat template); `chat(messages, ...)` formats
    messages with the model's chat template; `stream(...)` / `stream_chat(...)` yield chunks as
    tokens are accepted. Their keyword parameters are described in `generate`; `timeout`
    (seconds, per call or for every call of the client) bounds a call. `api_key`: sent with every
    call where the gateway requires one; `credentials`: TLS (e.g.
    `grpc.ssl_channel_credentials(open("ca.pem", "rb").read())`).
    """

    def __init__(self, address: str, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Mapping[str, Any] | None = None, api_key: str | None = None):
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=_channel_args(options))
        else:
            self._channel = grpc.secure_channel(address, credentials, options=_channel_args(options))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._timeout = timeout
        self._metadata = _auth(api_key)

    def models(self) -> gateway_pb2.ListModelsResponse:
        try:
            return self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=self._timeout,
                                         metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _unary(self, request: gateway_pb2.GenerateRequest, timeout: float | None) -> Generation:
        try:
            return _generation(self._stub.Generate(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    def _stream(self, request: gateway_pb2.GenerateRequest,
                timeout: float | None) -> Iterator[Chunk]:
        call = self._stub.GenerateStream(request, timeout=timeout, metadata=self._metadata)
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


class AsyncClient(_Generating[Awaitable[Generation], AsyncIterator[Chunk]]):
    """asyncio client of a specmesh gateway; same methods as `Client`: `generate` and `chat`
    return awaitables, `stream` and `stream_chat` async iterators."""

    def __init__(self, address: str, *, timeout: float | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 options: Mapping[str, Any] | None = None, api_key: str | None = None):
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=_channel_args(options))
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=_channel_args(options))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._timeout = timeout
        self._metadata = _auth(api_key)

    async def models(self) -> gateway_pb2.ListModelsResponse:
        try:
            return await self._stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=self._timeout,
                                         metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def _unary(self, request: gateway_pb2.GenerateRequest,
                     timeout: float | None) -> Generation:
        try:
            return _generation(await self._stub.Generate(request, timeout=timeout, metadata=self._metadata))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    async def _stream(self, request: gateway_pb2.GenerateRequest,
                      timeout: float | None) -> AsyncIterator[Chunk]:
        call = self._stub.GenerateStream(request, timeout=timeout, metadata=self._metadata)
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
