"""Gateway process: `specmesh serve gateway`."""
from __future__ import annotations

from specmesh_gateway.requests import ServedModel
from specmesh_gateway.servicer import SERVICE_NAME, GatewayServicer
from specmesh_services.common import models, serving
from specmesh_services.common.config import Settings
from specmesh_services.common.rpc import channel, start_server
from specmesh.v1 import gateway_pb2_grpc, router_pb2_grpc


def served_model(settings: Settings) -> ServedModel:
    path = models.resolve(settings.model, settings.cache_dir)
    return ServedModel(name=settings.model, tokenizer=models.load_tokenizer(path),
                       context_length=models.context_length(models.load_config(path)),
                       max_tokens_default=settings.max_tokens_default,
                       max_tokens_limit=settings.max_tokens_limit)


async def start(settings: Settings):
    router_channel = channel(settings.router_address)
    servicer = GatewayServicer(router_pb2_grpc.RouterStub(router_channel), served_model(settings))
    server, port = await start_server(
        [(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, SERVICE_NAME)],
        settings.host, settings.port)

    async def cleanup() -> None:
        await router_channel.close()
    return server, port, cleanup


def main(settings: Settings) -> None:
    serving.run_service("gateway", settings, start)
