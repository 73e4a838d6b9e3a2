"""Router gRPC servicer: a thin stream over Router.generate."""
from __future__ import annotations

from specmesh_services.common.rpc import rpc_errors
from specmesh_services.router.engine import Router
from specmesh.v1 import router_pb2_grpc

SERVICE_NAME = "specmesh.v1.Router"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    @rpc_errors
    async def Generate(self, request, context):
        async for chunk in self.router.generate(request, context.time_remaining()):
            yield chunk
