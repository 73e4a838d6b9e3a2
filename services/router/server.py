"""Router process: `specmesh serve router`."""
from __future__ import annotations

import logging
from pathlib import Path

import grpc

from specmesh_services.common import cores, metrics, models, pool as pool_mod, serving
from specmesh_services.common.metrics import RouterMetrics
from specmesh_services.common.config import Settings
from specmesh_services.common.rpc import channels, start_server
from specmesh_services.common.datastore_files import tokenizer_family
from specmesh_services.common.drafts import router_drafters, serves_drafter
from specmesh_services.router.engine import Router, TargetInfo
from specmesh_services.router.replicas import DatastoreReplicas, DrafterReplicas
from specmesh_services.router.servicer import SERVICE_NAME, RouterServicer
from specmesh.v1 import (datastore_pb2, datastore_pb2_grpc, drafter_pb2, drafter_pb2_grpc,
                         router_pb2_grpc)

log = logging.getLogger(__name__)


def target_info(name: str, path: Path, tokenizer) -> TargetInfo:
    config = models.load_config(path)
    return TargetInfo(name=name, vocab_size=config.vocab_size,
                      context_length=models.context_length(config),
                      eos_token_ids=tuple(models.eos_token_ids(path, tokenizer)))


async def check_datastore(datastore, tokenizer, timeout_s: float) -> None:
    """Refuses a datastore built with another tokenizer family than the target's."""
    info = await datastore.Info(datastore_pb2.DatastoreInfoRequest(), timeout=timeout_s)
    family = tokenizer_family(tokenizer)
    if info.tokenizer != family:
        raise SystemExit(f"the datastore {info.name!r} was built with tokenizer family "
                         f"{info.tokenizer}, the target's is {family}: build one for this model "
                         f"(specmesh datastore build --model ...)")


def replicated(addresses: str, settings: Settings, held: list, stub, replicas):
    """The stub of a drafting service at `addresses` (comma-separated replicas: one stub over
    all of them, each request sticking to one); its channels are appended to `held`."""
    opened = channels(addresses, settings.tls, "drafting service")
    held.extend(opened)
    stubs = [stub(c) for c in opened]
    return stubs[0] if len(stubs) == 1 else replicas(stubs)


async def start(settings: Settings):
    if not settings.redis_url:
        raise SystemExit("the router service needs the pool: set --redis-url / SPECMESH_REDIS_URL")
    settings = models.served(settings)
    path = models.resolve(settings.model, settings.cache_dir)
    tokenizer = models.load_tokenizer(path)
    pool = pool_mod.connect(settings.redis_url, settings.pool_prefix)
    held: list = []
    drafter = datastore = None
    if serves_drafter(settings):
        drafter = replicated(settings.drafter_address, settings, held,
                             drafter_pb2_grpc.DrafterStub, DrafterReplicas)
    if settings.speculation.source != "model":
        datastore = replicated(settings.datastore_address, settings, held,
                               datastore_pb2_grpc.DatastoreStub, DatastoreReplicas)
        await check_datastore(datastore, tokenizer, settings.router.step_timeout_s)
    names, costs, prefill = None, None, None
    spec = settings.speculation
    if drafter is not None and spec.depth > 0:
        needed = spec.selection != "fixed" or spec.voting  # the arms / the voters
        try:
            info = await drafter.Info(drafter_pb2.DrafterInfoRequest(),
                                      timeout=settings.router.step_timeout_s)
        except grpc.RpcError as err:
            if needed:
                raise
            # one configured drafter: its cost estimate is a nicety, the router times drafts
            log.warning("drafter Info failed (%s): no drafting-cost estimate before the first "
                        "drafts", err.code())
        else:
            names = [m.name for m in info.models] if needed else None
            costs = {m.name: m.level_seconds for m in info.models}
            prefill = {m.name: m.prefill_token_seconds for m in info.models}
    first, names = router_drafters(settings, names)
    router = Router(pool, drafter, tokenizer, target_info(settings.model, path, tokenizer),
                    settings.speculation, settings.router, datastore=datastore,
                    drafter_name=first, drafter_names=names, drafter_costs=costs,
                    drafter_prefill=prefill,
                    pipelined=cores.plan(settings.cores, settings.drafter_cores).split,
                    metrics=RouterMetrics(metrics.process_registry(), settings.model))
    router.start()
    server, port = await start_server(
        [(router_pb2_grpc.add_RouterServicer_to_server, RouterServicer(router), SERVICE_NAME)],
        settings.host, settings.port, settings.tls)

    async def cleanup() -> None:
        await router.stop()
        for c in held:
            await c.close()
        await pool.close()
    return server, port, cleanup


def main(settings: Settings) -> None:
    serving.run_service("router", settings, start)
