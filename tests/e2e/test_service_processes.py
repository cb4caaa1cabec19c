"""Many clients, each a real separate process, against one real ``kvmem serve``.

Each client process runs ``CHILD`` (``python -c``) with the real sync client and talks to
the test over a line protocol on its stdin/stdout:

    child: READY                 attached, requests open (and, mode "hold", pages held)
    test:  go                    start stepping                   (modes "random", "loop")
    child: STEPPING              its first step went through      (mode "loop")
    child: HELD <json>           its request -> pages map         (modes "random", "hold")
    test:  release | stop | step | exit
    child: DONE <json>           its summary; it then detaches and exits 0

Fixture geometry: page_size 4, 256 usable pages, 16 request slots, 256 tokens per
request, lease 1500 ms.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from conftest import LineProcess, ServerProcess

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

TOTAL = 256

CHILD = r"""
import json, os, random, sys, threading, time
from kvmem.client import AllocStatus, KVMemClient, KVMemError

target, mode, name, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
rng = random.Random(seed)


def say(*parts):
    print(*parts, flush=True)


def expect(word):
    line = sys.stdin.readline().strip()
    assert line == word, (word, line)


kv = KVMemClient(target, name=name)
g = kv.geometry
PS, NUM_PAGES, MAX_LEN = g.page_size, g.num_pages, g.max_context_len


class Requests:
    # What this process believes it holds; every response is checked against it.

    def __init__(self, ids):
        self.slot = dict(zip(ids, kv.open(ids).tolist()))
        self.pages = {rid: [] for rid in ids}
        self.length = {rid: 0 for rid in ids}
        self.counts = {"steps": 0, "ok": 0, "out_of_pages": 0, "too_long": 0, "released": 0, "truncated": 0}

    def step(self, releases, truncates, allocs):
        # releases: [rid]; truncates: [(rid, new_len)]; allocs: [(rid, need)]
        s = self.slot
        res = kv.step(
            release_slots=[s[r] for r in releases],
            truncate_slots=[s[r] for r, _ in truncates], truncate_lens=[n for _, n in truncates],
            alloc_slots=[s[r] for r, _ in allocs], alloc_needs=[n for _, n in allocs],
            alloc_expected_lens=[self.length[r] if r not in dict(truncates) else dict(truncates)[r]
                                 for r, _ in allocs],
        )
        dropped = sum(len(self.pages[r]) for r in releases)
        for r in releases:
            self.pages[r], self.length[r] = [], 0
        for r, n in truncates:
            keep = -(-n // PS)
            dropped += len(self.pages[r]) - keep
            del self.pages[r][keep:]
            self.length[r] = n
        assert res.num_pages_released == dropped, (res.num_pages_released, dropped)
        assert res.status.numel() == len(allocs)
        for i, (r, need) in enumerate(allocs):
            cur = self.length[r]
            new_pages = res.new_pages_of(i).tolist()
            kv_loc = res.kv_loc_of(i).tolist()
            if int(res.status[i]) != AllocStatus.OK:
                assert int(res.status[i]) in (AllocStatus.OUT_OF_PAGES, AllocStatus.CONTEXT_TOO_LONG), res.status
                if int(res.status[i]) == AllocStatus.CONTEXT_TOO_LONG:
                    assert cur + need > MAX_LEN
                    self.counts["too_long"] += 1
                else:
                    self.counts["out_of_pages"] += 1
                assert new_pages == [] and kv_loc == []
                continue
            self.counts["ok"] += 1
            assert len(new_pages) == -(-(cur + need) // PS) - -(-cur // PS), (cur, need, new_pages)
            assert all(0 < p < NUM_PAGES for p in new_pages), new_pages
            self.pages[r].extend(new_pages)
            pages = self.pages[r]
            assert kv_loc == [pages[t // PS] * PS + t % PS for t in range(cur, cur + need)], (cur, need)
            self.length[r] = cur + need
        held = [p for ps in self.pages.values() for p in ps]
        assert len(held) == len(set(held)), "a page in two of my requests"
        if releases:  # a released request id starts afresh on a (new) slot
            self.slot.update(zip(releases, kv.open(releases).tolist()))
        self.counts["steps"] += 1
        self.counts["released"] += len(releases)
        self.counts["truncated"] += len(truncates)

    def random_step(self):
        ids = list(self.slot)
        # Tuned so that each process holds ~100 of the 256 pages on average: the three
        # together run out of pages now and then, and requests hit max_context.
        releases = [r for r in ids if self.length[r] and rng.random() < 0.05]
        rest = [r for r in ids if r not in releases]
        truncates = [(r, rng.randint(0, self.length[r])) for r in rest if rng.random() < 0.15]
        allocs = [(r, rng.choice([0, 1, 1, 2, 5, 12, 40, 90])) for r in rest if rng.random() < 0.7]
        self.step(releases, truncates, allocs)


if mode == "random":
    reqs = Requests([f"{name}-r{i}" for i in range(4)])
    say("READY")
    expect("go")
    for _ in range(int(sys.argv[5])):
        reqs.random_step()
    say("HELD", json.dumps(reqs.pages))
    expect("release")
    reqs.step(list(reqs.slot), [], [])
    say("DONE", json.dumps(reqs.counts))

elif mode == "hold":
    reqs = Requests(["h0", "h1", "h2"])
    reqs.step([], [], [("h0", 10), ("h1", 7), ("h2", 20)])
    say("READY")
    say("HELD", json.dumps(reqs.pages))
    while True:
        line = sys.stdin.readline().strip()
        if line == "step":
            try:
                reqs.step([], [], [("h0", 1)])
                say("STEP OK")
            except KVMemError as err:
                say("STEP", json.dumps([type(err).__name__, err.code.name, err.reason, err.message]))
        else:
            break
    say("DONE", "{}")

elif mode == "loop":
    reqs = Requests(["l0", "l1"])
    say("READY")
    expect("go")
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    first = time.time()
    last, max_gap, error = first, 0.0, None
    stepped = False
    try:
        while not stop.is_set():
            if reqs.length["l0"] >= 64:
                reqs.step([], [("l0", 0), ("l1", 3)], [("l0", 1), ("l1", 1)])
            else:
                reqs.step([], [], [("l0", 1), ("l1", 1)])
            assert reqs.counts["out_of_pages"] == 0
            now = time.time()
            last, max_gap = now, max(max_gap, now - last)
            if not stepped:
                stepped = True
                say("STEPPING")
    except Exception as exc:  # reported to the test, which fails on it
        error = repr(exc)
    say("DONE", json.dumps({"steps": reqs.counts["steps"], "first": first, "last": last, "max_gap": max_gap,
                            "error": error}))
kv.close()
os._exit(0)  # detached and reported: skip the interpreter's slow teardown of torch
"""


class Child(LineProcess):
    """A client process running ``CHILD`` in one of its modes."""

    def __init__(self, server: ServerProcess, mode: str, name: str, seed: int = 0, *args: str) -> None:
        super().__init__(name, CHILD, server.target, mode, name, str(seed), *args)

    def expect_json(self, word: str, timeout: float = 60.0) -> Any:
        return json.loads(self.expect(word, timeout))

    def finish(self, timeout: float = 30.0) -> None:
        code = self.proc.wait(timeout=timeout)
        assert code == 0, f"{self.name} exited {code}:\n" + "\n".join(self.transcript)


@pytest.fixture
def children() -> Iterator[list[Child]]:
    """Client processes a test starts; whatever is left is killed afterwards."""
    started: list[Child] = []
    yield started
    for child in started:
        child.kill()


@pytest.fixture
def stub(server: ServerProcess) -> Iterator[kvmem_pb2_grpc.KVMemoryStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield kvmem_pb2_grpc.KVMemoryStub(channel)


def audited(stub: kvmem_pb2_grpc.KVMemoryStub) -> kvmem_pb2.StatsResponse:
    s = stub.Stats(kvmem_pb2.StatsRequest(audit=True), timeout=10)
    assert s.audit.ran and s.audit.ok, list(s.audit.problems)
    assert s.num_free_pages + s.num_cached_pages + s.num_used_pages + s.num_quarantined_pages == TOTAL
    assert s.num_used_pages == sum(u.num_pages_held for u in s.sessions), s
    return s


def held_by(s: kvmem_pb2.StatsResponse) -> dict[str, int]:
    return {u.name: u.num_pages_held for u in s.sessions}


def wait_for(stub: kvmem_pb2_grpc.KVMemoryStub, done: Any, timeout: float) -> tuple[kvmem_pb2.StatsResponse, float]:
    """Poll audited Stats until ``done(stats)``; returns it and when it was seen."""
    deadline = time.monotonic() + timeout
    while True:
        s = audited(stub)
        now = time.monotonic()
        if done(s):
            return s, now
        assert now < deadline, f"not within {timeout}s: {s}"
        time.sleep(0.02)


# -------------------------------------------------------------------------- tests


def test_concurrent_clients_in_processes_keep_the_audit(
    server: ServerProcess, stub: kvmem_pb2_grpc.KVMemoryStub, children: list[Child]
) -> None:
    """3 processes x 200 random steps (release, truncate, alloc) on their own requests,
    at once. The audit holds at every poll, the pages of different processes never
    overlap, and at the end every page is free."""
    names = ["p0", "p1", "p2"]
    children.extend(Child(server, "random", name, seed, "200") for seed, name in enumerate(names))
    for child in children:
        child.expect("READY")
    assert audited(stub).num_open_requests == 12
    for child in children:
        child.send("go")

    polls = 0
    held: dict[str, dict[str, list[int]]] = {}
    deadline = time.monotonic() + 60
    while len(held) < len(children):  # poll the audit while they step
        assert time.monotonic() < deadline, f"only {sorted(held)} finished their steps"
        audited(stub)
        polls += 1
        for child in children:
            if child.name not in held and not child.lines.empty():
                try:
                    held[child.name] = child.expect_json("HELD", timeout=0.01)
                except AssertionError:
                    if child.proc.poll() is not None:
                        raise
        time.sleep(0.01)
    assert polls >= 3

    # Everyone has stopped stepping and holds its pages: compare with the server.
    s = audited(stub)
    pages_of = {name: [p for ps in reqs.values() for p in ps] for name, reqs in held.items()}
    assert held_by(s) == {name: len(pages) for name, pages in pages_of.items()}
    every = [p for pages in pages_of.values() for p in pages]
    assert len(every) == len(set(every)), "a page is held by two processes"
    assert s.num_used_pages == len(every)

    summaries = {}
    for child in children:
        child.send("release")
        summaries[child.name] = child.expect_json("DONE")
        child.finish()
    for name, counts in summaries.items():
        assert counts["steps"] == 201 and counts["ok"] > 100 and counts["released"] > 0, (name, counts)
    # The shortfall paths ran too (the draws are seeded; the pool is 2/3 of the demand).
    assert sum(c["out_of_pages"] for c in summaries.values()) > 0, summaries
    assert sum(c["too_long"] for c in summaries.values()) > 0, summaries
    s = audited(stub)
    assert s.num_free_pages == TOTAL and s.num_used_pages == 0 and list(s.sessions) == []
    assert s.num_free_request_slots == 16 and s.num_open_requests == 0
    assert s.num_steps >= 3 * 201


def test_killed_and_stopped_clients_lose_their_pages_and_others_never_notice(
    server: ServerProcess, stub: kvmem_pb2_grpc.KVMemoryStub, children: list[Child]
) -> None:
    """At once: "killed" gets SIGKILL, "sleeper" SIGSTOP, while "bystander" steps on.

    The killed process's keep-alive stream breaks with it: its session ends for that
    reason (the server's log says why), before the stopped one's lease could lapse. The
    stopped one's stream stays open but silent: its session ends when its lease (1500 ms)
    lapses, not before, and its pages are quarantined (it may wake up and write into
    them), not free; woken up, its next call raises SessionLost, its client closes the
    keep-alive stream, and only then are its pages free. The bystander steps before,
    during and after, without an error. (How soon each comes back is the fault run's
    figure, bench/fault_run.py: on a loaded host it is the kernel's teardown.)"""
    killed = Child(server, "hold", "killed")
    sleeper = Child(server, "hold", "sleeper")
    bystander = Child(server, "loop", "bystander")
    children.extend([killed, sleeper, bystander])
    for victim in (killed, sleeper):
        victim.expect("READY")
        assert sum(map(len, victim.expect_json("HELD").values())) == 3 + 2 + 5  # 10, 7 and 20 tokens
    bystander.expect("READY")
    bystander.send("go")
    bystander.expect("STEPPING")
    held = held_by(audited(stub))
    assert held["killed"] == held["sleeper"] == 10 and "bystander" in held
    lease_s = 1.5

    sleeper.proc.send_signal(signal.SIGSTOP)
    killed.proc.send_signal(signal.SIGKILL)
    t0, t0_wall = time.monotonic(), time.time()
    try:
        s, seen_killed = wait_for(stub, lambda s: "killed" not in held_by(s), timeout=30)
        if seen_killed - t0 < 0.5:  # too early for any lease to lapse: the stopped one holds on
            assert held_by(s)["sleeper"] == 10
        s, seen_stopped = wait_for(stub, lambda s: "sleeper" not in held_by(s), timeout=30)
        # Not at once: its last keep-alive went a third of the lease before the SIGSTOP at the
        # most (more if its process was starved; hence a third, not two thirds, here).
        assert seen_stopped - t0 >= lease_s / 3, f"the stopped client lost its session {seen_stopped - t0:.2f}s in"
        log = server.log()
        killed_end = log.index("session ended name=killed ")
        sleeper_end = log.index("session ended name=sleeper ")
        assert killed_end < sleeper_end, log[-3000:]
        assert "why=keep-alive stream closed" in log[killed_end:].splitlines()[0], log[killed_end:][:300]
        assert "why=lease expired" in log[sleeper_end:].splitlines()[0], log[sleeper_end:][:300]
        assert list(held_by(s)) == ["bystander"] and s.num_open_requests == 2  # 6 request slots free again
        s = audited(stub)
        assert s.num_quarantined_pages == 10 and s.num_quarantined_sessions == 1, s
    finally:
        sleeper.proc.send_signal(signal.SIGCONT)

    sleeper.send("step")
    kind, code, reason, message = sleeper.expect_json("STEP")
    assert kind == "SessionLost", (kind, code, reason, message)
    s, _ = wait_for(stub, lambda s: s.num_quarantined_pages == 0, timeout=5)  # it let go: the stream closed
    assert s.num_quarantined_sessions == 0
    sleeper.send("exit")
    sleeper.expect("DONE")
    sleeper.finish()

    time.sleep(0.2)
    bystander.send("stop")
    report = bystander.expect_json("DONE")
    bystander.finish()
    assert report["error"] is None, report
    seen_wall = t0_wall + (seen_stopped - t0)
    assert report["first"] < t0_wall < seen_wall < report["last"] and report["steps"] > 10, report
    s = audited(stub)
    assert s.num_free_pages == TOTAL and list(s.sessions) == [] and s.num_open_requests == 0
