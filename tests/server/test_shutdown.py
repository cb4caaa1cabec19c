"""SIGTERM (docs/DESIGN.md, Shutdown): readiness NOT_SERVING and no new sessions at once; attached
sessions go on stepping through the drain period; then the server refuses every call
(UNAVAILABLE, SHUTTING_DOWN), ends the keep-alive streams and the sessions, and exits 0
within the drain and the grace period, whatever its clients do; no client sees a bare
CANCELLED, not even for the calls gRPC itself cancels as it stops. Real servers, real
client processes, real signals."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from conftest import LineProcess, start_server
from kvmem.client import AsyncKVMemClient, KVMemClient, KVMemError, SessionLost, Unavailable
from kvmem.client.admin import stats, watch_events
from kvmem.client.errors import from_rpc_error
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


def serve(tmpdir: str, drain_ms: int, grace_ms: int = 500) -> object:
    return start_server(
        tmpdir, "--num-pages", "65", "--page-size", "4", "--max-context", "64", "--lease-ms", "2000",
        "--drain-ms", str(drain_ms), "--shutdown-grace-ms", str(grace_ms),
    )  # fmt: skip


def test_sessions_step_through_the_drain_and_a_detach_ends_it_early(tmpdir_short: str) -> None:
    srv = serve(tmpdir_short, drain_ms=60000)  # a detach ends it: waiting it out would take a minute
    try:
        kv = KVMemClient(srv.target, name="worker")
        slots = kv.open(["r"])
        assert kv.alloc(slots, [4]).ok
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while srv.health() != NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(Unavailable) as refused:
            KVMemClient(srv.target, name="late", timeout=2)
        assert refused.value.reason == "SHUTTING_DOWN", refused.value
        for _ in range(20):  # the drain: the attached session goes on
            assert kv.alloc(slots, [1]).ok
        assert srv.proc.poll() is None
        kv.close()  # the last session detaches: no need to wait out the drain
        assert srv.proc.wait(timeout=30) == 0, srv.log()
        assert "drain over" not in srv.log(), srv.log()
        assert not os.path.exists(srv.socket_path)
    finally:
        srv.stop()


def test_stopped_and_silent_clients_cannot_hold_the_exit_back(tmpdir_short: str) -> None:
    """A SIGSTOPped client holding a session and a keep-alive stream opened just before
    SIGTERM: the server still exits 0, no later than its 1 s drain and 0.5 s grace period
    allow; an attached client that stays learns the session ended (SessionLost,
    UNAVAILABLE: SHUTTING_DOWN) and its later calls are refused.

    The stopped client can cost the whole grace period, however long: gRPC's shutdown
    waits for its connection, which a stopped process does not close, until the grace
    period ends and gRPC cuts it (measured: 9.05 s with a 1 s drain and an 8 s grace,
    60 s with a 60 s grace). Hence the bound: drain + grace, and 3 s for the process's
    exit on a loaded host; a client that could hold the exit back would hold it longer."""
    srv = serve(tmpdir_short, drain_ms=1000, grace_ms=500)
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
        assert took < 1.0 + 0.5 + 3.0, f"exit {took:.2f}s after SIGTERM with a 1 s drain and a 0.5 s grace"
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
    is refused as SHUTTING_DOWN (or gRPC cancels it before it does: the client reads that
    as SHUTTING_DOWN too); afterwards gRPC refuses the connection: UNAVAILABLE either way,
    never a bare CANCELLED."""
    srv = start_server(
        tmpdir_short, "--num-pages", "65", "--page-size", "4", "--max-context", "64", "--drain-ms", "300",
        "--shutdown-grace-ms", "2000",
    )  # fmt: skip
    try:
        with grpc.insecure_channel(srv.target) as channel:
            stub = kvmem_pb2_grpc.KVMemoryStub(channel)
            attached = stub.Attach(kvmem_pb2.AttachRequest(name="raw"), timeout=5)
            srv.proc.send_signal(signal.SIGTERM)
            seen = set()
            deadline = time.monotonic() + 8
            while srv.proc.poll() is None and time.monotonic() < deadline:
                try:
                    stub.Stats(kvmem_pb2.StatsRequest(), timeout=1)
                    seen.add("OK")
                except grpc.RpcError as err:
                    error = from_rpc_error(err)  # what the clients raise
                    seen.add(f"{error.code.name} {error.reason}")
                time.sleep(0.005)
            assert srv.proc.wait(timeout=5) == 0, srv.log()
            assert seen <= {"OK", "UNAVAILABLE SHUTTING_DOWN", "UNAVAILABLE UNSPECIFIED"}, seen
            del attached
    finally:
        srv.stop()


# ------------------------------------------- calls that reach the server as it stops

# `kvmem serve`, held just before its gRPC server stops: the drain is over, the service
# refuses every call, and the event loop is blocked until the test says go, so calls that
# arrive in the meantime wait inside gRPC, taken from the connection and not handed to the
# service. gRPC cancels those when its shutdown starts (grpc/grpc#41785): the race of a
# loaded server's shutdown, every time.
HELD_SERVER = r"""
import os, sys, time
import kvmem.server.process.app as app
from kvmem.cli import main

held, go = sys.argv[1], sys.argv[2]
listen = app.KVMemServer._listen

async def _listen(self):
    await listen(self)
    stop = self.grpc_server.stop

    async def held_stop(grace):
        open(held, "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(go) and time.monotonic() < deadline:
            time.sleep(0.005)  # blocks the event loop: no call is handed to the service
        await stop(grace)

    self.grpc_server.stop = held_stop

app.KVMemServer._listen = _listen
sys.exit(main(sys.argv[3:]))
"""


def _outcome(call: Any) -> object:
    try:
        call()
    except (grpc.RpcError, KVMemError) as err:
        return err
    return "OK"


def _aio_clients(target: str, ready: threading.Event, fire: threading.Event, out: dict[str, object]) -> None:
    """An asyncio client stepping unary and one whose first step opens its stream, both
    fired at ``fire``."""

    async def main() -> None:
        unary = await AsyncKVMemClient.connect(target, name="aio-unary", step_stream=False, timeout=10)
        streamed = await AsyncKVMemClient.connect(target, name="aio-stream", timeout=10)
        slots = [await unary.open(["u"]), await streamed.open(["s"])]
        ready.set()
        await asyncio.get_running_loop().run_in_executor(None, fire.wait)
        results = await asyncio.gather(
            unary.alloc(slots[0], [1]), streamed.alloc(slots[1], [1]), return_exceptions=True
        )
        out["aio unary Step"], out["aio first streamed Step"] = results
        for client in (unary, streamed):
            await client.close()

    asyncio.run(main())


@pytest.mark.parametrize("run", range(4))
def test_calls_gRPC_holds_when_the_shutdown_starts_are_unavailable_shutting_down(tmpdir_short: str, run: int) -> None:
    """Unary Steps, a step stream's first Step, Open, Attach, WatchEvents, Stats and a
    keep-alive stream, all arriving while the server is held before its gRPC server
    stops: every kvmem call fails UNAVAILABLE with SHUTTING_DOWN. The raw gRPC calls
    beside them show what gRPC itself answers those (CANCELLED: the race was hit), and
    the attached sessions learn from their keep-alive that the server shut down."""
    held, go = os.path.join(tmpdir_short, "held"), os.path.join(tmpdir_short, "go")
    srv = start_server(
        tmpdir_short, "--num-pages", "65", "--page-size", "4", "--max-context", "64", "--lease-ms", "5000",
        "--drain-ms", "100", "--shutdown-grace-ms", "3000", launcher=("-c", HELD_SERVER, held, go),
    )  # fmt: skip
    unary = KVMemClient(srv.target, name="unary", step_stream=False, timeout=10)
    streamed = KVMemClient(srv.target, name="stream", timeout=10)  # its stream opens at its first Step
    opener = KVMemClient(srv.target, name="opener", timeout=10)
    slots = [unary.open(["u"]), streamed.open(["s"])]
    assert unary.alloc(slots[0], [4]).ok
    aio_ready, fire = threading.Event(), threading.Event()
    out: dict[str, object] = {}
    aio = threading.Thread(target=_aio_clients, args=(srv.target, aio_ready, fire, out))
    aio.start()
    assert aio_ready.wait(30)
    channel = grpc.insecure_channel(srv.target)
    stub = kvmem_pb2_grpc.KVMemoryStub(channel)
    stub.Stats(kvmem_pb2.StatsRequest(), timeout=5)  # connected before the hold
    try:
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not os.path.exists(held):
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log()
            time.sleep(0.01)

        def raw_keepalive() -> None:
            for _ in stub.KeepAlive(iter([kvmem_pb2.KeepAliveRequest(session_id=unary.session_id)]), timeout=10):
                pass

        def watch() -> None:
            with watch_events(srv.target) as events:
                next(events)

        calls = {
            "unary Step": lambda: unary.alloc(slots[0], [1]),
            "first streamed Step": lambda: streamed.alloc(slots[1], [1]),
            "Open": lambda: opener.open(["o"]),
            "Attach": lambda: KVMemClient(srv.target, name="late", timeout=10).close(),
            "WatchEvents": watch,
            "Stats": lambda: stats(srv.target, timeout=10),
            **{f"raw Stats {i}": lambda: stub.Stats(kvmem_pb2.StatsRequest(), timeout=10) for i in range(3)},
            "raw KeepAlive": raw_keepalive,
        }
        started = threading.Barrier(len(calls) + 1)

        def run_call(name: str, call: Any) -> None:
            started.wait()
            out[name] = _outcome(call)

        threads = [threading.Thread(target=run_call, args=item) for item in calls.items()]
        for thread in threads:
            thread.start()
        started.wait()
        fire.set()
        time.sleep(1.0)  # the calls reach the held server (a unix socket: microseconds)
        open(go, "w").close()
        for thread in [*threads, aio]:
            thread.join(timeout=30)
        assert srv.proc.wait(timeout=10) == 0, srv.log()

        raw_codes = [out[name].code() for name in out if name.startswith("raw")]  # type: ignore[union-attr]
        assert grpc.StatusCode.CANCELLED in raw_codes, (raw_codes, "the calls missed the held server")
        assert from_rpc_error(out["raw KeepAlive"]).reason == "SHUTTING_DOWN", out["raw KeepAlive"]  # type: ignore[arg-type]
        for name, outcome in out.items():
            if name.startswith("raw"):
                continue
            assert isinstance(outcome, Unavailable), (name, outcome)
            assert (outcome.code, outcome.reason) == (grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN"), (name, outcome)
        for client in (unary, streamed, opener):  # their keep-alive streams told them
            thread = client._keepalive_thread  # it ends once it has read the stream's end: wait for that, not a race
            assert thread is not None
            thread.join(timeout=30)
            with pytest.raises(SessionLost) as lost:
                client.stats()
            assert lost.value.reason == "SHUTTING_DOWN" and lost.value.views_stale, lost.value
    finally:
        open(go, "w").close()
        fire.set()
        channel.close()
        for client in (unary, streamed, opener):
            client.close()
        srv.stop()


def test_a_stream_answering_at_the_drains_end_ends_with_shutting_down_not_at_the_grace(tmpdir_short: str) -> None:
    """A step stream whose client reads its answers late: when the drain ends the
    server's handler is sending an answer (flow control holds it), not waiting for a
    message. It is not cut there: the client reads the answers sent, then the stream's
    UNAVAILABLE with SHUTTING_DOWN, long before the 5 s grace period would end it."""
    srv = start_server(
        tmpdir_short, "--num-pages", "1025", "--page-size", "16", "--max-context", "4096", "--lease-ms", "10000",
        "--drain-ms", "300", "--shutdown-grace-ms", "5000",
    )  # fmt: skip
    kv = KVMemClient(srv.target, name="owner", step_stream=False)
    slot = int(kv.open(["r"])[0])
    # The answers wait in HTTP/2 windows of a fixed size (no BDP probing to grow them).
    channel = grpc.insecure_channel(srv.target, options=[("grpc.http2.bdp_probe", 0)])
    step = kvmem_pb2.StepRequest(
        session_id=kv.session_id, truncate_slots=[slot], truncate_lens=[0], alloc_slots=[slot], alloc_needs=[4000]
    )  # an answer of 16 kB (4,000 int32 kv_loc)
    sent = 400  # 6.4 MB of answers: more than the windows and socket buffers hold
    try:
        answers = kvmem_pb2_grpc.KVMemoryStub(channel).StepStream(iter([step] * sent), timeout=30)
        time.sleep(0.5)  # the server handles what the windows let it answer, then waits to send
        srv.proc.send_signal(signal.SIGTERM)
        while "drain over" not in srv.log():
            assert srv.proc.poll() is None, srv.log()
            time.sleep(0.02)
        t0 = time.monotonic()
        received = 0
        with pytest.raises(grpc.RpcError) as ended:
            for answer in answers:
                assert answer.alloc_status == b"\x00", answer
                received += 1
        took = time.monotonic() - t0
        assert 0 < received < sent, received  # the handler was sending, not waiting, at the drain's end
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
        assert from_rpc_error(ended.value).reason == "SHUTTING_DOWN", ended.value
        assert took < 2.5, f"the stream ended {took:.2f}s after the drain (grace 5 s)"
        assert srv.proc.wait(timeout=10) == 0, srv.log()
    finally:
        channel.close()
        kv.close()
        srv.stop()
