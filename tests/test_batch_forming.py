"""The verifier worker's batch forming (worker.py `_fill`): with fewer trees in hand than
requests it serves, it waits (bounded) for the others' trees; alone it never waits. Real
in-memory pool; the engine is not involved."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from specmesh_services.common.config import VerifierSettings
from specmesh_services.common.pool.memory import MemoryPool
from specmesh_services.verifier.cost import VerifyCostModel
from specmesh_services.verifier.worker import VerifierWorker
from specmesh.v1 import pool_pb2


def worker(pool: MemoryPool, **settings) -> VerifierWorker:
    engine = SimpleNamespace(name="verifier-test")
    return VerifierWorker(engine, pool, executor=None, settings=VerifierSettings(**settings))


async def submit(pool: MemoryPool, request_id: str, delay: float = 0.0) -> None:
    await asyncio.sleep(delay)
    await pool.submit(pool_pb2.DraftEntry(request_id=request_id, step=1, reply_to="r"))


def test_waits_for_the_trees_of_the_requests_it_serves():
    async def run():
        pool = MemoryPool()
        w = worker(pool, batch_size=8, batch_wait_s=1.0)
        now = time.monotonic()
        w._serving.update({"a": now, "b": now, "c": now})
        await submit(pool, "a")
        batch = await pool.take(w.name, 8, 0.1)
        late = [asyncio.create_task(submit(pool, rid, 0.05)) for rid in ("b", "c")]
        start = time.perf_counter()
        batch = await w._fill(batch)
        waited = time.perf_counter() - start
        await asyncio.gather(*late)
        return batch, waited, w.batch_waits
    batch, waited, waits = asyncio.run(run())
    assert sorted(t.entry.request_id for t in batch) == ["a", "b", "c"]
    assert waited < 0.5, "returns as soon as every served request's tree is in"
    assert waits == 1


def test_the_wait_is_bounded_and_a_lone_request_never_waits():
    async def run():
        pool = MemoryPool()
        w = worker(pool, batch_size=8, batch_wait_s=0.05)
        await submit(pool, "a")
        start = time.perf_counter()
        alone = await w._fill(await pool.take(w.name, 8, 0.1))
        alone_s = time.perf_counter() - start
        w._serving.update({"a": time.monotonic(), "gone": time.monotonic()})
        await submit(pool, "a")
        start = time.perf_counter()
        bounded = await w._fill(await pool.take(w.name, 8, 0.1))
        bounded_s = time.perf_counter() - start
        never = worker(pool, batch_size=8, batch_wait_s=0)
        never._serving.update(w._serving)
        await submit(pool, "a")
        start = time.perf_counter()
        await never._fill(await pool.take(never.name, 8, 0.1))
        return alone, alone_s, bounded, bounded_s, time.perf_counter() - start
    alone, alone_s, bounded, bounded_s, never_s = asyncio.run(run())
    assert len(alone) == 1 and alone_s < 0.02
    assert len(bounded) == 1 and 0.04 < bounded_s < 0.5, "waited batch_wait_s for 'gone'"
    assert never_s < 0.02


def test_measured_policy_waits_only_for_trees_due_within_a_steps_fixed_cost():
    """Default policy: a missing tree is waited for when it is expected (last result + measured
    turnaround) within the step's fixed cost, the verify-cost model's intercept (0.2 s here)."""
    cost = VerifyCostModel()
    for rows in range(1, 11):
        cost.observe(rows, 100 * rows, 1, 0.2 + 0.01 * rows)

    async def run(turnaround: float) -> tuple[int, float]:
        pool = MemoryPool()
        w = VerifierWorker(SimpleNamespace(name="verifier-test", cost=cost), pool,
                           executor=None, settings=VerifierSettings(batch_size=8))
        now = time.monotonic()
        w._serving.update({"a": now, "b": now})
        w._turnaround_s = turnaround
        await submit(pool, "a")
        batch = await pool.take(w.name, 8, 0.1)
        late = asyncio.create_task(submit(pool, "b", 0.05))
        start = time.perf_counter()
        batch = await w._fill(batch)
        waited = time.perf_counter() - start
        await late
        return len(batch), waited

    joined, waited = asyncio.run(run(turnaround=0.05))
    assert joined == 2 and waited < 0.2, "due within the fixed cost: waited for it"
    alone, waited = asyncio.run(run(turnaround=1.0))
    assert alone == 1 and waited < 0.04, "due after the fixed cost: stepped at once"


def test_an_entry_that_fails_every_verifier_is_dead_lettered():
    """A tree whose step raises every time (the loop logs it, the entry stays unacknowledged
    and is re-claimed) goes to the dead-letter stream after max_deliveries; its router gets the
    reason as an error result, and the worker serves on."""
    class Crashing:
        name = "verifier-test"
        steps = 0

        def step_entries(self, entries):
            raise RuntimeError("poison")

    async def run():
        pool = MemoryPool()
        w = VerifierWorker(Crashing(), pool, executor=None,
                           settings=VerifierSettings(claim_idle_s=0.05, max_deliveries=3,
                                                     batch_wait_s=0))
        w._run = lambda fn, *args: asyncio.sleep(0, fn(*args))  # no executor: run inline
        await pool.put_request(pool_pb2.RequestState(request_id="a", prompt_ids=[1]), 60)
        await pool.submit(pool_pb2.DraftEntry(request_id="a", step=1, reply_to="r"))
        w.start()
        try:
            results = await pool.results("r", block_s=10.0)
        finally:
            await w.stop()
        return results, await pool.dead_letters(), await pool.pending(), w
    results, dead, pending, w = asyncio.run(run())
    (failed,) = results
    assert "delivered 4 times without being verified" in failed.error
    assert [reason for _, reason in dead] == [failed.error] and pending == 0
    assert w.metrics.dead_lettered._value.get() == 1


def test_results_carry_the_row_cost_and_the_round_trip_routers_price_trees_with():
    """Every verified result says what a row adds to a pass (the cost fit's per-row term) and
    the measured round trip; before a fit, 0 (the routers then time passes themselves)."""
    cost = VerifyCostModel()
    for rows in range(1, 11):
        for context in (100, 900):
            cost.observe(rows, context, 1, 0.2 + 0.01 * rows + 1e-4 * context)
    w = VerifierWorker(SimpleNamespace(name="verifier-test", cost=cost), MemoryPool(),
                       executor=None, settings=VerifierSettings(batch_size=8))
    w._turnaround_s = 0.012
    done = [(pool_pb2.VerifyResult(), []), None, (pool_pb2.VerifyResult(error="bad tree"), [])]
    w._costs(done)
    assert done[0][0].row_seconds == pytest.approx(0.01, rel=1e-3)
    assert done[0][0].turnaround_seconds == pytest.approx(0.012)
    assert done[2][0].row_seconds == 0 and done[2][0].turnaround_seconds == 0
    fresh = VerifierWorker(SimpleNamespace(name="v", cost=VerifyCostModel()), MemoryPool(),
                           executor=None, settings=VerifierSettings(batch_size=8))
    done = [(pool_pb2.VerifyResult(), [])]
    fresh._costs(done)
    assert done[0][0].row_seconds == 0 and done[0][0].turnaround_seconds == 0
