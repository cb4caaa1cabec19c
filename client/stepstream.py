"""The StepStream call of each client: one long-lived bidirectional stream per session that
carries its Steps, one message each way per step, in order (no call set-up per step).

The server answers a refused step in-band (the answer's ``error``: the status the unary
Step would have failed with) and the stream goes on; the clients read that as the unary
call's failure (:func:`kvmem.client.errors.from_status`). Anything else that ends the
step in flight (the stream breaks or ends, the deadline passes, the caller is
interrupted) leaves the stream in an unknown state: the client drops it, reports the
step as failed as a unary call would have failed, and opens a new stream for the next
step. Per-step deadlines are the client's, since a stream has only one for its whole
life: past it the stream is cancelled and the step fails with DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.message import Message

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .channel import BIG_REQUEST_BYTES, deadline_exceeded
from .errors import Unavailable

_UNSPECIFIED = ""  # no kvmem reason: the failure is the client's or gRPC's


def stream_ended() -> Unavailable:
    """What a step gets when the server closed the stream without answering it."""
    return Unavailable(grpc.StatusCode.UNAVAILABLE, _UNSPECIFIED, "the server ended the step stream without an answer")


class StepStream:
    """The blocking client's stream. gRPC's sync API sends from a thread of its own,
    which consumes :meth:`_feed`; that thread also watches the deadline of the step in
    flight (it waits on the queue no longer than that), so a step costs no timer (but
    a big one: see :meth:`step`).
    :meth:`step` may be called from several threads: steps go one at a time."""

    def __init__(self, stub: kvmem_pb2_grpc.KVMemoryStub, metadata: Any) -> None:
        self._queue: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self._serial = threading.Lock()  # one step in flight
        self._guard = threading.Lock()  # the deadline, between the caller and the feeder
        self._deadline: float | None = None  # monotonic seconds; None: no step in flight
        self._timed_out = False
        self._call: Any = None  # grpc's stream call: an iterator of answers that can be cancelled
        self._call = stub.StepStream(self._feed(), metadata=metadata)

    @property
    def usable(self) -> bool:
        """Neither ended nor cancelled: a step may go on it."""
        return not self._timed_out and not self._call.done()

    def step(self, request: Message, timeout: float) -> kvmem_pb2.StepResponse:
        """Send ``request`` and wait up to ``timeout`` seconds for its answer. Raises
        ``grpc.RpcError`` when the stream broke, :class:`KVMemError` DEADLINE_EXCEEDED
        or :class:`Unavailable` (the server ended the stream); the stream is then done."""
        with self._serial:
            deadline = time.monotonic() + timeout
            with self._guard:
                self._deadline = deadline
            # A big request may not fit the stream's flow-control window: gRPC's sending
            # thread then waits for the server to take it and does not come back to the
            # feeder, which cannot watch the deadline. Such a step gets a timer of its own
            # (a thread: negligible next to sending that much).
            timer = None
            if request.ByteSize() > BIG_REQUEST_BYTES:
                timer = threading.Timer(timeout, self._expire, (deadline,))
                timer.daemon = True
                timer.start()
            self._queue.put(request)
            try:
                response: kvmem_pb2.StepResponse = next(self._call)
                return response
            except grpc.RpcError:
                if self._timed_out:
                    raise deadline_exceeded("Step", timeout) from None
                raise
            except StopIteration:
                raise stream_ended() from None
            finally:
                if timer is not None:
                    timer.cancel()
                with self._guard:
                    self._deadline = None

    def _expire(self, deadline: float) -> None:
        """The deadline of a step passed: cancel the stream if that step is still in flight."""
        with self._guard:
            if self._deadline == deadline:
                self._timed_out = True
                self._call.cancel()

    def _feed(self) -> Iterator[Message]:
        """The requests, as gRPC's sending thread takes them. Between steps it waits for
        the next one as long as it takes; with a step in flight, no longer than its
        deadline, past which it cancels the stream (and the step fails)."""
        get = self._queue.get
        wait: float | None = None
        while True:
            try:
                request = get(timeout=wait)
            except queue.Empty:
                with self._guard:
                    deadline = self._deadline
                    if deadline is not None and time.monotonic() >= deadline:
                        self._timed_out = True
                        self._call.cancel()
                        return
                wait = None if deadline is None else deadline - time.monotonic()
                continue
            if request is None:
                return
            yield request
            deadline = self._deadline  # set before the request was queued
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)

    def close(self) -> None:
        """End the stream (idempotent): the feeder returns and the call is cancelled."""
        self._queue.put(None)
        self._call.cancel()


class AsyncStepStream:
    """The asyncio client's stream: ``write`` then ``read`` under a lock (one step in
    flight), bounded by ``asyncio.timeout``."""

    def __init__(self, stub: kvmem_pb2_grpc.KVMemoryStub, metadata: Any) -> None:
        self._call: Any = stub.StepStream(metadata=metadata)  # grpc.aio's StreamStreamCall
        self._lock = asyncio.Lock()
        self._broken = False

    @property
    def usable(self) -> bool:
        return not self._broken and not self._call.done()

    async def step(self, request: Message, timeout: float) -> kvmem_pb2.StepResponse:
        """As :meth:`StepStream.step`; also when the caller is cancelled, the stream is
        done (its answer would come to the next step)."""
        async with self._lock:
            try:
                async with asyncio.timeout(timeout):
                    await self._call.write(request)
                    response = await self._call.read()
            except TimeoutError:
                self.close()
                raise deadline_exceeded("Step", timeout) from None
            except asyncio.InvalidStateError:  # written after the call ended without an error
                self.close()
                raise stream_ended() from None
            except BaseException:
                self.close()
                raise
            if response is grpc.aio.EOF:
                self.close()
                raise stream_ended()
            return response

    def close(self) -> None:
        """Cancel the stream (idempotent)."""
        self._broken = True
        self._call.cancel()
