"""Drafter process: `specmesh serve drafter`."""
from __future__ import annotations

from services.common import serving
from services.drafter.models import build_draft_models
from services.drafter.servicer import SERVICE_NAME, DrafterServicer
from specmesh.v1 import drafter_pb2_grpc

start, main = serving.compute_service("drafter", build_draft_models, DrafterServicer,
                                      drafter_pb2_grpc.add_DrafterServicer_to_server,
                                      SERVICE_NAME)
