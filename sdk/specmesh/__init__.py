"""specmesh client SDK: talk to a specmesh gateway over gRPC.

    from specmesh import Client, AsyncClient
    Client("localhost:50051").generate("Hello", max_tokens=16).text
"""
from specmesh.client import AsyncClient, Client, build_request
from specmesh.errors import InvalidRequest, SpecmeshError, Unauthenticated, Unavailable
from specmesh.types import Chunk, Decision, Generation, Stats

__all__ = ["AsyncClient", "Chunk", "Client", "Decision", "Generation", "InvalidRequest",
           "SpecmeshError", "Stats", "Unauthenticated", "Unavailable", "build_request"]
__version__ = "0.1.0"
