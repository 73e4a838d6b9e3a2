"""Verifier gRPC servicer: what the pool does not carry (model info and counters)."""
from __future__ import annotations

from specmesh_services.common.rpc import rpc_errors
from specmesh_services.verifier.worker import VerifierWorker
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

SERVICE_NAME = "specmesh.v1.Verifier"


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, worker: VerifierWorker, model_name: str) -> None:
        self.worker = worker
        self.model_name = model_name

    @rpc_errors
    async def Info(self, request, context):
        engine = self.worker.engine
        lm, store = engine.lm, engine.store
        info = verifier_pb2.VerifierInfo(
            model=self.model_name, vocab_size=lm.vocab_size, context_length=lm.context_length,
            dtype=str(lm.dtype).removeprefix("torch."), name=self.worker.name,
            active_requests=len(engine.requests), steps=self.worker.steps,
            prefills=self.worker.prefills, kv_capacity_tokens=store.capacity,
            kv_used_tokens=store.used_blocks * store.block_size, evictions=engine.evictions,
            batch_size=self.worker.settings.batch_size,
            max_batch_tokens=engine.limits.max_batch_tokens,
            attention_backend=engine.backend.name)
        fit = engine.cost.fit()
        if fit is not None:
            info.cost.CopyFrom(verifier_pb2.VerifyCost(
                intercept_s=fit.intercept_s, per_row_s=fit.per_row_s,
                per_context_s=fit.per_context_s, per_segment_s=fit.per_segment_s,
                samples=fit.samples))
        return info
