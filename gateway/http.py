"""OpenAI-compatible HTTP on the gateway (FastAPI, served by uvicorn in the gateway's event loop).

POST /v1/completions, POST /v1/chat/completions (whole or streamed as server-sent events),
GET /v1/models, GET /health. Requests go through the gRPC servicer's own validation and router
stub, so both APIs give the same output for the same request. Errors have OpenAI's shape and
status codes: 400 for a bad request, 401 for a missing or wrong API key, 404 for an unknown
model, 429 when the mesh is overloaded, 503 when a backend is unreachable.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CollectorRegistry, make_asgi_app

from specmesh_gateway.openai_responses import Reply, error_body, sse
from specmesh_gateway.openai_schema import ChatCompletionRequest, CompletionRequest, UnsupportedField
from specmesh_services.common.config import TlsSettings
from specmesh_services.common.rpc import status_of
from specmesh_services.common.security import bearer_ok

log = logging.getLogger(__name__)

HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
               grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
               grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
               grpc.StatusCode.DEADLINE_EXCEEDED: 504}
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
               404: "invalid_request_error", 429: "rate_limit_error"}


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def of(cls, exc: BaseException) -> "HttpError":
        if isinstance(exc, HttpError):
            return exc
        if isinstance(exc, UnsupportedField):
            return cls(400, str(exc), param=exc.param, code="unsupported_parameter")
        status_code, message = status_of(exc)
        return cls(HTTP_STATUS.get(status_code, 500), message or status_code.name)

    def body(self) -> dict:
        return error_body(self.message, ERROR_TYPES.get(self.status, "server_error"),
                          self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def create_app(servicer, ready: Callable[[], Awaitable[bool]] | None = None,
               api_keys: frozenset[str] = frozenset(),
               registry: CollectorRegistry | None = None) -> FastAPI:
    """The HTTP API over a GatewayServicer. `ready` answers /health; `api_keys`, when not empty,
    are the Bearer tokens /v1 accepts; `registry`, when given, is served at /metrics."""
    app = FastAPI(title="specmesh", description="OpenAI-compatible API of a specmesh gateway",
                  docs_url=None, redoc_url=None)
    if registry is not None:
        app.mount("/metrics", make_asgi_app(registry))
    model = servicer.model

    async def authorized(request: Request) -> None:
        if api_keys and not bearer_ok(request.headers.get("authorization"), api_keys):
            raise HttpError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                            code="invalid_api_key")

    @app.exception_handler(HttpError)
    async def _http_error(_: Request, exc: HttpError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        message = f"{'.'.join(where)}: {first['msg']}" if where else first["msg"]
        return HttpError(400, message, param=".".join(where) or None).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = True if ready is None else await ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/v1/models", dependencies=[Depends(authorized)])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "specmesh",
                                            "max_model_len": model.context_length}]}

    @app.post("/v1/completions", dependencies=[Depends(authorized)])
    async def completions(body: CompletionRequest):
        return await _serve(body, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(authorized)])
    async def chat_completions(body: ChatCompletionRequest):
        return await _serve(body, chat=True)

    async def _serve(body, chat: bool):
        try:
            body.check()
            if body.model and body.model != model.name:
                raise HttpError(404, f"The model '{body.model}' does not exist: this server "
                                     f"serves '{model.name}'", param="model",
                                code="model_not_found")
            request_id, route = servicer.route(body.to_generate())
            chunks = aiter(servicer.router.Generate(route))
            reply = Reply(chat=chat, model=model.name, request_id=request_id,
                          metrics_level=body.speculation_metrics,
                          include_usage=bool(body.stream_options and
                                             body.stream_options.include_usage))
            # the first chunk before the status line: an early failure is an HTTP error
            first = await anext(chunks)
        except StopAsyncIteration:
            raise HttpError(500, "the router ended the stream without a result") from None
        except Exception as exc:  # noqa: BLE001 - mapped to an HTTP status
            raise _logged(HttpError.of(exc), exc) from None
        if body.stream:
            return StreamingResponse(_events(reply, first, chunks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        reply.add(first)
        try:
            async for chunk in chunks:
                reply.add(chunk)
        except Exception as exc:  # noqa: BLE001
            raise _logged(HttpError.of(exc), exc) from None
        return reply.whole()

    return app


async def _events(reply: Reply, first, chunks: AsyncIterator) -> AsyncIterator[str]:
    """SSE stream: the chunks' events, an error event if the stream fails, then [DONE]."""
    try:
        for event in reply.event(first, first=True):
            yield event
        async for chunk in chunks:
            for event in reply.event(chunk, first=False):
                yield event
    except Exception as exc:  # noqa: BLE001 - the status line is sent: report it in the stream
        yield sse(_logged(HttpError.of(exc), exc).body())
    yield sse("[DONE]")


def _logged(error: HttpError, exc: BaseException) -> HttpError:
    if error.status >= 500:
        log.error("HTTP request failed: %s", exc, exc_info=not isinstance(exc, grpc.RpcError))
    return error


class _Server(uvicorn.Server):
    def capture_signals(self):  # the service's own loop handles SIGTERM / SIGINT
        return contextlib.nullcontext()


async def serve(app: FastAPI, host: str, port: int, tls: TlsSettings | None = None
                ) -> tuple[int, Callable[[], Awaitable[None]]]:
    """Serves `app` on host:port (0 = any free port) in the running loop, over HTTPS with the
    service's certificate when `tls` is enabled; returns the bound port and a coroutine
    function that stops it."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot serve HTTP on {host}:{port}: {err}") from err
    https = {"ssl_certfile": str(tls.cert_file), "ssl_keyfile": str(tls.key_file)} \
        if tls is not None and tls.enabled else {}
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                    timeout_graceful_shutdown=3, **https))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise OSError(f"HTTP server on {host}:{port} stopped at start")
        await asyncio.sleep(0.01)

    async def stop() -> None:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
    return sock.getsockname()[1], stop
