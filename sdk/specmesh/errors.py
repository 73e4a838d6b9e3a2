"""Errors raised by the SDK: one class per gRPC status a caller may want to handle."""
from __future__ import annotations

import grpc


class SpecmeshError(Exception):
    """A request failed; `code` is the gRPC status code, `message` the server's explanation."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class InvalidRequest(SpecmeshError, ValueError):
    """The gateway rejected the request's parameters (INVALID_ARGUMENT); the message says what to fix."""


class Unavailable(SpecmeshError, ConnectionError):
    """The gateway could not be reached or is overloaded (UNAVAILABLE, RESOURCE_EXHAUSTED)."""


class Unauthenticated(SpecmeshError, PermissionError):
    """The gateway wants an API key and got none or a wrong one (UNAUTHENTICATED): pass
    `api_key=` to the client."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Unavailable,
}


def from_rpc_error(err: grpc.RpcError) -> SpecmeshError:
    """Converts a grpc error (sync or aio) into the matching SpecmeshError."""
    code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
    details = err.details() if callable(getattr(err, "details", None)) else str(err)
    return _BY_CODE.get(code, SpecmeshError)(code, details or "")
