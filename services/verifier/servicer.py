"""Verifier gRPC servicer: what the pool does not carry (model info and counters)."""
from __future__ import annotations

from services.common.rpc import rpc_errors
from services.verifier.worker import VerifierWorker
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

SERVICE_NAME = "specmesh.v1.Verifier"


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, worker: VerifierWorker, model_name: str) -> None:
        self.worker = worker
        self.model_name = model_name

    @rpc_errors
    async def Info(self, request, context):
        lm = self.worker.engine.lm
        return verifier_pb2.VerifierInfo(
            model=self.model_name, vocab_size=lm.vocab_size, context_length=lm.context_length,
            dtype=str(lm.dtype).removeprefix("torch."), name=self.worker.name,
            active_requests=len(self.worker.engine.requests), steps=self.worker.steps,
            prefills=self.worker.prefills)
