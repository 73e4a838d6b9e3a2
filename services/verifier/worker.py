"""Verifier worker: the loop between the pool and the engine, with continuous batching.

Each step pulls up to `batch_size` drafts (claiming ones a dead verifier left unacknowledged),
registers requests it has not seen from the pool's durable state (the engine prefills them
inside the step), verifies them in one batched forward on the compute thread, and completes
each entry in the pool atomically. Entries the engine defers (token or KV budget) wait in a
local backlog for the next step, never dropped. It follows the release feed to drop finished
requests' caches. A step waits for a missing tree only when it is due within the step's fixed
cost (`batch_wait_s` fixes the wait; docs/decisions/verifier-batch-forming.md).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specmesh_services.common import tasks, telemetry
from specmesh_services.common.config import VerifierSettings
from specmesh_services.common.pool import Pool, Taken
from specmesh_services.verifier.engine import VerifierEngine
from specmesh_services.common.metrics import VerifierMetrics

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)
# the batch wait reads the verify-cost fit every step; refitting it once per this many steps
# keeps the solve off the step-to-step path (the fit moves little between steps)
REFIT_STEPS = 16


class VerifierWorker:
    def __init__(self, engine: VerifierEngine, pool: Pool, executor: Executor,
                 settings: VerifierSettings, metrics: VerifierMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or VerifierMetrics()
        self.pool = pool
        self.executor = executor
        self.settings = settings
        self.name = engine.name
        self.steps = 0
        self.prefills = 0
        self._tasks: list[asyncio.Task] = []
        self._draining = False  # SIGTERM: finish the step in progress, take no more
        self._serving: dict[str, float] = {}  # request -> when its last result went out
        self._step_s = 0.0  # EMA of step seconds (batch waiting's default)
        self.batch_waits = 0
        self._waited_s = 0.0  # the last `_fill`'s wait for more trees
        self._turnaround: dict[str, float] = {}  # request -> EMA of result out to next tree in
        self._turnaround_s = 0.0  # EMA over all requests (for requests not measured yet)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._verify_loop(), name=f"{self.name}-verify"),
                       asyncio.create_task(self._release_loop(), name=f"{self.name}-release")]

    async def stop(self) -> None:
        await tasks.stop(self._tasks)

    async def drain(self, timeout_s: float) -> None:
        """Takes no new entries, finishes the step in progress (its results published and
        acknowledged) within `timeout_s`, then stops. Entries it holds unverified stay
        unacknowledged in the pool, where another verifier claims them (`claim_idle_s`)."""
        self._draining = True
        if self._tasks:
            await asyncio.wait(self._tasks[:1], timeout=timeout_s)
        await self.stop()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # loops ------------------------------------------------------------------------------------
    async def _verify_loop(self) -> None:
        next_claim = 0.0
        backlog: list[Taken] = []
        wait = 1.0
        while not self._draining:
            try:
                # always look for new drafts, even with a backlog: deferred entries may be
                # waiting for KV that only the requests behind them in the pool will free
                count = self.settings.batch_size
                fresh: list[Taken] = []
                if time.monotonic() >= next_claim:
                    fresh = await self.pool.claim_stale(self.name, self.settings.claim_idle_s,
                                                        count)
                    self.metrics.reclaimed.inc(len(fresh))
                    fresh = await self._give_up_on_poison(fresh)
                    next_claim = time.monotonic() + self.settings.claim_idle_s / 2
                if not fresh:
                    fresh = await self.pool.take(self.name, count, block_s=wait)
                self._arrived(fresh)
                batch = await self._fill(backlog + fresh)
                started = time.perf_counter()
                backlog = await self.step(batch)
                if batch:
                    seconds = time.perf_counter() - started
                    self._step_s = seconds if not self._step_s else \
                        0.9 * self._step_s + 0.1 * seconds
                # nothing could run (all deferred): wait a little for drafts instead of spinning
                wait = 1.0 if not backlog else (0.05 if len(backlog) == len(batch) else 0.0)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep serving; the entries are re-claimed later
                log.exception("verifier step failed")
                backlog = []
                await asyncio.sleep(0.5)

    async def _give_up_on_poison(self, taken: list[Taken]) -> list[Taken]:
        """Dead-letters the entries delivered more than `max_deliveries` times (a tree that
        crashes or fails every verifier would otherwise come back forever); returns the rest."""
        limit = self.settings.max_deliveries
        for t in (t for t in taken if t.deliveries > limit):
            reason = (f"delivered {t.deliveries} times without being verified: every verifier "
                      f"that took it died or failed on it")
            log.warning("dead-lettering step %d of request %s: %s", t.entry.step,
                        t.entry.request_id, reason)
            await self.pool.dead_letter(t, reason)
            self.metrics.dead_lettered.inc()
        return [t for t in taken if t.deliveries <= limit]

    def _arrived(self, taken: list[Taken]) -> None:
        """Measures the turnaround of requests whose next tree just came in."""
        now = time.monotonic()
        for t in taken:
            served = self._serving.get(t.entry.request_id)
            if served is None:
                continue
            seconds = now - served
            old = self._turnaround.get(t.entry.request_id)
            self._turnaround[t.entry.request_id] = seconds if old is None else \
                0.7 * old + 0.3 * seconds
            self._turnaround_s = seconds if not self._turnaround_s else \
                0.9 * self._turnaround_s + 0.1 * seconds

    def _wait_s(self, batch: list[Taken]) -> float:
        """How long to wait for the missing trees (module docstring)."""
        wait = self.settings.batch_wait_s
        if wait is not None:
            return wait
        cost = getattr(self.engine, "cost", None)
        fit = cost.fit(stale=REFIT_STEPS) if cost is not None else None
        if fit is None or not self._turnaround_s:
            return 0.5 * self._step_s  # not measured yet
        held = {t.entry.request_id for t in batch}
        now = time.monotonic()
        saving = max(fit.intercept_s, 0.0)
        due = [served + self._turnaround.get(rid, self._turnaround_s) - now
               for rid, served in self._serving.items() if rid not in held]
        spread = 0.25 * self._turnaround_s  # turnarounds vary: a little late is still due
        worth = [d for d in due if -self._turnaround_s <= d <= saving]
        return min(max(max(worth), 0.0) + spread, saving) if worth else 0.0

    def _expected(self, batch: list[Taken]) -> int:
        """Trees a full batch would hold now: the ones in hand plus one per other request
        served recently (results returned within the last 20 steps' time)."""
        now = time.monotonic()
        horizon = max(20 * self._step_s, 1.0)
        for rid in [r for r, t in self._serving.items() if now - t > horizon]:
            del self._serving[rid]  # went quiet (another verifier took it, or it hangs)
            self._turnaround.pop(rid, None)
        held = {t.entry.request_id for t in batch}
        return len(held) + sum(1 for r in self._serving if r not in held)

    async def _fill(self, batch: list[Taken]) -> list[Taken]:
        """Waits (up to `_wait_s`) for the trees of the requests being served to join."""
        self._waited_s = 0.0
        if not batch:
            return batch
        start = time.monotonic()
        deadline = start + self._wait_s(batch)
        waited = False
        while True:
            want = min(self._expected(batch), self.settings.batch_size) - len(batch)
            left = deadline - time.monotonic()
            if want <= 0 or left <= 0:
                break
            waited = True
            more = await self.pool.take(self.name, want, block_s=left)
            if not more:
                break
            self._arrived(more)
            batch = batch + more
        self.batch_waits += waited
        self._waited_s = time.monotonic() - start if waited else 0.0
        return batch

    async def _release_loop(self) -> None:
        cursor = ""
        while True:
            try:
                cursor, ids = await self.pool.releases(cursor, block_s=1.0)
                self.metrics.pool_pending.set(await self.pool.pending())
                for request_id in ids:  # on the compute thread: never under a running step
                    self._serving.pop(request_id, None)
                    self._turnaround.pop(request_id, None)
                    await self._run(self.engine.release, request_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("release feed failed")
                await asyncio.sleep(0.5)

    # one step ---------------------------------------------------------------------------------
    async def step(self, batch: list[Taken]) -> list[Taken]:
        """Verifies `batch` in one engine step; returns the entries deferred to the next one."""
        ready = [t for t in batch if await self._ensure_loaded(t)]
        if not ready:
            return []
        spans = [self._span(t, len(ready)) for t in ready]
        steps = self.engine.steps
        try:
            done = await self._run(self.engine.step_entries, [t.entry for t in ready])
        except BaseException as err:
            for span in spans:
                span.record_exception(err)
                span.end()
            raise
        if self.engine.steps > steps:  # it ran a forward pass: where the step's time went
            timing = self._step_timing()
            for span in spans:
                span.set_attributes(timing)
        self._observe(done)
        self._costs(done)
        deferred, completions = [], []
        for taken, span, out in zip(ready, spans, done):
            if out is None:
                span.set_attribute("specmesh.deferred", True)
                span.end()
                deferred.append(taken)
            else:
                completions.append(self._complete(taken, span, *out))
        await asyncio.gather(*completions)
        return deferred

    def _observe(self, done) -> None:
        stats = self.engine.last_step
        if stats is None:
            return
        results = [out[0] for out in done if out is not None and not out[0].error]
        self.metrics.observe_step(self.engine, stats, sum(r.tree_size for r in results),
                                  sum(len(r.accepted) for r in results))

    def _costs(self, done) -> None:
        """What the routers' batched tree-size choice prices a tree with: the seconds a row adds
        to a pass (the verify-cost fit's per-row term) and the round trip a plain run saves."""
        cost = getattr(self.engine, "cost", None)
        fit = cost.fit(stale=REFIT_STEPS) if cost is not None else None
        row = max(fit.per_row_s, 0.0) if fit is not None else 0.0
        for out in done:
            if out is not None and not out[0].error:
                out[0].row_seconds = row
                out[0].turnaround_seconds = self._turnaround_s

    def _step_timing(self) -> dict:
        """The engine step's index and time split, shared by all its entries' spans."""
        stats = self.engine.last_step
        return {"specmesh.verifier_step": self.engine.steps,
                "specmesh.step_rows": stats.rows,
                "specmesh.forward_seconds": stats.forward_seconds,
                "specmesh.walk_seconds": stats.walk_seconds,
                "specmesh.step_bucket": stats.bucket,
                "specmesh.step_kv_chunks": stats.chunks,
                "specmesh.batch_wait_seconds": self._waited_s}

    def _span(self, taken: Taken, batch_size: int):
        entry = taken.entry
        span = tracer.start_span("verifier.verify", context=telemetry.extract(entry.trace_context))
        span.set_attributes({"specmesh.request_id": entry.request_id, "specmesh.step": entry.step,
                             "specmesh.tree_size": len(entry.tree.tokens),
                             "specmesh.sources": list(entry.tree.source_names),
                             "specmesh.deliveries": taken.deliveries,
                             "specmesh.batch_size": batch_size})
        return span

    async def _complete(self, taken: Taken, span, result, tokens: list[int]) -> None:
        entry = taken.entry
        try:
            if result.error:
                span.set_status(Status(StatusCode.ERROR, result.error))
            span.set_attribute("specmesh.accepted", len(result.accepted))
            with trace.use_span(span, end_on_exit=False):
                result.trace_context.update(telemetry.inject())
            if await self.pool.complete(taken, result, tokens):
                self.steps += 1
                if not result.error:
                    self._serving[entry.request_id] = time.monotonic()
            else:  # someone else applied this step: our state may be ahead of the pool's
                await self._run(self.engine.release, entry.request_id)
        finally:
            span.end()

    async def _ensure_loaded(self, taken: Taken) -> bool:
        """Registers the request at the entry's base from the pool if the engine is not there;
        False drops a stale entry (its router is told) or one of a request that ended."""
        entry = taken.entry
        if self.engine.ready_for(entry.request_id, entry.base_len):
            return True
        found = await self.pool.get_request(entry.request_id)
        if found is None:  # the request ended or expired: nobody waits for this step
            await self.pool.ack(taken)
            return False
        if len(found[1]) != entry.base_len:  # its router re-reads the request's tokens
            log.info("stale draft %s: step %d of %s at %d tokens, the pool holds %d",
                     taken.entry_id, entry.step, entry.request_id, entry.base_len,
                     len(found[1]))
            await self.pool.reply_stale(taken)
            return False
        state, generated = found
        await self._run(self.engine.load, state, generated)
        self.prefills += 1
        return True


def default_name() -> str:
    return f"verifier-{os.uname().nodename}-{os.getpid()}"
