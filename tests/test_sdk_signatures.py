"""The SDK's generation methods (Client and AsyncClient: generate, chat, stream, stream_chat)
take named, annotated keyword-only parameters that an IDE can show, documented once in
`generate`; an unknown keyword is a TypeError; every value reaches the request. No server:
the gRPC stub is replaced by a recorder."""
import asyncio
import inspect

import pytest

from specmesh import AsyncClient, Client, build_request
from specmesh.v1 import gateway_pb2

METHODS = ["generate", "chat", "stream", "stream_chat"]
BUILD = inspect.signature(build_request).parameters
# what every method takes by keyword: build_request's parameters but the input, and the deadline
KEYWORDS = [name for name in BUILD if name not in ("prompt", "messages")] + ["timeout"]
VALUES = dict(model="m", max_tokens=3, temperature=0.5, top_p=0.9, top_k=4, seed=7, stop="x",
              repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=-0.3)


@pytest.mark.parametrize("cls", [Client, AsyncClient])
@pytest.mark.parametrize("method", METHODS)
def test_methods_take_named_annotated_keywords(cls, method):
    params = inspect.signature(getattr(cls, method)).parameters
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds
    assert inspect.Parameter.VAR_POSITIONAL not in kinds
    first = "messages" if "chat" in method else "prompt"
    assert list(params) == ["self", first, *KEYWORDS]
    assert params[first].kind == inspect.Parameter.POSITIONAL_OR_KEYWORD
    for name in KEYWORDS:
        p = params[name]
        assert p.kind == inspect.Parameter.KEYWORD_ONLY, name
        assert p.annotation is not inspect.Parameter.empty, name
        if name != "timeout":  # the same defaults as the one documented description
            assert p.default == BUILD[name].default, name
    assert params["timeout"].default is None


def test_every_keyword_is_documented_in_generate():
    for name in KEYWORDS:
        assert f"\n            {name}: " in Client.generate.__doc__, name
    for method in METHODS[1:]:
        assert "as `generate`" in getattr(Client, method).__doc__


def test_an_unknown_keyword_is_a_type_error():
    with Client("127.0.0.1:1") as client:
        for method in METHODS:
            first = [("user", "hi")] if "chat" in method else "hi"
            with pytest.raises(TypeError, match="max_token"):
                getattr(client, method)(first, max_token=3)

    async def run():
        async with AsyncClient("127.0.0.1:1") as client:
            for method in METHODS:
                first = [("user", "hi")] if "chat" in method else "hi"
                with pytest.raises(TypeError, match="temprature"):
                    getattr(client, method)(first, temprature=0.5)
    asyncio.run(run())


class _Call:
    """What a stub's streaming call returns: the chunks, and cancel()."""

    def __init__(self, chunks):
        self.chunks = chunks

    def __iter__(self):
        return iter(self.chunks)

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk

    def cancel(self):
        pass


class _Recorder:
    """Stands in for the GatewayStub: records (method, request, timeout) and the metadata."""

    def __init__(self, asynchronous: bool):
        self.calls = []
        self.asynchronous = asynchronous

    def Generate(self, request, timeout=None, metadata=None):
        self.calls.append(("Generate", request, timeout))
        self.metadata = metadata
        response = gateway_pb2.GenerateResponse(text="ok", token_ids=[1])
        if not self.asynchronous:
            return response

        async def answer():
            return response
        return answer()

    def GenerateStream(self, request, timeout=None, metadata=None):
        self.calls.append(("GenerateStream", request, timeout))
        self.metadata = metadata
        return _Call([gateway_pb2.GenerateChunk(text="o"), gateway_pb2.GenerateChunk(text="k")])


def test_every_value_reaches_the_request_and_timeout_the_call():
    with Client("127.0.0.1:1", timeout=5.0) as client:
        client._stub = recorder = _Recorder(asynchronous=False)
        assert client.generate("hi", **VALUES).text == "ok"
        assert "".join(c.text for c in client.stream("hi", **VALUES, timeout=2.0)) == "ok"
        client.chat([("user", "hi")], **VALUES)
        list(client.stream_chat([{"role": "user", "content": "hi"}], **VALUES))
    prompt, chat = build_request(prompt="hi", **VALUES), build_request(
        messages=[("user", "hi")], **VALUES)
    assert recorder.calls == [("Generate", prompt, 5.0), ("GenerateStream", prompt, 2.0),
                              ("Generate", chat, 5.0), ("GenerateStream", chat, 5.0)]


def test_async_client_passes_the_same_request():
    async def run():
        async with AsyncClient("127.0.0.1:1") as client:
            client._stub = recorder = _Recorder(asynchronous=True)
            out = await client.chat([("user", "hi")], **VALUES, timeout=3.0)
            chunks = [c async for c in client.stream("hi", **VALUES)]
        return recorder.calls, out, chunks
    calls, out, chunks = asyncio.run(run())
    assert out.text == "ok" and "".join(c.text for c in chunks) == "ok"
    assert calls == [("Generate", build_request(messages=[("user", "hi")], **VALUES), 3.0),
                     ("GenerateStream", build_request(prompt="hi", **VALUES), None)]


def test_an_api_key_goes_with_every_call():
    with Client("127.0.0.1:1", api_key="k-1") as client:
        client._stub = recorder = _Recorder(asynchronous=False)
        client.generate("hi")
        assert recorder.metadata == (("authorization", "Bearer k-1"),)
        list(client.stream("hi"))
        assert recorder.metadata == (("authorization", "Bearer k-1"),)
    with Client("127.0.0.1:1") as client:
        client._stub = recorder = _Recorder(asynchronous=False)
        client.generate("hi")
        assert recorder.metadata is None
