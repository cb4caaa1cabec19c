"""Sessions resume across a server restart (``kvmem serve --keep-state``): real servers
SIGKILLed at random moments and at each named point of applying a Step, real client
processes (the blocking and the asyncio client) that step and write K/V through the
whole run and never see an exception. Every value written before a crash reads back
after it through the block table, every Step is applied exactly once (each alloc
names the length it expects, so a Step applied twice or lost would be refused), no
token is allocated again (the requests' lengths go on from where they were), and the
audit is clean. A client that does not come back within ``--resume-ms`` is ended as a
lapsed lease ends it, its pages quarantined so that a process stopped through the crash
never writes into another session's pages; its resume is then refused as SessionLost."""

from __future__ import annotations

import json
import os
import random
import signal
import textwrap
import time

import pytest
from conftest import LineProcess, short_tmpdir, start_server

from kvmem.client import KVMemClient
from kvmem.server.core.crash import POINTS

FLAGS = ("--num-pages", "1024", "--max-context", "2048", "--dtype", "float32", "--lease-ms", "3000")

# A worker: 4 requests of 40 tokens, then decode steps (one token each, the length each
# must have named) until the file argv[3] exists, every token's K/V = slot * 1000 +
# position; then every token is read back through the block table. argv[4]: "sync" or
# "async" (the client); argv[5]: "prefix" to make each Step carry a cache item too (the
# general path, through every crash point).
WORKER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time, torch
    from kvmem.client import AsyncKVMemClient, KVMemClient
    target, name, stop, api, mode = sys.argv[1:6]
    resumed = []
    N = 4

    def write(kv, slots, r, lens):
        for i, s in enumerate(slots):
            loc = r.kv_loc_of(i).long()
            val = s * 1000 + torch.arange(lens[i], lens[i] + loc.numel(), dtype=torch.float32)
            for k, v in kv.kv_cache():
                k[loc] = val[:, None, None]
                v[loc] = -val[:, None, None]

    def check(kv, slots, lens):
        ps, bt, bad = kv.geometry.page_size, kv.block_table, 0
        for i, s in enumerate(slots):
            row = bt[s].tolist()
            assert sum(1 for p in row if p) == -(-lens[i] // ps), (s, lens[i], row)
            loc = torch.tensor([row[p // ps] * ps + p % ps for p in range(lens[i])])
            want = s * 1000 + torch.arange(lens[i], dtype=torch.float32)
            for k, v in kv.kv_cache():
                bad += int((k[loc][:, 0, 0] != want).sum()) + int((v[loc][:, 0, 0] != -want).sum())
        return bad

    def columns(slots, lens, step):
        extra = {}
        if mode == "prefix":  # a cache item: the general path
            extra["cache"] = [(slots[0], list(range(7, 7 + lens[0])))]
        return dict(alloc_slots=slots, alloc_needs=[1] * N, alloc_expected_lens=lens, **extra)

    def report(kv, slots, lens, steps):
        st = kv.stats(audit=True)
        print("done", json.dumps({"resumes": len(resumed), "bad": check(kv, slots, lens), "lens": lens,
              "steps": steps, "audit": st.audit.ok, "problems": list(st.audit.problems)}), flush=True)

    def run_sync():
        kv = KVMemClient(target, name=name, on_resumed=resumed.append, timeout=30, cache_namespace="ns")
        slots = kv.open([f"{name}-{i}" for i in range(N)]).tolist()
        r = kv.step(alloc_slots=slots, alloc_needs=[40] * N)
        assert r.ok
        lens = [0] * N
        write(kv, slots, r, lens)
        lens = [40] * N
        print("ready", flush=True)
        steps = 0
        while not os.path.exists(stop):
            r = kv.step(**columns(slots, lens, steps))
            assert r.ok, r.status
            write(kv, slots, r, lens)
            lens = [n + 1 for n in lens]
            steps += 1
            time.sleep(0.01)
        report(kv, slots, lens, steps)
        kv.close()

    async def run_async():
        kv = await AsyncKVMemClient.connect(target, name=name, on_resumed=resumed.append, timeout=30,
                                            cache_namespace="ns")
        slots = (await kv.open([f"{name}-{i}" for i in range(N)])).tolist()
        r = await kv.step(alloc_slots=slots, alloc_needs=[40] * N)
        lens = [0] * N
        write(kv, slots, r, lens)
        lens = [40] * N
        print("ready", flush=True)
        steps = 0
        while not os.path.exists(stop):
            r = await kv.step(**columns(slots, lens, steps))
            assert r.ok, r.status
            write(kv, slots, r, lens)
            lens = [n + 1 for n in lens]
            steps += 1
            await asyncio.sleep(0.01)
        st = await kv.stats(audit=True)
        print("done", json.dumps({"resumes": len(resumed), "bad": check(kv, slots, lens), "lens": lens,
              "steps": steps, "audit": st.audit.ok, "problems": list(st.audit.problems)}), flush=True)
        await kv.close()

    run_sync() if api == "sync" else asyncio.run(run_async())
    """
)


def serve(directory: str, *extra: str, env: dict[str, str] | None = None, wait: bool = True) -> object:
    return start_server(
        directory, "--keep-state", "--shm-dir", directory, "--resume-ms", "20000", *FLAGS, *extra, env=env, wait=wait
    )


def finish(workers: list[LineProcess], stop: str) -> list[dict]:
    open(stop, "w").close()
    return [json.loads(w.expect("done", timeout=120)) for w in workers]


def test_workers_resume_through_random_sigkills_with_every_value_and_no_token_again() -> None:
    directory = short_tmpdir()
    stop = os.path.join(directory, "stop")
    rng = random.Random(int(os.environ.get("KVMEM_TEST_SEED", "22")))
    srv = serve(directory, "--num-pages", "3072")
    servers = [srv]
    workers = [
        LineProcess(f"w{i}", WORKER, srv.target, f"w{i}", stop, "sync" if i % 2 == 0 else "async", "decode")
        for i in range(16)
    ]
    try:
        for w in workers:
            w.expect("ready", timeout=120)
        kills = 4
        for _ in range(kills):
            time.sleep(rng.uniform(0.2, 0.8))
            assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
            srv = serve(directory, "--num-pages", "3072")
            servers.append(srv)
            assert "nothing to repair" in srv.log().split("--keep-state: adopted")[-1], srv.log()
        time.sleep(0.5)
        results = finish(workers, stop)
        for r in results:
            assert r["bad"] == 0 and r["audit"], r
            assert 1 <= r["resumes"] <= kills, r  # a kill before a resume: one resume over two runs
            assert r["lens"] == [40 + r["steps"]] * 4, r  # each Step applied once, nothing allocated again
        with KVMemClient(srv.target, name="look") as kv:
            origin = kv.stats().origin
            assert (origin.kind, origin.sessions, origin.resumed, origin.not_resumed) == ("adopted", 16, 16, 0), origin
    finally:
        for w in workers:
            w.kill()
        for s in servers:
            s.stop(signal.SIGKILL)


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_each_point_of_a_step_is_recovered_and_the_client_learns_its_fate(point: str) -> None:
    """The server dies at ``point`` of its 5th Step with a cache item; the restarted one
    undoes the Step (it was not committed) or keeps it (after the commit, its answer
    kept); the worker, none the wiser, goes on: every Step once, every value right."""
    directory = short_tmpdir()
    stop = os.path.join(directory, "stop")
    srv = serve(directory, env={"KVMEM_TEST_CRASH_AT": f"{point}:5"})
    servers = [srv]
    worker = LineProcess("w", WORKER, srv.target, "w", stop, "sync", "prefix")
    try:
        worker.expect("ready")
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == -signal.SIGKILL, srv.log()
        again = serve(directory)
        servers.append(again)
        log = again.log()
        if point == "after-commit":
            assert "was undone" not in log, log
        else:
            assert "cut by the crash was undone" in log, log
        assert "nothing to repair" in log, log
        time.sleep(0.5)
        (result,) = finish([worker], stop)
        assert result["bad"] == 0 and result["audit"] and result["resumes"] == 1, result
        assert result["lens"] == [40 + result["steps"]] * 4, result
    finally:
        worker.kill()
        for s in servers:
            s.stop(signal.SIGKILL)


# A client that holds two requests, prints its pages, and on "go" steps once more.
HOLDER = textwrap.dedent(
    """
    import json, sys
    from kvmem.client import KVMemClient, SessionLost
    kv = KVMemClient(sys.argv[1], name="holder", timeout=5)
    slots = kv.open(["a", "b"]).tolist()
    r = kv.step(alloc_slots=slots, alloc_needs=[64, 64])
    assert r.ok
    print("ready", json.dumps(r.new_pages.tolist()), flush=True)
    sys.stdin.readline()
    try:
        kv.step(alloc_slots=slots, alloc_needs=[1, 1])
        print("stepped", flush=True)
    except SessionLost as e:
        print("lost", json.dumps({"views_stale": e.views_stale, "message": str(e)}), flush=True)
    """
)


def test_a_client_not_back_in_time_is_released_and_never_writes_into_another_sessions_pages() -> None:
    """The holder is stopped (SIGSTOP) through the crash and past the resume window: its
    session ends as a lapsed lease ends it, its pages quarantined, so another session
    that takes every free page gets none of them; woken, the holder's resume is refused
    and it gets SessionLost (views stale), not an answer to write through."""
    directory = short_tmpdir()
    srv = serve(directory)
    servers = [srv]
    holder = LineProcess("holder", HOLDER, srv.target)
    try:
        held = set(json.loads(holder.expect("ready")))
        assert len(held) == 8
        holder.proc.send_signal(signal.SIGSTOP)
        assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
        again = serve(directory, "--resume-ms", "1000", "--quarantine-ms", "60000")
        servers.append(again)
        with KVMemClient(again.target, name="other") as kv:
            deadline = time.monotonic() + 20
            while kv.stats().origin.not_resumed == 0:
                assert time.monotonic() < deadline, again.log()
                time.sleep(0.1)
            stats = kv.stats()
            assert stats.num_quarantined_pages == 8 and stats.origin.waiting == 0, stats
            assert "why=not resumed in time" in again.log(), again.log()
            free, row = stats.num_free_pages, 2048 // 16  # pages; a request holds at most a row
            needs = [2048] * (free // row) + ([free % row * 16] if free % row else [])
            slots = kv.open([f"r{i}" for i in range(len(needs))]).tolist()
            r = kv.step(alloc_slots=slots, alloc_needs=needs)
            taken = set(r.new_pages.tolist())
            assert r.ok and len(taken) == free and not taken & held, (len(taken), free, taken & held)
            holder.proc.send_signal(signal.SIGCONT)
            holder.send("go")
            lost = json.loads(holder.expect("lost", timeout=30))
            assert lost["views_stale"] and "could not be resumed" in lost["message"], lost
    finally:
        holder.proc.send_signal(signal.SIGCONT)
        holder.kill()
        for s in servers:
            s.stop(signal.SIGKILL)


def test_stats_kvmem_stats_and_metrics_show_the_resumes_and_the_undone_step() -> None:
    """After a crash at ``mid-allocs`` of the 3rd Step: the restarted server's Stats,
    ``kvmem stats`` and metrics say a Step was undone and the session resumed."""
    import socket
    import subprocess
    import sys
    import urllib.request

    directory = short_tmpdir()
    stop = os.path.join(directory, "stop")
    srv = serve(directory, env={"KVMEM_TEST_CRASH_AT": "mid-allocs:3"})
    servers = [srv]
    worker = LineProcess("w", WORKER, srv.target, "w", stop, "sync", "decode")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        srv.proc.wait(timeout=60)
        again = serve(directory, "--metrics", f"127.0.0.1:{port}")
        servers.append(again)
        worker.expect("ready")
        deadline = time.monotonic() + 20
        with KVMemClient(again.target, name="look") as kv:
            while kv.stats().origin.resumed < 1:
                assert time.monotonic() < deadline, again.log()
                time.sleep(0.05)
            origin = kv.stats().origin
            assert (origin.sessions, origin.resumed, origin.waiting) == (1, 1, 0), origin
            assert "cut by the crash was undone" in origin.undone, origin
        shown = subprocess.run(
            [sys.executable, "-m", "kvmem.cli", "stats", "--socket", again.socket_path], capture_output=True, text=True
        )  # fmt: skip
        assert "sessions: 1 of 1 resumed, 0 waiting, 0 ended unresumed" in shown.stdout, shown.stdout
        assert "was undone" in shown.stdout, shown.stdout
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert "kvmem_state_step_undone 1.0" in scraped and 'kvmem_state_sessions{fate="resumed"} 1.0' in scraped
        (result,) = finish([worker], stop)
        assert result["bad"] == 0 and result["audit"] and result["lens"] == [40 + result["steps"]] * 4, result
    finally:
        worker.kill()
        for s in servers:
            s.stop(signal.SIGKILL)


# The drop-in (the reference allocator's interface) through two SIGKILLs: 4 requests of
# 40 tokens, then decode blocks until argv[2] exists; every token's K/V checked at the end.
DROPIN = textwrap.dedent(
    """
    import json, os, sys, time, torch
    from kvmem.client import KVAllocator
    resumed = []
    a = KVAllocator(sys.argv[1], max_batch_size=4, name="dropin", on_resumed=resumed.append, timeout=30)
    layers = a.client.kv_cache()
    lens = [0] * 4

    def block(need):
        with a.iteration():
            out = [a.alloc(i, need, lens[i]) for i in range(4)]
        for i, r in enumerate(out):
            loc = r.value.long()
            val = i * 1000 + torch.arange(lens[i], lens[i] + loc.numel(), dtype=torch.float32)
            for k, v in layers:
                k[loc] = val[:, None, None]
                v[loc] = -val[:, None, None]
            lens[i] += loc.numel()

    block(40)
    print("ready", flush=True)
    steps = 0
    while not os.path.exists(sys.argv[2]):
        block(1)
        steps += 1
        time.sleep(0.01)
    bad, ps = 0, a.page_size
    for i in range(4):
        row = a.req_to_page[i].tolist()
        loc = torch.tensor([row[p // ps] * ps + p % ps for p in range(lens[i])])
        want = i * 1000 + torch.arange(lens[i], dtype=torch.float32)
        for k, v in layers:
            bad += int((k[loc][:, 0, 0] != want).sum()) + int((v[loc][:, 0, 0] != -want).sum())
    print("done", json.dumps({"resumes": len(resumed), "bad": bad, "lens": lens, "steps": steps}), flush=True)
    a.close()
    """
)


def test_the_drop_in_goes_on_through_restarts_without_an_exception() -> None:
    directory = short_tmpdir()
    stop = os.path.join(directory, "stop")
    srv = serve(directory)
    servers = [srv]
    dropin = LineProcess("dropin", DROPIN, srv.target, stop)
    try:
        dropin.expect("ready")
        for _ in range(2):
            time.sleep(0.5)
            assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
            srv = serve(directory)
            servers.append(srv)
        time.sleep(0.5)
        open(stop, "w").close()
        result = json.loads(dropin.expect("done", timeout=60))
        assert result["bad"] == 0 and 1 <= result["resumes"] <= 2, result
        assert result["lens"] == [40 + result["steps"]] * 4, result
    finally:
        dropin.kill()
        for s in servers:
            s.stop(signal.SIGKILL)
