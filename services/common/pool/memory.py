"""In-memory pool for the embedded single-process mode: the same contract as RedisPool,
on asyncio primitives (one event loop)."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from specmesh_services.common.pool.base import Pool, Taken, stale_result
from specmesh.v1 import pool_pb2

DEAD_MAXLEN = 10_000  # dead-lettered drafts kept
DRAFTS, RESULTS, RELEASES = "drafts", "results", "releases"


@dataclass
class _Request:
    state: pool_pb2.RequestState
    tokens: list[int]
    ttl_s: float
    expires: float


@dataclass
class _Pending:
    entry: pool_pb2.DraftEntry
    consumer: str
    delivered_at: float
    deliveries: int


@dataclass
class _Feed:
    """An append-only list of items with monotonically increasing integer cursors."""

    items: deque = field(default_factory=lambda: deque(maxlen=100_000))
    last: int = 0


def _failed(taken: Taken, reason: str) -> pool_pb2.VerifyResult:
    entry = taken.entry
    return pool_pb2.VerifyResult(request_id=entry.request_id, step=entry.step,
                                 base_len=entry.base_len, error=reason)


class MemoryPool(Pool):
    def __init__(self) -> None:
        self._requests: dict[str, _Request] = {}
        self._queued: OrderedDict[str, pool_pb2.DraftEntry] = OrderedDict()
        self._pending: OrderedDict[str, _Pending] = OrderedDict()
        self._results: dict[str, deque[pool_pb2.VerifyResult]] = {}
        self._releases = _Feed()
        self._dead: deque[tuple[pool_pb2.DraftEntry, str]] = deque(maxlen=DEAD_MAXLEN)
        self._ids = itertools.count(1)
        # waiters by what they wait for: a new draft (verifiers), a result (routers), a release
        self._waiters: dict[str, set[asyncio.Future]] = {DRAFTS: set(), RESULTS: set(),
                                                         RELEASES: set()}

    def _notify(self, kind: str) -> None:
        """Wakes the waiters for `kind`; each re-evaluates its own condition (a result wakes
        the routers only, not the verifiers and the release feed: three wake-ups a step fewer)."""
        waiters = self._waiters[kind]
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        waiters.clear()

    async def _wait_for(self, ready, block_s: float, kind: str):
        """Evaluates `ready()` until it returns something truthy or block_s elapses.

        One event loop owns the pool, so no lock is needed: `ready()` runs without an await,
        atomically. A plain future per wait, awaited with asyncio.wait (which never cancels
        it), replaces asyncio.Condition + wait_for: on Python 3.11 a wait_for cancelled while
        Condition.wait re-acquires its lock can leave that lock held by a finished task, after
        which every notify blocks forever (a whole-mesh hang with idle threads, seen once in
        the test suite)."""
        deadline = time.monotonic() + block_s
        loop = asyncio.get_running_loop()
        while True:
            value = ready()
            remaining = deadline - time.monotonic()
            if value or remaining <= 0:
                return value
            waiter = loop.create_future()
            self._waiters[kind].add(waiter)
            try:
                await asyncio.wait((waiter,), timeout=remaining)
            finally:
                self._waiters[kind].discard(waiter)
                if not waiter.done():
                    waiter.cancel()

    def _live(self, request_id: str) -> _Request | None:
        req = self._requests.get(request_id)
        if req is not None and req.expires < time.monotonic():
            del self._requests[request_id]
            return None
        return req

    # request state ----------------------------------------------------------------------------
    async def put_request(self, state: pool_pb2.RequestState, ttl_s: float) -> None:
        copy = pool_pb2.RequestState()
        copy.CopyFrom(state)
        self._requests[state.request_id] = _Request(copy, [], ttl_s, time.monotonic() + ttl_s)

    async def get_request(self, request_id: str) -> tuple[pool_pb2.RequestState, list[int]] | None:
        req = self._live(request_id)
        if req is None:
            return None
        state = pool_pb2.RequestState()
        state.CopyFrom(req.state)
        return state, list(req.tokens)

    async def delete_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._releases.last += 1
        self._releases.items.append((self._releases.last, request_id))
        self._notify(RELEASES)

    # drafts -----------------------------------------------------------------------------------
    async def submit(self, entry: pool_pb2.DraftEntry) -> str:
        entry_id = f"{next(self._ids)}-0"
        copy = pool_pb2.DraftEntry()
        copy.CopyFrom(entry)
        self._queued[entry_id] = copy
        self._notify(DRAFTS)
        return entry_id

    async def take(self, consumer: str, count: int, block_s: float) -> list[Taken]:
        def ready() -> list[Taken]:
            out = []
            while self._queued and len(out) < count:
                entry_id, entry = self._queued.popitem(last=False)
                self._pending[entry_id] = _Pending(entry, consumer, time.monotonic(), 1)
                out.append(Taken(entry_id, entry, 1))
            return out

        return await self._wait_for(ready, block_s, DRAFTS)

    async def claim_stale(self, consumer: str, min_idle_s: float, count: int) -> list[Taken]:
        now = time.monotonic()
        out = []
        for entry_id, p in self._pending.items():
            if len(out) >= count:
                break
            if now - p.delivered_at >= min_idle_s:
                p.consumer, p.delivered_at, p.deliveries = consumer, now, p.deliveries + 1
                out.append(Taken(entry_id, p.entry, p.deliveries))
        return out

    async def complete(self, taken: Taken, result: pool_pb2.VerifyResult,
                       new_tokens: list[int]) -> bool:
        # No await before the state change: atomic with respect to other tasks.
        pending = self._pending.pop(taken.entry_id, None)
        req = self._live(taken.entry.request_id)
        if pending is None or req is None:
            return False
        if len(req.tokens) != taken.entry.base_len:
            self._reply(taken.entry.reply_to, stale_result(taken.entry))
            return False
        req.tokens.extend(new_tokens)
        req.expires = time.monotonic() + req.ttl_s
        copy = pool_pb2.VerifyResult()
        copy.CopyFrom(result)
        self._reply(taken.entry.reply_to, copy)
        return True

    async def reply_stale(self, taken: Taken) -> None:
        self._pending.pop(taken.entry_id, None)
        self._reply(taken.entry.reply_to, stale_result(taken.entry))

    def _reply(self, router_id: str, result: pool_pb2.VerifyResult) -> None:
        self._results.setdefault(router_id, deque()).append(result)
        self._notify(RESULTS)

    async def ack(self, taken: Taken) -> None:
        self._pending.pop(taken.entry_id, None)

    async def dead_letter(self, taken: Taken, reason: str) -> None:
        self._pending.pop(taken.entry_id, None)
        self._queued.pop(taken.entry_id, None)
        self._dead.append((taken.entry, reason))
        self._reply(taken.entry.reply_to, _failed(taken, reason))

    async def dead_letters(self, count: int = 100) -> list[tuple[pool_pb2.DraftEntry, str]]:
        return list(self._dead)[-count:]

    async def has_entry(self, entry_id: str) -> bool:
        return entry_id in self._queued or entry_id in self._pending

    async def pending(self) -> int:
        return len(self._queued) + len(self._pending)

    # results ----------------------------------------------------------------------------------
    async def results(self, router_id: str, block_s: float) -> list[pool_pb2.VerifyResult]:
        def ready() -> list[pool_pb2.VerifyResult]:
            queue = self._results.get(router_id)
            out = list(queue or ())
            if queue:
                queue.clear()
            return out

        return await self._wait_for(ready, block_s, RESULTS)

    # release feed -----------------------------------------------------------------------------
    async def releases(self, cursor: str, block_s: float) -> tuple[str, list[str]]:
        after = self._releases.last if cursor == "" else int(cursor)

        def ready() -> list[str]:
            return [rid for seq, rid in self._releases.items if seq > after]

        ids = await self._wait_for(ready, block_s, RELEASES)
        return str(self._releases.last if ids or cursor == "" else after), ids
