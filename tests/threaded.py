"""A server coroutine on its own event loop in a thread, for module-scoped fixtures that serve an
embedded mesh over real gRPC or HTTP while the tests call it synchronously."""
import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future


@contextlib.contextmanager
def served(serve: Callable[[Callable[[object], None], asyncio.Event], Awaitable[None]],
           timeout: float = 600) -> Iterator[object]:
    """Runs `serve(publish, stop)` in a thread: it calls publish(value) once it serves, then
    awaits stop.wait() and shuts down. Yields the value; a failure before publish is raised."""
    value: Future = Future()
    stopper: Future = Future()

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        stopper.set_result(lambda: loop.call_soon_threadsafe(stop.set))
        await serve(value.set_result, stop)

    def run():
        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting fixture
            if not value.done():
                value.set_exception(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield value.result(timeout=timeout)
    finally:
        if stopper.done():
            stopper.result()()
        thread.join(timeout=60)


@contextlib.asynccontextmanager
async def gateway_apis(mesh, api_keys: frozenset[str] = frozenset(), backends: bool = False):
    """An embedded mesh's gateway over real gRPC and HTTP on free ports: (grpc port, http port).
    With `backends`, the gRPC port serves the mesh's router and drafter servicers too."""
    from specmesh.v1 import drafter_pb2_grpc, gateway_pb2_grpc, router_pb2_grpc
    from specmesh_gateway import http
    from specmesh_gateway.requests import ServedModel
    from specmesh_gateway.servicer import SERVICE_NAME, GatewayServicer
    from specmesh_services.common.rpc import LocalStub, start_server
    from specmesh_services.drafter.servicer import SERVICE_NAME as DRAFTER
    from specmesh_services.router.servicer import SERVICE_NAME as ROUTER, RouterServicer

    router = mesh.router
    model = ServedModel.from_settings(mesh.settings, router.tokenizer,
                                      router.target.context_length)
    router_servicer = RouterServicer(router)
    servicer = GatewayServicer(LocalStub(router_servicer), model)
    services = [(gateway_pb2_grpc.add_GatewayServicer_to_server, servicer, SERVICE_NAME)]
    if backends:
        services.append((router_pb2_grpc.add_RouterServicer_to_server, router_servicer, ROUTER))
        if mesh.drafter is not None:
            services.append((drafter_pb2_grpc.add_DrafterServicer_to_server, mesh.drafter,
                             DRAFTER))
    server, grpc_port = await start_server(services, "127.0.0.1", 0)
    http_port, stop_http = await http.serve(http.create_app(servicer, api_keys=api_keys),
                                            "127.0.0.1", 0)
    try:
        yield grpc_port, http_port
    finally:
        await stop_http()
        await server.stop(None)


@contextlib.contextmanager
def served_mesh(settings, executor, api_keys: frozenset[str] = frozenset(),
                backends: bool = False) -> Iterator[tuple]:
    """An embedded mesh with its gateway_apis, on its own event loop in a thread, for a
    module-scoped fixture: yields (grpc port, http port, the mesh, its event loop)."""
    from specmesh_services.launch.embedded import EmbeddedMesh

    async def serve(publish, stop):
        async with EmbeddedMesh.start(settings, executor) as mesh, \
                gateway_apis(mesh, api_keys, backends) as (grpc_port, http_port):
            publish((grpc_port, http_port, mesh, asyncio.get_running_loop()))
            await stop.wait()

    with served(serve) as value:
        yield value
