"""Calls that need no session (and no torch): what ``kvmem stats`` uses, and the event
stream a KV-aware router reads. ``tls_ca``, ``tls_server_name``, ``tls_cert`` and
``tls_key`` are the clients' (see :mod:`kvmem.client.channel`)."""

from __future__ import annotations

import grpc

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .channel import PemSource, auth_metadata, transport
from .errors import from_rpc_error
from .events import EventStream, watch_request


def stats(
    target: str,
    *,
    audit: bool = False,
    timeout: float = 3.0,
    auth_token: str | None = None,
    tls_ca: PemSource | bool | None = None,
    tls_server_name: str | None = None,
    tls_cert: PemSource | None = None,
    tls_key: PemSource | None = None,
) -> kvmem_pb2.StatsResponse:
    """A server's Stats without attaching a session (what ``kvmem stats`` prints)."""
    how = transport(target, tls_ca=tls_ca, tls_server_name=tls_server_name, tls_cert=tls_cert, tls_key=tls_key)
    with how.channel() as channel:
        stub = kvmem_pb2_grpc.KVMemoryStub(channel)
        try:
            return stub.Stats(kvmem_pb2.StatsRequest(audit=audit), timeout=timeout, metadata=auth_metadata(auth_token))
        except grpc.RpcError as err:
            raise how.error(from_rpc_error(err), first=True) from None


def watch_events(
    target: str,
    *,
    from_seq: int = 0,
    epoch: str = "",
    auth_token: str | None = None,
    tls_ca: PemSource | bool | None = None,
    tls_server_name: str | None = None,
    tls_cert: PemSource | None = None,
    tls_key: PemSource | None = None,
) -> EventStream:
    """The server's prefix-cache events from batch ``from_seq`` of ``epoch`` on, then
    live, without attaching a session (what a router runs): an iterator of
    ``kvmem.v1.KVEventBatch`` over a channel of its own; ``close()`` (or leaving a
    ``with`` block) cancels the call and closes the channel. See
    :mod:`kvmem.client.events`."""
    request = watch_request(from_seq, epoch)
    how = transport(target, tls_ca=tls_ca, tls_server_name=tls_server_name, tls_cert=tls_cert, tls_key=tls_key)
    channel = how.channel()
    try:
        call = kvmem_pb2_grpc.KVMemoryStub(channel).WatchEvents(request, metadata=auth_metadata(auth_token))
    except BaseException:
        channel.close()
        raise
    return EventStream(call, on_close=channel.close, transport=how)
