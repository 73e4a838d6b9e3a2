"""Admission (services/router/admission.py): a bounded number of requests generate, a bounded
number wait for a slot up to their deadline, any more are refused at once with
RESOURCE_EXHAUSTED over gRPC and 429 over HTTP; nothing queues without bound."""
import asyncio
import threading
import time

import grpc
import httpx
import pytest

from specmesh_services.common.rpc import Overloaded
from specmesh_services.router.admission import Admission
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc
from threaded import served_mesh  # tests/ is on the path


def test_requests_beyond_the_slots_wait_in_order_and_beyond_the_queue_are_refused_at_once():
    async def body():
        admission = Admission(max_requests=1, max_waiting=2, wait_s=5.0)
        order, release = [], asyncio.Event()

        async def request(name):
            async with admission.slot():
                order.append(name)
                await release.wait()
        first = asyncio.create_task(request("a"))
        await asyncio.sleep(0)
        waiting = [asyncio.create_task(request(n)) for n in ("b", "c")]
        await asyncio.sleep(0.01)
        assert admission.waiting == 2
        began = time.monotonic()
        with pytest.raises(Overloaded, match="at capacity"):
            async with admission.slot():
                pass
        assert time.monotonic() - began < 0.1  # at once
        async with admission.slot(resumed=True):  # a resumed request is taken anyway
            pass
        release.set()
        await asyncio.gather(first, *waiting)
        assert order == ["a", "b", "c"] and admission.waiting == 0 and admission.refused == 1

    asyncio.run(body())


def test_a_waiter_is_refused_at_its_deadline_and_its_place_is_freed():
    async def body():
        admission = Admission(max_requests=1, max_waiting=1, wait_s=5.0)
        hold = asyncio.Event()

        async def holder():
            async with admission.slot():
                await hold.wait()
        task = asyncio.create_task(holder())
        await asyncio.sleep(0)
        began = time.monotonic()
        with pytest.raises(Overloaded, match="no slot freed within"):
            async with admission.slot(deadline_s=0.2):
                pass
        assert 0.15 < time.monotonic() - began < 1.0
        assert admission.waiting == 0
        hold.set()
        await task
        async with admission.slot(deadline_s=0.2):  # the slot came back
            pass

    asyncio.run(body())


@pytest.fixture(scope="module")
def mesh(base_settings, compute):
    """An embedded mesh whose router generates one request at once and queues one."""
    settings = base_settings.with_overrides(
        drafters=["layers:4"], **{"speculation.depth": 2, "router.max_requests": 1,
                                  "router.max_waiting": 1, "router.admission_wait_s": 120})

    with served_mesh(settings, compute) as (grpc_port, http_port, *_):
        yield grpc_port, http_port


def test_beyond_capacity_grpc_gets_resource_exhausted_and_http_429_at_once(mesh):
    grpc_port, http_port = mesh
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        gateway = gateway_pb2_grpc.GatewayStub(channel)
        story = gateway_pb2.ChatMessage(role="user", content="Write a long story about a dragon.")
        long = gateway_pb2.GenerateRequest(messages=gateway_pb2.ChatMessages(messages=[story]),
                                           max_tokens=120)
        stream = gateway.GenerateStream(long, timeout=300)
        next(stream)  # generating: the one slot is taken
        results = {}
        queued = threading.Thread(target=lambda: results.update(
            queued=gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=4),
                                    timeout=300)))
        queued.start()
        time.sleep(0.5)  # it waits in the one place of the queue
        began = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            gateway.Generate(gateway_pb2.GenerateRequest(prompt="Hi", max_tokens=4), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "at capacity" in err.value.details()
        reply = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions",
                           json={"model": "", "prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert reply.status_code == 429, reply.text
        assert reply.json()["error"]["type"] == "rate_limit_error"
        assert time.monotonic() - began < 10  # refused at once, not after a wait
        assert sum(1 for _ in stream) > 0  # the first request finishes
        queued.join(timeout=300)
        assert len(results["queued"].token_ids) == 4  # the waiting one is served after it
