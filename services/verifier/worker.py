"""Verifier worker: the loop between the pool and the engine.

Pulls drafts (claiming ones a dead verifier left unacknowledged), makes sure the request's cache
is at the entry's base (re-prefilling from the pool's durable state if it is not: first sight,
eviction, or a crash elsewhere), verifies on the compute thread, and completes the entry in the
pool atomically. Follows the release feed to drop finished requests' caches.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import Executor

from opentelemetry.trace import Status, StatusCode

from services.common import telemetry
from services.common.config import VerifierSettings
from services.common.pool import Pool, Taken
from services.verifier.engine import VerifierEngine

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


class VerifierWorker:
    def __init__(self, engine: VerifierEngine, pool: Pool, executor: Executor,
                 settings: VerifierSettings) -> None:
        self.engine = engine
        self.pool = pool
        self.executor = executor
        self.settings = settings
        self.name = engine.name
        self.steps = 0
        self.prefills = 0
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._verify_loop(), name=f"{self.name}-verify"),
                       asyncio.create_task(self._release_loop(), name=f"{self.name}-release")]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # loops ------------------------------------------------------------------------------------
    async def _verify_loop(self) -> None:
        next_claim = 0.0
        while True:
            try:
                batch: list[Taken] = []
                if time.monotonic() >= next_claim:
                    batch = await self.pool.claim_stale(self.name, self.settings.claim_idle_s,
                                                        self.settings.batch_size)
                    next_claim = time.monotonic() + self.settings.claim_idle_s / 2
                if not batch:
                    batch = await self.pool.take(self.name, self.settings.batch_size, block_s=1.0)
                for taken in batch:
                    await self.process(taken)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep serving; the entry is re-claimed later
                log.exception("verifier step failed")
                await asyncio.sleep(0.5)

    async def _release_loop(self) -> None:
        cursor = ""
        while True:
            try:
                cursor, ids = await self.pool.releases(cursor, block_s=1.0)
                for request_id in ids:
                    self.engine.release(request_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001
                log.exception("release feed failed")
                await asyncio.sleep(0.5)

    # one entry --------------------------------------------------------------------------------
    async def process(self, taken: Taken) -> None:
        entry = taken.entry
        parent = telemetry.extract(entry.trace_context)
        with tracer.start_as_current_span("verifier.verify", context=parent) as span:
            span.set_attributes({"specmesh.request_id": entry.request_id,
                                 "specmesh.step": entry.step, "specmesh.tree_size":
                                 len(entry.tree.tokens), "specmesh.deliveries": taken.deliveries})
            if not self.engine.ready_for(entry.request_id, entry.base_len):
                if not await self._load(taken):
                    span.set_attribute("specmesh.dropped", True)
                    return
            result, tokens = await self._run(self.engine.verify_entry, entry)
            if result.error:
                span.set_status(Status(StatusCode.ERROR, result.error))
            span.set_attribute("specmesh.accepted", len(result.accepted))
            result.trace_context.update(telemetry.inject())
            if await self.pool.complete(taken, result, tokens):
                self.steps += 1
            else:  # someone else applied this step: our cache may be ahead of the pool's state
                self.engine.release(entry.request_id)

    async def _load(self, taken: Taken) -> bool:
        """Brings the request's cache to the entry's base from the pool; False drops the entry."""
        entry = taken.entry
        found = await self.pool.get_request(entry.request_id)
        if found is None or len(found[1]) != entry.base_len:
            log.info("dropping stale draft %s step %d of %s", taken.entry_id, entry.step,
                     entry.request_id)
            await self.pool.ack(taken)
            return False
        state, generated = found
        await self._run(self.engine.load, state, generated)
        self.prefills += 1
        return True


def default_name() -> str:
    return f"verifier-{os.uname().nodename}-{os.getpid()}"
