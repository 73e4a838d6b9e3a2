"""Admission: a router generates at most `router.max_requests` requests at once. One more waits
(first come, first served) for a slot until its deadline (the client's, else
`router.admission_wait_s`); while `router.max_waiting` already wait, a new request is refused
at once with RESOURCE_EXHAUSTED (HTTP 429): the queue is bounded, and a client learns it should
back off instead of waiting behind an unbounded backlog. A resumed request (its router died)
was admitted before and is taken at once."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from specmesh_services.common.rpc import Overloaded


class Admission:
    def __init__(self, max_requests: int, max_waiting: int, wait_s: float) -> None:
        self.max_requests = max_requests
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self._slots = asyncio.Semaphore(max_requests)  # FIFO: waiters wake in arrival order
        self.waiting = 0  # requests waiting for a slot
        self.refused = 0  # requests refused (queue full, or no slot within their wait)

    @contextlib.asynccontextmanager
    async def slot(self, deadline_s: float | None = None, resumed: bool = False
                   ) -> AsyncIterator[None]:
        """Holds a slot while the request generates; `deadline_s`: seconds its client waits."""
        if resumed:
            yield
            return
        if not self._slots.locked():
            await self._slots.acquire()  # a free slot: taken at once
        elif self.waiting >= self.max_waiting:
            self.refused += 1
            raise Overloaded(f"the router is at capacity ({self.max_requests} requests "
                             f"generating, {self.waiting} waiting): retry later")
        else:
            wait = self.wait_s if deadline_s is None else min(self.wait_s, max(deadline_s, 0.0))
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), wait)
            except asyncio.TimeoutError:
                self.refused += 1
                raise Overloaded(f"no slot freed within {wait:.0f} s ({self.max_requests} "
                                 f"requests generating): retry later") from None
            finally:
                self.waiting -= 1
        try:
            yield
        finally:
            self._slots.release()
