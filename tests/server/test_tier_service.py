"""The host-memory tier on a real server (``kvmem serve --host-memory``), over its socket,
with its shared memory mapped by clients in separate processes.

One process writes a prompt's K/V through its mapping and releases it into the prefix
cache; another's allocs take the whole pool, so the prompt's pages are evicted (and
demoted to the host tier); a third process, which never saw any of it, matches the prompt
and reads every token's K and V back through its own block-table row: all as written.
``kvmem stats`` shows the tier; options that cannot work are refused at start with a
line that says why. With ``--keep-state`` the tier and its index outlive a SIGKILL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import ServerProcess, refused_at_start, short_tmpdir, start_server
from prometheus_client.parser import text_string_to_metric_families

from kvmem.client import KVMemClient, watch_events

PS, PAGES = 4, 9  # 8 usable pages of 4 tokens
# 2 layers, K and V, 1 head of 2 float32: 128 bytes a page; 16 host pages.
FLAGS = ["--device", "cpu", "--page-size", str(PS), "--num-pages", str(PAGES), "--max-requests", "8",
         "--max-context", "32", "--layers", "2", "--kv-heads", "1", "--head-dim", "2", "--dtype", "float32",
         "--host-memory", "2KiB"]  # fmt: skip
PROMPT = list(range(100, 114))  # 3 full pages and 2 tokens

# A client process: attach, then run ``action`` (write / fill / read) and print JSON.
CLIENT = r"""
import json, sys
import torch
from kvmem.client import KVMemClient

target, action, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
PS = 4

def value(token, pos, layer, kv, rank):
    return float(token * 1000 + pos * 10 + layer * 2 + kv + rank * 0.5)

def sync():  # a CUDA pool: the writes are done before the Step that caches them
    if kv.memory.backend == "cuda":
        torch.cuda.synchronize()

with KVMemClient(target, name=action) as kv:
    ranks = [kv.kv_cache(rank) for rank in range(kv.memory.num_ranks)]  # per rank, per layer (k, v)
    (slot,) = kv.open([action]).tolist()
    if action == "write":
        r = kv.step(alloc_slots=[slot], alloc_needs=[len(tokens)])
        for pos, loc in enumerate(r.kv_loc.tolist()):
            for rank, layers in enumerate(ranks):
                for layer, planes in enumerate(layers):
                    for k in range(2):
                        planes[k][loc] = value(tokens[pos], pos, layer, k, rank)
        sync()
        kv.step(release_slots=[slot], release_token_ids=[tokens])
        print(json.dumps({"ok": True}))
    elif action == "fill":
        r = kv.step(alloc_slots=[slot], alloc_needs=[len(tokens)])
        ok = r.ok
        kv.step(release_slots=[slot])
        print(json.dumps({"ok": ok}))
    else:
        r = kv.step(match=[(slot, tokens)])
        matched, loading = int(r.match_lens[0]), int(r.match_loading[0])
        # the server copies the pages in after it answers: wait for them, in this process's memory
        kv.wait_loads(slot, matched, loading, timeout=30)
        row = kv.block_table[slot].tolist()
        assert kv.page_loads.ready(kv.page_loads.pages_of(kv.block_table[slot], matched, matched))
        wrong = []
        for pos in range(matched):
            loc = row[pos // PS] * PS + pos % PS
            for rank, layers in enumerate(ranks):
                for layer, planes in enumerate(layers):
                    for k in range(2):
                        want = value(tokens[pos], pos, layer, k, rank)
                        got = planes[k][loc].tolist()
                        if got != [[want, want]]:
                            wrong.append([pos, rank, layer, k, got])
        print(json.dumps({"matched": matched, "wrong": wrong[:5], "loading_ok": loading in (0, 4, 8, 12)}))
"""


def client(target: str, action: str, tokens: list[int]) -> dict:
    run = subprocess.run(
        [sys.executable, "-c", CLIENT, target, action, json.dumps(tokens)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    out: dict = json.loads(run.stdout.strip().splitlines()[-1])
    return out


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    srv = start_server(short_tmpdir(), *FLAGS, "--metrics", "127.0.0.1:0")
    yield srv
    assert srv.stop() == 0, srv.log()


def test_tier_a_prefix_evicted_by_another_process_is_read_back_from_the_host_by_a_third(
    server: ServerProcess,
) -> None:
    assert client(server.target, "write", PROMPT) == {"ok": True}
    assert client(server.target, "fill", list(range(500, 532))) == {"ok": True}  # every page: the prompt's evicted
    with KVMemClient(server.target, name="look") as kv:
        st = kv.stats(audit=True)
        assert st.audit.ok, st.audit.problems
        assert (st.num_cached_pages, st.host_tier.num_cached_pages, st.host_tier.num_demoted) == (0, 3, 3)
    got = client(server.target, "read", PROMPT)
    assert got == {"matched": 12, "wrong": [], "loading_ok": True}, got
    with KVMemClient(server.target, name="look") as kv:
        st = kv.stats(audit=True)
        assert st.audit.ok, st.audit.problems
        assert (st.host_tier.num_loaded, st.host_tier.hit_tokens, st.host_tier.page_bytes) == (3, 12, 128)
    shown = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "stats", "--socket", server.socket_path], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    shown_tier = "host tier 16 pages   cached 3   free 13   in copy 0   since start: demoted 3, loaded 3 (12 tokens"
    assert shown_tier in shown.stdout
    assert re.search(r"loads: p50 \d+\.\d\d ms, p99 \d+\.\d\d ms, \d+\.\d GiB/s", shown.stdout), shown.stdout
    found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", server.log())
    assert found, server.log()
    with urllib.request.urlopen(found.group(1), timeout=10) as resp:
        samples = {
            (x.name, tuple(sorted(x.labels.items()))): x.value
            for family in text_string_to_metric_families(resp.read().decode())
            for x in family.samples
        }
    assert samples[("kvmem_host_tier_pages", (("state", "cached"),))] == 3
    assert samples[("kvmem_host_tier_pages", (("state", "free"),))] == 13
    assert samples[("kvmem_host_tier_pages_moved_total", (("direction", "demoted"),))] == 3
    assert samples[("kvmem_host_tier_pages_moved_total", (("direction", "loaded"),))] == 3
    assert samples[("kvmem_host_tier_bytes_moved_total", ())] == 6 * 128
    assert samples[("kvmem_host_tier_hit_tokens_total", ())] == 12
    assert samples[("kvmem_host_tier_pages_in_copy", ())] == 0
    assert 0 < samples[("kvmem_host_tier_load_seconds", (("quantile", "0.5"),))] < 10

    # The events say where the prompt's pages are, as vLLM's medium does: stored on the
    # device ("GPU"), stored on the host as they were evicted ("CPU") and removed from the
    # device, then stored on the device again by the load.
    with watch_events(server.target) as stream:
        seen: list[tuple[str, str, int]] = []
        for batch in stream:
            for e in batch.events:
                kind = e.WhichOneof("event")
                if kind == "stored":
                    seen.append(("stored", e.stored.medium, len(e.stored.keys)))
                elif kind == "removed":
                    seen.append(("removed", e.removed.medium, len(e.removed.keys)))
            if seen and seen[-1] == ("stored", "GPU", 3) and ("stored", "CPU", 1) in seen:
                break
    prompt = [x for x in seen if x[2] in (1, 3)]
    assert prompt[0] == ("stored", "GPU", 3)  # the write's release
    assert prompt.count(("stored", "CPU", 1)) == 3  # demoted one page per event
    assert seen.index(("stored", "CPU", 1)) < seen.index(("removed", "GPU", 3))
    assert prompt[-1] == ("stored", "GPU", 3)  # the load

    # A watcher that lost track resyncs from a snapshot of both tiers: the prompt's chain
    # in the pool and, as a run of its own, on the host.
    with watch_events(server.target, from_seq=1, epoch="an-earlier-run") as resync:
        snapshot: list[tuple[str, int]] = []
        for batch in resync:
            assert batch.snapshot
            snapshot += [
                (e.stored.medium, len(e.stored.keys)) for e in batch.events if e.WhichOneof("event") == "stored"
            ]
            if batch.snapshot_done:
                break
    assert sorted(snapshot) == [("CPU", 3), ("GPU", 3)], snapshot


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("devices", [("--device", "cuda:0"), ("--devices", "0,1")], ids=["cuda0", "tp2"])
def test_tier_on_a_cuda_pool_a_prefix_evicted_is_read_back_from_pinned_host_memory(devices: tuple[str, ...]) -> None:
    """The same round trip on a CUDA pool (bench/gpu_check.sh runs it where a GPU is
    lent): the pages go to pinned host memory (a tier per rank with ``--devices``), the
    load is copied in on the server's own stream, and a third process reads every rank's
    K and V back through CUDA IPC after waiting on the counters in its shared memory."""
    need = 2 if devices[0] == "--devices" else 1
    if _gpus() < need:
        pytest.skip(f"needs {need} CUDA device(s), this host has {_gpus()}")
    flags = [*FLAGS[2:], *devices]  # FLAGS without its --device cpu
    srv = start_server(short_tmpdir(), *flags)
    try:
        assert client(srv.target, "write", PROMPT) == {"ok": True}
        assert client(srv.target, "fill", list(range(500, 532))) == {"ok": True}
        with KVMemClient(srv.target, name="look") as kv:
            st = kv.stats(audit=True)
            assert st.audit.ok, st.audit.problems
            assert (st.host_tier.num_cached_pages, st.host_tier.num_demoted) == (3, 3)
        got = client(srv.target, "read", PROMPT)
        assert got == {"matched": 12, "wrong": [], "loading_ok": True}, got
        with KVMemClient(srv.target, name="look") as kv:
            st = kv.stats(audit=True)
            assert st.audit.ok and st.host_tier.num_loaded == 3, st
    finally:
        assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (("--host-memory", "1GiB", "--device", "none"), "--device none has no KV memory to keep"),
        (("--host-memory", "1GiB", "--no-prefix-cache"), "it needs the prefix cache on"),
        (("--host-memory", "100", "--layers", "2"), "--host-memory 100 holds no page: a page of this geometry is"),
        (("--host-memory", "1000TiB"), "more than the"),
        (("--host-memory", "lots"), "must be a size such as 40GiB"),
    ],
)
def test_tier_options_that_cannot_work_are_refused_at_start(extra: tuple[str, ...], words: str) -> None:
    run = refused_at_start(*extra)
    assert words in run.stderr, run.stderr


def test_tier_the_drop_in_returns_from_an_iteration_block_once_its_matched_pages_are_loaded(
    server: ServerProcess,
) -> None:
    """The drop-in (``KVAllocator``) over a server with a host tier: a block whose match
    reaches the host tier returns only once the matched pages are copied in (every
    layer: its load counters say so), with the K/V as written."""
    from kvmem.client.compat import KVAllocator

    assert client(server.target, "write", PROMPT) == {"ok": True}
    assert client(server.target, "fill", list(range(500, 532))) == {"ok": True}  # the prompt's pages to the host
    with KVMemClient(server.target, name="drop-in") as kv, KVAllocator(kv, max_batch_size=4) as alloc:
        with alloc.iteration():
            matched = alloc.match_prefix(0, PROMPT)
            alloc.alloc(0, len(PROMPT), 0)
        assert int(matched) == 12
        slot = alloc._out.book.reqs[0].slot
        pages = kv.page_loads.pages_of(kv.block_table[slot], 12, 12)
        assert kv.page_loads.ready(pages)  # the block waited for them
        layers = kv.kv_cache()
        row = kv.block_table[slot].tolist()
        for pos in range(12):
            loc = row[pos // PS] * PS + pos % PS
            for layer, planes in enumerate(layers):
                for k in range(2):
                    want = float(PROMPT[pos] * 1000 + pos * 10 + layer * 2 + k)
                    assert planes[k][loc].tolist() == [[want, want]], (pos, layer, k)
        assert kv.stats().host_tier.num_loaded == 3


def test_tier_a_killed_server_with_its_state_kept_comes_back_with_its_host_tier() -> None:
    """``--keep-state --host-memory``: the prompt's pages demoted to the host tier, the
    server SIGKILLed; the next server adopts the state, the tier and its index with it,
    and a process that never saw the prompt matches it from the host tier and reads every
    token's K and V back as written."""
    import signal

    directory = short_tmpdir()
    args = ("--keep-state", "--shm-dir", directory, *FLAGS)
    srv = start_server(directory, *args)
    try:
        assert client(srv.target, "write", PROMPT) == {"ok": True}
        assert client(srv.target, "fill", list(range(500, 532))) == {"ok": True}
        with KVMemClient(srv.target, name="look") as kv:
            assert kv.stats().host_tier.num_cached_pages == 3
        assert srv.stop(signal.SIGKILL) == -signal.SIGKILL
        assert any(name.endswith(".ht") for name in os.listdir(directory))  # the tier's pages, kept
        srv = start_server(directory, *args)
        assert "adopted" in srv.log() and "repaired" not in srv.log().split("adopted", 1)[1].split("\n", 1)[0]
        with KVMemClient(srv.target, name="look") as kv:
            st = kv.stats(audit=True)
            assert st.audit.ok, st.audit.problems
            assert (st.num_cached_pages, st.host_tier.num_cached_pages) == (0, 3)
        got = client(srv.target, "read", PROMPT)
        assert got == {"matched": 12, "wrong": [], "loading_ok": True}, got
        with KVMemClient(srv.target, name="look") as kv:
            assert kv.stats().host_tier.num_loaded == 3
    finally:
        srv.stop(signal.SIGKILL)


def test_tier_an_asyncio_client_waits_for_a_load_without_blocking_its_loop(server: ServerProcess) -> None:
    """``AsyncKVMemClient.wait_loads`` awaits the load counters (the loop runs meanwhile)
    and returns once every layer of the matched pages is in."""
    import asyncio

    from kvmem.client import AsyncKVMemClient

    assert client(server.target, "write", PROMPT) == {"ok": True}
    assert client(server.target, "fill", list(range(500, 532))) == {"ok": True}

    async def main() -> tuple[int, bool, int]:
        async with AsyncKVMemClient(server.target, name="async") as kv:
            (slot,) = (await kv.open(["a"])).tolist()
            r = await kv.step(match=[(slot, PROMPT)])
            matched, loading = int(r.match_lens[0]), int(r.match_loading[0])
            ticks = 0

            async def tick() -> None:  # the loop keeps running while the wait polls
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0)

            ticker = asyncio.ensure_future(tick())
            await kv.wait_loads(slot, matched, loading, timeout=30)
            ticker.cancel()
            loads = kv.page_loads
            assert loads is not None
            ready = loads.ready(loads.pages_of(kv.block_table[slot], matched, matched))
            return matched, ready, ticks

    matched, ready, _ = asyncio.run(main())
    assert matched == 12 and ready
