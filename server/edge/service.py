"""The gRPC servicer: parse the proto, call the sessions layer, map the result. Nothing else.

Every handler runs behind the server's one :class:`~kvmem.server.edge.guard.Guard`
(admission, bodies that do not parse, the refusal log, the RPC metrics, the abort): a
handler refuses by raising :class:`KVMemError`. The conversions are
:mod:`kvmem.server.edge.wire`'s. Errors are mapped in one place,
:func:`~kvmem.server.edge.wire.to_status`: a :class:`KVMemError`'s kind picks the gRPC status
code, its message (which names the offending value) becomes the status message, and its
reason travels as a ``google.rpc.ErrorInfo`` detail, so a client can tell "no free
request slot" from gRPC's own RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from kvmem.cli.version import version
from kvmem.server.core import StepOutcome
from kvmem.server.edge.guard import Guard, stream, unary
from kvmem.server.edge.handlers import register
from kvmem.server.edge.wire import carries_prefix, refused_step, stats_response, step_batch, step_response
from kvmem.server.edge.wire import geometry_to_proto as geometry_to_proto  # re-exported: the service's vocabulary
from kvmem.server.edge.wire import handle_to_proto as handle_to_proto
from kvmem.server.errors import KVMemError, Reason
from kvmem.server.sessions import Sessions
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

if TYPE_CHECKING:
    from kvmem.server.observe.events import EventLog


def add_to_server(service: KVMemoryService, server: grpc.aio.Server) -> None:
    """Register ``service``'s methods (every method of the proto's KVMemory) on
    ``server``, as ``kvmem_pb2_grpc.add_KVMemoryServicer_to_server`` would, but with
    request deserializers that hand a body that does not parse to the handler as a
    :class:`~kvmem.server.edge.wire.Malformed`, which the guard refuses as
    INVALID_ARGUMENT naming the method."""
    register(server, kvmem_pb2.DESCRIPTOR.services_by_name["KVMemory"], lambda method: getattr(service, method.name))


class KVMemoryService(kvmem_pb2_grpc.KVMemoryServicer):
    """kvmem.v1.KVMemory over :class:`~kvmem.server.sessions.Sessions`, behind ``guard``."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self._sessions: Sessions | None = None  # until ready(): the server waits for its memory
        self.geometry = kvmem_pb2.PoolGeometry()
        self.memory_handles: list[kvmem_pb2.MemoryHandle] = []
        self.memory_backend = "none"
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

    @unary
    def Attach(self, request: kvmem_pb2.AttachRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.AttachResponse:
        quota = request.quota_pages if request.HasField("quota_pages") else None
        sessions = self.sessions
        if request.model_id:  # with a store: part of every store key (one model per server)
            tier = sessions.core.host_tier
            refused = None if tier is None or tier.link is None else tier.link.set_model(request.model_id)
            if refused is not None:
                raise KVMemError(Reason.MODEL_MISMATCH, refused)
        resumed = None
        if request.resume_session_id:
            resumed = sessions.resume(request.resume_session_id)
            session = resumed.session
        else:
            session = sessions.attach(request.name, quota, request.cache_namespace)
        core = sessions.core
        response = kvmem_pb2.AttachResponse(
            epoch=sessions.epoch,
            session_id=session.session_id,
            lease_ms=int(sessions.lease_s * 1000),
            geometry=self.geometry,
            memory=self.memory_handles,
            prefix_cache=kvmem_pb2.PrefixCacheInfo(
                enabled=core.prefix_enabled, hash=core.page_keys.name, cache_namespace=session.cache_namespace
            ),
            resume_ms=int(sessions.resume_s * 1000) if sessions.steplog is not None else 0,
        )
        if resumed is not None:
            response.resumed.applied_seq = resumed.applied_seq
            response.resumed.last_step_answer = resumed.answer
            response.resumed.answer_kept = resumed.answer_kept
            response.resumed.num_requests = resumed.num_requests
        return response

    @unary
    def Detach(self, request: kvmem_pb2.DetachRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.DetachResponse:
        sessions = self.sessions
        sessions.session(request.session_id)  # UNKNOWN_SESSION unless it is live
        released = sessions.end(request.session_id, "detached")
        return kvmem_pb2.DetachResponse(epoch=sessions.epoch, num_requests_released=released)

    @unary
    def Open(self, request: kvmem_pb2.OpenRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.OpenResponse:
        slots = self.sessions.open(request.session_id, list(request.request_ids))
        return kvmem_pb2.OpenResponse(epoch=self.sessions.epoch, slots=slots.tolist())

    @unary
    def Step(self, request: kvmem_pb2.StepRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StepResponse:
        return self._step(request, context)

    def _step(self, request: kvmem_pb2.StepRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StepResponse:
        prefix = carries_prefix(request)  # decided once: the batch's columns and the response's fields
        batch = step_batch(request, prefix)
        sessions = self.sessions  # a property (NOT_READY before the pool exists): read once
        pool = sessions.core.pool

        def answer(result: StepOutcome, seq: int) -> kvmem_pb2.StepResponse:
            return step_response(result, sessions.epoch, pool.num_free, prefix, seq)

        return sessions.step(request.session_id, batch, request.seq, answer)

    @unary
    def Stats(self, request: kvmem_pb2.StatsRequest, context: grpc.aio.ServicerContext) -> kvmem_pb2.StatsResponse:
        sessions = self.sessions
        stats = sessions.stats(audit=request.audit)
        response = stats_response(stats, sessions.epoch, self.geometry, self.memory_backend, len(sessions.quarantined))
        response.version = version()
        return response

    @stream("the server is shutting down: it takes no more calls")
    async def StepStream(
        self, request_iterator: AsyncIterator[kvmem_pb2.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmem_pb2.StepResponse]:
        """Steps on one stream: each message is handled as a unary Step would be, and a
        refused one is answered in-band (:func:`~kvmem.server.edge.wire.refused_step`), the
        stream going on. The token is checked once, at the stream's start. Once a
        shutdown's drain is over the stream ends with UNAVAILABLE (SHUTTING_DOWN), at
        the next message or at once if it waits for one, as a unary Step would fail."""
        guard, step = self.guard, KVMemoryService._step
        async for request in guard.messages(request_iterator):
            response, refused = guard.run("StepStream", step, self, request, context)
            if refused is not None:
                response = refused_step(refused, "" if self._sessions is None else self._sessions.epoch)
            assert response is not None
            yield response

    @stream("the server is shutting down: the event stream ended")
    async def WatchEvents(
        self, request: kvmem_pb2.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvmem_pb2.KVEventBatch]:
        """The prefix cache's events from ``request.from_seq`` on, then live, until the
        watcher leaves or the server stops (the stream then ends with UNAVAILABLE,
        SHUTTING_DOWN, so a router knows to reconnect to the next run). Needs no
        session: the caller's token, where the server asks for one, is all it checks."""
        events = self._events
        if events is None:
            _ = self.sessions  # NOT_READY until the pool (and with it the event log) exists
            raise KVMemError(Reason.NOT_READY, "this server keeps no event log")
        async for batch in events.watch(request, context):
            yield batch

    @stream("the server is shutting down: this session ended")
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
        sessions = self.sessions
        session_id = None
        reply = kvmem_pb2.KeepAliveResponse(epoch=sessions.epoch)
        ended_by_server = False
        try:
            async for message in self.guard.messages(request_iterator, "KeepAlive"):
                if session_id is not None and message.session_id and message.session_id != session_id:
                    raise KVMemError(Reason.BAD_VALUE, "a keep-alive stream serves one session")
                if sessions.in_quarantine(session_id or message.session_id):
                    session_id = session_id or message.session_id
                    continue  # parked: no answer (see above)
                sessions.session(session_id or message.session_id)  # refreshes the lease
                session_id = session_id or message.session_id
                yield reply
        except KVMemError:  # a bad message, or the session ended while the stream was open
            ended_by_server = True
            raise
        finally:
            if session_id is not None and not ended_by_server and not self.guard.stopping.is_set():
                sessions.stream_gone(session_id)
