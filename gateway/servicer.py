"""Gateway gRPC servicer: validate + tokenize, relay to the router, assemble or stream."""
from __future__ import annotations

import uuid

from opentelemetry import trace

from specmesh_gateway.requests import ServedModel, to_route_request
from specmesh_services.common.rpc import rpc_errors
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc, router_pb2

SERVICE_NAME = "specmesh.v1.Gateway"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, router, model: ServedModel) -> None:
        self.router = router  # RouterStub or LocalStub
        self.model = model

    def route(self, request: gateway_pb2.GenerateRequest) -> tuple[str, router_pb2.RouteRequest]:
        """A new request id and the validated, tokenized router request (ValueError if bad);
        the HTTP API goes through here too."""
        request_id = uuid.uuid4().hex
        trace.get_current_span().set_attribute("specmesh.request_id", request_id)
        return request_id, to_route_request(request, self.model, request_id)

    @rpc_errors
    async def Generate(self, request, context):
        request_id, route = self.route(request)
        response = gateway_pb2.GenerateResponse(model=self.model.name, request_id=request_id)
        texts = []
        async for chunk in self.router.Generate(route, timeout=context.time_remaining()):
            texts.append(chunk.text)
            response.token_ids.extend(chunk.token_ids)
            response.finish_reason = chunk.finish_reason
            response.stats.CopyFrom(chunk.stats)
        response.text = "".join(texts)
        return response

    @rpc_errors
    async def GenerateStream(self, request, context):
        request_id, route = self.route(request)
        async for chunk in self.router.Generate(route, timeout=context.time_remaining()):
            yield gateway_pb2.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids,
                                            finish_reason=chunk.finish_reason, stats=chunk.stats,
                                            request_id=request_id)

    @rpc_errors
    async def ListModels(self, request, context):
        return gateway_pb2.ListModelsResponse(models=[self.model.info()],
                                              default_model=self.model.name)
