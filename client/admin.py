"""Calls that need no session (and no torch): what ``kvmem stats`` uses."""

from __future__ import annotations

import grpc

from kvmem.client.errors import from_rpc_error
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
)


def normalize_target(target: str) -> str:
    """``/path/to.sock`` and ``unix:/path`` are unix sockets; anything else is
    ``HOST:PORT``."""
    if target.startswith("/") or target.startswith("./"):
        return f"unix:{target}"
    return target


def auth_metadata(auth_token: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if auth_token is None else (("authorization", f"Bearer {auth_token}"),)


def stats(target: str, *, audit: bool = False, timeout: float = 3.0, auth_token: str | None = None) -> kvmem_pb2.StatsResponse:
    """A server's Stats without attaching a session (what ``kvmem stats`` prints)."""
    with grpc.insecure_channel(normalize_target(target), options=CHANNEL_OPTIONS) as channel:
        stub = kvmem_pb2_grpc.KVMemoryStub(channel)
        try:
            return stub.Stats(kvmem_pb2.StatsRequest(audit=audit), timeout=timeout, metadata=auth_metadata(auth_token))
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
