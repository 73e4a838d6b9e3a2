"""Datastore process: `specmesh serve datastore`.

Serves the suffix-array datastore of the target's tokenizer family (memory-mapped, so several
processes on one host share the pages) plus per-request prompt/output indexes. Refuses to start
on a datastore built with another tokenizer than the target's.
"""
from __future__ import annotations

from specmesh_services.common import models, serving
from specmesh_services.common.config import Settings
from specmesh_services.datastore.engine import LookupEngine, open_for_target
from specmesh_services.datastore.servicer import SERVICE_NAME, DatastoreServicer
from specmesh.v1 import datastore_pb2_grpc


def build_engine(settings: Settings) -> LookupEngine:
    tokenizer = models.load_tokenizer(models.resolve(settings.model, settings.cache_dir))
    return LookupEngine(open_for_target(settings, tokenizer), settings.datastore)


start, main = serving.compute_service("datastore", build_engine, DatastoreServicer,
                                      datastore_pb2_grpc.add_DatastoreServicer_to_server,
                                      SERVICE_NAME)
