"""Drafter process: `specmesh serve drafter`."""
from __future__ import annotations

from specmesh_services.common import serving
from specmesh_services.drafter.models import build_draft_models
from specmesh_services.drafter.servicer import SERVICE_NAME, DrafterServicer
from specmesh.v1 import drafter_pb2_grpc

start, main = serving.compute_service("drafter", build_draft_models, DrafterServicer,
                                      drafter_pb2_grpc.add_DrafterServicer_to_server,
                                      SERVICE_NAME)
