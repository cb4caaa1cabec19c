"""kvmem's one error taxonomy.

Capacity shortfalls are *results* (per-item statuses in a step), never exceptions. Bad
input raises a :class:`KVMemError` whose :class:`Reason` is one of a closed set; each
reason knows its :class:`ErrorKind`, and the service maps kinds to gRPC status codes in
one place (``kvmem.server.edge.service``). The core never imports gRPC.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorKind(enum.Enum):
    """Transport-neutral error classes; the names match gRPC's status codes."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class Reason(enum.Enum):
    """Why a call failed: a closed set. Sent as ``google.rpc.ErrorInfo.reason`` (the
    member name); each reason knows its :class:`ErrorKind`.

    The wire contract lists the same set as the proto's ``kvmem.v1.ErrorReason`` (there
    ``ERROR_REASON_`` + the member name): a reason added here is added there too, with
    its meaning and gRPC code (the service refuses to start otherwise, and
    tests/test_proto.py checks both sets are equal). This enum stays the core's own: the
    core never imports the proto."""

    # INVALID_ARGUMENT: malformed input.
    BAD_VALUE = ("BAD_VALUE", ErrorKind.INVALID_ARGUMENT)
    LENGTH_MISMATCH = ("LENGTH_MISMATCH", ErrorKind.INVALID_ARGUMENT)
    DUPLICATE_SLOT = ("DUPLICATE_SLOT", ErrorKind.INVALID_ARGUMENT)
    # NOT_FOUND: never says whether the slot belongs to someone else.
    SLOT_NOT_FOUND = ("SLOT_NOT_FOUND", ErrorKind.NOT_FOUND)
    TICKET_NOT_FOUND = ("TICKET_NOT_FOUND", ErrorKind.NOT_FOUND)  # no open hand-off ticket of that value
    # FAILED_PRECONDITION: the input is well formed but disagrees with the state.
    UNKNOWN_SESSION = ("UNKNOWN_SESSION", ErrorKind.FAILED_PRECONDITION)
    ALLOCED_LEN_MISMATCH = ("ALLOCED_LEN_MISMATCH", ErrorKind.FAILED_PRECONDITION)
    TRUNCATE_BEYOND_ALLOCED = ("TRUNCATE_BEYOND_ALLOCED", ErrorKind.FAILED_PRECONDITION)
    PAGE_SHARED = ("PAGE_SHARED", ErrorKind.FAILED_PRECONDITION)  # a write into a page the prefix cache shares
    NAMESPACE_MISMATCH = ("NAMESPACE_MISMATCH", ErrorKind.FAILED_PRECONDITION)  # a ticket of another namespace
    MODEL_MISMATCH = ("MODEL_MISMATCH", ErrorKind.FAILED_PRECONDITION)  # an Attach naming another model (--store)
    # RESOURCE_EXHAUSTED: a resource that is not pages (pages are a per-item result).
    NO_FREE_REQUEST_SLOT = ("NO_FREE_REQUEST_SLOT", ErrorKind.RESOURCE_EXHAUSTED)
    TOO_MANY_SESSIONS = ("TOO_MANY_SESSIONS", ErrorKind.RESOURCE_EXHAUSTED)  # the max_sessions limit
    QUOTA_EXCEEDED = ("QUOTA_EXCEEDED", ErrorKind.RESOURCE_EXHAUSTED)  # an adoption past the session's quota
    # Transport-level reasons raised by the service.
    BAD_TOKEN = ("BAD_TOKEN", ErrorKind.UNAUTHENTICATED)
    SHUTTING_DOWN = ("SHUTTING_DOWN", ErrorKind.UNAVAILABLE)
    NOT_READY = ("NOT_READY", ErrorKind.UNAVAILABLE)  # started, waiting for its KV memory
    # A broken invariant: a bug in kvmem, never the caller's fault.
    CORRUPTION = ("CORRUPTION", ErrorKind.INTERNAL)

    def __init__(self, _name: str, kind: ErrorKind) -> None:
        self.kind = kind


class KVMemError(Exception):
    """A call failed; nothing was changed. ``metadata`` holds the offending values."""

    def __init__(self, reason: Reason, message: str, **metadata: Any) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.metadata = {k: str(v) for k, v in metadata.items()}

    @property
    def kind(self) -> ErrorKind:
        return self.reason.kind

    def __repr__(self) -> str:
        return f"KVMemError({self.reason.name}, {self.message!r})"


class CorruptionError(KVMemError):
    """An invariant of the pool does not hold: a bug in kvmem, reported, never ignored."""

    def __init__(self, message: str, **metadata: Any) -> None:
        super().__init__(Reason.CORRUPTION, message, **metadata)
