"""Embedded mode: every role in one process, joined by an in-memory pool and in-process calls.

The same engines and servicers as the multi-process stack; only the transport differs (direct
calls through LocalStub instead of gRPC, MemoryPool instead of Redis). `specmesh run` uses it;
so do tests and benchmarks.

    async with EmbeddedMesh.start(Settings()) as mesh:
        response = await mesh.generate(prompt="Hello", max_tokens=32)
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from specmesh_gateway.requests import ServedModel
from specmesh_gateway.servicer import GatewayServicer
from specmesh_services.common import cores, models, serving
from specmesh_services.common.config import Settings
from specmesh_services.common.device import resolve_device
from specmesh_services.common.drafts import router_drafters, serves_drafter
from specmesh_services.common.metrics import RouterMetrics, VerifierMetrics
from specmesh_services.common.pool import MemoryPool
from specmesh_services.common.rpc import LocalStub
from specmesh_services.datastore.engine import LookupEngine, open_for_target
from specmesh_services.datastore.servicer import DatastoreServicer
from specmesh_services.drafter.models import build_draft_models
from specmesh_services.drafter.servicer import DrafterServicer
from specmesh_services.router.engine import Router, TargetInfo
from specmesh_services.router.servicer import RouterServicer
from specmesh_services.verifier.server import build_engine, load_target
from specmesh_services.verifier.worker import VerifierWorker
from specmesh import build_request
from specmesh.v1 import gateway_pb2

log = logging.getLogger(__name__)


@dataclass
class EmbeddedMesh:
    settings: Settings
    gateway: LocalStub  # GatewayServicer called in-process
    router: Router
    worker: VerifierWorker
    drafter: DrafterServicer | None  # None when only the datastore drafts
    pool: MemoryPool
    datastore: DatastoreServicer | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def start(cls, settings: Settings, executor: Executor | None = None,
                    draft_executor: Executor | None = None) -> AsyncIterator["EmbeddedMesh"]:
        """Loads the models and starts the roles. With `cores` shared, all model work runs on
        `executor` (default: a new single-thread one): drafter and verifier take the cores in
        turn. Pass the thread other torch work of this process runs on: each thread that runs
        torch ops gets its own OpenMP team, and two teams on the same cores slow small ops down
        by up to 2x. With `cores` split, the verifier's work runs on `executor` pinned to the
        verifier's cores and the drafting roles' on `draft_executor` (default: a new thread)
        pinned to theirs; threads passed in get their cores back when the mesh stops."""
        settings = models.served(settings)
        placement = cores.plan(settings.cores, settings.drafter_cores)
        with _compute_threads(placement, executor, draft_executor,
                              resolve_device(settings.device)) as (executor, draft_executor):
            async with cls._started(settings, placement, executor, draft_executor) as mesh:
                yield mesh

    @classmethod
    @contextlib.asynccontextmanager
    async def _started(cls, settings: Settings, placement: cores.CorePlan, executor: Executor,
                       draft_executor: Executor) -> AsyncIterator["EmbeddedMesh"]:
        loop = asyncio.get_running_loop()
        path = await loop.run_in_executor(executor, models.resolve, settings.model,
                                          settings.cache_dir)
        tokenizer = models.load_tokenizer(path)
        target = await loop.run_in_executor(executor, load_target, settings)
        use_model = serves_drafter(settings)
        drafts = (await loop.run_in_executor(draft_executor, build_draft_models, settings)
                  if use_model else [])
        datastore = None
        if settings.speculation.source != "model":
            store = open_for_target(settings, tokenizer)
            datastore = DatastoreServicer(LookupEngine(store, settings.datastore), draft_executor)
        pool = MemoryPool()
        engine = await loop.run_in_executor(executor, build_engine, target, settings,
                                            "verifier-embedded")
        registry = CollectorRegistry()  # the mesh's roles' metrics (router.metrics.registry)
        worker = VerifierWorker(engine, pool, executor, settings.verifier,
                                VerifierMetrics(registry, settings.model))
        drafter = DrafterServicer(drafts, draft_executor) if use_model else None
        info = TargetInfo(settings.model, target.vocab_size, target.context_length,
                          tuple(models.eos_token_ids(path, tokenizer)))
        first, names = router_drafters(settings,
                                       list(drafter.models) if drafter else None)
        router = Router(pool, LocalStub(drafter) if drafter else None, tokenizer, info,
                        settings.speculation, settings.router,
                        datastore=LocalStub(datastore) if datastore else None,
                        drafter_name=first, drafter_names=names,
                        drafter_costs={m.name: m.level_seconds for m in drafts},
                        drafter_prefill={m.name: m.prefill_token_seconds for m in drafts},
                        pipelined=draft_executor is not executor,  # drafting beside verifying
                        metrics=RouterMetrics(registry, settings.model))
        served = ServedModel.from_settings(settings, tokenizer, target.context_length)
        gateway = LocalStub(GatewayServicer(LocalStub(RouterServicer(router)), served))
        worker.start()
        router.start()
        try:
            with serving.frozen_heap():
                yield cls(settings, gateway, router, worker, drafter, pool, datastore)
        finally:
            await router.stop()
            await worker.stop()

    async def generate(self, **kwargs) -> gateway_pb2.GenerateResponse:
        """Same keyword arguments as the SDK's build_request (prompt= or messages=, ...)."""
        return await self.gateway.Generate(build_request(**kwargs))

    def stream(self, **kwargs) -> AsyncIterator[gateway_pb2.GenerateChunk]:
        return self.gateway.GenerateStream(build_request(**kwargs))


@contextlib.contextmanager
def _compute_threads(placement: cores.CorePlan, executor: Executor | None,
                     draft_executor: Executor | None, device=None
                     ) -> Iterator[tuple[Executor, Executor]]:
    """(verifier's, drafting roles') compute threads: one for both when the cores are shared;
    with split cores two, pinned to their cores; on a GPU two, the drafting one issuing on its
    own CUDA stream (the current stream is per thread), so that its kernels queue beside the
    verifier's. Threads made here are shut down and threads passed in get their cores back on
    exit, also when loading fails."""
    owned = []
    if executor is None:
        executor = serving.compute_executor()
        owned.append(executor)
    on_gpu = device is not None and device.type == "cuda"
    if on_gpu and draft_executor is None:
        import torch

        draft_executor = serving.compute_executor(role="drafter")
        owned.append(draft_executor)
        draft_executor.submit(lambda: torch.cuda.set_stream(torch.cuda.Stream(device))).result()
    elif not placement.split:
        draft_executor = executor
    elif draft_executor is None:
        draft_executor = serving.compute_executor(role="drafter")
        owned.append(draft_executor)
    pinned = []
    try:
        if placement.split:
            for e, role in ((executor, "verifier"), (draft_executor, "drafter")):
                pinned.append((e, cores.pin_executor(e, placement.cpus(role),
                                                     placement.threads(role))))
        yield executor, draft_executor
    finally:
        for e in owned:
            e.shutdown(wait=False, cancel_futures=True)
        for e, before in pinned:
            if e not in owned:
                cores.pin_executor(e, *before)
