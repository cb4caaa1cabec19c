"""SIGTERM (DESIGN §6): readiness NOT_SERVING and no new sessions at once; attached
sessions go on stepping through the drain period; then the server refuses every call
(UNAVAILABLE, SHUTTING_DOWN), ends the keep-alive streams and the sessions, and exits 0
within a second of the drain's end, whatever its clients do. Real servers, real client
processes, real signals."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from conftest import LineProcess, start_server
from kvmem.client import KVMemClient, SessionLost, Unavailable
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

SLEEPER = r"""
import sys
from kvmem.client import KVMemClient
kv = KVMemClient(sys.argv[1], name="sleeper")
assert kv.alloc(kv.open(["r"]), [5]).ok
print("READY", flush=True)
sys.stdin.readline()
"""


def serve(tmpdir: str, drain_ms: int) -> object:
    return start_server(
        tmpdir, "--num-pages", "65", "--page-size", "4", "--max-context", "64", "--lease-ms", "2000",
        "--drain-ms", str(drain_ms),
    )  # fmt: skip


def test_sessions_step_through_the_drain_and_a_detach_ends_it_early(tmpdir_short: str) -> None:
    srv = serve(tmpdir_short, drain_ms=5000)
    try:
        kv = KVMemClient(srv.target, name="worker")
        slots = kv.open(["r"])
        assert kv.alloc(slots, [4]).ok
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        while srv.health() != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(Unavailable) as refused:
            KVMemClient(srv.target, name="late", timeout=2)
        assert refused.value.reason == "SHUTTING_DOWN", refused.value
        for _ in range(20):  # the drain: the attached session goes on
            assert kv.alloc(slots, [1]).ok
        assert srv.proc.poll() is None
        kv.close()  # the last session detaches: no need to wait out the 5 s drain
        assert srv.proc.wait(timeout=5) == 0, srv.log()
        assert time.monotonic() - t0 < 2.5, time.monotonic() - t0
        assert not os.path.exists(srv.socket_path)
    finally:
        srv.stop()


def test_stopped_and_silent_clients_cannot_hold_the_exit_back(tmpdir_short: str) -> None:
    """A SIGSTOPped client holding a session and a keep-alive stream opened just before
    SIGTERM: the server still exits 0 within a second of its 1 s drain; an attached
    client that stays learns the session ended (SessionLost, UNAVAILABLE: SHUTTING_DOWN)
    and its later calls are refused."""
    srv = serve(tmpdir_short, drain_ms=1000)
    sleeper = LineProcess("sleeper", SLEEPER, srv.target)
    try:
        sleeper.expect("READY")
        stays = KVMemClient(srv.target, name="stays")
        slots = stays.open(["r"])
        assert stays.alloc(slots, [4]).ok
        sleeper.proc.send_signal(signal.SIGSTOP)
        fresh = KVMemClient(srv.target, name="fresh")  # its keep-alive stream opens now
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=10) == 0, srv.log()
        took = time.monotonic() - t0
        assert took < 1.0 + 1.0, f"exit {took:.2f}s after SIGTERM with a 1 s drain"
        with pytest.raises((SessionLost, Unavailable)) as later:
            stays.alloc(slots, [1])
        assert later.value.code == grpc.StatusCode.UNAVAILABLE, later.value
        fresh.close()
        stays.close()
        assert "drain over: 3 session(s) still attached end now" in srv.log()
    finally:
        sleeper.proc.send_signal(signal.SIGCONT)
        sleeper.kill()
        srv.stop()


def test_calls_after_the_drain_are_unavailable_with_a_reason(tmpdir_short: str) -> None:
    """Between the drain's end and the listener closing, a call reaches the service and
    is refused as SHUTTING_DOWN; afterwards gRPC refuses the connection: UNAVAILABLE
    either way, never a bare CANCELLED."""
    srv = start_server(
        tmpdir_short, "--num-pages", "65", "--page-size", "4", "--max-context", "64", "--drain-ms", "300",
        "--shutdown-grace-ms", "2000",
    )  # fmt: skip
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = kvmem_pb2_grpc.KVMemoryStub(channel)
            attached = stub.Attach(kvmem_pb2.AttachRequest(name="raw"), timeout=5)
            srv.proc.send_signal(signal.SIGTERM)
            codes = set()
            deadline = time.monotonic() + 8
            while srv.proc.poll() is None and time.monotonic() < deadline:
                try:
                    stub.Stats(kvmem_pb2.StatsRequest(), timeout=1)
                    codes.add("OK")
                except grpc.RpcError as err:
                    codes.add(err.code().name)
                time.sleep(0.005)
            assert srv.proc.wait(timeout=5) == 0, srv.log()
            assert "CANCELLED" not in codes and "UNKNOWN" not in codes, codes
            assert codes <= {"OK", "UNAVAILABLE"}, codes
            del attached
    finally:
        srv.stop()
