"""The wire contract: the generated gRPC code is current with the .proto (CI fails when
it is stale), and the error reasons of server, proto and client are one closed set."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_has_stubs_and_package_imports() -> None:
    gen = ROOT / "proto" / "kvmem" / "v1"
    for name in ("kvmem_pb2.py", "kvmem_pb2.pyi", "kvmem_pb2_grpc.py"):
        assert (gen / name).is_file(), name
    # Chosen package path: the generated modules import each other as kvmem.v1.*.
    assert "from kvmem.v1 import kvmem_pb2" in (gen / "kvmem_pb2_grpc.py").read_text()


# ------------------------------------------------------------------ error reasons


def _proto_reasons() -> set[str]:
    from kvmem.v1 import kvmem_pb2

    names = {name for name, _number in kvmem_pb2.ErrorReason.items()}
    assert all(name.startswith("ERROR_REASON_") for name in names), names
    return {name.removeprefix("ERROR_REASON_") for name in names} - {"UNSPECIFIED"}


def test_server_reasons_are_the_protos_error_reasons() -> None:
    """The core's own Reason enum and the proto's ErrorReason (less its prefix and
    UNSPECIFIED) name the same set: a reason added to one is added to the other."""
    from kvmem.server.errors import Reason

    assert {reason.name for reason in Reason} == _proto_reasons()


def test_client_reasons_are_built_from_the_proto() -> None:
    from kvmem.client.errors import Reason

    assert {reason.value for reason in Reason} == _proto_reasons() | {"UNSPECIFIED"}
    assert {reason.name for reason in Reason} == {reason.value for reason in Reason}
    assert Reason.SLOT_NOT_FOUND == "SLOT_NOT_FOUND"  # a str: compares with the wire name


def test_service_sends_each_reason_as_its_proto_name() -> None:
    """``to_status`` puts the reason's proto name (less the prefix) in an ErrorInfo of
    domain kvmem.v1, with the status code of the reason's kind."""
    from google.rpc import error_details_pb2, status_pb2

    from kvmem.server.edge.wire import to_status
    from kvmem.server.errors import KVMemError, Reason

    for reason in Reason:
        status = to_status(KVMemError(reason, f"because of {reason.name}", value=7))
        assert status.code.name == reason.kind.name and status.details == f"because of {reason.name}"
        (detail,) = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"]).details
        info = error_details_pb2.ErrorInfo()
        assert detail.Unpack(info)
        assert info.domain == "kvmem.v1" and dict(info.metadata) == {"value": "7"}
        assert info.reason == reason.name and info.reason in _proto_reasons()


class _FailedCall(grpc.RpcError):
    """A failed call as the client sees one (the sync RpcError is also a grpc.Call)."""

    def __init__(self, code: grpc.StatusCode, details: str, reason: str | None) -> None:
        self._code, self._details, self._trailing = code, details, ()
        if reason is not None:
            from google.protobuf import any_pb2
            from google.rpc import error_details_pb2, status_pb2

            detail = any_pb2.Any()
            detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="kvmem.v1", metadata={"slot": "3"}))
            status = status_pb2.Status(code=code.value[0], message=details, details=[detail])
            self._trailing = (("grpc-status-details-bin", status.SerializeToString()),)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, bytes], ...]:
        return self._trailing


def test_client_reads_reasons_and_maps_an_unknown_one_to_unspecified() -> None:
    from kvmem.client.errors import NotFound, Reason, SessionLost, Unavailable, from_rpc_error

    err = from_rpc_error(_FailedCall(grpc.StatusCode.NOT_FOUND, "slot 3 is not open", "SLOT_NOT_FOUND"))
    assert type(err) is NotFound and err.reason is Reason.SLOT_NOT_FOUND and err.raw_reason == "SLOT_NOT_FOUND"
    assert err.metadata == {"slot": "3"} and str(err) == "NOT_FOUND (SLOT_NOT_FOUND): slot 3 is not open"

    lost = from_rpc_error(_FailedCall(grpc.StatusCode.FAILED_PRECONDITION, "unknown session", "UNKNOWN_SESSION"))
    assert type(lost) is SessionLost and lost.reason == "UNKNOWN_SESSION"

    newer = from_rpc_error(_FailedCall(grpc.StatusCode.NOT_FOUND, "from a newer server", "SOMETHING_NEW"))
    assert newer.reason is Reason.UNSPECIFIED and newer.raw_reason == "SOMETHING_NEW"
    assert str(newer) == "NOT_FOUND (SOMETHING_NEW): from a newer server"

    plain = from_rpc_error(_FailedCall(grpc.StatusCode.UNAVAILABLE, "connection refused", None))
    assert type(plain) is Unavailable and plain.reason is Reason.UNSPECIFIED and plain.raw_reason == ""
    assert str(plain) == "UNAVAILABLE: connection refused"
