"""Drafter process: `specmesh serve drafter` (or `python -m services.drafter`)."""
from __future__ import annotations

import asyncio

from services.common import serving
from services.common.config import Settings
from services.common.rpc import start_server
from services.drafter.models import build_draft_models
from services.drafter.servicer import SERVICE_NAME, DrafterServicer
from specmesh.v1 import drafter_pb2_grpc


async def start(settings: Settings):
    executor = serving.compute_executor()
    loop = asyncio.get_running_loop()
    draft_models = await loop.run_in_executor(executor, build_draft_models, settings)
    servicer = DrafterServicer(draft_models, executor)
    server, port = await start_server(
        [(drafter_pb2_grpc.add_DrafterServicer_to_server, servicer, SERVICE_NAME)],
        settings.host, settings.port)

    async def cleanup() -> None:
        executor.shutdown(wait=False, cancel_futures=True)
    return server, port, cleanup


def main(settings: Settings) -> None:
    serving.run_service("drafter", settings, start)
