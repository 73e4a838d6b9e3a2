"""Verifier process: `specmesh serve verifier`."""
from __future__ import annotations

import asyncio
import logging

from specmesh_services.common import models, pool as pool_mod, serving
from specmesh_services.common.config import Settings
from specmesh_services.common.lm import CausalLM
from specmesh_services.common.rpc import start_server
from specmesh_kernels.backend import select_attention_backend
from specmesh_services.verifier.engine import EngineLimits, VerifierEngine
from specmesh_services.verifier.servicer import SERVICE_NAME, VerifierServicer
from specmesh_services.verifier.worker import VerifierWorker, default_name
from specmesh.v1 import verifier_pb2_grpc

log = logging.getLogger(__name__)


def load_target(settings: Settings) -> CausalLM:
    dtype = models.resolve_dtype(settings.dtype)
    path = models.resolve(settings.model, settings.cache_dir)
    lm = CausalLM(models.load_model(path, dtype, linear=settings.linear), settings.model)
    log.info("target %s: %d layers, %s", settings.model, lm.num_layers, dtype)
    return lm


def build_engine(target: CausalLM, settings: Settings, name: str) -> VerifierEngine:
    """The verifier engine as `settings.verifier` configures it (KV budget, batch, backend)."""
    v = settings.verifier
    limits = EngineLimits(kv_budget_tokens=v.kv_budget_tokens, block_size=v.kv_block_size,
                          max_batch_tokens=v.max_batch_tokens, max_batch_trees=v.batch_size)
    backend = select_attention_backend(target.device, v.attention)
    engine = VerifierEngine(target, name, limits, backend)
    log.info("verifier %s: KV budget %d rows (%.0f MiB), batch %d trees / %d rows, attention %s",
             name, engine.store.capacity,
             engine.store.capacity * engine.store.bytes_per_token() / 2**20, v.batch_size,
             v.max_batch_tokens, backend.name)
    return engine


async def start(settings: Settings):
    if not settings.redis_url:
        raise SystemExit("the verifier service needs the pool: set --redis-url / SPECMESH_REDIS_URL")
    executor = serving.compute_executor()
    lm = await asyncio.get_running_loop().run_in_executor(executor, load_target, settings)
    pool = pool_mod.connect(settings.redis_url, settings.pool_prefix)
    engine = build_engine(lm, settings, settings.verifier.name or default_name())
    worker = VerifierWorker(engine, pool, executor, settings.verifier)
    if settings.verifier.metrics_port is not None:
        worker.metrics.serve(settings.verifier.metrics_port, settings.host)
        log.info("Prometheus metrics on %s:%d", settings.host, settings.verifier.metrics_port)
    worker.start()
    server, port = await start_server(
        [(verifier_pb2_grpc.add_VerifierServicer_to_server,
          VerifierServicer(worker, settings.model), SERVICE_NAME)],
        settings.host, settings.port)

    async def cleanup() -> None:
        await worker.stop()
        await pool.close()
        executor.shutdown(wait=False, cancel_futures=True)
    return server, port, cleanup


def main(settings: Settings) -> None:
    serving.run_service("verifier", settings, start)
