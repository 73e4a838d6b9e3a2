"""Drafting-service replicas behind one stub (services/router/replicas.py), with recording fake
replicas (real replicas killed under load: tests/test_cli.py)."""
import asyncio

import grpc
import pytest

from specmesh_services.common.rpc import LocalRpcError
from specmesh_services.router.replicas import DatastoreReplicas, DrafterReplicas
from specmesh.v1 import common_pb2, datastore_pb2, drafter_pb2


class FakeDrafter:
    """Answers each item with a one-node tree naming this replica and the item's request."""

    def __init__(self, index: int) -> None:
        self.index, self.calls, self.dead = index, [], False

    async def _answer(self, method, request):
        self.calls.append((method, request))
        if self.dead:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused")

    async def Prefill(self, request, timeout=None):  # noqa: N802
        await self._answer("Prefill", request)
        return drafter_pb2.DraftPrefillResponse(context_len=self.index)

    async def Draft(self, request, timeout=None):  # noqa: N802
        await self._answer("Draft", request)
        return drafter_pb2.DraftBatchResponse(
            trees=[common_pb2.TokenTree(tokens=[self.index], source_names=[i.request_id])
                   for i in request.items],
            draft_seconds=[0.1 * (self.index + 1)] * len(request.items))

    async def Lookup(self, request, timeout=None):  # noqa: N802
        await self._answer("Lookup", request)
        return datastore_pb2.LookupBatchResponse(
            trees=[common_pb2.TokenTree(tokens=[self.index], source_names=[i.request_id])
                   for i in request.items], lookup_seconds=0.01 * (self.index + 1))

    async def Release(self, request, timeout=None):  # noqa: N802
        await self._answer("Release", request)
        return drafter_pb2.DraftReleaseResponse(released=len(request.request_ids))


REQUESTS = [f"r{i}" for i in range(12)]


def draft(replicas, ids):
    batch = drafter_pb2.DraftBatchRequest(items=[drafter_pb2.DraftItem(request_id=r)
                                                 for r in ids])
    return asyncio.run(replicas.Draft(batch))


def test_each_request_sticks_to_one_replica_and_a_batch_is_split_and_merged_in_order():
    fakes = [FakeDrafter(i) for i in range(3)]
    replicas = DrafterReplicas(fakes)
    home = {r: replicas.pick(r) for r in REQUESTS}
    assert len(set(home.values())) == 3  # spread over all of them
    reply = draft(replicas, REQUESTS)
    assert [t.source_names[0] for t in reply.trees] == REQUESTS  # in the items' order
    assert [t.tokens[0] for t in reply.trees] == [home[r] for r in REQUESTS]
    assert list(reply.draft_seconds) == pytest.approx([0.1 * (home[r] + 1) for r in REQUESTS])
    for fake in fakes:  # one call each, holding only its own requests
        ((_, request),) = fake.calls
        assert {i.request_id for i in request.items} == {r for r in REQUESTS
                                                         if home[r] == fake.index}
    assert draft(replicas, REQUESTS).trees == reply.trees  # the same again


def test_a_dead_replicas_requests_move_and_stay_moved_once_it_is_back():
    fakes = [FakeDrafter(i) for i in range(2)]
    replicas = DrafterReplicas(fakes, down_s=60)
    home = {r: replicas.pick(r) for r in REQUESTS}
    fakes[0].dead = True
    with pytest.raises(grpc.RpcError):
        draft(replicas, REQUESTS)
    assert all(replicas.pick(r) == 1 for r in REQUESTS)  # replica 0 is down: all on 1
    assert [t.tokens[0] for t in draft(replicas, REQUESTS).trees] == [1] * len(REQUESTS)
    fakes[0].dead = False
    replicas._down_until[0] = 0.0  # back
    assert all(replicas.pick(r) == 1 for r in REQUESTS)  # their state is on 1 now
    asyncio.run(replicas.Release(drafter_pb2.DraftReleaseRequest(request_ids=REQUESTS)))
    assert {r: replicas.pick(r) for r in REQUESTS} == home  # released: home again
    assert all(f.calls[-1][0] == "Release" for f in fakes)  # a release reaches every replica


def test_datastore_lookups_are_split_the_same_way():
    fakes = [FakeDrafter(i) for i in range(2)]
    replicas = DatastoreReplicas(fakes)
    batch = datastore_pb2.LookupBatchRequest(items=[datastore_pb2.LookupItem(request_id=r)
                                                    for r in REQUESTS])
    reply = asyncio.run(replicas.Lookup(batch))
    assert [t.source_names[0] for t in reply.trees] == REQUESTS
    assert [t.tokens[0] for t in reply.trees] == [replicas.pick(r) for r in REQUESTS]
    assert reply.lookup_seconds == pytest.approx(0.02)  # the slower replica's
