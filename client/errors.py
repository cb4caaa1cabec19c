"""Client-side errors, and the one function that turns a gRPC error into them.

The server sends each failure's reason as a ``google.rpc.ErrorInfo`` detail (domain
``kvmem.v1``); :func:`from_rpc_error` reads it, so "no free request slot" is told apart
from gRPC's own RESOURCE_EXHAUSTED (e.g. a message too large). The reasons are the
proto's closed ``kvmem.v1.ErrorReason`` (:class:`Reason`); the client invents none.
"""

from __future__ import annotations

import enum

import grpc
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmem.v1 import kvmem_pb2

ERROR_DOMAIN = "kvmem.v1"
_REASON_PREFIX = "ERROR_REASON_"

_REASON_NAMES = [name.removeprefix(_REASON_PREFIX) for name, _number in kvmem_pb2.ErrorReason.items()]
Reason = enum.StrEnum("Reason", [(name, name) for name in _REASON_NAMES])  # type: ignore[misc]
Reason.__doc__ = """Why a call failed: the proto's ErrorReason without its prefix. A ``str``
whose value is the name the server sends (``Reason.SLOT_NOT_FOUND == "SLOT_NOT_FOUND"``);
UNSPECIFIED when the failure came from gRPC itself, the client, or a server newer than
this client (the server's string is then in ``KVMemError.raw_reason``)."""
_UNSPECIFIED: Reason = Reason["UNSPECIFIED"]


def parse_reason(raw: str) -> Reason:
    """The :class:`Reason` a server's ``ErrorInfo.reason`` names; UNSPECIFIED for one
    the proto does not list."""
    try:
        return Reason(raw)
    except ValueError:
        return _UNSPECIFIED


class KVMemError(Exception):
    """A kvmem call failed. ``code`` is the gRPC status code, ``reason`` kvmem's
    :class:`Reason` (UNSPECIFIED when the failure came from gRPC itself),
    ``raw_reason`` the string the server sent (empty if none), ``metadata`` the offending
    values the server named."""

    def __init__(
        self,
        code: grpc.StatusCode,
        reason: Reason | str,
        message: str,
        metadata: dict[str, str] | None = None,
    ) -> None:
        raw = "" if reason is _UNSPECIFIED else str(reason)
        super().__init__(f"{code.name}{f' ({raw})' if raw else ''}: {message}")
        self.code = code
        self.reason = parse_reason(raw)
        self.raw_reason = raw
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
    restarted (its epoch changed). Attach again; every slot is void.

    ``views_stale`` is True when the server itself is gone or was replaced (its process
    died, it shut down, its epoch changed): then every KV and block-table view taken from
    this client is stale too. The client has dropped its own mappings; drop yours (any
    tensor from ``kv_cache()``, ``block_table``, ``memory``), so the old memory can be
    freed and a restarted server can allocate its pool, then re-attach, re-map and
    re-open (docs/OPERATIONS.md, "Recovering from a lost session")."""

    views_stale: bool = False


class NoFreeRequestSlot(KVMemError):
    """Every request slot of the server is open."""


class TooManySessions(KVMemError):
    """The server holds as many sessions as its --max-sessions allows."""


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
_BY_REASON: dict[Reason, type[KVMemError]] = {
    Reason["UNKNOWN_SESSION"]: SessionLost,
    Reason["NO_FREE_REQUEST_SLOT"]: NoFreeRequestSlot,
    Reason["TOO_MANY_SESSIONS"]: TooManySessions,
}


# What gRPC's Python channels (sync and asyncio) say of a call the application cancelled.
LOCAL_CANCELLATION = "Locally cancelled by application!"
# What gRPC's asyncio client makes the status of a call whose operation it could not
# start because the call had ended under it (a message written on a stream whose
# connection just broke): INTERNAL with this text, in place of the status the
# transport would have given (grpc/grpc#36066). It is no status of the server's.
ASYNCIO_BROKEN_CALL = "Internal error from Core"


def from_rpc_error(err: grpc.RpcError) -> KVMemError:
    """The domain exception for a failed call (sync ``RpcError`` or asyncio
    ``AioRpcError``: both are calls whose ``code()``, ``details()`` and
    ``trailing_metadata()`` answer at once).

    A CANCELLED that this process did not ask for is :class:`Unavailable` with the
    reason SHUTTING_DOWN: kvmem never cancels a call, but the server's gRPC does, to
    every call it has taken from the connection and not yet handed to the service when
    its shutdown starts (grpc/grpc#41785: such a call never ran, so it changed
    nothing). A scheduler must be able to tell that from its own cancellation.

    gRPC's asyncio client answers INTERNAL "Internal error from Core" for a call whose
    write it could not start because the call had already ended under it (the
    connection broke: grpc/grpc#36066); without a reason from the server, that is
    :class:`Unavailable` too, the transport failure it stands for, not a server bug."""
    code, details = err.code(), err.details() or ""
    if code == grpc.StatusCode.CANCELLED and details != LOCAL_CANCELLATION:
        return server_cancelled(details)
    try:
        status: status_pb2.Status | None = rpc_status.from_call(err)
    except (AttributeError, TypeError, ValueError, DecodeError):
        status = None  # malformed, or disagreeing with the call's code and message (a proxy's rewrite)
    if code == grpc.StatusCode.INTERNAL and details == ASYNCIO_BROKEN_CALL and status is None:
        return Unavailable(
            grpc.StatusCode.UNAVAILABLE,
            _UNSPECIFIED,
            f"the call broke as a message was sent: the connection to the server failed (gRPC's asyncio "
            f"client said INTERNAL: {details})",
        )
    return _domain_error(code, details, status)


def server_cancelled(details: str) -> Unavailable:
    """What a call the server cancelled (see :func:`from_rpc_error`) raises."""
    return Unavailable(
        grpc.StatusCode.UNAVAILABLE,
        Reason["SHUTTING_DOWN"],
        "the server cancelled the call before it ran: its gRPC does so to the calls not yet handed to "
        f"the service when it starts to shut down, so nothing changed (gRPC said CANCELLED: {details})",
    )


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def from_status(status: status_pb2.Status) -> KVMemError:
    """The domain exception for a ``google.rpc.Status`` the server sent in-band (a
    StepStream answer's ``error``): the same as the unary call's failure would give."""
    return _domain_error(_CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message, status)


def _domain_error(code: grpc.StatusCode, message: str, status: status_pb2.Status | None) -> KVMemError:
    info = _error_info(status)
    raw = "" if info is None else info.reason
    cls = _BY_REASON.get(parse_reason(raw)) or _BY_CODE.get(code, KVMemError)
    return cls(code, raw, message, None if info is None else dict(info.metadata))


def _error_info(status: status_pb2.Status | None) -> error_details_pb2.ErrorInfo | None:
    """kvmem's ``ErrorInfo`` among a status's details, or None: no status, no detail,
    or another domain's is no kvmem reason."""
    for detail in () if status is None else status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Is(info.DESCRIPTOR) and detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return info
    return None
