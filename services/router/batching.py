"""Micro-batching of draft work (Minions 3.4, SPIN V.B): the single-request Draft / Lookup calls
that the router's request loops make at the same moment are coalesced into one batched call.

Request loops become ready together: one verifier step answers a whole batch of requests, the
router's dispatcher resolves their futures in one go, and each loop then asks for its next
tree. A batcher holds the items submitted during one turn of the event loop, then sends them
as one request; each caller gets its own tree back, or the call's exception (every caller then
handles it as it handles a failed single call).
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from specmesh_services.router.pipeline import split


class MicroBatcher:
    def __init__(self, call: Callable[[Any, float], Awaitable[Any]],
                 make_request: Callable[[Sequence[Any]], Any], max_items: int = 64,
                 seconds: Callable[[Any, int], Sequence[float]] | None = None,
                 parts: Callable[[int], int] | None = None) -> None:
        """`call(request, timeout)` sends one batched request built by `make_request(items)`;
        its response's `trees` answer the items in order. `seconds(response, n)`: the service
        time of each of the n items (`submit_timed`); default none known (0). `parts(n)`: the
        micro-batches n items ready together go out in (SPIN V.B, `pipeline.micro_batches`),
        sent as that many calls in order; default one."""
        if max_items < 1:
            raise ValueError("need max_items >= 1")
        self._call, self._make = call, make_request
        self._parts = parts or (lambda n: 1)
        self._seconds = seconds or (lambda response, n: [0.0] * n)
        self.max_items = max_items
        self._queue: list[tuple[Any, asyncio.Future]] = []
        self._timer: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task] = set()

    async def submit_timed(self, item: Any, timeout: float, alone: bool = False
                           ) -> tuple[Any, float]:
        """The item's tree and the service's seconds for it (its share of the batched call).
        `alone`: the caller knows nobody else will submit this turn (one request in flight):
        the call goes out at once, from the caller's task."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if alone and not self._queue:
            await self._send([(item, future)], timeout)
            return future.result()
        self._queue.append((item, future))
        if len(self._queue) >= self.max_items:
            self._flush(timeout)
        elif self._timer is None:
            self._timer = loop.call_soon(self._flush, timeout)
        return await future

    def _flush(self, timeout: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._queue = self._queue, []
        batch = [(item, fut) for item, fut in batch if not fut.cancelled()]
        for part in split(batch, self._parts(len(batch))) if batch else ():
            task = asyncio.get_running_loop().create_task(self._send(part, timeout))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, batch: list[tuple[Any, asyncio.Future]], timeout: float) -> None:
        try:
            response = await self._call(self._make([item for item, _ in batch]), timeout)
            trees = list(response.trees)
            if len(trees) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} got {len(trees)} trees back")
            seconds = list(self._seconds(response, len(batch)))
            if len(seconds) != len(batch):
                seconds = [0.0] * len(batch)
        except BaseException as err:  # noqa: BLE001 - every caller gets the call's failure
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(err)
            if isinstance(err, asyncio.CancelledError):
                raise
            return
        for (_, fut), tree, secs in zip(batch, trees, seconds):
            if not fut.done():
                fut.set_result((tree, secs))
