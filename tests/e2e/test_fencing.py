"""Fencing (docs/DESIGN.md, Leases and fencing): a process that slept through its lease never writes into pages
another session now holds.

The server side: a session whose lease lapses while its connection stays open has its
pages quarantined: out of use until its keep-alive stream closes (the process died or
let go) or the quarantine period passes. The client side: a Step answer that arrives
later than the lease allows is withheld (SessionLost), and ``lease_remaining()`` says how
long the lease is known to hold. Real servers, real client processes, real signals.
"""

from __future__ import annotations

import datetime
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from conftest import LineProcess, ServerProcess, start_server
from kvmem.client import KVMemClient, SessionLost
from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.sessions import Sessions
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

# ------------------------------------------------------------------- the core


def test_quarantined_pages_are_not_handed_out_until_released() -> None:
    core = KVCore(CoreConfig(9, 4, 4, 32), audit_every_step=True)  # 8 pages
    a, b = core.add_owner(), core.add_owner()
    (sa,) = core.open(a, ["a"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[sa], alloc_needs=[20]))  # 5 pages
    assert core.remove_owner(a, quarantine=True) == 1
    assert core.quarantined_pages(a) == 5 and core.pool.num_quarantined == 5 and core.pool.num_free == 3
    stats = core.stats()
    assert (stats.num_free_pages, stats.num_used_pages, stats.num_quarantined_pages) == (3, 0, 5)
    report = core.audit()
    assert report.ok and report.num_quarantined_pages == 5, report
    (sb,) = core.open(b, ["b"]).tolist()
    res = core.step(b, StepBatch.of(alloc_slots=[sb], alloc_needs=[16]))  # 4 pages: only 3 are free
    assert res.alloc_status.tolist() == [1]  # OUT_OF_PAGES
    assert core.release_quarantine(a) == 5 and core.release_quarantine(a) == 0
    res = core.step(b, StepBatch.of(alloc_slots=[sb], alloc_needs=[16]))
    assert res.alloc_status.tolist() == [0] and core.audit().ok


def test_a_page_both_free_and_quarantined_is_a_broken_invariant() -> None:
    core = KVCore(CoreConfig(9, 4, 4, 32))
    a = core.add_owner()
    (sa,) = core.open(a, ["a"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[sa], alloc_needs=[4]))
    core.remove_owner(a, quarantine=True)
    core.pool._free[core.pool.num_free - 1] = core._quarantine[a][0][0]  # corrupt: the page in both
    report = core.audit()
    assert not report.ok and any("twice in the free stack and quarantines" in p for p in report.problems), report


# ------------------------------------------------------------- the sessions


def test_a_lapsed_session_is_quarantined_until_its_stream_goes_or_the_period_passes() -> None:
    sessions = Sessions(KVCore(CoreConfig(9, 4, 4, 32)), lease_s=1.0, quarantine_s=5.0)
    a, b = sessions.attach("a", None), sessions.attach("b", None)
    for s in (a, b):
        slots = sessions.open(s.session_id, ["r"])
        sessions.step(s.session_id, StepBatch.of(alloc_slots=slots, alloc_needs=[8]))
    later = time.monotonic() + 2.0
    assert sorted(sessions.expire(later)) == sorted([a.session_id, b.session_id])
    assert set(sessions.quarantined) == {a.session_id, b.session_id}
    assert sessions.core.stats().num_quarantined_pages == 4 and sessions.core.pool.num_free == 4
    sessions.stream_gone(a.session_id)  # a's process is gone: its pages are free at once
    assert set(sessions.quarantined) == {b.session_id} and sessions.core.pool.num_free == 6
    sessions.expire(later + 4.0)  # not yet 5 s since b's quarantine began
    assert set(sessions.quarantined) == {b.session_id}
    sessions.expire(time.monotonic() + 10.0)
    assert not sessions.quarantined and sessions.core.pool.num_free == 8 and sessions.core.audit().ok


# ----------------------------------------------------------- real processes

HOLDER = r"""
import sys
from kvmem.client import KVMemClient
kv = KVMemClient(sys.argv[1], name="holder")
slots = kv.open(["r1", "r2"])
assert kv.alloc(slots, [16, 8]).ok  # 4 + 2 pages of 4 tokens
print("READY", flush=True)
for line in sys.stdin:
    if line.strip() == "step":
        try:
            kv.alloc(slots, [1, 1])
            print("STEP ok", flush=True)
        except Exception as err:
            print("STEP", type(err).__name__, flush=True)
"""


def stats(server: ServerProcess) -> kvmem_pb2.StatsResponse:
    with grpc.insecure_channel(server.target) as channel:
        s = kvmem_pb2_grpc.KVMemoryStub(channel).Stats(kvmem_pb2.StatsRequest(audit=True), timeout=10)
    assert s.audit.ok, list(s.audit.problems)
    assert s.num_free_pages + s.num_used_pages + s.num_quarantined_pages == s.num_pages_total
    return s


def wait_stats(server: ServerProcess, done, timeout: float) -> tuple[kvmem_pb2.StatsResponse, float]:
    start = time.monotonic()
    while True:
        s = stats(server)
        if done(s):
            return s, time.monotonic() - start
        assert time.monotonic() - start < timeout, f"not within {timeout}s: {s}"
        time.sleep(0.05)


def quarantine_ends(server: ServerProcess) -> list[str]:
    """Why each quarantine ended, in order, from the server's log."""
    return [
        line.partition(" why=")[2].partition(" pages_freed=")[0]
        for line in server.log().splitlines()
        if "quarantine ended " in line
    ]


def logged_at(server: ServerProcess, text: str) -> float:
    """When the server logged the first line with ``text`` (seconds of its clock)."""
    line = next(line for line in server.log().splitlines() if text in line)
    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


@pytest.fixture
def fenced_server(tmpdir_short: str) -> Iterator[ServerProcess]:
    srv = start_server(
        tmpdir_short, "--num-pages", "17", "--page-size", "4", "--max-requests", "8", "--max-context", "64",
        "--lease-ms", "600", "--quarantine-ms", "3000",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


def holder(server: ServerProcess) -> LineProcess:
    proc = LineProcess("holder", HOLDER, server.target)
    proc.expect("READY")
    return proc


def test_a_stopped_process_pages_stay_out_of_use_until_it_dies(fenced_server: ServerProcess) -> None:
    """SIGSTOP past the lease: the session ends, its 6 pages are quarantined and nobody
    can take them (a 16-page pool, 10 free); SIGKILL: its connection closes and they are
    free, for that reason (not the quarantine's end)."""
    proc = holder(fenced_server)
    try:
        proc.proc.send_signal(signal.SIGSTOP)
        s, _ = wait_stats(fenced_server, lambda s: not s.sessions, timeout=5)
        assert s.num_quarantined_pages == 6 and s.num_quarantined_sessions == 1 and s.num_free_pages == 10
        with KVMemClient(fenced_server.target, name="other") as kv:
            slots = kv.open(["x"])
            assert kv.alloc(slots, [11 * 4]).status.tolist() == [1]  # OUT_OF_PAGES: 10 free, 6 held back
            assert kv.alloc(slots, [10 * 4]).ok
            kv.release(slots)
        proc.proc.send_signal(signal.SIGKILL)
        s, _ = wait_stats(fenced_server, lambda s: s.num_quarantined_pages == 0, timeout=30)
        assert s.num_free_pages == 16, s
    finally:
        proc.kill()
    assert quarantine_ends(fenced_server) == ["its keep-alive stream closed"], fenced_server.log()


def test_the_quarantine_ends_after_its_period_while_the_process_sleeps(fenced_server: ServerProcess) -> None:
    """The quarantine's 3 s are the server's: timed by its own log lines, not by how soon
    a poll sees the pages come back."""
    proc = holder(fenced_server)
    try:
        proc.proc.send_signal(signal.SIGSTOP)
        wait_stats(fenced_server, lambda s: s.num_quarantined_pages == 6, timeout=30)
        s, _ = wait_stats(fenced_server, lambda s: s.num_quarantined_pages == 0, timeout=30)
        assert s.num_free_pages == 16, s
        assert quarantine_ends(fenced_server) == ["the quarantine period passed"], fenced_server.log()
        began = logged_at(fenced_server, "session ended name=holder ")
        ended = logged_at(fenced_server, "quarantine ended name=holder ")
        assert ended - began >= 3.0 - 0.001, (began, ended)  # never early (the log's clock is in ms)
    finally:
        proc.proc.send_signal(signal.SIGCONT)
        proc.kill()


def test_a_process_that_wakes_up_learns_it_lost_the_session_and_lets_go(fenced_server: ServerProcess) -> None:
    proc = holder(fenced_server)
    try:
        proc.proc.send_signal(signal.SIGSTOP)
        wait_stats(fenced_server, lambda s: s.num_quarantined_pages == 6, timeout=5)
        proc.proc.send_signal(signal.SIGCONT)
        proc.send("step")
        assert proc.expect("STEP") == "SessionLost"
        s, _ = wait_stats(fenced_server, lambda s: s.num_quarantined_pages == 0, timeout=30)
        assert s.num_free_pages == 16, s
        # Its client closed the keep-alive stream (the process lives on): not the quarantine's end.
        assert quarantine_ends(fenced_server) == ["its keep-alive stream closed"], fenced_server.log()
        assert proc.proc.poll() is None
    finally:
        proc.kill()


# ------------------------------------------------------------ the client side


def test_the_lease_is_known_to_hold_while_the_keepalive_is_answered(tmpdir_short: str) -> None:
    """No call after the Attach: only the keep-alive's answers (every second, a third of
    the 3 s lease) move the time up to which the lease is known to hold."""
    srv = start_server(tmpdir_short, "--num-pages", "17", "--page-size", "4", "--max-context", "64",
                       "--lease-ms", "3000")  # fmt: skip
    try:
        with KVMemClient(srv.target, name="c") as kv:
            first = kv.lease_valid_until
            assert 0.0 < kv.lease_remaining() <= 3.0
            deadline = time.monotonic() + 30
            while kv.lease_valid_until <= first + 2.0:  # two keep-alive answers later, at least
                assert time.monotonic() < deadline, "the keep-alive's answers did not move the lease"
                time.sleep(0.05)
            assert 0.0 < kv.lease_remaining() <= 3.0
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_a_step_answer_that_arrives_past_the_lease_is_withheld(fenced_server: ServerProcess, step_stream: bool) -> None:
    """The server is stopped while a Step is on its way: the answer (or the refusal)
    comes two seconds later, past the 600 ms lease. The client raises SessionLost and hands
    over no kv_loc. The same over the step stream and over unary calls. The client has
    no keep-alive here: the answer to a keep-alive message sent during the stop, if the
    server takes it before its reaper runs, proves that the lease held, and the Step's
    answer would then rightly be handed over (a flake of this test before, in CI)."""
    kv = KVMemClient(fenced_server.target, name="late", step_stream=step_stream, keepalive=False)
    slots = kv.open(["r"])
    assert kv.alloc(slots, [4]).ok
    outcome: list[object] = []
    stepping = threading.Event()

    def step() -> None:
        stepping.set()
        try:
            outcome.append(kv.alloc(slots, [1]))
        except Exception as err:
            outcome.append(err)

    fenced_server.proc.send_signal(signal.SIGSTOP)
    try:
        worker = threading.Thread(target=step)
        worker.start()
        assert stepping.wait(5)
        time.sleep(2.0)  # from when the step is built: its answer comes well past the 600 ms lease
    finally:
        fenced_server.proc.send_signal(signal.SIGCONT)
    worker.join(10)
    [result] = outcome
    assert isinstance(result, SessionLost), result
    if "withheld" in str(result):  # the server took the Step before its reaper ran
        assert "past the 600 ms lease" in str(result)
    with pytest.raises(SessionLost):
        kv.alloc(slots, [1])
    kv.close()
    s, _ = wait_stats(fenced_server, lambda s: not s.sessions and s.num_quarantined_pages == 0, timeout=6)
    assert s.num_free_pages == 16 and s.num_used_pages == 0
