"""gRPC plumbing shared by the services: errors mapped to status codes in one place, server
start-up with health checking, and in-process stubs for the embedded mode.

Mapping: ValueError -> INVALID_ARGUMENT, LookupError (KeyError, unknown request/model) ->
NOT_FOUND, Overloaded -> RESOURCE_EXHAUSTED, TimeoutError (a backend did not answer) ->
UNAVAILABLE, a downstream gRPC error -> its own status, anything else -> INTERNAL (logged with
its stack).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmesh_services.common import metrics, security, telemetry
from specmesh_services.common.config import TlsSettings

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The service cannot take more work now (RESOURCE_EXHAUSTED); the client may retry."""


class FailedPrecondition(Exception):
    """The call needs state the service does not hold (FAILED_PRECONDITION): the message says
    what to send instead."""


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return exc.code(), exc.details() or ""
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND, str(exc.args[0]) if exc.args else repr(exc)
    if isinstance(exc, Overloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, FailedPrecondition):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def _abort(context, method: str, exc: Exception):
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method)
    await context.abort(code, message)


def rpc_errors(method: Callable) -> Callable:
    """Decorates an async servicer method (unary or server-streaming) with the error mapping."""
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                await _abort(context, name, exc)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            await _abort(context, name, exc)
    return unary


# ---------------------------------------------------------------------------------------------
# servers


async def start_server(register: Sequence[tuple[Callable[[Any, grpc.aio.Server], None], Any, str]],
                       host: str, port: int, tls: TlsSettings | None = None,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = ()
                       ) -> tuple[grpc.aio.Server, int]:
    """Starts a grpc.aio server with the given (add_fn, servicer, full service name) entries,
    grpc.health.v1 (each service and "" SERVING) and server reflection (grpcurl lists and calls
    them); with `tls` enabled it serves TLS only. Returns the server and its bound port."""
    server = grpc.aio.server(interceptors=[*telemetry.server_interceptors(),
                                           metrics.rpc_metrics(), *interceptors],
                             options=[("grpc.so_reuseport", 0)])
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for add_fn, servicer, _ in register:
        add_fn(servicer, server)
    reflection.enable_server_reflection(
        [name for _, _, name in register] + [health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    credentials = security.server_credentials(tls) if tls is not None else None
    try:  # grpcio returns 0 for a port it cannot bind, or (newer releases) raises
        bound = (server.add_secure_port(f"{host}:{port}", credentials) if credentials is not None
                 else server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port}: the port is in use or the address is "
                      "not this machine's")
    await server.start()
    for _, _, service_name in register:
        await health_servicer.set(service_name, health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    _health[server] = (health_servicer, ["", *(name for _, _, name in register)])
    return server, bound


_health: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_draining = False


def draining() -> bool:
    """Whether this process's server reported NOT_SERVING: calls cancelled from now on are
    cut by the shutdown, not by their clients."""
    return _draining


async def not_serving(server: grpc.aio.Server) -> None:
    """Reports every service of `server` NOT_SERVING (a draining process: load balancers and
    Kubernetes' readiness probes send it no new work)."""
    global _draining
    _draining = True
    health_servicer, names = _health.get(server, (None, []))
    for name in names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def channels(addresses: str, tls: TlsSettings | None, what: str) -> list[grpc.aio.Channel]:
    """One channel per address of a comma-separated list of a service's replicas."""
    found = [a.strip() for a in addresses.split(",") if a.strip()]
    if not found:
        raise SystemExit(f"no address given for the {what}: host:port, comma-separated for "
                         f"replicas")
    return [channel(address, tls) for address in found]


def channel(address: str, tls: TlsSettings | None = None) -> grpc.aio.Channel:
    """Client channel with tracing interceptors; TLS when `tls` is enabled."""
    credentials = security.channel_credentials(tls) if tls is not None else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, interceptors=telemetry.client_interceptors())
    return grpc.aio.secure_channel(address, credentials,
                                   interceptors=telemetry.client_interceptors())


# ---------------------------------------------------------------------------------------------
# in-process calls (embedded mode)


class LocalRpcError(grpc.RpcError):
    """What a local call raises where a remote one would raise grpc.aio.AioRpcError."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _LocalContext:
    """The part of grpc.aio.ServicerContext our servicers use."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise LocalRpcError(code, details)

    def cancelled(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None  # in-process calls carry no deadline


class LocalStub:
    """Calls a servicer's methods in-process with the stub's calling convention:
    `await stub.Method(request)` for unary methods, `async for x in stub.Method(request)` for
    server-streaming ones. Errors arrive as LocalRpcError with the same status codes."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    def __getattr__(self, name: str) -> Callable:
        method = getattr(self._servicer, name)

        def call(request, timeout: float | None = None, **_: Any):
            result = method(request, _LocalContext())
            if timeout is not None and inspect.iscoroutine(result):
                # the deadline a real channel enforces: a stuck call raises TimeoutError,
                # which callers already handle, instead of hanging the request
                return _within(result, timeout)
            return result
        return call


async def _within(call, timeout: float):
    """`call` awaited under a deadline, in the caller's task (asyncio.wait_for would run it
    as a task of its own: one more turn of the event loop per call)."""
    async with asyncio.timeout(timeout):
        return await call
