"""The gateway's failover over router replicas (gateway/routers.py), with scripted router stubs
(the real routers and a real kill: tests/test_stack.py)."""
import asyncio

import grpc
import pytest

from specmesh_gateway.routers import Routers
from specmesh_services.common.rpc import LocalRpcError
from specmesh.v1 import router_pb2

TOKENS = [[1, 2], [3], [4, 5, 6], [7]]
TEXTS = ["a", "bc", "", "d"]


class ScriptedRouter:
    """Streams the request's chunks from where its `resume` says; fails after `fail_after`
    chunks with `code`, or refuses a resume it does not know with NOT_FOUND."""

    def __init__(self, fail_after=None, code=grpc.StatusCode.UNAVAILABLE, knows=True):
        self.fail_after, self.code, self.knows = fail_after, code, knows
        self.requests = []

    def Generate(self, request, timeout=None):  # noqa: N802 - the stub's name
        self.requests.append(request)
        return self._stream(request)

    async def _stream(self, request):
        start = 0
        if request.HasField("resume"):
            if not self.knows:
                raise LocalRpcError(grpc.StatusCode.NOT_FOUND, "not in the pool")
            start = next(i for i in range(len(TOKENS) + 1)
                         if sum(map(len, TOKENS[:i])) == request.resume.tokens)
        for n, i in enumerate(range(start, len(TOKENS))):
            if self.fail_after is not None and n >= self.fail_after:
                raise LocalRpcError(self.code, "gone")
            yield router_pb2.RouteChunk(token_ids=TOKENS[i], text=TEXTS[i],
                                        finish_reason=1 if i == len(TOKENS) - 1 else 0)


def collect(routers, request=None):
    async def run():
        return [c async for c in routers.Generate(request or router_pb2.RouteRequest(
            request_id="r1", prompt_ids=[9], max_tokens=7))]
    return asyncio.run(run())


def test_a_stream_whose_router_dies_goes_on_on_the_next_after_what_was_sent():
    dying, other = ScriptedRouter(fail_after=2), ScriptedRouter()
    chunks = collect(Routers([dying, other]))
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5, 6, 7]
    assert "".join(c.text for c in chunks) == "abcd"
    (resumed,) = other.requests
    assert resumed.resume.tokens == 3 and resumed.resume.text_chars == 3
    assert list(resumed.prompt_ids) == [9] and resumed.request_id == "r1"


def test_a_router_dead_before_the_request_reached_the_pool_gets_it_fresh_on_the_next():
    dead, other = ScriptedRouter(fail_after=0), ScriptedRouter(knows=False)
    routers = Routers([dead, other])
    chunks = collect(routers)
    assert [t for c in chunks for t in c.token_ids] == [1, 2, 3, 4, 5, 6, 7]
    assert [r.HasField("resume") for r in other.requests] == [True, False]


def test_new_requests_go_round_robin():
    a, b = ScriptedRouter(), ScriptedRouter()
    routers = Routers([a, b])
    for _ in range(4):
        collect(routers)
    assert len(a.requests) == len(b.requests) == 2


def test_an_error_of_the_request_is_not_retried():
    bad, other = ScriptedRouter(fail_after=0, code=grpc.StatusCode.INVALID_ARGUMENT), \
        ScriptedRouter()
    with pytest.raises(grpc.RpcError) as err:
        collect(Routers([bad, other]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and not other.requests


def test_failover_gives_up_after_resume_s():
    routers = Routers([ScriptedRouter(fail_after=0), ScriptedRouter(fail_after=0)], resume_s=0.3)
    with pytest.raises(grpc.RpcError) as err:
        collect(routers)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_router_at_capacity_passes_a_new_request_to_the_next_and_all_full_refuse_it():
    full = grpc.StatusCode.RESOURCE_EXHAUSTED
    busy, free = ScriptedRouter(fail_after=0, code=full), ScriptedRouter()
    assert [t for c in collect(Routers([busy, free])) for t in c.token_ids] == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(grpc.RpcError) as err:
        collect(Routers([ScriptedRouter(fail_after=0, code=full),
                         ScriptedRouter(fail_after=0, code=full)]))
    assert err.value.code() == full
