"""The KV memory through the service: real ``kvmem serve`` processes, real client
processes that map the KV cache and the block table, the shared-memory files' life
cycle, and every geometry the command line refuses.

Unit-level backend tests are in ``test_memory.py`` / ``test_memory_cuda.py``; here the
server, the clients and the test are separate processes, as in production. Servers run
with ``--shm-dir`` in a private directory (under /dev/shm where there is one), so the
files each server creates and removes are observable and no other test's are seen.

Client processes run ``CHILD`` (``python -c``) with the real sync client. They start
while the server starts (so their imports overlap) and take JSON commands on stdin,
one per line, answering each with one ``R <json>`` line on stdout:

    attach {target, name}            -> backend, layout and the mapped views' shapes
    open {ids}                       -> slots
    step {release, truncate, alloc}  -> status, kv_loc, kv_loc_offsets, new_pages, ...
    write {locs, bits}               -> writes K/V (or the mla latent) of every layer at
                                        token slots ``locs`` through its own mapping
    read {locs}                      -> the same, read through its own mapping
    touched                          -> per layer and part: token slots not all zero
    table                            -> ``kv.block_table`` (the device copy for cuda)
    exit                             -> detaches and exits 0

Values travel as the integer bit patterns of the KV dtype, so equality is bit-exact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import LineProcess, ServerProcess, start_server, wait_serving

from kvmem.client import KVMemClient
from kvmem.server.memory import KVGeometry, format_size, pages_for_budget
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

HAS_CUDA = torch.cuda.is_available()
SHM_FILE = re.compile(r"^kvmem-(\d+)-[0-9a-f]{16}\.(kv|bt|lock)$")

CHILD = r"""
import json, os, sys, traceback
import torch
from kvmem.client import KVMemClient

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
kv = None


def parts(layer):
    entry = kv.kv_cache()[layer]
    return list(entry) if isinstance(entry, tuple) else [entry]


def sync():
    if kv.memory.backend == "cuda":
        torch.cuda.synchronize()


def handle(cmd):
    global kv
    op = cmd["op"]
    if op == "attach":
        kv = KVMemClient(cmd["target"], name=cmd["name"])
        layers = kv.kv_cache()  # maps the memory
        lay = kv.geometry.layout
        return {
            "backend": kv.memory.backend,
            "layout": [lay.format, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.kv_lora_rank,
                       lay.rope_dim, lay.dtype, lay.bytes_per_token],
            "num_layers": len(layers),
            "shapes": [list(p.shape) for p in parts(0)],
            "devices": [str(p.device) for p in parts(0)] + [str(kv.block_table.device)],
            "table_shape": list(kv.block_table.shape),
            "paths": sorted(h.shm.path for h in kv.memory_handles if h.WhichOneof("handle") == "shm"),
        }
    if op == "open":
        return {"slots": kv.open(cmd["ids"]).tolist()}
    if op == "step":
        rel, tr, al = cmd.get("release", []), cmd.get("truncate", []), cmd.get("alloc", [])
        r = kv.step(release_slots=rel, truncate_slots=[s for s, _ in tr], truncate_lens=[n for _, n in tr],
                    alloc_slots=[s for s, _ in al], alloc_needs=[n for _, n in al])
        return {k: getattr(r, k).tolist() for k in ("status", "kv_loc", "kv_loc_offsets", "new_pages",
                                                     "new_page_offsets")}
    if op == "write":
        for layer, per_part in enumerate(cmd["bits"]):
            for view, bits in zip(parts(layer), per_part):
                idx = torch.tensor(cmd["locs"], dtype=torch.int64, device=view.device)
                view[idx] = torch.tensor(bits, dtype=INT[view.element_size()]).view(view.dtype).to(view.device)
        sync()
        return {}
    if op == "read":
        out = []
        for layer in range(len(kv.kv_cache())):
            row = []
            for view in parts(layer):
                idx = torch.tensor(cmd["locs"], dtype=torch.int64, device=view.device)
                row.append(view[idx].cpu().view(INT[view.element_size()]).tolist())
            out.append(row)
        return {"bits": out}
    if op == "touched":
        return {"slots": [[torch.nonzero(view.reshape(view.shape[0], -1).ne(0).any(dim=1)).flatten().tolist()
                           for view in parts(layer)] for layer in range(len(kv.kv_cache()))]}
    if op == "table":
        sync()
        return {"table": kv.block_table.cpu().tolist()}
    if op == "exit":
        kv.close()
        return {}
    raise ValueError(f"unknown op {op!r}")


print("READY", flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    try:
        reply = handle(cmd)
    except Exception:
        reply = {"error": traceback.format_exc()}
    print("R " + json.dumps(reply), flush=True)
    if cmd["op"] == "exit":
        sys.stdout.flush()
        os._exit(0)  # skip the interpreter's slow teardown of torch
"""


class Child(LineProcess):
    """A client process running ``CHILD``: one JSON op per line, one ``R`` reply each."""

    def __init__(self, name: str) -> None:
        super().__init__(name, CHILD)

    def call(self, op: str, timeout: float = 60.0, **args: Any) -> dict[str, Any]:
        self.send(json.dumps({"op": op, **args}))
        reply = json.loads(self.expect("R", timeout))
        assert "error" not in reply, f"{self.name} {op}:\n{reply['error']}"
        return reply

    def ready(self) -> None:
        self.expect("READY", 120.0)

    def finish(self) -> None:
        self.call("exit")
        assert self.proc.wait(timeout=30) == 0


# ------------------------------------------------------------------------ helpers


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A private directory for the servers' shared-memory files."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    d = tempfile.mkdtemp(prefix="kvmem-test-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Servers and children a test starts; whatever is still running is killed after."""
    things: list[Any] = []
    yield things
    for t in things:
        if isinstance(t, Child):
            t.kill()
        elif t.proc.poll() is None:
            t.proc.kill()
            t.proc.wait()


def shm_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if SHM_FILE.match(n))


def files_of(directory: str, pid: int) -> list[str]:
    return [n for n in shm_files(directory) if SHM_FILE.match(n).group(1) == str(pid)]  # type: ignore[union-attr]


def stop_clean(server: ServerProcess, directory: str) -> None:
    """SIGTERM: exit 0 and none of this server's files left."""
    code = server.stop()
    assert code == 0, f"server exited {code} after SIGTERM:\n{server.log()}"
    assert files_of(directory, server.proc.pid) == [], server.log()


def stats_of(server: ServerProcess) -> kvmem_pb2.StatsResponse:
    with grpc.insecure_channel(server.target) as channel:
        return kvmem_pb2_grpc.KVMemoryStub(channel).Stats(kvmem_pb2.StatsRequest(audit=True), timeout=10)


INT_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


class Model:
    """What the step results imply the block table is: request slot -> pages in order,
    and alloced lengths. ``apply`` also checks each alloc's kv_loc against its pages."""

    def __init__(self, page_size: int, shape: tuple[int, int]) -> None:
        self.ps = page_size
        self.shape = shape
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def apply(self, res: dict[str, Any], release=(), truncate=(), alloc=()) -> list[int]:
        """Apply one step's requests and results; return the token slots it allocated."""
        for slot in release:
            self.pages.pop(slot, None)
            self.lens.pop(slot, None)
        for slot, new_len in truncate:
            assert new_len <= self.lens.get(slot, 0)
            self.lens[slot] = new_len
            self.pages[slot] = self.pages.get(slot, [])[: -(-new_len // self.ps)]
        assert res["status"] == [0] * len(alloc), res
        locs: list[int] = []
        for i, (slot, need) in enumerate(alloc):
            new = res["new_pages"][res["new_page_offsets"][i] : res["new_page_offsets"][i + 1]]
            got = res["kv_loc"][res["kv_loc_offsets"][i] : res["kv_loc_offsets"][i + 1]]
            pages = self.pages.setdefault(slot, [])
            pages += new
            start = self.lens.get(slot, 0)
            self.lens[slot] = start + need
            assert len(pages) == -(-self.lens[slot] // self.ps), (slot, pages, self.lens[slot])
            want = [pages[p // self.ps] * self.ps + p % self.ps for p in range(start, start + need)]
            assert got == want, f"slot {slot}: kv_loc {got}, its pages {pages} imply {want}"
            locs += got
        return locs

    def table(self) -> list[list[int]]:
        t = np.zeros(self.shape, dtype=np.int32)
        for slot, pages in self.pages.items():
            t[slot, : len(pages)] = pages
        return t.tolist()


def random_bits(n: int, widths: list[tuple[int, ...]], num_layers: int, dtype: torch.dtype, seed: int) -> list:
    """Per layer, per part (K, V or latent): ``n`` token rows of random values, no zeros,
    as integer bit patterns of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num_layers):
        per_part = []
        for width in widths:
            x = torch.randn((n, *width), generator=gen).to(dtype)
            x[x == 0] = 1
            per_part.append(x.view(INT_DTYPE[x.element_size()]).tolist())
        out.append(per_part)
    return out


def select(bits: list, rows: list[int]) -> list:
    return [[[part[r] for r in rows] for part in layer] for layer in bits]


# ------------------------------------------------------------- two client processes

GEOMETRIES = {
    "mha": (["--format", "mha", "--layers", "3", "--kv-heads", "2", "--head-dim", "8", "--dtype", "bfloat16"],
            [kvmem_pb2.KV_FORMAT_MHA, 3, 2, 8, 0, 0, "bfloat16", 3 * 2 * 2 * 8 * 2], [(2, 8), (2, 8)]),
    "mla": (["--format", "mla", "--layers", "2", "--kv-lora-rank", "16", "--rope-dim", "8", "--dtype", "float16"],
            [kvmem_pb2.KV_FORMAT_MLA, 2, 0, 0, 16, 8, "float16", 2 * 1 * 24 * 2], [(24,)]),
}  # fmt: skip
PAGE_SIZE, NUM_PAGES, MAX_REQUESTS, MAX_CONTEXT = 4, 33, 4, 64


def two_process_round_trip(device: str, fmt: str, shm_dir: str, tmpdir: str, cleanup: list[Any]) -> None:
    """A writes K/V at its kv_loc through its mapping; B, another session in another
    process, reads exactly those values through its own. After every step, the block
    table both see equals what the step results imply (rows of both sessions; a
    released row is zeros)."""
    opts, layout, widths = GEOMETRIES[fmt]
    a, b = Child("A"), Child("B")  # importing while the server starts
    cleanup += [a, b]
    server = start_server(
        tmpdir, "--device", device, "--shm-dir", shm_dir, "--page-size", str(PAGE_SIZE), "--num-pages", str(NUM_PAGES),
        "--max-requests", str(MAX_REQUESTS), "--max-context", str(MAX_CONTEXT), *opts,
    )  # fmt: skip
    cleanup.append(server)
    num_layers, dtype = layout[1], getattr(torch, layout[6])
    num_tokens = NUM_PAGES * PAGE_SIZE
    model = Model(PAGE_SIZE, (MAX_REQUESTS + 1, MAX_CONTEXT // PAGE_SIZE))
    backend = "cuda" if device.startswith("cuda") else "shm"

    infos = []
    for child in (a, b):
        child.ready()
        info = child.call("attach", target=server.target, name=child.name)
        assert info["backend"] == backend
        assert info["layout"] == layout, "Attach geometry.layout disagrees with the serve options"
        assert info["num_layers"] == num_layers
        assert info["shapes"] == [[num_tokens, *w] for w in widths]
        assert info["table_shape"] == list(model.shape)
        if backend == "shm":
            assert set(info["devices"]) == {"cpu"}
            assert len(info["paths"]) == 2 and all(os.path.dirname(p) == shm_dir for p in info["paths"])
        else:
            assert all(d.startswith("cuda") for d in info["devices"]), info["devices"]
            assert info["paths"] == []
        infos.append(info)
    if backend == "shm":
        assert infos[0]["paths"] == infos[1]["paths"]
        assert len(files_of(shm_dir, server.proc.pid)) == 3

    a0, a1 = a.call("open", ids=["a0", "a1"])["slots"]
    (b0,) = b.call("open", ids=["b0"])["slots"]
    written: dict[int, list] = {}  # token slot -> its bits, per layer and part

    def check_tables() -> None:
        want = model.table()
        for child in (a, b):
            assert child.call("table")["table"] == want, f"{child.name}'s block table != the step results'"

    def step(child: Child, release=(), truncate=(), alloc=()) -> list[int]:
        res = child.call("step", release=list(release), truncate=[list(t) for t in truncate],
                         alloc=[list(x) for x in alloc])  # fmt: skip
        locs = model.apply(res, release, truncate, alloc)
        check_tables()
        return locs

    def write(locs: list[int], seed: int) -> None:
        bits = random_bits(len(locs), widths, num_layers, dtype, seed)
        a.call("write", locs=locs, bits=bits)  # A reports locs; the test hands them to B
        for i, loc in enumerate(locs):
            written[loc] = select(bits, [i])
        all_locs = sorted(written)
        got = b.call("read", locs=all_locs)["bits"]
        want = [[[written[loc][layer][p][0] for loc in all_locs] for p in range(len(widths))]
                for layer in range(num_layers)]  # fmt: skip
        assert got == want, "B does not read what A wrote"
        touched = b.call("touched")["slots"]
        assert touched == [[all_locs] * len(widths)] * num_layers, "memory outside A's kv_loc changed"

    check_tables()  # all zeros: nothing allocated yet
    locs = step(a, alloc=[(a0, 5), (a1, 3)])  # 2 pages and 1 page
    write(locs, seed=1)
    step(b, alloc=[(b0, 6)])  # the other session's row appears beside A's
    locs = step(a, alloc=[(a0, 3), (a1, 2)])  # a0 fills its tail; a1 takes a page
    write(locs, seed=2)
    locs = step(a, truncate=[(a0, 2)], alloc=[(a0, 1)])  # a0 drops its 2nd page, writes at 2
    assert locs == [model.pages[a0][0] * PAGE_SIZE + 2]
    write(locs, seed=3)  # overwrites a written slot
    step(a, release=[a1])  # a1's row zeroed
    assert a1 not in model.pages
    step(b, release=[b0])
    step(a, release=[a0])
    assert model.table() == np.zeros(model.shape, dtype=np.int32).tolist()
    s = stats_of(server)
    assert s.audit.ok and s.num_used_pages == 0 and s.memory_backend == backend
    a.finish()
    b.finish()
    stop_clean(server, shm_dir)
    assert shm_files(shm_dir) == []


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_two_client_processes_share_kv_and_block_table(fmt: str, shm_dir: str, tmpdir_short: str, cleanup) -> None:
    two_process_round_trip("cpu", fmt, shm_dir, tmpdir_short, cleanup)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_two_client_processes_share_cuda_kv_and_device_block_table(
    fmt: str, shm_dir: str, tmpdir_short: str, cleanup
) -> None:
    """The same with ``--device cuda:0``: CUDA IPC handles opened in two client processes,
    the device block table (what ``kv.block_table`` is there) checked after each step."""
    two_process_round_trip("cuda:0", fmt, shm_dir, tmpdir_short, cleanup)
    assert shm_files(shm_dir) == []  # the cuda backend creates no shm files


# ---------------------------------------------------------------- pool sizing


def test_budget_sizes_the_pool_attach_carries_the_layout_and_sigterm_removes_files(
    shm_dir: str, tmpdir_short: str, cleanup
) -> None:
    opts = ["--memory", "8MiB", "--page-size", "16", "--max-requests", "8", "--max-context", "1024",
            "--format", "mha", "--layers", "4", "--kv-heads", "2", "--head-dim", "32", "--dtype", "float16"]  # fmt: skip
    geometry = KVGeometry("mha", 4, 2, 32, dtype="float16", page_size=16)
    want_pages = pages_for_budget(8 * 2**20, geometry, 8, 1024)
    server = start_server(tmpdir_short, "--shm-dir", shm_dir, *opts)
    cleanup.append(server)
    bpt = 4 * 2 * 2 * 32 * 2
    assert geometry.bytes_per_token == bpt

    s = stats_of(server)
    assert s.geometry.num_pages == want_pages
    assert s.num_pages_total == want_pages - 1
    kv_bytes = want_pages * 16 * bpt
    table_bytes = 9 * 64 * 4
    assert kv_bytes + table_bytes <= 8 * 2**20 < kv_bytes + table_bytes + 16 * bpt  # one more page would not fit
    lines = [line for line in server.log().splitlines() if " pool: " in line]
    assert len(lines) == 1, server.log()
    line = lines[0]
    for fact in (f"{want_pages} pages", f"{(want_pages - 1) * 16} tokens", f"{bpt} bytes per token",
                 f"KV {format_size(kv_bytes)}", "shm"):  # fmt: skip
        assert fact in line, f"{fact!r} not in the startup line {line!r}"

    with KVMemClient(server.target, name="sizes") as kv:
        g = kv.geometry
        assert (g.num_pages, g.page_size, g.max_requests, g.max_context_len, g.max_pages_per_request) == (
            want_pages,
            16,
            8,
            1024,
            64,
        )
        lay = g.layout
        assert (lay.format, lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.kv_lora_rank, lay.rope_dim,
                lay.dtype, lay.bytes_per_token) == (kvmem_pb2.KV_FORMAT_MHA, 4, 2, 32, 0, 0, "float16", bpt)  # fmt: skip
        handles = {h.name: h for h in kv.memory_handles}
        assert set(handles) == {"kv", "block_table"}
        assert handles["kv"].size_bytes == kv_bytes == os.path.getsize(handles["kv"].shm.path)
        assert list(handles["kv"].shape) == [4, 2, want_pages * 16, 2, 32] and handles["kv"].dtype == "float16"
        assert handles["block_table"].size_bytes == table_bytes
        assert os.path.dirname(handles["kv"].shm.path) == shm_dir
        files = files_of(shm_dir, server.proc.pid)
        assert len(files) == 3 and shm_files(shm_dir) == files
        for name in files:
            assert os.stat(os.path.join(shm_dir, name)).st_mode & 0o777 == 0o600
        k, v = kv.kv_cache()[3]
        assert k.shape == v.shape == (want_pages * 16, 2, 32) and k.dtype == torch.float16
        (slot,) = kv.open(["r"]).tolist()
        res = kv.alloc([slot], [20])
        assert res.ok and kv.block_table[slot, :2].tolist() == res.new_pages.tolist()
        k[res.kv_loc.long()] = 1.5
        # SIGTERM with a session attached and its mapping alive: exit 0, files gone.
        stop_clean(server, shm_dir)
        assert shm_files(shm_dir) == []
        assert bool((k[res.kv_loc.long()] == 1.5).all())  # this process's mapping stays valid


# ------------------------------------------------------------- file life cycle


def test_sigkilled_servers_files_go_at_the_next_start_and_live_servers_are_never_touched(
    shm_dir: str, tmpdir_short: str, cleanup
) -> None:
    """Two live servers on one machine (same --shm-dir, different sockets); one is
    SIGKILLed (its files stay); a third start removes exactly those, while the live
    one's files survive and it keeps serving."""
    opts = ["--shm-dir", shm_dir, "--page-size", "4", "--num-pages", "65", "--max-requests", "4", "--max-context", "64",
            "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--dtype", "float32"]  # fmt: skip
    live = start_server(tmpdir_short, *opts, socket_name="live.sock", wait=False)
    doomed = start_server(tmpdir_short, *opts, socket_name="doomed.sock", wait=False)
    cleanup += [live, doomed]
    wait_serving(live)
    wait_serving(doomed)
    live_files = files_of(shm_dir, live.proc.pid)
    doomed_files = files_of(shm_dir, doomed.proc.pid)
    assert len(live_files) == len(doomed_files) == 3
    assert shm_files(shm_dir) == sorted(live_files + doomed_files)
    inodes = {n: os.stat(os.path.join(shm_dir, n)).st_ino for n in live_files}

    kv = KVMemClient(live.target, name="survivor")
    try:
        (slot,) = kv.open(["r"]).tolist()
        first = kv.alloc([slot], [6])
        kv.kv_cache()[0][0][first.kv_loc.long()] = 7.0

        doomed.stop(signal.SIGKILL)
        assert sorted(files_of(shm_dir, doomed.proc.pid)) == sorted(doomed_files)  # SIGKILL cleans nothing

        third = start_server(tmpdir_short, *opts, socket_name="third.sock")
        cleanup.append(third)
        third_files = files_of(shm_dir, third.proc.pid)
        assert len(third_files) == 3
        assert shm_files(shm_dir) == sorted(live_files + third_files), "stale files not removed, or live ones touched"
        assert {n: os.stat(os.path.join(shm_dir, n)).st_ino for n in live_files} == inodes
        assert "removed 3 stale kvmem shm file(s)" in third.log(), third.log()
        assert "stale" not in live.log()  # the live server removed nothing of the other's

        # The live server keeps serving, its memory intact and shared.
        second = kv.alloc([slot], [3])
        assert second.ok and kv.block_table[slot, :3].tolist() == (first.new_pages.tolist() + second.new_pages.tolist())
        kv.kv_cache()[1][1][second.kv_loc.long()] = -2.0
        with KVMemClient(live.target, name="late") as other:
            k0 = other.kv_cache()[0][0]
            v1 = other.kv_cache()[1][1]
            assert bool((k0[first.kv_loc.long()] == 7.0).all()) and bool((v1[second.kv_loc.long()] == -2.0).all())
            assert torch.equal(other.block_table, kv.block_table)
        assert stats_of(live).audit.ok

        stop_clean(third, shm_dir)
        assert shm_files(shm_dir) == sorted(live_files)
    finally:
        kv.close()
    stop_clean(live, shm_dir)
    assert shm_files(shm_dir) == []


# ------------------------------------------------------------- refused geometry


def refusals() -> list[tuple[list[str], list[str]]]:
    """(serve options, words the error must contain): the option and its value. Each
    case costs a process start (about 3 CPU-seconds of imports on a slow core), so
    refusals checked at the unit level (``test_memory.py``, ``test_cli.py``) are not
    repeated here."""
    cases = [
        (["--layers", "0"], ["--layers", "0"]),
        (["--kv-heads", "0"], ["--kv-heads", "0"]),
        (["--head-dim", "0"], ["--head-dim", "0"]),
        (["--page-size", "0"], ["--page-size", "0"]),
        (["--dtype", "int7"], ["--dtype", "'int7'"]),
        (["--format", "gqa"], ["--format", "'gqa'"]),
        (["--memory", "100KiB"], ["--memory", "102400 bytes", "100.00 KiB", "One page is 16384 bytes"]),
        (["--num-pages", "9", "--max-context", "1000"], ["--max-context 1000", "128 tokens"]),
        (["--devices", "0,x"], ["--devices", "'0,x'"]),
        (["--shm-dir", "/nonexistent/kvmem"], ["--shm-dir", "/nonexistent/kvmem"]),
    ]
    if HAS_CUDA:  # a device this machine does not have
        cases.append((["--devices", "63"], ["--devices", "63"]))
    else:  # no GPU at all: refused at start, not a traceback
        cases.append((["--device", "cuda:0"], ["--device cuda:0", "CUDA"]))
    return cases


def test_every_refused_geometry_exits_nonzero_naming_the_option_and_value(shm_dir: str, tmpdir_short: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    cases = refusals()
    sock = os.path.join(tmpdir_short, "refused.sock")
    procs = []
    pending = list(enumerate(cases))
    results: dict[int, tuple[int, str, float]] = {}
    # Two at a time (test machines may have 2 cores): each start costs the interpreter's
    # and torch's imports, then must be refused before anything is allocated.
    while pending or procs:
        while pending and len(procs) < 2:
            i, (args, _) = pending.pop(0)
            cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--socket", sock, "--shm-dir", shm_dir, *args]
            procs.append((i, time.monotonic(), subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                                 text=True, env=env)))  # fmt: skip
        i, t0, proc = procs.pop(0)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"{cases[i][0]}: still running after 60 s:\n{err}")
        results[i] = (proc.returncode, out + err, time.monotonic() - t0)
    problems = []
    for i, (args, words) in enumerate(cases):
        code, text, took = results[i]
        missing = [w for w in words if w not in text]
        if code == 0 or missing or "Traceback" in text:
            problems.append(f"{args}: exit {code} after {took:.1f} s, missing {missing}, output:\n{text}")
    assert not problems, "\n\n".join(problems)
    assert not os.path.exists(sock)
    assert shm_files(shm_dir) == []  # a refused start leaves nothing behind
