"""Client-side errors, and the one function that turns a gRPC error into them.

The server sends each failure's reason as a ``google.rpc.ErrorInfo`` detail (domain
``kvmem.v1``); :func:`from_rpc_error` reads it, so "no free request slot" is told apart
from gRPC's own RESOURCE_EXHAUSTED (e.g. a message too large).
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2, status_pb2

ERROR_DOMAIN = "kvmem.v1"


class KVMemError(Exception):
    """A kvmem call failed. ``code`` is the gRPC status code, ``reason`` kvmem's reason
    (e.g. ``"SLOT_NOT_FOUND"``; empty when the failure came from gRPC itself),
    ``metadata`` the offending values the server named."""

    def __init__(self, code: grpc.StatusCode, reason: str, message: str, metadata: dict[str, str] | None = None):
        super().__init__(f"{code.name}{f' ({reason})' if reason else ''}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.metadata = dict(metadata or {})


class InvalidArgument(KVMemError):
    """Malformed input; nothing changed."""


class NotFound(KVMemError):
    """A request slot that is not open in this session."""


class FailedPrecondition(KVMemError):
    """Well-formed input that disagrees with the server's state; nothing changed."""


class SessionLost(FailedPrecondition):
    """The session is gone: detached, lease expired, keep-alive broken, or the server
    restarted (its epoch changed). Attach again; every slot and handle is void."""


class NoFreeRequestSlot(KVMemError):
    """Every request slot of the server is open."""


class Unauthenticated(KVMemError):
    """Missing or wrong bearer token."""


class Unavailable(KVMemError):
    """The server is shutting down or cannot be reached."""


_BY_CODE: dict[grpc.StatusCode, type[KVMemError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}
_BY_REASON: dict[str, type[KVMemError]] = {
    "UNKNOWN_SESSION": SessionLost,
    "NO_FREE_REQUEST_SLOT": NoFreeRequestSlot,
}


def from_rpc_error(err: grpc.RpcError) -> KVMemError:
    """The domain exception for a failed call (sync or asyncio)."""
    code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
    message: str = err.details() or ""  # type: ignore[attr-defined]
    reason = ""
    metadata: dict[str, str] = {}
    for detail in _status_details(err):
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            reason, metadata = info.reason, dict(info.metadata)
            break
    cls = _BY_REASON.get(reason) or _BY_CODE.get(code, KVMemError)
    return cls(code, reason, message, metadata)


def _status_details(err: grpc.RpcError) -> list:
    """The ``google.rpc.Status`` details in a failed call's trailing metadata (works for
    the sync ``RpcError`` and asyncio's ``AioRpcError`` alike)."""
    try:
        trailing = err.trailing_metadata() or ()  # type: ignore[attr-defined]
    except (AttributeError, TypeError, ValueError):
        return []
    for key, value in trailing:
        if key == "grpc-status-details-bin":
            status = status_pb2.Status()
            try:
                status.ParseFromString(value)
            except Exception:  # a malformed detail is no detail
                return []
            return list(status.details)
    return []
