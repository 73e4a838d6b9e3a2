"""Replicas of a drafting service (the drafter, the datastore) behind one stub.

Each holds per-request state (draft KV caches, prompt/output indexes), so a request sticks to
one replica: rendezvous hashing of its id over the replicas not marked down. A replica whose
call fails with UNAVAILABLE is marked down for `down_s`; its requests move to another one,
which the request's loop re-synchronises with the whole context, as after any failed draft
call (drafting.py), and they stay there (the move is only undone if that replica fails too).
A batched call (Draft, Lookup) is split by replica and the parts sent concurrently.
"""
from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence

import grpc

from specmesh.v1 import datastore_pb2, drafter_pb2


class _Sticky:
    released: type  # the service's release reply

    def __init__(self, stubs: Sequence, down_s: float = 5.0) -> None:
        self.stubs = list(stubs)
        self.down_s = down_s
        self._down_until = [0.0] * len(self.stubs)
        self._placed: dict[str, int] = {}  # request -> replica it was moved to

    def pick(self, request_id: str) -> int:
        """The replica holding `request_id`: where it was moved, else its hashed home; when
        that one is down, the live replica it hashes highest on (where it moves)."""
        now = time.monotonic()
        held = self._placed.get(request_id)
        if held is None:
            held = self._highest(request_id, range(len(self.stubs)))
        if self._down_until[held] <= now:
            return held
        live = [i for i in range(len(self.stubs)) if self._down_until[i] <= now]
        if not live:
            return held  # all down: the call fails, as with one replica
        self._placed[request_id] = self._highest(request_id, live)
        return self._placed[request_id]

    @staticmethod
    def _highest(request_id: str, replicas) -> int:
        return max(replicas, key=lambda i: hashlib.blake2b(f"{i}:{request_id}".encode(),
                                                            digest_size=8).digest())

    async def Info(self, request, timeout: float | None = None):  # noqa: N802 - the stub's names
        return await self._any("Info", request, timeout)

    async def Release(self, request, timeout: float | None = None):  # noqa: N802
        """On every replica (the request may have moved); it goes home again."""
        released = await self._everywhere("Release", request, timeout)
        for request_id in request.request_ids:
            self._placed.pop(request_id, None)
        return self.released(released=released)

    async def _call(self, index: int, method: str, request, timeout: float | None):
        try:
            return await getattr(self.stubs[index], method)(request, timeout=timeout)
        except grpc.RpcError as err:
            if callable(getattr(err, "code", None)) and err.code() == grpc.StatusCode.UNAVAILABLE:
                self._down_until[index] = time.monotonic() + self.down_s
            raise

    async def _any(self, method: str, request, timeout: float | None):
        """`method` on the first replica that answers (they serve the same models/corpus)."""
        last = None
        for i in sorted(range(len(self.stubs)), key=lambda i: self._down_until[i]):
            try:
                return await self._call(i, method, request, timeout)
            except grpc.RpcError as err:
                last = err
        raise last

    async def _everywhere(self, method: str, request, timeout: float | None) -> int:
        """`method` on every replica (releases: the request may have moved); the count freed."""
        replies = await asyncio.gather(*(self._call(i, method, request, timeout)
                                         for i in range(len(self.stubs))),
                                       return_exceptions=True)
        return sum(r.released for r in replies if not isinstance(r, BaseException))

    async def _split(self, method: str, items: Sequence, make: Callable, merge: Callable,
                     timeout: float | None):
        """A batch of per-request items, sent to each item's replica; the replies merged in
        the items' order by `merge(parts)` (parts: (positions, reply) per replica)."""
        groups: dict[int, list[int]] = {}
        for position, item in enumerate(items):
            groups.setdefault(self.pick(item.request_id), []).append(position)
        replies = await asyncio.gather(*(
            self._call(i, method, make([items[p] for p in positions]), timeout)
            for i, positions in groups.items()))
        return merge(list(zip(groups.values(), replies)))


class DrafterReplicas(_Sticky):
    """The drafter service's stub over its replicas."""

    released = drafter_pb2.DraftReleaseResponse

    async def Prefill(self, request, timeout: float | None = None):  # noqa: N802
        return await self._call(self.pick(request.request_id), "Prefill", request, timeout)

    async def Draft(self, request, timeout: float | None = None):  # noqa: N802
        def merge(parts):
            out = drafter_pb2.DraftBatchResponse()
            trees, seconds = [None] * len(request.items), [0.0] * len(request.items)
            for positions, reply in parts:
                for k, position in enumerate(positions):
                    trees[position] = reply.trees[k]
                    if k < len(reply.draft_seconds):
                        seconds[position] = reply.draft_seconds[k]
            out.trees.extend(trees)
            out.draft_seconds.extend(seconds)
            return out
        return await self._split("Draft", request.items,
                                 lambda items: drafter_pb2.DraftBatchRequest(items=items),
                                 merge, timeout)


class DatastoreReplicas(_Sticky):
    """The datastore service's stub over its replicas."""

    released = datastore_pb2.DatastoreReleaseResponse

    async def Lookup(self, request, timeout: float | None = None):  # noqa: N802
        def merge(parts):
            trees = [None] * len(request.items)
            for positions, reply in parts:
                for k, position in enumerate(positions):
                    trees[position] = reply.trees[k]
            # the replicas looked up concurrently: the batch took the longest of them
            return datastore_pb2.LookupBatchResponse(
                trees=trees, lookup_seconds=max(reply.lookup_seconds for _, reply in parts))
        return await self._split("Lookup", request.items,
                                 lambda items: datastore_pb2.LookupBatchRequest(items=items),
                                 merge, timeout)
