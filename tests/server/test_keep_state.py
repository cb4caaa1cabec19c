"""``kvmem serve --keep-state``: a server killed (SIGKILL) or stopped (SIGTERM) comes back
with its KV memory and its state: the prefix cache's pages with their K/V bytes, and
the requests of clients still attached (which resume them: ``test_resume.py``; with
``--resume-ms 0`` they are ended as a lapsed lease ends them: quarantined, then freed). Real servers, real client processes,
a private ``--shm-dir`` each. Refusals: another geometry (unless ``--discard-state``),
a state a running server holds, ``--keep-state`` off the shm backend, ``--discard-state``
alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from conftest import refused_at_start, short_tmpdir, start_server

from kvmem.client import KVMemClient
from kvmem.server.memory import PoolSpec
from kvmem.server.memory.geometry import KVGeometry
from kvmem.server.memory.shm import ShmBackend

PROMPT = np.arange(1000, 1064, dtype=np.int32)  # 4 pages of 16
FLAGS = ("--num-pages", "64", "--max-context", "512", "--dtype", "float32", "--lease-ms", "3000")

# A client process: caches PROMPT (its K/V: the position, in every element), opens a
# request of 20 tokens that it keeps, says so and waits (alive through the server's crash).
HOLDER = textwrap.dedent(
    """
    import sys, time, numpy as np, torch
    from kvmem.client import KVMemClient
    kv = KVMemClient(sys.argv[1], name="holder", cache_namespace="ns")
    a, b = kv.open(["a", "b"]).tolist()
    r = kv.step(alloc_slots=[a, b], alloc_needs=[64, 20])
    assert r.ok, r
    for k, v in kv.kv_cache():
        loc = r.kv_loc_of(0).long()
        k[loc] = torch.arange(64, dtype=k.dtype)[:, None, None].expand(64, *k.shape[1:])
        v[loc] = -k[loc]
    kv.step(release_slots=[a], release_token_ids=[np.arange(1000, 1064, dtype=np.int32)])
    print("ready", flush=True)
    time.sleep(600)
    """
)


def serve(directory: str, *extra: str) -> object:
    return start_server(directory, "--keep-state", "--shm-dir", directory, *FLAGS, *extra)


def kept_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("kvmem-0-"))


def read_back(target: str) -> tuple[list[int], bool]:
    """A new client matches PROMPT (all but its last token) and reads its K/V through
    the block table: the match lengths, and whether every value is what HOLDER wrote."""
    with KVMemClient(target, name="reader", cache_namespace="ns") as kv:
        (c,) = kv.open(["c"]).tolist()
        r = kv.step(match=[(c, PROMPT, 63)], alloc_slots=[c], alloc_needs=[64])
        assert r.ok, r
        ps = kv.geometry.page_size
        row = kv.block_table[c].tolist()
        loc = torch.tensor([row[p // ps] * ps + p % ps for p in range(48)])
        want = torch.arange(48, dtype=torch.float32)[:, None, None]
        ok = all(bool((k[loc] == want).all() and (v[loc] == -want).all()) for k, v in kv.kv_cache())
        return r.match_lens.tolist(), ok


def test_a_killed_server_comes_back_with_its_prefix_cache_kv_bytes_and_quarantines() -> None:
    directory = short_tmpdir()
    srv = serve(directory, "--quarantine-ms", "1500", "--resume-ms", "0")
    servers = [srv]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, srv.target], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
        assert len(kept_files(directory)) == 5, os.listdir(directory)  # kv, bt, st, sl, lock
        again = serve(directory, "--quarantine-ms", "1500", "--resume-ms", "0")
        servers.append(again)
        log = again.log()
        assert "--keep-state: adopted 1 owners, 1 open requests holding 2 pages, 4 cached pages" in log, log
        assert "nothing to repair" in log and "adopted owner ended index=1" in log, log
        matched, same = read_back(again.target)
        assert matched == [48] and same, (matched, same)
        shown = subprocess.run(
            [sys.executable, "-m", "kvmem.cli", "stats", "--socket", again.socket_path], capture_output=True, text=True
        )  # fmt: skip
        assert "state adopted from the last run in" in shown.stdout and "1 requests (2 pages)" in shown.stdout, shown
        with KVMemClient(again.target, name="look") as kv:
            origin = kv.stats().origin
            assert (origin.kind, origin.owners, origin.requests, origin.cached_pages) == ("adopted", 1, 1, 4), origin
            assert kv.stats().num_quarantined_pages == 2  # b's 20 tokens: its pages wait, the holder may write
            deadline = time.monotonic() + 20
            while kv.stats().num_quarantined_pages and time.monotonic() < deadline:
                time.sleep(0.1)
            assert kv.stats().num_quarantined_pages == 0, "the adopted quarantine never ended"
        assert again.stop() == 0, again.log()
    finally:
        holder.kill()
        holder.wait()
        for server in servers:  # a failed assertion leaves no server behind
            server.stop(signal.SIGKILL)
    assert len(kept_files(directory)) == 5  # a clean stop keeps the state too


def test_a_stopped_server_keeps_its_state_and_the_next_adopts_it() -> None:
    directory = short_tmpdir()
    srv = serve(directory)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, srv.target], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        assert srv.stop() == 0, srv.log()
    finally:
        holder.kill()
        holder.wait()
    again = serve(directory)
    try:
        assert "4 cached pages" in again.log(), again.log()
        assert read_back(again.target) == ([48], True)
    finally:
        assert again.stop() == 0


def test_another_geometry_is_refused_unless_the_state_is_discarded() -> None:
    directory = short_tmpdir()
    srv = serve(directory)
    with KVMemClient(srv.target, name="w", cache_namespace="ns") as kv:
        (a,) = kv.open(["a"]).tolist()
        assert kv.step(alloc_slots=[a], alloc_needs=[64]).ok
        kv.step(release_slots=[a], release_token_ids=[PROMPT])
    assert srv.stop() == 0
    args = ["--keep-state", "--shm-dir", directory, *FLAGS[2:], "--num-pages", "80", "--socket", srv.socket_path]
    refused = subprocess.run([sys.executable, "-m", "kvmem.cli", "serve", *args], capture_output=True, text=True)
    assert refused.returncode != 0
    assert "the kept state does not fit this pool" in refused.stderr and "--discard-state" in refused.stderr
    assert len(kept_files(directory)) == 5  # left as it was
    fresh = start_server(directory, *args[:-2], "--discard-state")
    try:
        assert "--discard-state: removed the kept" in fresh.log() and "a new state in" in fresh.log(), fresh.log()
        with KVMemClient(fresh.target, name="w", cache_namespace="ns") as kv:
            assert kv.stats().num_cached_pages == 0 and kv.stats().origin.kind == "new"
    finally:
        assert fresh.stop() == 0


def test_a_state_a_running_server_holds_is_never_adopted() -> None:
    directory = short_tmpdir()
    geometry = KVGeometry("mha", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)
    pool = PoolSpec(geometry, num_pages=8, max_requests=4, max_context_len=16)
    first = ShmBackend(pool, directory, keep="00112233aabbccdd", state_bytes=4096)
    with pytest.raises(RuntimeError, match="is in use by a running kvmem server"):
        ShmBackend(pool, directory, keep="00112233aabbccdd", state_bytes=4096)
    first.close()
    second = ShmBackend(pool, directory, keep="00112233aabbccdd", state_bytes=4096)
    assert second.reopened and second.state is not None
    second.close()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--keep-state", "--device", "none"), "--keep-state keeps the KV memory in --shm-dir"),
        (("--discard-state",), "--discard-state drops a state --keep-state kept"),
    ],
)
def test_keep_state_options_that_cannot_work_are_refused(extra: tuple[str, ...], words: str) -> None:
    run = refused_at_start(*extra)
    assert words in run.stderr, run.stderr


def test_a_server_that_keeps_no_state_says_so() -> None:
    directory = short_tmpdir()
    srv = start_server(directory, "--shm-dir", directory, *FLAGS)
    try:
        with KVMemClient(srv.target, name="look") as kv:
            assert kv.stats().origin.kind == "fresh"
        shown = subprocess.run(
            [sys.executable, "-m", "kvmem.cli", "stats", "--socket", srv.socket_path], capture_output=True, text=True
        )  # fmt: skip
        assert "state not kept (a restart starts empty; kvmem serve --keep-state keeps it)" in shown.stdout, shown
    finally:
        assert srv.stop() == 0
    assert kept_files(directory) == []


# A writer process: over and over, a request of one of 6 prompts (4 shared 32-token
# prefixes, then a tail of its own) is matched against the cache, allocated, written
# (K = token * 1000 + position, V = -K, every layer: a value any reader can check from
# the tokens alone) and released with its tokens, so its full pages enter the cache. On
# any error (the server was killed) it attaches again and goes on. Stops on a line on stdin.
WRITER = textwrap.dedent(
    """
    import random, select, sys, time, numpy as np, torch
    from kvmem.client import KVMemClient
    from kvmem.client.errors import KVMemError

    rng = random.Random(int(sys.argv[2]))
    prefixes = [np.arange(100 * p + 1, 100 * p + 33, dtype=np.int32) for p in range(4)]
    kv, written = None, 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        try:
            if kv is None:
                kv = KVMemClient(sys.argv[1], name=f"writer-{sys.argv[2]}", cache_namespace="ns", timeout=2.0)
            tail = [rng.randrange(1, 900) for _ in range(rng.randrange(1, 40))]
            tokens = np.concatenate([prefixes[rng.randrange(4)], np.array(tail, dtype=np.int32)])
            (slot,) = kv.open([f"r{written}"]).tolist()
            r = kv.step(match=[(slot, tokens, tokens.size - 1)], alloc_slots=[slot], alloc_needs=[tokens.size])
            if not r.ok:
                kv.release([slot]); continue
            start = int(r.match_lens[0])
            loc = r.kv_loc_of(0).long()
            values = torch.from_numpy((tokens[start:] * 1000 + np.arange(start, tokens.size)).astype(np.float32))
            for k, v in kv.kv_cache():
                k[loc] = values[:, None, None].expand(-1, *k.shape[1:])
                v[loc] = -k[loc]
            kv.step(release_slots=[slot], release_token_ids=[tokens])
            written += 1
        except KVMemError:
            if kv is not None:
                try:
                    kv.close()
                except Exception:
                    pass
            kv = None
            time.sleep(0.05)
    print(written, flush=True)
    """
)


def verify_cached(target: str) -> int:
    """Match each shared prefix (and nothing more) and check every matched token's K and V
    in every layer against its tokens: returns the tokens checked."""
    checked = 0
    with KVMemClient(target, name="verifier", cache_namespace="ns") as kv:
        ps = kv.geometry.page_size
        for p in range(4):
            tokens = np.arange(100 * p + 1, 100 * p + 33, dtype=np.int32)
            (slot,) = kv.open([f"v{p}"]).tolist()
            r = kv.step(match=[(slot, tokens)])
            m = int(r.match_lens[0])
            row = kv.block_table[slot].tolist()
            loc = torch.tensor([row[i // ps] * ps + i % ps for i in range(m)], dtype=torch.long)
            want = torch.from_numpy((tokens[:m] * 1000 + np.arange(m)).astype(np.float32))[:, None, None]
            for k, v in kv.kv_cache():
                assert bool((k[loc] == want).all() and (v[loc] == -want).all()), (
                    f"prefix {p}: wrong K/V after a restart"
                )
            checked += m * len(kv.kv_cache())
            kv.release([slot])
    return checked


def test_cached_kv_survives_sigkills_at_random_instants_under_load() -> None:
    """4 writer processes cache and write prefixes while the server is SIGKILLed at
    random instants 8 times and restarted; after each restart the prefixes cached before
    the kill match and read back exactly (every token, K and V, both layers), the state
    was adopted (audited at start, KVMEM_DEBUG audits every Step), and at the end no page
    is lost."""
    directory = short_tmpdir()
    rng = np.random.default_rng(22)
    srv = serve(directory, "--quarantine-ms", "500", "--lease-ms", "1000")
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, srv.target, str(i)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    servers, checked = [srv], 0
    try:
        time.sleep(3.0)  # the writers import torch and start caching
        for _ in range(8):
            time.sleep(float(rng.uniform(0.2, 1.2)))
            assert servers[-1].stop(signal.SIGKILL) == -signal.SIGKILL
            servers.append(serve(directory, "--quarantine-ms", "500", "--lease-ms", "1000"))
            assert "--keep-state: adopted" in servers[-1].log(), servers[-1].log()
            checked += verify_cached(servers[-1].target)
        for w in writers:
            assert w.stdin is not None
            w.stdin.write("stop\n")
            w.stdin.flush()
        ends = [w.communicate(timeout=60) for w in writers]
        written = [int(out.strip() or 0) for out, _ in ends]
        assert all(n > 0 for n in written), (written, [err[-2000:] for _, err in ends])
        with KVMemClient(servers[-1].target, name="end") as kv:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                s = kv.stats(audit=True)
                if s.num_used_pages == 0 and s.num_quarantined_pages == 0:
                    break
                time.sleep(0.1)
            assert s.audit.ok and s.num_used_pages == 0 and s.num_quarantined_pages == 0, s
            assert s.num_free_pages + s.num_cached_pages == s.num_pages_total, s
        print(f"writers wrote {written} requests; {checked} cached tokens read back after 8 SIGKILLs")
        assert checked > 0
        repairs = [line for server in servers for line in server.log().splitlines() if "repaired:" in line]
        print("\n".join(repairs) or "no adoption needed a repair")
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
        for server in servers:
            server.stop(signal.SIGKILL)
