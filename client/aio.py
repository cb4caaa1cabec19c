"""The asyncio client: the methods of :class:`~kvmem.client.sync.KVMemClient`,
awaitable, with the keep-alive as a task on the caller's loop.

Every method and all the session logic are :class:`~kvmem.client.session.ClientBase`'s
and :class:`~kvmem.client.session.Session`'s; this module awaits the calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import grpc

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .channel import BIG_REQUEST_BYTES, TLSError, deadline_exceeded
from .errors import KVMemError, SessionLost
from .events import AsyncEventStream, watch_request
from .session import Call, Session
from .stepstream import AsyncStepStream
from .surface import Awaiting, ClientBase

T = TypeVar("T")
P = ParamSpec("P")


class AsyncKVMemClient(ClientBase[Awaiting]):
    """A session with a kvmem server, for asyncio schedulers.

    ``client = await AsyncKVMemClient.connect(target, name=...)`` or
    ``async with AsyncKVMemClient(target, name=...) as client:``; the constructor takes
    the arguments of :class:`~kvmem.client.sync.KVMemClient`'s and attaches nothing.
    """

    _stub: kvmem_pb2_grpc.KVMemoryStub  # set by attach(): no call is built before it

    def _setup(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._steps: AsyncStepStream | None = None  # opened at the first Step (step_stream)

    @classmethod
    async def connect(cls, target: str, **kwargs: Any) -> AsyncKVMemClient:
        client = cls(target, **kwargs)
        await client.attach()
        return client

    async def attach(self) -> None:
        """Open the channel and attach; the keep-alive task starts on this loop."""
        self._channel = self._transport.aio_channel()
        self._stub = kvmem_pb2_grpc.KVMemoryStub(self._channel)
        started = time.monotonic()
        try:
            while True:
                try:
                    await self._perform(self._session.attach())
                    break
                except KVMemError as err:
                    delay = None if isinstance(err, TLSError) else self._session.attach_retry(err, started)
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
        except BaseException:
            await self._channel.close()
            self._channel = None
            raise
        if self._session.keepalive:
            self._keepalive_task = asyncio.create_task(self._keepalive(), name="kvmem-keepalive")

    async def _invoke(
        self, build: Callable[Concatenate[Session, P], Call[T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> T:
        return await self._perform(build(self._session, *args, **kwargs))

    async def _perform(self, call: Call[T]) -> T:
        try:
            try:
                if call.method == "Step" and self._step_stream:
                    stream = self._steps
                    if stream is None or not stream.usable:
                        if stream is not None:
                            stream.close()
                        stream = self._steps = AsyncStepStream(self._stub, self._session.metadata)
                    response = self._session.streamed(await stream.step(call.request, call.timeout))
                else:
                    rpc = getattr(self._stub, call.method)
                    pending = rpc(call.request, timeout=call.timeout, metadata=self._session.metadata)
                    if call.request.ByteSize() > BIG_REQUEST_BYTES:  # bounded by the client too: see channel.py
                        try:
                            async with asyncio.timeout(call.timeout):
                                response = await pending
                        except TimeoutError:
                            pending.cancel()
                            raise deadline_exceeded(call.method, call.timeout) from None
                    else:
                        response = await pending
            except grpc.RpcError as err:
                raise self._transport.error(self._session.failed(err), first=call.method == "Attach") from None
            return self._session.finish(call, response)
        except SessionLost:
            await self._stop_keepalive()  # over for this client: closing the stream tells the server it let go
            raise
        finally:
            if call.ends_session:
                await self._stop_keepalive()
                self._close_steps()

    def _close_steps(self) -> None:
        stream, self._steps = self._steps, None
        if stream is not None:
            stream.close()

    def watch_events(self, from_seq: int = 0, epoch: str = "") -> AsyncEventStream:
        """The prefix cache's events from batch ``from_seq`` of ``epoch`` (empty: the
        server's current one) on, then live: ``async for batch in
        client.watch_events(...)`` yields ``kvmem.v1.KVEventBatch`` messages (see
        :mod:`kvmem.client.events`); ``close()`` it to cancel the call. It needs no
        session, only the client's channel (open once attached)."""
        if self._channel is None:
            raise RuntimeError("not attached: the channel opens at attach()")
        request = watch_request(from_seq, epoch)
        return AsyncEventStream(self._stub.WatchEvents(request, metadata=self._session.metadata))

    async def close(self) -> None:
        """Detach (if still attached) and close the channel. Idempotent."""
        detach = self._session.close()
        try:
            if detach is not None:
                await self._perform(detach)
        except KVMemError as err:
            self._session.detach_failed(err)  # the session is gone either way; maybe the server too
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        await self._stop_keepalive()
        self._close_steps()
        self._unmap()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncKVMemClient:
        if self._channel is None:
            await self.attach()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _keepalive(self) -> None:
        first, later = self._session.keepalive_requests()
        interval = self._session.keepalive_interval

        session = self._session

        async def requests() -> AsyncIterator[kvmem_pb2.KeepAliveRequest]:
            session.keepalive_sent()
            yield first
            while True:
                try:
                    await asyncio.wait_for(self._closing.wait(), interval)
                    return
                except TimeoutError:
                    session.keepalive_sent()
                    yield later

        call = self._stub.KeepAlive(requests(), metadata=session.metadata)
        try:
            async for _ in call:
                session.keepalive_answered()
        except grpc.RpcError as err:
            self._session.keepalive_ended(err, self._closing.is_set())
        except asyncio.CancelledError:
            call.cancel()
            raise
        else:
            self._session.keepalive_ended(None, self._closing.is_set())

    async def _stop_keepalive(self) -> None:
        self._closing.set()
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
