"""Calls that need no session (and no torch): what ``kvmem stats`` uses."""

from __future__ import annotations

import grpc

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .channel import CHANNEL_OPTIONS, auth_metadata, normalize_target
from .errors import from_rpc_error


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
