"""The blocking client: one object per session, a keep-alive thread in the background.

Every method and all the session logic are :class:`~kvmem.client.session.ClientBase`'s
and :class:`~kvmem.client.session.Session`'s; this module makes the calls, blocking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .channel import BIG_REQUEST_BYTES, TLSError, deadline_exceeded
from .errors import KVMemError, SessionLost
from .events import EventStream, watch_request
from .session import Call, Session
from .stepstream import StepStream
from .surface import Blocking, ClientBase

T = TypeVar("T")
P = ParamSpec("P")


class KVMemClient(ClientBase[Blocking]):
    """A session with a kvmem server; the constructor attaches (or raises), ``close()``
    (or leaving a ``with`` block) detaches.

    ``target`` is a unix socket path (``/tmp/kvmem.sock`` or ``unix:/tmp/kvmem.sock``)
    or ``HOST:PORT`` (TLS with ``tls_ca``: see :class:`~kvmem.client.surface.ClientBase`).
    Every call takes ``timeout`` seconds (default: the client's). A keep-alive thread
    holds the session's lease; if the session breaks, the next call raises
    :class:`~kvmem.client.errors.SessionLost`.
    """

    _channel: grpc.Channel | None
    _stub: kvmem_pb2_grpc.KVMemoryStub

    def _setup(self) -> None:
        self._closing = threading.Event()
        self._keepalive_call: Any = None  # grpc's stream call: an iterator that can be cancelled
        self._keepalive_thread: threading.Thread | None = None
        self._steps: StepStream | None = None  # opened at the first Step (step_stream)
        self._steps_lock = threading.Lock()
        self._channel = self._transport.channel()
        self._stub = kvmem_pb2_grpc.KVMemoryStub(self._channel)
        started = time.monotonic()
        try:
            while True:
                try:
                    self._perform(self._session.attach())
                    break
                except KVMemError as err:
                    delay = None if isinstance(err, TLSError) else self._session.attach_retry(err, started)
                    if delay is None:
                        raise
                    time.sleep(delay)
        except BaseException:
            self._channel.close()
            raise
        if self._session.keepalive:
            self._keepalive_thread = threading.Thread(target=self._keepalive, name="kvmem-keepalive", daemon=True)
            self._keepalive_thread.start()

    def _invoke(self, build: Callable[Concatenate[Session, P], Call[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._perform(build(self._session, *args, **kwargs))

    def _perform(self, call: Call[T]) -> T:
        try:
            try:
                if call.method == "Step" and self._step_stream:
                    response = self._session.streamed(self._stream_step(call))
                elif call.request.ByteSize() > BIG_REQUEST_BYTES:
                    response = self._bounded(call)
                else:
                    rpc = getattr(self._stub, call.method)
                    response = rpc(call.request, timeout=call.timeout, metadata=self._session.metadata)
            except grpc.RpcError as err:
                raise self._transport.error(self._session.failed(err), first=call.method == "Attach") from None
            return self._session.finish(call, response)
        except SessionLost:
            self._stop_keepalive()  # over for this client: closing the stream tells the server it let go
            raise
        finally:
            if call.ends_session:
                self._stop_keepalive()
                self._close_steps()

    def _bounded(self, call: Call[T]) -> Any:
        """A unary call with a big request, waited for no longer than its deadline (see
        :data:`~kvmem.client.channel.BIG_REQUEST_BYTES`): cancelled past it."""
        future = getattr(self._stub, call.method).future(
            call.request, timeout=call.timeout, metadata=self._session.metadata
        )
        try:
            return future.result(timeout=call.timeout)
        except grpc.FutureTimeoutError:
            future.cancel()
            raise deadline_exceeded(call.method, call.timeout) from None

    def _stream_step(self, call: Call[T]) -> kvmem_pb2.StepResponse:
        """``call`` on the step stream, opened (again) when there is none that works;
        anything but an answer leaves the stream done, and the next step opens another."""
        with self._steps_lock:
            stream = self._steps
            if stream is None or not stream.usable:
                if stream is not None:
                    stream.close()
                stream = self._steps = StepStream(self._stub, self._session.metadata)
        try:
            return stream.step(call.request, call.timeout)
        except BaseException:
            stream.close()
            raise

    def _close_steps(self) -> None:
        with self._steps_lock:
            stream, self._steps = self._steps, None
        if stream is not None:
            stream.close()

    def watch_events(self, from_seq: int = 0, epoch: str = "") -> EventStream:
        """The prefix cache's events from batch ``from_seq`` of ``epoch`` (empty: the
        server's current one) on, then live: an iterator of ``kvmem.v1.KVEventBatch``
        (see :mod:`kvmem.client.events`); ``close()`` it to cancel the call. It needs no
        session (a router without one: :func:`kvmem.client.admin.watch_events`)."""
        if self._channel is None:
            raise RuntimeError("the client is closed")
        request = watch_request(from_seq, epoch)
        return EventStream(self._stub.WatchEvents(request, metadata=self._session.metadata))

    def close(self) -> None:
        """Detach (if still attached) and close the channel. Idempotent."""
        detach = self._session.close()
        try:
            if detach is not None:
                self._perform(detach)
        except KVMemError as err:
            self._session.detach_failed(err)  # the session is gone either way; maybe the server too
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._stop_keepalive()
        self._close_steps()
        self._unmap()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> KVMemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keepalive(self) -> None:
        first, later = self._session.keepalive_requests()
        interval = self._session.keepalive_interval

        session = self._session

        def requests() -> Iterator[kvmem_pb2.KeepAliveRequest]:
            session.keepalive_sent()
            yield first
            while not self._closing.wait(interval):
                session.keepalive_sent()
                yield later

        try:
            self._keepalive_call = self._stub.KeepAlive(requests(), metadata=session.metadata)
            for _ in self._keepalive_call:
                session.keepalive_answered()
        except grpc.RpcError as err:
            self._session.keepalive_ended(err, self._closing.is_set())
        else:
            self._session.keepalive_ended(None, self._closing.is_set())

    def _stop_keepalive(self) -> None:
        self._closing.set()
        if self._keepalive_call is not None:
            self._keepalive_call.cancel()
        if self._keepalive_thread is not None and self._keepalive_thread is not threading.current_thread():
            self._keepalive_thread.join(timeout=5)
            self._keepalive_thread = None
