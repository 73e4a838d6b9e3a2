"""The pool contract (services/common/pool/base.py), one suite run against MemoryPool and
RedisPool (on a private redis-server). Each test runs its coroutine in one event loop that
lives as long as the pool (`run`), since both pools bind to the loop they are used in."""
from __future__ import annotations

import asyncio
import time

import pytest

from specmesh_services.common.pool import MemoryPool, Pool, Taken, connect
from specmesh_services.common.pool.redis import RedisPool
from specmesh.v1 import common_pb2, pool_pb2

TTL_S = 60.0
NOTHING_S = 0.05  # block time of reads that are expected to find nothing


@pytest.fixture
def run():
    """Runs a coroutine to completion in the test's own event loop."""
    with asyncio.Runner() as runner:
        yield runner.run


@pytest.fixture(params=["memory", "redis"])
def pool(request, run) -> Pool:
    if request.param == "memory":
        pool = MemoryPool()
    else:
        pool = RedisPool(request.getfixturevalue("redis_url"), prefix="test")
    yield pool
    run(pool.close())


def state(rid: str) -> pool_pb2.RequestState:
    return pool_pb2.RequestState(request_id=rid, prompt_ids=[5, 6, 7], seed=11, model="m",
                                 sampling=common_pb2.SamplingParams(temperature=0.5, top_k=3))


def draft(rid: str, step: int = 0, base_len: int = 0, reply_to: str = "router-a"
          ) -> pool_pb2.DraftEntry:
    tree = common_pb2.TokenTree(tokens=[step, 100 + step], parents=[-1, 0])
    return pool_pb2.DraftEntry(request_id=rid, step=step, base_len=base_len, tree=tree,
                               reply_to=reply_to, trace_context={"traceparent": f"t{step}"})


def result(taken: Taken, accepted: list[int], bonus: int) -> pool_pb2.VerifyResult:
    e = taken.entry
    return pool_pb2.VerifyResult(request_id=e.request_id, step=e.step, base_len=e.base_len,
                                 accepted=accepted, bonus=bonus, verifier="v")


async def take_one(pool: Pool, consumer: str = "v1") -> Taken:
    (taken,) = await pool.take(consumer, 1, block_s=1.0)
    return taken


# ---------------------------------------------------------------------------------------------
# request state


def test_put_get_delete_request(pool, run):
    async def body():
        assert await pool.get_request("nope") is None
        await pool.put_request(state("r1"), TTL_S)
        got_state, tokens = await pool.get_request("r1")
        assert got_state == state("r1") and tokens == []
        await pool.delete_request("r1")
        assert await pool.get_request("r1") is None
        await pool.delete_request("never-existed")  # no error

    run(body())


def test_request_expires_after_ttl_unless_completed(pool, run):
    async def body():
        await pool.put_request(state("short"), 0.3)
        await pool.put_request(state("kept"), 0.6)
        await pool.submit(draft("kept"))
        await asyncio.sleep(0.4)
        assert await pool.get_request("short") is None
        taken = await take_one(pool)
        assert await pool.complete(taken, result(taken, [], 9), [9])  # refreshes the expiry
        await asyncio.sleep(0.4)  # 0.8 s after put, 0.4 s after complete
        assert (await pool.get_request("kept"))[1] == [9]

    run(body())


# ---------------------------------------------------------------------------------------------
# drafts


def test_submit_take_order_and_count(pool, run):
    async def body():
        ids = [await pool.submit(draft("r", step=i)) for i in range(5)]
        assert len(set(ids)) == 5
        first = await pool.take("v1", 3, block_s=1.0)
        rest = await pool.take("v1", 10, block_s=1.0)
        assert [t.entry.step for t in first] == [0, 1, 2]
        assert [t.entry.step for t in rest] == [3, 4]
        assert [t.entry_id for t in first + rest] == ids
        assert all(t.deliveries == 1 for t in first + rest)
        assert first[0].entry == draft("r", step=0)

    run(body())


def test_take_returns_empty_after_block(pool, run):
    async def body():
        t0 = time.monotonic()
        assert await pool.take("v1", 4, block_s=0.15) == []
        assert 0.1 <= time.monotonic() - t0 < 1.0
        assert await pool.take("v1", 4, block_s=0) == []

    run(body())


def test_take_wakes_up_on_submit(pool, run):
    async def body():
        async def later():
            await asyncio.sleep(0.1)
            await pool.submit(draft("r"))

        t0 = time.monotonic()
        got, _ = await asyncio.gather(pool.take("v1", 4, block_s=5.0), later())
        assert len(got) == 1 and time.monotonic() - t0 < 2.0

    run(body())


def test_two_consumers_never_get_the_same_entry(pool, run):
    async def body():
        for i in range(20):
            await pool.submit(draft("r", step=i))
        a, b = await asyncio.gather(*(pool.take(c, 7, block_s=0.2) for c in ("v1", "v2")))
        a += await pool.take("v1", 7, block_s=NOTHING_S)
        b += await pool.take("v2", 7, block_s=NOTHING_S)
        ids_a, ids_b = {t.entry_id for t in a}, {t.entry_id for t in b}
        assert not ids_a & ids_b and len(ids_a | ids_b) == 20 and len(a) + len(b) == 20

    run(body())


def test_complete_appends_tokens_and_publishes_to_its_router(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        await pool.submit(draft("r1", step=0, base_len=0, reply_to="router-a"))
        taken = await take_one(pool)
        assert await pool.complete(taken, result(taken, [4, 5], 6), [4, 5, 6]) is True
        assert (await pool.get_request("r1"))[1] == [4, 5, 6]
        assert await pool.results("router-b", NOTHING_S) == []
        assert await pool.results("router-a", 1.0) == [result(taken, [4, 5], 6)]
        assert await pool.results("router-a", NOTHING_S) == []  # read once

        await pool.submit(draft("r1", step=1, base_len=3))
        taken = await take_one(pool)
        assert await pool.complete(taken, result(taken, [], -7), [-7, 2**31 - 1])
        assert (await pool.get_request("r1"))[1] == [4, 5, 6, -7, 2**31 - 1]

    run(body())


def test_a_stale_complete_appends_nothing_and_tells_its_router(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        for _ in range(2):  # the same step submitted twice (e.g. a router retry)
            await pool.submit(draft("r1", step=0, base_len=0))
        first, dup = await pool.take("v1", 2, block_s=1.0)
        assert await pool.complete(first, result(first, [1], 2), [1, 2]) is True
        assert await pool.complete(dup, result(dup, [1], 2), [1, 2]) is False  # stale
        assert await pool.complete(first, result(first, [1], 2), [1, 2]) is False  # duplicate
        assert (await pool.get_request("r1"))[1] == [1, 2]
        applied, stale = await pool.results("router-a", 1.0)
        assert not applied.stale and list(applied.accepted) == [1]
        assert stale.stale and stale.step == 0 and stale.base_len == 0 and not stale.accepted
        assert await pool.results("router-a", NOTHING_S) == []  # a duplicate tells nobody
        assert await pool.pending() == 0

    run(body())


def test_a_draft_found_stale_before_verification_is_acknowledged_and_its_router_told(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        await pool.submit(draft("r1", step=3, base_len=7))
        taken = await take_one(pool)
        await pool.reply_stale(taken)
        (reply,) = await pool.results("router-a", 1.0)
        assert reply.stale and reply.request_id == "r1" and reply.step == 3 and reply.base_len == 7
        assert await pool.pending() == 0
        assert not await pool.has_entry(taken.entry_id)

    run(body())


def test_complete_for_a_deleted_request_is_dropped(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        await pool.submit(draft("r1"))
        taken = await take_one(pool)
        await pool.delete_request("r1")
        assert await pool.complete(taken, result(taken, [], 3), [3]) is False
        assert await pool.get_request("r1") is None
        assert await pool.results("router-a", NOTHING_S) == []
        assert await pool.pending() == 0

    run(body())


def test_claim_stale_redelivers_unacknowledged_entries(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        await pool.submit(draft("r1", step=0))
        await pool.submit(draft("r1", step=1, base_len=1))
        crashed = await take_one(pool, "v1")
        done = await take_one(pool, "v1")
        await pool.ack(done)
        assert await pool.claim_stale("v2", min_idle_s=0.15, count=10) == []  # not idle yet
        await asyncio.sleep(0.2)
        (claimed,) = await pool.claim_stale("v2", min_idle_s=0.15, count=10)
        assert claimed.entry_id == crashed.entry_id and claimed.entry == crashed.entry
        assert claimed.deliveries == 2
        await asyncio.sleep(0.2)
        (again,) = await pool.claim_stale("v3", min_idle_s=0.15, count=10)
        assert again.deliveries == 3
        assert await pool.complete(again, result(again, [], 8), [8])
        await asyncio.sleep(0.2)
        assert await pool.claim_stale("v2", min_idle_s=0.15, count=10) == []
        assert await pool.take("v2", 10, block_s=NOTHING_S) == []  # claimed != queued

    run(body())


def test_has_entry_until_the_draft_is_completed(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        entry_id = await pool.submit(draft("r1"))
        assert await pool.has_entry(entry_id)
        taken = await take_one(pool)
        assert await pool.has_entry(entry_id), "being verified"
        assert await pool.complete(taken, result(taken, [], 5), [5])
        assert not await pool.has_entry(entry_id)

    run(body())


def test_a_dead_lettered_entry_leaves_the_drafts_and_fails_its_step(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        await pool.submit(draft("r1", step=3, base_len=0))
        taken = await take_one(pool, "v1")
        await pool.dead_letter(taken, "delivered 6 times without being verified")
        assert await pool.pending() == 0
        assert await pool.claim_stale("v2", min_idle_s=0, count=10) == []
        ((entry, reason),) = await pool.dead_letters()
        assert entry == taken.entry and reason == "delivered 6 times without being verified"
        (failed,) = await pool.results("router-a", block_s=1.0)
        assert (failed.request_id, failed.step, failed.error) == \
            ("r1", 3, "delivered 6 times without being verified")
        assert (await pool.get_request("r1"))[1] == [], "nothing was applied"

    run(body())


def test_pending_counts_queued_and_unacknowledged(pool, run):
    async def body():
        assert await pool.pending() == 0
        await pool.put_request(state("r1"), TTL_S)
        for i in range(4):
            await pool.submit(draft("r1", step=i, base_len=i))
        assert await pool.pending() == 4
        t0, t1 = await pool.take("v1", 2, block_s=1.0)
        assert await pool.pending() == 4
        assert await pool.complete(t0, result(t0, [], 1), [1])
        assert await pool.pending() == 3
        await pool.ack(t1)
        assert await pool.pending() == 2
        await pool.take("v1", 2, block_s=1.0)
        assert await pool.pending() == 2

    run(body())


# ---------------------------------------------------------------------------------------------
# results


def test_results_per_router_in_order(pool, run):
    async def body():
        for rid in ("ra", "rb"):
            await pool.put_request(state(rid), TTL_S)
        for step in range(3):
            for rid, router in (("ra", "A"), ("rb", "B")):
                await pool.submit(draft(rid, step=step, base_len=step, reply_to=router))
            for taken in await pool.take("v1", 2, block_s=1.0):
                assert await pool.complete(taken, result(taken, [], step), [step])
        got_a = await pool.results("A", 1.0)
        got_b = await pool.results("B", 1.0)
        assert [(r.request_id, r.step) for r in got_a] == [("ra", 0), ("ra", 1), ("ra", 2)]
        assert [(r.request_id, r.step) for r in got_b] == [("rb", 0), ("rb", 1), ("rb", 2)]
        assert await pool.results("A", NOTHING_S) == []

    run(body())


def test_results_wakes_up_on_publish(pool, run):
    async def body():
        await pool.put_request(state("r1"), TTL_S)
        await pool.submit(draft("r1"))
        taken = await take_one(pool)

        async def later():
            await asyncio.sleep(0.1)
            await pool.complete(taken, result(taken, [], 1), [1])

        t0 = time.monotonic()
        got, _ = await asyncio.gather(pool.results("router-a", 5.0), later())
        assert len(got) == 1 and time.monotonic() - t0 < 2.0

    run(body())


# ---------------------------------------------------------------------------------------------
# release feed


def test_releases_broadcast_to_every_reader(pool, run):
    async def body():
        await pool.delete_request("before")  # released before anyone followed: never seen
        cursor_1, ids_1 = await pool.releases("", 0)
        cursor_2, ids_2 = await pool.releases("", NOTHING_S)
        assert ids_1 == ids_2 == []
        await pool.delete_request("r1")
        await pool.delete_request("r2")
        cursor_1, ids_1 = await pool.releases(cursor_1, 1.0)
        assert ids_1 == ["r1", "r2"]
        await pool.delete_request("r3")
        cursor_2, ids_2 = await pool.releases(cursor_2, 1.0)
        assert ids_2 == ["r1", "r2", "r3"]
        cursor_1, ids_1 = await pool.releases(cursor_1, 1.0)
        assert ids_1 == ["r3"]
        for cursor in (cursor_1, cursor_2):
            assert await pool.releases(cursor, NOTHING_S) == (cursor, [])

    run(body())


def test_releases_no_id_seen_twice(pool, run):
    async def body():
        cursor, _ = await pool.releases("", 0)
        seen: list[str] = []

        async def follow():
            nonlocal cursor
            while len(seen) < 10:
                cursor, ids = await pool.releases(cursor, 0.5)
                seen.extend(ids)

        async def release():
            for i in range(10):
                await pool.delete_request(f"r{i}")
                await asyncio.sleep(0.01 * (i % 3))

        await asyncio.wait_for(asyncio.gather(follow(), release()), 5.0)
        assert seen == [f"r{i}" for i in range(10)]
        assert (await pool.releases(cursor, NOTHING_S))[1] == []

    run(body())


# ---------------------------------------------------------------------------------------------


def test_connect(redis_url, run):
    assert isinstance(connect(None), MemoryPool)
    pool = connect(redis_url, prefix="x")
    assert isinstance(pool, RedisPool)
    run(pool.close())


def test_redis_key_layout_and_lost_groups(redis_url, run):
    """RedisPool specifics: the documented key layout, and groups recreated after Redis lost
    them (a restarted Redis keeps working, minus the in-flight drafts)."""
    import redis.asyncio

    async def body():
        pool, raw = RedisPool(redis_url, prefix="p"), redis.asyncio.Redis.from_url(redis_url)
        try:
            await pool.put_request(state("r1"), TTL_S)
            await pool.submit(draft("r1"))
            taken = await take_one(pool)
            assert await pool.complete(taken, result(taken, [], 1), [1, -2])
            assert await raw.get("p:tok:r1") == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
            assert 0 < await raw.pttl("p:req:r1") <= TTL_S * 1000
            assert await raw.xlen("p:results:router-a") == 1
            await raw.flushall()
            assert await pool.take("v1", 1, block_s=0) == []
            assert await pool.results("router-a", 0) == []
            await pool.submit(draft("r1"))
            assert len(await pool.take("v1", 1, block_s=1.0)) == 1
        finally:
            await pool.close()
            await raw.aclose()

    run(body())


def test_redis_entries_that_are_no_draft_are_dead_lettered_on_delivery(redis_url, run):
    """Bytes that do not parse, or no data field: written to the stream by something else than
    a router. No verifier could take them; they are dead-lettered with the reason at once."""
    pool = RedisPool(redis_url, prefix="test")

    async def body():
        raw = pool._redis
        await raw.xadd(pool._drafts, {"data": b"\xff\xff\xff not a protobuf"})
        await raw.xadd(pool._drafts, {"other": b"x"})
        await pool.submit(draft("r1"))
        (taken,) = await pool.take("v1", 10, block_s=1.0)
        assert taken.entry.request_id == "r1"
        reasons = [reason for _, reason in await pool.dead_letters()]
        assert len(reasons) == 2 and "undecodable" in reasons[0] and "without a data" in reasons[1]
        await pool.ack(taken)
        assert await pool.pending() == 0
        await pool.close()

    run(body())
