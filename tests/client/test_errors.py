"""How the clients read a failed call (``kvmem.client.errors.from_rpc_error``) where gRPC
itself, not the server, made the status: gRPC's own exception objects, as its asyncio
client raises them (the end-to-end cases run against real servers in
tests/server/test_shutdown.py and tests/server/test_service.py)."""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from kvmem.client.errors import ASYNCIO_BROKEN_CALL, KVMemError, Unavailable, from_rpc_error


def _aio_error(code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, bytes], ...] = ()) -> grpc.RpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details, "debug")


def test_the_asyncio_clients_internal_for_a_broken_call_is_unavailable() -> None:
    """INTERNAL "Internal error from Core": gRPC's asyncio client could not send on a
    call that had ended under it (the connection broke). No server said it: the client
    raises Unavailable (the transport failure), naming what gRPC said."""
    err = from_rpc_error(_aio_error(grpc.StatusCode.INTERNAL, ASYNCIO_BROKEN_CALL))
    assert isinstance(err, Unavailable)
    assert err.code == grpc.StatusCode.UNAVAILABLE and err.reason == "UNSPECIFIED" and err.raw_reason == ""
    assert "connection to the server failed" in err.message and ASYNCIO_BROKEN_CALL in err.message


def test_a_servers_internal_stays_internal() -> None:
    """The same text with the server's reason attached, or another INTERNAL, is the
    server's and stays what it said."""
    info = error_details_pb2.ErrorInfo(reason="CORRUPTED", domain="kvmem.v1")
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=grpc.StatusCode.INTERNAL.value[0], message=ASYNCIO_BROKEN_CALL, details=[detail])
    with_reason = _aio_error(
        grpc.StatusCode.INTERNAL, ASYNCIO_BROKEN_CALL, (("grpc-status-details-bin", status.SerializeToString()),)
    )
    for err in (from_rpc_error(with_reason), from_rpc_error(_aio_error(grpc.StatusCode.INTERNAL, "pool audit failed"))):
        assert isinstance(err, KVMemError) and not isinstance(err, Unavailable)
        assert err.code == grpc.StatusCode.INTERNAL
    assert from_rpc_error(with_reason).raw_reason == "CORRUPTED"
