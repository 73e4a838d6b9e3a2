"""Datastore gRPC servicer: protobuf in, LookupEngine calls on the compute thread, protobuf out."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

from specmesh_services.common.rpc import rpc_errors
from specmesh_services.datastore.engine import LookupEngine, LookupRequest
from specmesh.v1 import datastore_pb2, datastore_pb2_grpc

SERVICE_NAME = "specmesh.v1.Datastore"
MAX_BATCH = 1024
MAX_NODES = 1024
MAX_DEPTH = 64


class DatastoreServicer(datastore_pb2_grpc.DatastoreServicer):
    def __init__(self, engine: LookupEngine, executor: Executor) -> None:
        self.engine = engine
        self.executor = executor

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @rpc_errors
    async def Info(self, request, context):
        return self.engine.info()

    @rpc_errors
    async def Lookup(self, request, context):
        if len(request.items) > MAX_BATCH:
            raise ValueError(f"a Lookup takes at most {MAX_BATCH} items, got {len(request.items)}")
        items = []
        for item in request.items:
            if not item.request_id:
                raise ValueError("every lookup item needs a request_id")
            if item.max_nodes > MAX_NODES or item.max_depth > MAX_DEPTH:
                raise ValueError(f"max_nodes must be <= {MAX_NODES} and max_depth <= {MAX_DEPTH}")
            items.append(LookupRequest(item.request_id, list(item.new_tokens), item.max_nodes,
                                       item.max_depth, item.reset))
        trees, seconds = await self._run(self._timed_lookup, items)
        return datastore_pb2.LookupBatchResponse(trees=[t.to_pb() for t in trees],
                                                 lookup_seconds=seconds)

    def _timed_lookup(self, items: list[LookupRequest]) -> tuple[list, float]:
        """The lookup and its own time (not the wait for the compute thread)."""
        start = time.perf_counter()
        trees = self.engine.lookup(items)
        return trees, time.perf_counter() - start

    @rpc_errors
    async def Release(self, request, context):
        released = await self._run(self.engine.release, list(request.request_ids))
        return datastore_pb2.DatastoreReleaseResponse(released=released)
