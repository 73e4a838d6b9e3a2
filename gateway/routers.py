"""The gateway's routers: new requests go round-robin over the router replicas; a stream whose
router dies (or hands it back while stopping) goes on on the next one, from the request's state
in the pool (`RouteRequest.resume`: the tokens and text the client already received), so the
client sees one stream, no token repeated or skipped."""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from specmesh.v1 import router_pb2

log = logging.getLogger(__name__)

# what a router's death or shutdown looks like from here; any other error is the request's
FAILOVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Routers:
    """Router stubs (RouterStub or LocalStub) behind one `Generate`."""

    def __init__(self, stubs: Sequence, resume_s: float = 30.0) -> None:
        if not stubs:
            raise ValueError("the gateway needs at least one router")
        self.stubs = list(stubs)
        self.resume_s = resume_s
        self._turn = itertools.count()

    def Generate(self, route: router_pb2.RouteRequest, timeout: float | None = None  # noqa: N802 - the stub's name
                 ) -> AsyncIterator[router_pb2.RouteChunk]:
        """`timeout`: the client's deadline, passed on (a router queues a request at most
        that long for a slot)."""
        return self._generate(route, None if timeout is None else time.monotonic() + timeout)

    async def _generate(self, route: router_pb2.RouteRequest, client_deadline: float | None
                        ) -> AsyncIterator[router_pb2.RouteChunk]:
        at, tries, full = next(self._turn), 0, 0
        sent = router_pb2.Resume()
        request, deadline, delay = route, None, 0.05
        while True:
            stub = self.stubs[at % len(self.stubs)]
            left = None if client_deadline is None else max(client_deadline - time.monotonic(),
                                                            0.0)
            try:
                async for chunk in stub.Generate(request, timeout=left):
                    sent.tokens += len(chunk.token_ids)
                    sent.text_chars += len(chunk.text)
                    deadline, delay = None, 0.05  # progress: a later failure gets its own time
                    yield chunk
                return
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.NOT_FOUND and request.HasField("resume") \
                        and not sent.tokens:
                    request = route  # the dead router never put it in the pool: start it here
                    continue
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not request.HasField("resume") \
                        and full + 1 < len(self.stubs):
                    at, full = at + 1, full + 1  # at capacity: the next router may have room
                    continue
                if code not in FAILOVER:
                    raise
                request = router_pb2.RouteRequest()
                request.CopyFrom(route)
                request.resume.CopyFrom(sent)
                now = time.monotonic()
                deadline = deadline or now + self.resume_s
                if now >= deadline:
                    raise
                at, tries = at + 1, tries + 1
                log.warning("router failed on %s (%s: %s): going on after %d tokens on the "
                            "next", route.request_id, code.name, err.details(), sent.tokens)
                if tries % len(self.stubs) == 0:  # every router tried once more: wait a little
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
