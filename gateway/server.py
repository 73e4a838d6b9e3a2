"""Gateway process: `specmesh serve gateway`: the gRPC API on `port`, the OpenAI-compatible HTTP
API on `gateway.http_port`, both over one GatewayServicer."""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh_gateway import http
from specmesh_gateway.requests import ServedModel
from specmesh_gateway.routers import Routers
from specmesh_gateway.servicer import SERVICE_NAME, GatewayServicer
from specmesh_services.common import metrics, models, security, serving
from specmesh_services.common.config import Settings
from specmesh_services.common.rpc import channels, start_server
from specmesh.v1 import gateway_pb2_grpc, router_pb2_grpc

log = logging.getLogger(__name__)


def served_model(settings: Settings) -> ServedModel:
    path = models.resolve(settings.model, settings.cache_dir)
    return ServedModel.from_settings(settings, models.load_tokenizer(path),
                                     models.context_length(models.load_config(path)))


def router_ready(router_channels: list[grpc.aio.Channel]):
    """/health: whether a router answers grpc.health.v1 as SERVING within a second."""
    stubs = [health_pb2_grpc.HealthStub(c) for c in router_channels]

    async def serving(stub) -> bool:
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def ready() -> bool:
        return any(await asyncio.gather(*(serving(stub) for stub in stubs)))
    return ready


async def start(settings: Settings):
    keys = security.api_keys(settings.gateway)
    if keys:
        log.info("API keys required: %d accepted", len(keys))
    router_channels = channels(settings.router_address, settings.tls, "router")
    routers = Routers([router_pb2_grpc.RouterStub(c) for c in router_channels],
                      settings.gateway.resume_s)
    servicer = GatewayServicer(routers, served_model(settings))
    server, port = await start_server(
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, SERVICE_NAME)],
        settings.host, settings.port, settings.tls,
        [security.ApiKeyInterceptor(keys, [SERVICE_NAME])])
    stop_http = None
    if settings.gateway.http_port is not None:
        app = http.create_app(servicer, ready=router_ready(router_channels), api_keys=keys,
                              registry=metrics.process_registry())
        http_port, stop_http = await http.serve(app, settings.host, settings.gateway.http_port,
                                                settings.tls)
        scheme = "https" if settings.tls.enabled else "http"
        print(f"gateway HTTP (OpenAI-compatible) on {scheme}://{settings.host}:{http_port}/v1",
              flush=True)

    async def cleanup() -> None:
        if stop_http is not None:
            await stop_http()
        for c in router_channels:
            await c.close()
    return server, port, cleanup


def main(settings: Settings) -> None:
    serving.run_service("gateway", settings, start)
