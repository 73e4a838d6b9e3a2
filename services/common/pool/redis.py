"""The Redis pool: the `Pool` contract (see base.py) on Redis streams and consumer groups.

All keys live under `prefix` (default "specmesh"): per request a state hash and a string of
generated token ids (packed int32, grown with APPEND, both expiring after the request's idle
ttl); the drafts stream (consumer group `verifiers`), one results stream per router (group
`routers`), the dead-letter and the release streams. The layout in full: docs/architecture.md,
The pool. `complete` is one Lua script, so check-append-publish-acknowledge is atomic; groups
are created on first use and again if Redis lost them (NOGROUP), so a restarted Redis only
loses in-flight work.
"""
from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from google.protobuf.message import DecodeError
from redis.exceptions import ResponseError

from specmesh_services.common.pool.base import Pool, Taken, stale_result
from specmesh_services.common.tasks import stopping
from specmesh.v1 import pool_pb2

VERIFIERS = "verifiers"  # consumer group of the drafts stream
ROUTERS = "routers"  # consumer group of every results stream
RESULTS_MAXLEN = 10_000  # approximate cap of a router's results stream
RELEASES_MAXLEN = 10_000  # approximate cap of the release feed
DEAD_MAXLEN = 10_000  # approximate cap of the dead-letter stream
RELEASES_BATCH = 1_000  # ids returned by one `releases` call at most

T = TypeVar("T")
log = logging.getLogger(__name__)

# KEYS: req, tok, results, drafts. ARGV: base_len, packed tokens, result, entry id, group, maxlen,
# stale result (published instead when the count is not base_len).
_COMPLETE_LUA = """
if redis.call('XACK', KEYS[4], ARGV[5], ARGV[4]) == 0 then return 0 end
redis.call('XDEL', KEYS[4], ARGV[4])
local ttl = redis.call('HGET', KEYS[1], 'ttl_ms')
if not ttl then return 0 end
if redis.call('STRLEN', KEYS[2]) ~= tonumber(ARGV[1]) * 4 then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[7])
  return 0
end
redis.call('APPEND', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[6], '*', 'data', ARGV[3])
return 1
"""

# KEYS: drafts. ARGV: group, consumer, min idle ms, count. Returns {id, fields, deliveries}...
# XAUTOCLAIM and the delivery counters read in one step, so no other claim slips in between.
_CLAIM_LUA = """
local claimed = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0',
                           'COUNT', ARGV[4])
local out = {}
for _, e in ipairs(claimed[2]) do
  if e[2] then
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], e[1], e[1], 1)
    table.insert(out, {e[1], e[2], p[1][4]})
  else  -- deleted while pending (Redis 6.2 still lists it): nothing to deliver
    redis.call('XACK', KEYS[1], ARGV[1], e[1])
  end
end
return out
"""


def _pack(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def _unpack(data: bytes | None) -> list[int]:
    if not data:
        return []
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _block_ms(block_s: float) -> int | None:
    """BLOCK argument: None (return at once) for block_s <= 0, since BLOCK 0 waits forever."""
    return _ms(block_s) if block_s > 0 else None


def _entries(reply) -> list[tuple[str, dict]]:
    """(id, fields) pairs of an XREAD/XREADGROUP reply on one stream."""
    out = []
    for _stream, entries in reply or []:
        out.extend((entry_id.decode(), fields) for entry_id, fields in entries)
    return out


def _draft(data: bytes) -> pool_pb2.DraftEntry:
    return pool_pb2.DraftEntry.FromString(data)


def _decoded(fields: dict) -> pool_pb2.DraftEntry | str:
    """The entry in a drafts-stream entry's fields, or why there is none."""
    data = fields.get(b"data")
    if data is None:
        return "a draft entry without a data field"
    try:
        return _draft(data)
    except DecodeError as err:
        return f"an undecodable draft entry ({len(data)} bytes: {err})"


class _Redis(Redis):
    """redis-py's client, ending a task that `tasks.stop` is stopping after each command: its
    timeouts can swallow a cancellation that lands as the reply arrives."""

    async def execute_command(self, *args, **options):
        reply = await super().execute_command(*args, **options)
        if stopping():
            raise asyncio.CancelledError("stopped")
        return reply


class RedisPool(Pool):
    def __init__(self, url: str, prefix: str = "specmesh") -> None:
        self._redis = _Redis.from_url(url)
        self._prefix = prefix
        self._drafts = f"{prefix}:drafts"
        self._release_feed = f"{prefix}:releases"
        self._dead = f"{prefix}:dead"
        self._groups: set[tuple[str, str]] = set()  # (stream, group) known to exist
        self._complete = self._redis.register_script(_COMPLETE_LUA)
        self._claim = self._redis.register_script(_CLAIM_LUA)

    def _req(self, request_id: str) -> str:
        return f"{self._prefix}:req:{request_id}"

    def _tok(self, request_id: str) -> str:
        return f"{self._prefix}:tok:{request_id}"

    def _results(self, router_id: str) -> str:
        return f"{self._prefix}:results:{router_id}"

    async def _ensure_group(self, stream: str, group: str) -> None:
        try:
            await self._redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._groups.add((stream, group))

    async def _grouped(self, stream: str, group: str, call: Callable[[], Awaitable[T]]) -> T:
        """Runs `call` on a consumer group, creating the group first use and again if lost."""
        if (stream, group) not in self._groups:
            await self._ensure_group(stream, group)
        try:
            return await call()
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self._ensure_group(stream, group)
            return await call()

    # request state ----------------------------------------------------------------------------
    async def put_request(self, state: pool_pb2.RequestState, ttl_s: float) -> None:
        req, tok, ttl_ms = self._req(state.request_id), self._tok(state.request_id), _ms(ttl_s)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(req, tok)
            pipe.hset(req, mapping={"state": state.SerializeToString(), "ttl_ms": ttl_ms})
            pipe.pexpire(req, ttl_ms)
            pipe.set(tok, b"", px=ttl_ms)
            await pipe.execute()

    async def get_request(self, request_id: str) -> tuple[pool_pb2.RequestState, list[int]] | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hget(self._req(request_id), "state")
            pipe.get(self._tok(request_id))
            state, tokens = await pipe.execute()
        if state is None:
            return None
        return pool_pb2.RequestState.FromString(state), _unpack(tokens)

    async def delete_request(self, request_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._req(request_id), self._tok(request_id))
            pipe.xadd(self._release_feed, {"data": request_id.encode()},
                      maxlen=RELEASES_MAXLEN, approximate=True)
            await pipe.execute()

    # drafts -----------------------------------------------------------------------------------
    async def submit(self, entry: pool_pb2.DraftEntry) -> str:
        entry_id = await self._redis.xadd(self._drafts, {"data": entry.SerializeToString()})
        return entry_id.decode()

    async def take(self, consumer: str, count: int, block_s: float) -> list[Taken]:
        reply = await self._grouped(self._drafts, VERIFIERS, lambda: self._redis.xreadgroup(
            VERIFIERS, consumer, {self._drafts: ">"}, count=count, block=_block_ms(block_s)))
        return await self._taken([(entry_id, fields, 1) for entry_id, fields in _entries(reply)])

    async def claim_stale(self, consumer: str, min_idle_s: float, count: int) -> list[Taken]:
        args = [VERIFIERS, consumer, round(min_idle_s * 1000), count]
        rows = await self._grouped(self._drafts, VERIFIERS,
                                   lambda: self._claim(keys=[self._drafts], args=args))
        return await self._taken([(entry_id.decode(), dict(zip(fields[::2], fields[1::2])),
                                   int(deliveries)) for entry_id, fields, deliveries in rows])

    async def _taken(self, rows: list[tuple[str, dict, int]]) -> list[Taken]:
        """The delivered entries; one that is not a DraftEntry goes to the dead-letter stream
        at once (no verifier could ever take it, and it names no router to tell)."""
        out = []
        for entry_id, fields, deliveries in rows:
            entry = _decoded(fields)
            if isinstance(entry, str):
                log.warning("dead-lettering drafts entry %s: %s", entry_id, entry)
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.xadd(self._dead, {"data": fields.get(b"data", b""), "reason": entry,
                                           "deliveries": deliveries},
                              maxlen=DEAD_MAXLEN, approximate=True)
                    pipe.xack(self._drafts, VERIFIERS, entry_id)
                    pipe.xdel(self._drafts, entry_id)
                    await pipe.execute()
                continue
            out.append(Taken(entry_id, entry, deliveries))
        return out

    async def complete(self, taken: Taken, result: pool_pb2.VerifyResult,
                       new_tokens: list[int]) -> bool:
        entry = taken.entry
        keys = [self._req(entry.request_id), self._tok(entry.request_id),
                self._results(entry.reply_to), self._drafts]
        args = [entry.base_len, _pack(new_tokens), result.SerializeToString(), taken.entry_id,
                VERIFIERS, RESULTS_MAXLEN, stale_result(entry).SerializeToString()]
        return bool(await self._complete(keys=keys, args=args))

    async def reply_stale(self, taken: Taken) -> None:
        entry = taken.entry
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self._drafts, VERIFIERS, taken.entry_id)
            pipe.xdel(self._drafts, taken.entry_id)
            pipe.xadd(self._results(entry.reply_to),
                      {"data": stale_result(entry).SerializeToString()},
                      maxlen=RESULTS_MAXLEN, approximate=True)
            await pipe.execute()

    async def ack(self, taken: Taken) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(self._drafts, VERIFIERS, taken.entry_id)
            pipe.xdel(self._drafts, taken.entry_id)
            await pipe.execute()

    async def dead_letter(self, taken: Taken, reason: str) -> None:
        entry = taken.entry
        failed = pool_pb2.VerifyResult(request_id=entry.request_id, step=entry.step,
                                       base_len=entry.base_len, error=reason)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self._dead, {"data": entry.SerializeToString(), "reason": reason,
                                   "deliveries": taken.deliveries},
                      maxlen=DEAD_MAXLEN, approximate=True)
            pipe.xack(self._drafts, VERIFIERS, taken.entry_id)
            pipe.xdel(self._drafts, taken.entry_id)
            pipe.xadd(self._results(entry.reply_to), {"data": failed.SerializeToString()},
                      maxlen=RESULTS_MAXLEN, approximate=True)
            await pipe.execute()

    async def dead_letters(self, count: int = 100) -> list[tuple[pool_pb2.DraftEntry, str]]:
        rows = await self._redis.xrevrange(self._dead, count=count)
        out = []
        for _, fields in rows[::-1]:
            entry = _decoded(fields)
            out.append((entry if isinstance(entry, pool_pb2.DraftEntry) else pool_pb2.DraftEntry(),
                        fields[b"reason"].decode()))
        return out

    async def has_entry(self, entry_id: str) -> bool:
        return bool(await self._redis.xrange(self._drafts, entry_id, entry_id, count=1))

    async def pending(self) -> int:
        # Acknowledged entries are deleted, so the stream holds exactly the queued + unacked ones.
        return await self._redis.xlen(self._drafts)

    # results ----------------------------------------------------------------------------------
    async def results(self, router_id: str, block_s: float) -> list[pool_pb2.VerifyResult]:
        stream = self._results(router_id)
        reply = await self._grouped(stream, ROUTERS, lambda: self._redis.xreadgroup(
            ROUTERS, router_id, {stream: ">"}, block=_block_ms(block_s)))
        entries = _entries(reply)
        if entries:
            await self._redis.xack(stream, ROUTERS, *(entry_id for entry_id, _ in entries))
        return [pool_pb2.VerifyResult.FromString(fields[b"data"]) for _, fields in entries]

    # release feed -----------------------------------------------------------------------------
    async def _last_release(self) -> str:
        """Id of the feed's newest entry ("$" made concrete), or "0-0" when the feed is empty."""
        last = await self._redis.xrevrange(self._release_feed, count=1)
        return last[0][0].decode() if last else "0-0"

    async def releases(self, cursor: str, block_s: float) -> tuple[str, list[str]]:
        cursor = cursor or await self._last_release()
        reply = await self._redis.xread({self._release_feed: cursor}, count=RELEASES_BATCH,
                                        block=_block_ms(block_s))
        entries = _entries(reply)
        if entries:
            cursor = entries[-1][0]
        return cursor, [fields[b"data"].decode() for _, fields in entries]

    async def close(self) -> None:
        await self._redis.aclose(close_connection_pool=True)
