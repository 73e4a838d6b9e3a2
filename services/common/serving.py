"""Running one service as a process: logging, tracing, the compute executor, graceful shutdown."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from specmesh_services.common import cores, metrics, rpc, telemetry
from specmesh_services.common.config import Settings

log = logging.getLogger(__name__)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@contextlib.contextmanager
def frozen_heap():
    """What startup allocated (the models' Python objects, tokenizer tables) kept out of the
    collector's full passes while serving: unfrozen, each one scanned it all and stalled the
    event loop, and with it every request, for ~250 ms (docs/decisions/frozen-heap.md)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def compute_executor(settings: Settings | None = None, role: str = "") -> ThreadPoolExecutor:
    """One thread runs all model work of a process: torch already uses every core per op, and
    per-request caches need no locking when a single thread touches them. Given settings whose
    `cores` split them, the thread is pinned to the role's cores."""
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"compute-{role}".rstrip("-"))
    if settings is not None:
        placement = cores.plan(settings.cores, settings.drafter_cores)
        if placement.split:
            cores.pin_executor(executor, placement.cpus(role), placement.threads(role))
    return executor


def compute_service(role: str, load: Callable[[Settings], object],
                    make_servicer: Callable[[object, ThreadPoolExecutor], object],
                    add_to_server: Callable, service_name: str):
    """(start, main) of a service whose state (models, a datastore) is loaded by `load` on the
    compute thread and served by one servicer that runs its work on that same thread."""
    async def start(settings: Settings):
        executor = compute_executor(settings, role)
        state = await asyncio.get_running_loop().run_in_executor(executor, load, settings)
        server, port = await rpc.start_server(
            [(add_to_server, make_servicer(state, executor), service_name)],
            settings.host, settings.port, settings.tls)

        async def cleanup() -> None:
            executor.shutdown(wait=False, cancel_futures=True)
        return server, port, cleanup

    def main(settings: Settings) -> None:
        run_service(role, settings, start)
    return start, main


async def wait_for_signal() -> None:
    """Returns on SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def run_service(role: str, settings: Settings,
                start: Callable[[Settings], Awaitable[tuple[grpc.aio.Server, int, Callable]]]) -> None:
    """Runs a service until SIGTERM/SIGINT. `start` returns (server, port, cleanup coroutine fn).
    Prints "<role> listening on host:port" once serving (what `specmesh up` waits for)."""
    setup_logging(settings.log_level)
    telemetry.setup(f"specmesh-{role}", settings.telemetry)

    async def main() -> None:
        server, port, cleanup = await start(settings)
        print(f"{role} listening on {settings.host}:{port}", flush=True)
        if settings.metrics_port is not None:
            bound = metrics.serve(metrics.process_registry(), settings.host, settings.metrics_port)
            print(f"{role} metrics on http://{settings.host}:{bound}/metrics", flush=True)
        try:
            with frozen_heap():
                await wait_for_signal()
        finally:
            # drain: no new work (NOT_SERVING, no new calls), what is in flight finishes within
            # drain_s (the cleanup drains what the process does outside calls), then exit
            began = time.monotonic()
            log.info("%s draining (at most %.0f s)", role, settings.drain_s)
            await rpc.not_serving(server)
            await server.stop(grace=settings.drain_s)
            await cleanup()
            log.info("%s drained in %.1f s", role, time.monotonic() - began)
            telemetry.shutdown()

    asyncio.run(main())
