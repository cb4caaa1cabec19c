"""The gRPC servicer: parse the proto, call the sessions layer, map the result. Nothing else.

The conversions are :mod:`kvmem.server.edge.wire`'s. Errors are mapped in one place,
:func:`~kvmem.server.edge.wire.to_status`: a :class:`KVMemError`'s kind picks the gRPC status
code, its message (which names the offending value) becomes the status message, and its
reason travels as a ``google.rpc.ErrorInfo`` detail, so a client can tell "no free
request slot" from gRPC's own RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvmem.cli.version import version
from kvmem.server.edge.handlers import register
from kvmem.server.edge.refusals import RefusalLog
from kvmem.server.edge.wire import (
    STATUS_CODE,
    Malformed,
    refused_step,
    stats_response,
    step_batch,
    step_response,
)
from kvmem.server.edge.wire import geometry_to_proto as geometry_to_proto  # re-exported: the service's vocabulary
from kvmem.server.edge.wire import handle_to_proto as handle_to_proto
from kvmem.server.edge.wire import to_status as _to_status
from kvmem.server.errors import CorruptionError, KVMemError, Reason
from kvmem.server.observe.metrics import RpcStats
from kvmem.server.sessions import Sessions
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

if TYPE_CHECKING:
    from kvmem.server.observe.events import EventLog

log = logging.getLogger("kvmem.service")


def add_to_server(service: KVMemoryService, server: grpc.aio.Server) -> None:
    """Register ``service``'s methods (every method of the proto's KVMemory) on
    ``server``, as ``kvmem_pb2_grpc.add_KVMemoryServicer_to_server`` would, but with
    request deserializers that hand a body that does not parse to the handler as a
    :class:`Malformed`, so that it is refused as INVALID_ARGUMENT naming the method."""
    register(server, kvmem_pb2.DESCRIPTOR.services_by_name["KVMemory"], lambda method: getattr(service, method.name))


Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _unary(
    method: Callable[[KVMemoryService, Req, grpc.aio.ServicerContext], Resp],
) -> Callable[[KVMemoryService, Req, grpc.aio.ServicerContext], Coroutine[Any, Any, Resp]]:
    """Make a plain handler (it never awaits: each call is one critical section on the
    event loop) the coroutine gRPC calls (:meth:`KVMemoryService._handle` runs it); a
    refusal becomes the call's status."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: KVMemoryService, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        response, refused = self._handle(name, method, request, context, admit=True)
        if refused is not None:
            await context.abort_with_status(_to_status(refused))
            raise AssertionError("abort_with_status returned") from refused  # it always raises
        return response  # type: ignore[return-value]  # set when not refused

    return wrapper


def _as_bytes(value: str | bytes) -> bytes:
    """A metadata value as bytes (gRPC hands text keys' values as str)."""
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


class KVMemoryService(kvmem_pb2_grpc.KVMemoryServicer):
    """kvmem.v1.KVMemory over :class:`~kvmem.server.sessions.Sessions`."""

    def __init__(self, auth_token: str | None = None) -> None:
        self._sessions: Sessions | None = None  # until ready(): the server waits for its memory
        self.geometry = kvmem_pb2.PoolGeometry()
        self.memory_handles: list[kvmem_pb2.MemoryHandle] = []
        self.memory_backend = "none"
        self._auth = None if auth_token is None else f"Bearer {auth_token}".encode()
        # The session streams' handler tasks (KeepAlive, StepStream) while they wait for
        # the client's next message: what the shutdown cancels (see _messages).
        self.waiting: set[asyncio.Task[Any]] = set()
        self.stopping = asyncio.Event()
        self.rpc_stats: RpcStats | None = None  # set by the server when it serves metrics
        self.refusals = RefusalLog()  # flushed by the server at shutdown
        self._events: EventLog | None = None  # the prefix cache's events, for WatchEvents

    def ready(
        self,
        sessions: Sessions,
        geometry: kvmem_pb2.PoolGeometry,
        memory_handles: list[kvmem_pb2.MemoryHandle],
        memory_backend: str,
        events: EventLog | None = None,
    ) -> None:
        """The pool exists: serve it. Before this every call is refused as NOT_READY."""
        self.geometry = geometry
        self.memory_handles = memory_handles
        self.memory_backend = memory_backend
        self._events = events
        self._sessions = sessions

    @property
    def sessions(self) -> Sessions:
        if self._sessions is None:
            raise KVMemError(
                Reason.NOT_READY, "the server has started but waits for its KV memory (readiness NOT_SERVING): retry"
            )
        return self._sessions

    def _handle(
        self,
        name: str,
        method: Callable[[KVMemoryService, Req, grpc.aio.ServicerContext], Resp],
        request: Req,
        context: grpc.aio.ServicerContext,
        *,
        admit: bool,
    ) -> tuple[Resp | None, KVMemError | None]:
        """Run one call's handler: ``(response, None)``, or ``(None, err)`` when it is
        refused (a KVMemError, an auth failure with ``admit``, a body that did not parse:
        :class:`Malformed`, INVALID_ARGUMENT). Every refusal is counted in the service's
        :class:`RefusalLog` (rate-limited summaries, never a line per call), corruption
        logged each time. With metrics on (``rpc_stats`` set), the call is counted by its
        code and the handler timed; off, it pays two ``is None`` tests for that (the
        timing costs ~2% of a 256-item Step's round trip, measured)."""
        stats = self.rpc_stats
        started = 0.0 if stats is None else time.perf_counter()
        code, reason = "OK", None
        try:
            if admit:
                self._admit(context)
            if isinstance(request, Malformed):
                raise request.error(name)
            return method(self, request, context), None
        except KVMemError as err:
            code, reason = STATUS_CODE[err.kind].name, err.reason.name
            self._refused(context, name, err)
            return None, err
        except Exception:
            code = grpc.StatusCode.UNKNOWN.name  # what gRPC answers for an unexpected exception
            raise
        finally:
            if stats is not None:
                stats.record(name, code, reason, time.perf_counter() - started)

    def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse every call once the drain of a shutdown is over (UNAVAILABLE, with the
        reason SHUTTING_DOWN), then check the caller's token."""
        if self.stopping.is_set():
            raise KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: it takes no more calls")
        self._check_auth(context)

    async def _messages(self, request_iterator: AsyncIterator[Req]) -> AsyncIterator[Req]:
        """A session stream's messages, until the client ends the stream or the drain of a
        shutdown is over. While it waits for the next message the handler's task is in
        :attr:`waiting`: the shutdown cancels those tasks (the handler then ends the stream
        with SHUTTING_DOWN), and only those. A task cancelled while it sends an answer
        would send no status at all, leaving the client to wait for the end of the grace
        period (gRPC then fails the call); one that answers sees the shutdown here,
        before it waits again."""
        task = asyncio.current_task()
        assert task is not None
        waiting, stopping = self.waiting, self.stopping
        messages = aiter(request_iterator)
        while not stopping.is_set():
            waiting.add(task)
            try:
                message = await anext(messages)
            except StopAsyncIteration:
                return
            finally:
                waiting.discard(task)
            yield message

    def _refused(self, context: grpc.aio.ServicerContext, method: str, err: KVMemError) -> None:
        """Log a refused call: corruption (a bug in kvmem) as an ERROR each time, any
        other refusal into the rate-limited summaries."""
        if isinstance(err, CorruptionError):
            log.error("corruption detected in %s: %s", method, err.message)
        else:
            self.refusals.record(context.peer(), method, err.reason.name, err.message)

    def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        """With a token set, every call that does not come over the unix socket must
        carry ``authorization: Bearer <token>``, compared in constant time (how long the
        comparison takes says nothing of how much of a guess was right)."""
        if self._auth is None or context.peer().startswith("unix:"):
            return
        given = dict(context.invocation_metadata() or ()).get("authorization")
        if given is None or not hmac.compare_digest(_as_bytes(given), self._auth):
            raise KVMemError(
                Reason.BAD_TOKEN,
                "missing authorization metadata" if given is None else "wrong bearer token in authorization metadata",
            )

    @_unary
    def Attach(self, request: kvmem_pb2.AttachRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.AttachResponse:
        quota = request.quota_pages if request.HasField("quota_pages") else None
        sessions = self.sessions
        session = sessions.attach(request.name, quota, request.cache_namespace)
        core = sessions.core
        return kvmem_pb2.AttachResponse(
            epoch=sessions.epoch,
            session_id=session.session_id,
            lease_ms=int(sessions.lease_s * 1000),
            geometry=self.geometry,
            memory=self.memory_handles,
            prefix_cache=kvmem_pb2.PrefixCacheInfo(
                enabled=core.prefix_enabled, hash=core.page_keys.name, cache_namespace=session.cache_namespace
            ),
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
        return self._step(request, context)

    def _step(self, request: kvmem_pb2.StepRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StepResponse:
        batch = step_batch(request)
        sessions = self.sessions  # a property (NOT_READY before the pool exists): read once
        result = sessions.step(request.session_id, batch)
        return step_response(batch, result, sessions.epoch, sessions.core.pool.num_free)

    @_unary
    def Stats(self, request: kvmem_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StatsResponse:
        sessions = self.sessions
        stats = sessions.stats(audit=request.audit)
        response = stats_response(stats, sessions.epoch, self.geometry, self.memory_backend, len(sessions.quarantined))
        response.version = version()
        return response

    async def StepStream(
        self, request_iterator: AsyncIterator[kvmem_pb2.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmem_pb2.StepResponse]:
        """Steps on one stream: each message is handled as a unary Step would be, and a
        refused one is answered in-band (:func:`~kvmem.server.edge.wire.refused_step`), the
        stream going on. The token is checked once, at the stream's start. Once a
        shutdown's drain is over the stream ends with UNAVAILABLE (SHUTTING_DOWN), at
        the next message or at once if it waits for one, as a unary Step would fail."""
        try:
            self._admit(context)
        except KVMemError as err:
            self._refused(context, "StepStream", err)
            await context.abort_with_status(_to_status(err))
            raise AssertionError("abort_with_status returned") from err  # it always raises
        step = KVMemoryService._step
        try:
            async for request in self._messages(request_iterator):
                response, refused = self._handle("StepStream", step, request, context, admit=False)
                if refused is not None:
                    response = refused_step(refused, "" if self._sessions is None else self._sessions.epoch)
                assert response is not None
                yield response
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise  # gRPC cancelled the call: the peer is gone, there is no one to answer
            # The shutdown cancelled this task while it waited for a message (see _messages).
        if self.stopping.is_set():
            await context.abort_with_status(
                _to_status(KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: it takes no more calls"))
            )

    async def WatchEvents(
        self, request: kvmem_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmem_pb2.KVEventBatch]:
        """The prefix cache's events from ``request.from_seq`` on, then live, until the
        watcher leaves or the server stops (the stream then ends with UNAVAILABLE,
        SHUTTING_DOWN, so a router knows to reconnect to the next run). Needs no
        session: the caller's token, where the server asks for one, is all it checks."""
        try:
            self._admit(context)
            if isinstance(request, Malformed):
                raise request.error("WatchEvents")
            events = self._events
            if events is None:
                _ = self.sessions  # NOT_READY until the pool (and with it the event log) exists
                raise KVMemError(Reason.NOT_READY, "this server keeps no event log")
        except KVMemError as err:
            self._refused(context, "WatchEvents", err)
            await context.abort_with_status(_to_status(err))
            raise AssertionError("abort_with_status returned") from err  # it always raises
        try:
            async for batch in events.watch(request, context):
                yield batch
        except KVMemError as err:
            self._refused(context, "WatchEvents", err)
            await context.abort_with_status(_to_status(err))
        if self.stopping.is_set():
            await context.abort_with_status(
                _to_status(KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: the event stream ended"))
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
        reply = kvmem_pb2.KeepAliveResponse(epoch=sessions.epoch)
        ended_by_server = False
        try:
            async for message in self._messages(request_iterator):
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
            # The shutdown cancelled this task while it waited for a message (see _messages).
        finally:
            if session_id is not None and not ended_by_server and not self.stopping.is_set():
                sessions.stream_gone(session_id)
        if self.stopping.is_set():
            # grpc.aio sends no status for a handler that returns or is cancelled: without
            # one the stream would stay open until the grace period runs out.
            await context.abort_with_status(
                _to_status(KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: this session ended"))
            )
