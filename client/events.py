"""The prefix cache's event stream (WatchEvents) as an iterator, for KV-aware routers.

A watcher needs no session: :func:`kvmem.client.admin.watch_events` opens a channel of
its own, and an attached client's ``watch_events`` uses the client's. Each item is a
``kvmem.v1.KVEventBatch``: ``epoch``, ``seq`` (1, 2, 3, ... within an epoch), ``events``
(pages stored, removed, all cleared), and, when the watcher asked for a batch the
server's replay buffer no longer holds (or another epoch's), a ``snapshot`` of every
cached page first (``snapshot_done`` on its last batch). To resume after a break, watch
again from the last ``seq`` + 1 with that ``epoch``. No torch.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

import grpc

from kvmem.v1 import kvmem_pb2

from .errors import from_rpc_error

if TYPE_CHECKING:
    from .channel import Transport


def watch_request(from_seq: int = 0, epoch: str = "") -> kvmem_pb2.WatchEventsRequest:
    """The request of a watch from batch ``from_seq`` (0: whatever the buffer holds) of
    ``epoch`` (empty: the server's current one)."""
    if from_seq < 0:
        raise ValueError(f"from_seq must be >= 0, got {from_seq}")
    return kvmem_pb2.WatchEventsRequest(from_seq=from_seq, epoch=epoch)


class EventStream:
    """A blocking iterator of ``KVEventBatch`` messages over one WatchEvents call; it
    ends when :meth:`close` is called (which cancels the call; also on leaving a
    ``with`` block). A failure of the stream (the server shutting down: Unavailable)
    raises the client's :class:`kvmem.client.KVMemError` of it (a
    :class:`kvmem.client.TLSError` when its own channel, ``transport``, could
    not connect for a reason of TLS)."""

    def __init__(self, call: Any, on_close: Any = None, transport: Transport | None = None) -> None:
        self._call = call  # grpc's server-stream call: an iterator that can be cancelled
        self._on_close = on_close
        self._transport = transport
        self._closed = False
        self._received = False  # a batch arrived: the connection was up

    def __iter__(self) -> EventStream:
        return self

    def __next__(self) -> kvmem_pb2.KVEventBatch:
        if self._closed:
            raise StopIteration
        try:
            batch: kvmem_pb2.KVEventBatch = next(self._call)
        except grpc.RpcError as err:
            if self._closed and err.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            error = from_rpc_error(err)
            if self._transport is not None:
                error = self._transport.error(error, first=not self._received)
            raise error from None
        self._received = True
        return batch

    def close(self) -> None:
        """Cancel the call (idempotent); iteration ends."""
        if self._closed:
            return
        self._closed = True
        self._call.cancel()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):  # at interpreter exit grpc may be gone already
                self.close()


class AsyncEventStream:
    """An async iterator of ``KVEventBatch`` messages over one WatchEvents call
    (``async for batch in stream``); :meth:`close` (or leaving an ``async with``
    block) cancels the call and ends the iteration."""

    def __init__(self, call: Any) -> None:
        self._call = call  # grpc.aio's UnaryStreamCall
        self._closed = False

    def __aiter__(self) -> AsyncEventStream:
        return self

    async def __anext__(self) -> kvmem_pb2.KVEventBatch:
        if self._closed:
            raise StopAsyncIteration
        try:
            batch = await self._call.read()
        except asyncio.CancelledError:
            if self._closed:  # our close() cancelled the call (grpc.aio raises this then)
                raise StopAsyncIteration from None
            raise
        except grpc.RpcError as err:
            if self._closed and err.code() == grpc.StatusCode.CANCELLED:
                raise StopAsyncIteration from None
            raise from_rpc_error(err) from None
        if batch is grpc.aio.EOF:
            raise StopAsyncIteration
        result: kvmem_pb2.KVEventBatch = batch
        return result

    def close(self) -> None:
        """Cancel the call (idempotent); iteration ends."""
        if not self._closed:
            self._closed = True
            self._call.cancel()

    async def __aenter__(self) -> AsyncEventStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
