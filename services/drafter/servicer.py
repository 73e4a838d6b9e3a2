"""Drafter gRPC servicer: protobuf in, DraftModel calls on the compute thread, protobuf out."""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor

from specmesh_services.common.rpc import rpc_errors
from specmesh_services.common.sampling import SamplingParams
from specmesh_services.drafter.engine import Coupling, DraftJob, DraftModel
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

SERVICE_NAME = "specmesh.v1.Drafter"


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, models: list[DraftModel], executor: Executor) -> None:
        if not models:
            raise ValueError("a drafter needs at least one draft model")
        self.models = {m.name: m for m in models}
        self.default = models[0]
        self.executor = executor

    def _model(self, name: str) -> DraftModel:
        if not name:
            return self.default
        try:
            return self.models[name]
        except KeyError:
            raise LookupError(f"unknown draft model '{name}': this drafter hosts "
                              f"{', '.join(self.models)}") from None

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    @rpc_errors
    async def Info(self, request, context):
        return drafter_pb2.DrafterInfo(models=[
            drafter_pb2.DraftModelInfo(name=m.name, kind=m.kind, num_layers=m.lm.num_layers,
                                       vocab_size=m.lm.vocab_size, level_seconds=m.level_seconds,
                                       prefill_token_seconds=m.prefill_token_seconds)
            for m in self.models.values()],
            held_requests=sum(len(m.requests) for m in self.models.values()))

    @rpc_errors
    async def Prefill(self, request, context):
        model = self._model(request.drafter)
        coupling = (Coupling.of(SamplingParams.from_pb(request.sampling),
                                request.target_vocab_size)
                    if request.HasField("sampling") else None)
        length = await self._run(model.prefill, request.request_id, list(request.token_ids),
                                 coupling)
        return drafter_pb2.DraftPrefillResponse(context_len=length)

    @rpc_errors
    async def Draft(self, request, context):
        """Each model drafts all of its items in one batched run (one forward per tree level
        for all of them: DraftModel.draft_many); trees come back in item order."""
        groups: dict[str, list[int]] = {}
        for i, item in enumerate(request.items):
            groups.setdefault(self._model(item.drafter).name, []).append(i)
        out: list = [None] * len(request.items)
        for name, indices in groups.items():
            work = [_job(request.items[i]) for i in indices]
            for i, result in zip(indices, await self._run(self.models[name].draft_many, work)):
                out[i] = result
        response = drafter_pb2.DraftBatchResponse()
        for tree, seconds in out:
            response.trees.append(tree.to_pb())
            response.draft_seconds.append(seconds)
        return response

    @rpc_errors
    async def Release(self, request, context):
        released = sum(m.release(rid) for rid in request.request_ids for m in self.models.values())
        return drafter_pb2.DraftReleaseResponse(released=released)


def _job(item) -> DraftJob:
    return DraftJob(item.request_id, list(item.new_tokens), item.depth, item.width,
                    item.min_probability, item.context_len)
