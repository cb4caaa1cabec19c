"""The gRPC servicer: parse the proto, call the sessions layer, map the result. Nothing else.

Errors are mapped in one place, :func:`_to_status`: a :class:`KVMemError`'s kind picks
the gRPC status code, its message (which names the offending value) becomes the status
message, and its reason travels as a ``google.rpc.ErrorInfo`` detail, so a client can
tell "no free request slot" from gRPC's own RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmem.server.core import CoreConfig, StepBatch
from kvmem.server.errors import CorruptionError, ErrorKind, KVMemError, Reason
from kvmem.server.memory import HandleInfo, KVGeometry
from kvmem.server.metrics import RpcStats
from kvmem.server.refusals import RefusalLog
from kvmem.server.sessions import Sessions
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

log = logging.getLogger("kvmem.service")

ERROR_DOMAIN = "kvmem.v1"
_STATUS_CODE = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
_REASON_PREFIX = "ERROR_REASON_"
# Each Reason's ErrorInfo.reason: the name of its value in the proto's ErrorReason, less
# the prefix. Looked up here, at import, so a reason the proto does not list stops the
# server from starting (ValueError) instead of reaching a client as a name it cannot read.
_WIRE_REASON = {
    reason: kvmem_pb2.ErrorReason.Name(kvmem_pb2.ErrorReason.Value(_REASON_PREFIX + reason.name))[len(_REASON_PREFIX) :]
    for reason in Reason
}


def _to_status(err: KVMemError) -> grpc.Status:
    """The status of a refused call: the kind's code, the message, and the reason (a
    name of the proto's ErrorReason) with the offending values as an ErrorInfo."""
    info = error_details_pb2.ErrorInfo(reason=_WIRE_REASON[err.reason], domain=ERROR_DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    code = _STATUS_CODE[err.kind]
    return rpc_status.to_status(status_pb2.Status(code=code.value[0], message=err.message, details=[detail]))


_FORMAT = {"mha": kvmem_pb2.KV_FORMAT_MHA, "mla": kvmem_pb2.KV_FORMAT_MLA}


def layout_to_proto(g: KVGeometry) -> kvmem_pb2.KVLayout:
    return kvmem_pb2.KVLayout(
        format=_FORMAT[g.format],
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        kv_lora_rank=g.kv_lora_rank,
        rope_dim=g.rope_dim,
        dtype=g.dtype,
        bytes_per_token=g.bytes_per_token,
    )


def geometry_to_proto(core: CoreConfig, kv: KVGeometry | None) -> kvmem_pb2.PoolGeometry:
    """The pool geometry Attach and Stats report; ``kv`` is None without KV memory."""
    msg = kvmem_pb2.PoolGeometry(
        num_pages=core.num_pages,
        page_size=core.page_size,
        max_requests=core.max_requests,
        max_context_len=core.max_context_len,
        max_pages_per_request=core.max_pages_per_request,
    )
    if kv is not None:
        msg.layout.CopyFrom(layout_to_proto(kv))
    return msg


def handle_to_proto(h: HandleInfo) -> kvmem_pb2.MemoryHandle:
    """A backend's handle as the explicit proto fields (no pickle on the wire)."""
    msg = kvmem_pb2.MemoryHandle(name=h.name, rank=h.rank, dtype=h.dtype, shape=list(h.shape), size_bytes=h.size_bytes)
    if h.cuda is not None:
        msg.cuda.CopyFrom(kvmem_pb2.CudaIpcHandle(**dataclasses.asdict(h.cuda)))
    else:
        msg.shm.path = h.shm_path or ""
    return msg


class Malformed:
    """What a handler receives instead of a request whose body does not parse: gRPC
    would otherwise fail the call inside its own code (UNKNOWN, and a traceback in the
    log per call). The handler refuses it as INVALID_ARGUMENT (:meth:`error`)."""

    __slots__ = ("problem", "size", "type_name")

    def __init__(self, type_name: str, size: int, problem: str) -> None:
        self.type_name = type_name
        self.size = size
        self.problem = problem

    def error(self, method: str) -> KVMemError:
        return KVMemError(
            Reason.BAD_VALUE,
            f"{method}: the request body ({self.size} bytes) is not a valid {self.type_name}: {self.problem}",
            size=self.size,
        )


def _deserializer(cls: Any) -> Callable[[bytes], Any]:
    """``cls.FromString``, returning a :class:`Malformed` instead of raising."""
    parse, type_name = cls.FromString, cls.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:  # "Error parsing message with type '...': Wire format was corrupt"
            return Malformed(type_name, len(data), str(exc).rpartition("': ")[2] or "it does not parse")
        except Exception as exc:  # any other failure of the parser: still the caller's bytes
            return Malformed(type_name, len(data), f"{type(exc).__name__}: {exc}")

    return deserialize


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_to_server(service: KVMemoryService, server: grpc.aio.Server) -> None:
    """Register ``service``'s methods (every method of the proto's KVMemory) on
    ``server``, as ``kvmem_pb2_grpc.add_KVMemoryServicer_to_server`` would, but with
    request deserializers that hand a body that does not parse to the handler as a
    :class:`Malformed`, so that it is refused as INVALID_ARGUMENT naming the method."""
    descriptor = kvmem_pb2.DESCRIPTOR.services_by_name["KVMemory"]
    handlers = {}
    for method in descriptor.methods:
        request_cls = getattr(kvmem_pb2, method.input_type.name)
        response_cls = getattr(kvmem_pb2, method.output_type.name)
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(service, method.name),
            request_deserializer=_deserializer(request_cls),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    server.add_registered_method_handlers(descriptor.full_name, handlers)


Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _unary(
    method: Callable[[KVMemoryService, Req, grpc.aio.ServicerContext], Resp],
) -> Callable[[KVMemoryService, Req, grpc.aio.ServicerContext], Coroutine[Any, Any, Resp]]:
    """Make a plain handler (it never awaits: each call is one critical section on the
    event loop) the coroutine gRPC calls; turn a KVMemError (and an auth failure) into
    its status. A body that did not parse (:class:`Malformed`) is refused as
    INVALID_ARGUMENT; every refusal is counted in the service's :class:`RefusalLog`
    (rate-limited summaries, never a line per call), corruption logged each time.
    With metrics on (``rpc_stats`` set), count the call by its code and time the
    handler; off, the call pays two ``is None`` tests for it (the timing costs ~2% of a
    256-item Step's round trip, measured)."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: KVMemoryService, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        stats = self.rpc_stats
        started = 0.0 if stats is None else time.perf_counter()
        code, reason = "OK", None
        try:
            self._admit(context)
            if isinstance(request, Malformed):
                raise request.error(name)
            return method(self, request, context)
        except KVMemError as err:
            code, reason = _STATUS_CODE[err.kind].name, err.reason.name
            self._refused(context, name, err)
            await context.abort_with_status(_to_status(err))
            raise AssertionError("abort_with_status returned") from err  # it always raises
        except Exception:
            code = grpc.StatusCode.UNKNOWN.name  # what gRPC answers for an unexpected exception
            raise
        finally:
            if stats is not None:
                stats.record(name, code, reason, time.perf_counter() - started)

    return wrapper


def _array(field: Any) -> np.ndarray:
    """A packed repeated int field as an int64 array, without a Python loop. Up to 128
    items ``np.fromiter`` (which walks the field in C) costs half of protobuf's numpy
    conversion on a server whose caches are cold between calls; beyond, the conversion
    wins (measured in the server: 20 vs 40 µs for two 32-item fields, 45 vs 50 µs for
    two of 256)."""
    n = len(field)
    if not n:
        return _EMPTY
    return np.fromiter(field, np.int64, n) if n <= 128 else np.array(field, dtype=np.int64)


_EMPTY = np.zeros(0, dtype=np.int64)


def _le_bytes(a: np.ndarray) -> bytes:
    """An int32 array as the little-endian bytes the proto promises."""
    return a.tobytes() if _LITTLE_ENDIAN else a.astype("<i4").tobytes()


_LITTLE_ENDIAN = sys.byteorder == "little"


class KVMemoryService(kvmem_pb2_grpc.KVMemoryServicer):
    """kvmem.v1.KVMemory over :class:`~kvmem.server.sessions.Sessions`."""

    def __init__(self, auth_token: str | None = None) -> None:
        self._sessions: Sessions | None = None  # until ready(): the server waits for its memory
        self.geometry = kvmem_pb2.PoolGeometry()
        self.memory_handles: list[kvmem_pb2.MemoryHandle] = []
        self.memory_backend = "none"
        self._auth = None if auth_token is None else f"Bearer {auth_token}"
        self.keepalive_tasks: set[asyncio.Task[Any]] = set()
        self.stopping = asyncio.Event()
        self.rpc_stats: RpcStats | None = None  # set by the server when it serves metrics
        self.refusals = RefusalLog()  # flushed by the server at shutdown

    def ready(
        self,
        sessions: Sessions,
        geometry: kvmem_pb2.PoolGeometry,
        memory_handles: list[kvmem_pb2.MemoryHandle],
        memory_backend: str,
    ) -> None:
        """The pool exists: serve it. Before this every call is refused as NOT_READY."""
        self.geometry = geometry
        self.memory_handles = memory_handles
        self.memory_backend = memory_backend
        self._sessions = sessions

    @property
    def sessions(self) -> Sessions:
        if self._sessions is None:
            raise KVMemError(
                Reason.NOT_READY, "the server has started but waits for its KV memory (readiness NOT_SERVING): retry"
            )
        return self._sessions

    def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse every call once the drain of a shutdown is over (UNAVAILABLE, with the
        reason SHUTTING_DOWN), then check the caller's token."""
        if self.stopping.is_set():
            raise KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: it takes no more calls")
        self._check_auth(context)

    def _refused(self, context: grpc.aio.ServicerContext, method: str, err: KVMemError) -> None:
        """Log a refused call: corruption (a bug in kvmem) as an ERROR each time, any
        other refusal into the rate-limited summaries."""
        if isinstance(err, CorruptionError):
            log.error("corruption detected in %s: %s", method, err.message)
        else:
            self.refusals.record(context.peer(), method, err.reason.name, err.message)

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        """With a token set, every call that does not come over the unix socket must
        carry ``authorization: Bearer <token>``."""
        if self._auth is None or context.peer().startswith("unix:"):
            return
        given = dict(context.invocation_metadata() or ()).get("authorization")
        if given != self._auth:
            raise KVMemError(
                Reason.BAD_TOKEN,
                "missing authorization metadata" if given is None else "wrong bearer token in authorization metadata",
            )

    @_unary
    def Attach(self, request: kvmem_pb2.AttachRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.AttachResponse:
        quota = request.quota_pages if request.HasField("quota_pages") else None
        session = self.sessions.attach(request.name, quota)
        return kvmem_pb2.AttachResponse(
            epoch=self.sessions.epoch,
            session_id=session.session_id,
            lease_ms=int(self.sessions.lease_s * 1000),
            geometry=self.geometry,
            memory=self.memory_handles,
        )

    @_unary
    def Detach(self, request: kvmem_pb2.DetachRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.DetachResponse:
        self.sessions.session(request.session_id)
        released = self.sessions.end(request.session_id, "detached")
        return kvmem_pb2.DetachResponse(epoch=self.sessions.epoch, num_requests_released=released)

    @_unary
    def Open(self, request: kvmem_pb2.OpenRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.OpenResponse:
        slots = self.sessions.open(request.session_id, list(request.request_ids))
        return kvmem_pb2.OpenResponse(epoch=self.sessions.epoch, slots=slots.tolist())

    @_unary
    def Step(self, request: kvmem_pb2.StepRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StepResponse:
        expected = request.alloc_expected_lens
        batch = StepBatch(
            _array(request.release_slots),
            _array(request.truncate_slots),
            _array(request.truncate_lens),
            _array(request.alloc_slots),
            _array(request.alloc_needs),
            _array(expected) if len(expected) else None,
            request.atomic,
        )
        sessions = self.sessions  # a property (NOT_READY before the pool exists): read once
        result = sessions.step(request.session_id, batch)
        return kvmem_pb2.StepResponse(
            epoch=sessions.epoch,
            alloc_status=result.alloc_status.tobytes(),
            kv_loc=_le_bytes(result.kv_loc),
            kv_loc_offsets=_le_bytes(result.kv_loc_offsets),
            new_pages=_le_bytes(result.new_pages),
            new_page_offsets=_le_bytes(result.new_page_offsets),
            num_pages_released=result.num_pages_released,
            num_free_pages=sessions.core.pool.num_free,
        )

    @_unary
    def Stats(self, request: kvmem_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StatsResponse:
        stats = self.sessions.stats(audit=request.audit)
        pool = stats.pool
        now_sessions = []
        now = time.monotonic()
        for row in stats.sessions:
            session = row.session
            usage = kvmem_pb2.SessionUsage(
                name=session.name,
                index=session.owner,
                num_requests=row.num_requests,
                num_pages_held=row.num_pages_held,
                idle_ms=int((now - session.last_seen) * 1000),
            )
            if session.quota_pages is not None:
                usage.quota_pages = session.quota_pages
            now_sessions.append(usage)
        audit = kvmem_pb2.AuditResult(ran=stats.audit is not None)
        if stats.audit is not None:
            audit.ok = stats.audit.ok
            audit.problems.extend(stats.audit.problems)
        return kvmem_pb2.StatsResponse(
            epoch=self.sessions.epoch,
            geometry=self.geometry,
            num_pages_total=pool.num_pages_total,
            num_free_pages=pool.num_free_pages,
            num_cached_pages=pool.num_cached_pages,
            num_used_pages=pool.num_used_pages,
            num_quarantined_pages=pool.num_quarantined_pages,
            num_quarantined_sessions=len(self.sessions.quarantined),
            num_free_request_slots=pool.num_free_request_slots,
            num_open_requests=pool.num_open_requests,
            sessions=now_sessions,
            audit=audit,
            num_steps=stats.num_steps,
            memory_backend=self.memory_backend,
            uptime_ms=int(stats.uptime_s * 1000),
        )

    async def KeepAlive(
        self, request_iterator: AsyncIterator[kvmem_pb2.KeepAliveRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmem_pb2.KeepAliveResponse]:
        """Refresh the session's lease on every message. When the client ends the stream
        (its process is gone, or it closed it), the session ends at once, or its
        quarantine if its lease had lapsed (:meth:`Sessions.stream_gone`). When the
        server ends it (a refused message, shutdown), the client's process may live on:
        nothing is freed early on that account.

        A message for a session in quarantine (its process was stopped past its lease and
        woke up) gets no answer and the stream stays open: its end is then the sign that
        the process let go (the client stops its keep-alive once it learns the session is
        lost) or died, and the quarantine ends with it. The process learns of the loss
        from its next call, or from the Step answer it was waiting for (refused as late)."""
        try:
            self._admit(context)
            sessions = self.sessions
        except KVMemError as err:
            self._refused(context, "KeepAlive", err)
            await context.abort_with_status(_to_status(err))
            raise AssertionError("abort_with_status returned") from err  # it always raises
        session_id = None
        task = asyncio.current_task()
        assert task is not None
        self.keepalive_tasks.add(task)
        reply = kvmem_pb2.KeepAliveResponse(epoch=sessions.epoch)
        ended_by_server = False
        try:
            async for message in request_iterator:
                if isinstance(message, Malformed):
                    raise message.error("KeepAlive")
                if session_id is not None and message.session_id and message.session_id != session_id:
                    raise KVMemError(Reason.BAD_VALUE, "a keep-alive stream serves one session")
                if sessions.in_quarantine(session_id or message.session_id):
                    session_id = session_id or message.session_id
                    continue  # parked: no answer (see above)
                sessions.session(session_id or message.session_id)  # refreshes the lease
                session_id = session_id or message.session_id
                yield reply
        except KVMemError as err:  # a bad message, or the session ended while the stream was open
            ended_by_server = True
            self._refused(context, "KeepAlive", err)
            await context.abort_with_status(_to_status(err))
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise  # gRPC cancelled the call: the peer is gone, there is no one to answer
            # Shutdown cancels this task. grpc.aio sends no status for a cancelled handler,
            # so without one the stream would stay open until the grace period runs out.
            ended_by_server = True
            await context.abort_with_status(
                _to_status(KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: this session ended"))
            )
        finally:
            self.keepalive_tasks.discard(task)
            if session_id is not None and not ended_by_server and not self.stopping.is_set():
                sessions.stream_gone(session_id)
