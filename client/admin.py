"""Calls that need no session (and no torch): what ``kvmem stats`` uses, and the event
stream a KV-aware router reads."""

from __future__ import annotations

import grpc

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .channel import CHANNEL_OPTIONS, auth_metadata, normalize_target
from .errors import from_rpc_error
from .events import EventStream, watch_request


def stats(
    target: str, *, audit: bool = False, timeout: float = 3.0, auth_token: str | None = None
) -> kvmem_pb2.StatsResponse:
    """A server's Stats without attaching a session (what ``kvmem stats`` prints)."""
    with grpc.insecure_channel(normalize_target(target), options=CHANNEL_OPTIONS) as channel:
        stub = kvmem_pb2_grpc.KVMemoryStub(channel)
        try:
            return stub.Stats(kvmem_pb2.StatsRequest(audit=audit), timeout=timeout, metadata=auth_metadata(auth_token))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None


def watch_events(target: str, *, from_seq: int = 0, epoch: str = "", auth_token: str | None = None) -> EventStream:
    """The server's prefix-cache events from batch ``from_seq`` of ``epoch`` on, then
    live, without attaching a session (what a router runs): an iterator of
    ``kvmem.v1.KVEventBatch`` over a channel of its own; ``close()`` (or leaving a
    ``with`` block) cancels the call and closes the channel. See
    :mod:`kvmem.client.events`."""
    request = watch_request(from_seq, epoch)
    channel = grpc.insecure_channel(normalize_target(target), options=CHANNEL_OPTIONS)
    try:
        call = kvmem_pb2_grpc.KVMemoryStub(channel).WatchEvents(request, metadata=auth_metadata(auth_token))
    except BaseException:
        channel.close()
        raise
    return EventStream(call, on_close=channel.close)
