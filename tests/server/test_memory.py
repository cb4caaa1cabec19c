"""Memory backends: geometry arithmetic and refusals, the shm backend's files and their
life cycle, and mapping through the client library in separate processes."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import re
import signal
import stat
import time
import traceback

import numpy as np
import pytest
import torch

from kvmem.client.memory import MappedMemory, MemoryMapError
from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.edge.service import geometry_to_proto, handle_to_proto
from kvmem.server.memory import (
    DTYPES,
    CudaBackend,
    GeometryError,
    HandleInfo,
    KVGeometry,
    PoolSpec,
    ShmBackend,
    pages_for_budget,
    parse_size,
    remove_stale,
)
from kvmem.v1 import kvmem_pb2 as pb

MHA = dict(format="mha", num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=4)
MLA = dict(format="mla", num_layers=2, kv_lora_rank=6, rope_dim=2, dtype="float16", page_size=8)


# ------------------------------------------------------------------ proto helpers
# What the gRPC service does: HandleInfo / KVGeometry -> proto.


def to_proto_handle(info: HandleInfo) -> pb.MemoryHandle:
    return handle_to_proto(info)  # the service's own translation


def to_proto_geometry(backend) -> pb.PoolGeometry:
    core = CoreConfig(backend.num_pages, backend.geometry.page_size, backend.max_requests, backend.max_context_len)
    return geometry_to_proto(core, backend.geometry)  # the service's own translation


def attach_bytes(backend) -> tuple[list[bytes], bytes]:
    """The handles and geometry as wire bytes, as a client receives them."""
    return [to_proto_handle(h).SerializeToString() for h in backend.handles()], to_proto_geometry(
        backend
    ).SerializeToString()


def open_mapped(backend) -> MappedMemory:
    return MappedMemory.open([to_proto_handle(h) for h in backend.handles()], to_proto_geometry(backend))


# ------------------------------------------------------------------ client process


def _view(mem: MappedMemory, rank: int, layer: int, part: str) -> torch.Tensor:
    entry = mem.kv_cache(rank)[layer]
    if part == "latent":
        return entry
    return entry[0] if part == "k" else entry[1]


def client_worker(conn, handles: list[bytes], geometry: bytes) -> None:
    """A scheduler-worker stand-in: maps the handles through kvmem.client.memory and
    serves read/write commands over ``conn``."""
    try:
        mem = MappedMemory.open([pb.MemoryHandle.FromString(b) for b in handles], pb.PoolGeometry.FromString(geometry))
        conn.send(("ok", mem.backend))
        while True:
            op, args = conn.recv()
            if op == "write":
                view = _view(mem, args["rank"], args["layer"], args["part"])
                idx = torch.as_tensor(args["slots"], dtype=torch.int64, device=view.device)
                view[idx] = torch.from_numpy(args["values"]).to(device=view.device, dtype=view.dtype)
                if view.is_cuda:
                    torch.cuda.synchronize(view.device)
                conn.send(("ok", None))
            elif op == "read":
                view = _view(mem, args["rank"], args["layer"], args["part"])
                idx = torch.as_tensor(args["slots"], dtype=torch.int64, device=view.device)
                conn.send(("ok", view[idx].float().cpu().numpy()))
            elif op == "block_table":
                conn.send(("ok", mem.block_table.cpu().numpy().copy()))
            elif op == "close":
                mem.close()
                conn.send(("ok", None))
                return
    except Exception:  # report, do not hang the parent
        conn.send(("error", traceback.format_exc()))


def fresh_process_context():
    """A clean-process multiprocessing context without re-importing torch per child: a
    forkserver that preloaded torch and kvmem (it never touches CUDA). Children forked
    from it exit with ``os._exit`` (no atexit hooks); use "spawn" where those matter."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "numpy", "kvmem.client.memory", "kvmem.server.memory"])
    return ctx


class Client:
    """Parent-side proxy of a :func:`client_worker` in a separate process."""

    def __init__(self, backend) -> None:
        ctx = fresh_process_context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=client_worker, args=(child, *attach_bytes(backend)), daemon=True)
        self.proc.start()
        child.close()
        self.backend = self._reply()

    def _reply(self):
        if not self.conn.poll(120):
            raise TimeoutError("client process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError("client process failed:\n" + value)
        return value

    def call(self, op: str, **args):
        self.conn.send((op, args))
        return self._reply()

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()


def values_for(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers: exact in bfloat16 and float16."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + seed * 13) % 199 - 99).astype(np.float32).reshape(shape)


# ------------------------------------------------------------------ geometry


def test_mha_geometry_math():
    g = KVGeometry(format="mha", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    assert g.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert g.page_bytes == g.bytes_per_token * 16
    assert g.kv_shape(1024) == (32, 2, 1024, 8, 128)
    assert g.torch_dtype is torch.bfloat16
    assert KVGeometry(**{**MHA, "dtype": "float32"}).bytes_per_token == 3 * 2 * 2 * 4 * 4


def test_mla_geometry_math():
    g = KVGeometry(format="mla", num_layers=61, kv_lora_rank=512, rope_dim=64, dtype="bfloat16", page_size=64)
    assert g.bytes_per_token == 61 * (512 + 64) * 2
    assert g.kv_shape(128) == (61, 128, 576)
    # Fields of the other format are ignored (set to 0): CLI defaults do no harm.
    g2 = KVGeometry(format="mla", num_layers=2, num_kv_heads=8, head_dim=128, kv_lora_rank=4, rope_dim=0)
    assert (g2.num_kv_heads, g2.head_dim, g2.bytes_per_token) == (0, 0, 2 * 4 * 2)


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="torch without float8")
def test_float8_geometry():
    g = KVGeometry(**{**MHA, "dtype": "float8_e4m3fn"})
    assert g.itemsize == 1 and g.bytes_per_token == 3 * 2 * 2 * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_table_agrees_with_torch(dtype):
    """The server sizes dtypes from its own table (no torch); the client maps with torch's."""
    g = KVGeometry(**{**MHA, "dtype": dtype})
    assert g.itemsize == g.torch_dtype.itemsize and str(g.torch_dtype) == f"torch.{dtype}"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_layers": 0}, "--layers must be >= 1, got 0"),
        ({"num_kv_heads": 0}, "--kv-heads must be >= 1, got 0"),
        ({"head_dim": 0}, "--head-dim must be >= 1, got 0"),
        ({"head_dim": -3}, "--head-dim must be >= 1, got -3"),
        ({"page_size": 0}, "--page-size must be >= 1, got 0"),
        ({"dtype": "int8"}, "--dtype must be one of bfloat16, float16, float32"),
        ({"dtype": "bf16"}, "got 'bf16'"),
        ({"format": "gqa"}, "--format must be one of mha, mla, got 'gqa'"),
        ({"num_layers": "3"}, "--layers must be an integer, got '3'"),
        ({"num_kv_heads": 2.0}, "--kv-heads must be an integer, got 2.0"),
        ({"page_size": True}, "--page-size must be an integer, got True"),
        ({"format": "mla", "kv_lora_rank": 0, "rope_dim": 4}, "--kv-lora-rank must be >= 1, got 0"),
        ({"format": "mla", "kv_lora_rank": 8, "rope_dim": -1}, "--rope-dim must be >= 0, got -1"),
    ],
)
def test_refused_geometry_names_option_and_value(changes, message):
    with pytest.raises(GeometryError, match=re.escape(message)):
        KVGeometry(**{**MHA, **changes})


def test_geometry_error_is_a_value_error():
    assert issubclass(GeometryError, ValueError)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("123", 123),
        ("0", 0),
        ("512MiB", 512 * 2**20),
        ("40GiB", 40 * 2**30),
        ("1.5G", 3 * 2**29),
        ("1.5g", 3 * 2**29),
        ("2Gi", 2 * 2**30),
        ("4 KiB", 4096),
        ("1k", 1024),
        ("1KB", 1000),
        ("3GB", 3 * 10**9),
        ("1TiB", 2**40),
        ("10B", 10),
        (".5M", 2**19),
        (" 7 ", 7),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "G", "1.2.3G", "-5G", "5XB", "1e9", "nan", "inf", "5 G B", None, 1.5, -1])
def test_parse_size_refuses_garbage(text):
    with pytest.raises(GeometryError, match="--memory") as exc:
        parse_size(text)
    assert repr(text) in str(exc.value) or str(text) in str(exc.value)


def test_parse_size_names_the_given_option():
    with pytest.raises(GeometryError, match=r"--kv-memory must be a size .* got 'lots'"):
        parse_size("lots", option="--kv-memory")


def test_pages_for_budget_is_the_largest_that_fits():
    g = KVGeometry(**MHA)  # 96 bytes per token, 384 per page
    max_requests, max_context = 7, 4  # block table int32 [8, 1] = 32 bytes
    table = 8 * 1 * 4
    for budget in (2 * 384 + table, 10_000, 123_457, 10 * 2**20):
        n = pages_for_budget(budget, g, max_requests, max_context)
        assert n * g.page_bytes + table <= budget < (n + 1) * g.page_bytes + table
    assert pages_for_budget(parse_size("1MiB"), g, max_requests, max_context) == (2**20 - table) // 384


def test_pages_for_budget_caps_token_slots_at_int32():
    g = KVGeometry(format="mla", num_layers=1, kv_lora_rank=1, rope_dim=0, dtype="float16", page_size=1)
    n = pages_for_budget(2**40, g, 4, 16)
    assert n == 2**31 - 1


def test_budget_below_two_pages_is_refused_with_page_size():
    g = KVGeometry(**MHA)  # one page: 384 bytes
    with pytest.raises(GeometryError) as exc:
        pages_for_budget(800, g, 7, 8)
    msg = str(exc.value)
    assert "--memory 800 bytes" in msg and "One page is 384 bytes" in msg and "at least 2" in msg
    with pytest.raises(GeometryError, match="--memory 0 bytes"):
        pages_for_budget(0, g, 7, 8)


def test_budget_context_longer_than_pool_is_refused():
    g = KVGeometry(**MHA)  # 384 bytes per page of 4 tokens
    # 5 pages fit: 4 usable pages = 16 tokens < max context 40.
    with pytest.raises(GeometryError, match=re.escape("--max-context 40 exceeds the pool's 16 tokens")):
        pages_for_budget(5 * 384 + 11 * 10 * 4, g, 10, 40)


@pytest.mark.parametrize(
    "num_pages, max_requests, max_context, message",
    [
        (1, 4, 4, "--num-pages must be >= 2 (page 0 is padding), got 1"),
        (0, 4, 4, "--num-pages must be >= 2 (page 0 is padding), got 0"),
        (16, 0, 4, "--max-requests must be >= 1, got 0"),
        (16, 4, 0, "--max-context must be >= 1, got 0"),
        (16, 4, -2, "--max-context must be >= 1, got -2"),
        (16, 4, 61, "--max-context 61 exceeds the pool's 60 tokens"),
        (2**30, 4, 4, "--num-pages 1073741824 with --page-size 4 gives"),
        ("16", 4, 4, "--num-pages must be an integer, got '16'"),
    ],
)
def test_pool_spec_refusals(num_pages, max_requests, max_context, message):
    with pytest.raises(GeometryError, match=re.escape(message)):
        PoolSpec(KVGeometry(**MHA), num_pages, max_requests, max_context)
    pool = PoolSpec(KVGeometry(**MHA), 16, 4, 60)  # the largest context that fits
    assert (pool.num_tokens, pool.block_table_shape, pool.kv_shape) == (64, (5, 15), (3, 2, 64, 2, 4))


def test_backend_refuses_bad_pool(tmp_path):
    with pytest.raises(GeometryError, match=re.escape("--max-context 100 exceeds the pool's 60 tokens")):
        ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 100), directory=str(tmp_path))
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_backend_without_cuda_says_so():
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        CudaBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 16))


# ------------------------------------------------------------------ shm files


def _files(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("kvmem-"))


def test_shm_files_are_private_and_one_per_allocation(tmp_path):
    g = KVGeometry(**MHA)
    with ShmBackend(PoolSpec(g, 16, 4, 20), directory=str(tmp_path)) as b:
        names = _files(tmp_path)
        assert [n.rsplit(".", 1)[1] for n in names] == ["bt", "kv", "lock"]
        for n in names:
            assert stat.S_IMODE(os.stat(tmp_path / n).st_mode) == 0o600
            assert b.server_id in n
        assert os.path.getsize(b.kv_path) == 16 * 4 * g.bytes_per_token
        assert os.path.getsize(b.block_table_path) == 5 * 5 * 4
        handles = b.handles()
        assert [(h.name, h.rank, h.dtype) for h in handles] == [("kv", 0, "bfloat16"), ("block_table", 0, "int32")]
        assert handles[0].shape == (3, 2, 64, 2, 4) and handles[0].shm_path == b.kv_path
        assert handles[1].shape == (5, 5) and handles[1].shm_path == b.block_table_path
        assert b.kv().shape == g.kv_shape(64) and b.kv().dtype == torch.bfloat16
        raw = b.kv_raw()  # the server's own view: flat bytes, no torch
        assert raw.dtype == np.uint8 and raw.shape == (b.pool.kv_bytes,) and raw.flags.writeable
        assert b.kv().data_ptr() == raw.ctypes.data  # one mapping
        assert b.name == "shm" and b.num_ranks == 1
        assert b.block_table.dtype == np.int32 and b.block_table.shape == (5, 5)
        assert not b.block_table.any() and not b.kv().any()  # zero-filled by the kernel
        b.sync_rows(np.array([1, 2]))  # a no-op for shm
        with pytest.raises(IndexError, match="rank 1 out of range"):
            b.kv(1)


def test_close_removes_files_and_is_idempotent(tmp_path):
    b = ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path))
    mem = open_mapped(b)
    k0, _ = mem.kv_cache()[0]
    b.close()
    assert _files(tmp_path) == []
    b.close()
    assert b.closed
    with pytest.raises(RuntimeError, match="closed"):
        b.kv()
    with pytest.raises(RuntimeError, match="closed"):
        b.kv_raw()
    with pytest.raises(RuntimeError, match="closed"):
        b.handles()
    k0[3] = 1.0  # a client's mapping outlives the files
    assert k0[3].sum().item() == 8.0
    mem.close()
    mem.close()
    with pytest.raises(RuntimeError, match="closed"):
        mem.kv_cache()


def test_garbage_collected_backend_removes_its_files(tmp_path):
    b = ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path))
    assert len(_files(tmp_path)) == 3
    del b
    gc.collect()
    assert _files(tmp_path) == []


def test_two_backends_never_touch_each_others_files(tmp_path):
    a = ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path))
    b = ShmBackend(PoolSpec(KVGeometry(**MLA), 8, 2, 8), directory=str(tmp_path))
    assert a.server_id != b.server_id and a.kv_path != b.kv_path
    assert len(_files(tmp_path)) == 6
    assert remove_stale(str(tmp_path)) == []  # both alive
    a.kv()[0, 0, 0] = 5.0
    assert not b.kv().any()
    a.close()
    assert _files(tmp_path) == sorted(os.path.basename(p) for p in (b.kv_path, b.block_table_path, b.lock_path))
    b.close()
    assert _files(tmp_path) == []


def test_remove_stale_leaves_foreign_files(tmp_path):
    for name in ("kvmem-notes.kv", "other-1-0123456789abcdef.kv", "kvmem-1-0123456789abcdef.txt"):
        (tmp_path / name).write_bytes(b"x")
    # A set without its lock belongs to nobody (a set is created lock first).
    (tmp_path / "kvmem-1-0123456789abcdef.kv").write_bytes(b"x")
    removed = remove_stale(str(tmp_path))
    assert removed == [str(tmp_path / "kvmem-1-0123456789abcdef.kv")]
    assert sorted(os.listdir(tmp_path)) == [
        "kvmem-1-0123456789abcdef.txt", "kvmem-notes.kv", "other-1-0123456789abcdef.kv",
    ]  # fmt: skip
    assert remove_stale(str(tmp_path / "missing")) == []


def test_custom_prefix(tmp_path):
    with ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path), prefix="kvmem_test") as b:
        assert os.path.basename(b.kv_path).startswith("kvmem_test-")
        assert remove_stale(str(tmp_path), "kvmem_test") == []
    with pytest.raises(ValueError, match="prefix"):
        ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path), prefix="../x")


def test_shm_too_small_is_a_clear_error(tmp_path):
    # A pool larger than any disk: refused up front, nothing left behind.
    g = KVGeometry(format="mha", num_layers=80, num_kv_heads=64, head_dim=256, dtype="float32", page_size=64)
    with pytest.raises(GeometryError, match=r"the shm pool needs \d+ bytes .* free"):
        ShmBackend(PoolSpec(g, 2**20, 4, 64), directory=str(tmp_path), reserve=False)
    with pytest.raises(GeometryError, match=r"the shm pool needs \d+ bytes .* free"):
        ShmBackend(PoolSpec(g, 2**20, 4, 64), directory=str(tmp_path), reserve=True)
    assert _files(tmp_path) == []


def test_forked_child_does_not_remove_the_servers_files(tmp_path):
    """Exit hooks run in a forked child that exits normally; they must not touch the
    parent's files (the finalizer only acts in the creating process)."""
    b = ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            b._finalizer()  # what the child's exit hooks would run
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert len(_files(tmp_path)) == 3
    assert remove_stale(str(tmp_path)) == []  # still locked by this process
    b.close()
    assert _files(tmp_path) == []


def _hold_backend(conn, directory: str) -> None:
    b = ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=directory)
    conn.send([b.kv_path, b.block_table_path, b.lock_path])
    conn.recv()  # block until killed


def _exit_without_close(conn, directory: str) -> None:
    b = ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=directory)
    conn.send([b.kv_path, b.block_table_path, b.lock_path])
    globals()["_leaked"] = b  # alive until interpreter exit: atexit must clean up


def test_sigkilled_server_files_are_removed_but_live_ones_survive(tmp_path):
    ctx = fresh_process_context()
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hold_backend, args=(child, str(tmp_path)), daemon=True)
    proc.start()
    assert parent.poll(120)
    dead_paths = parent.recv()
    live = ShmBackend(PoolSpec(KVGeometry(**MLA), 8, 2, 8), directory=str(tmp_path))  # runs remove_stale
    assert all(os.path.exists(p) for p in dead_paths)  # its owner is alive
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL
    assert all(os.path.exists(p) for p in dead_paths)  # SIGKILL runs no cleanup
    assert sorted(remove_stale(str(tmp_path))) == sorted(dead_paths)
    assert _files(tmp_path) == sorted(
        os.path.basename(p) for p in (live.kv_path, live.block_table_path, live.lock_path)
    )
    # The next server's start does the same.
    live.close()
    assert _files(tmp_path) == []


def test_exit_without_close_removes_files(tmp_path):
    ctx = mp.get_context("spawn")  # a normal interpreter exit, atexit hooks included
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_exit_without_close, args=(child, str(tmp_path)))
    proc.start()
    assert parent.poll(120)
    paths = parent.recv()
    proc.join(60)
    assert proc.exitcode == 0
    assert not any(os.path.exists(p) for p in paths)


# ------------------------------------------------------------------ client mapping


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_client_process_writes_and_reads_kv_at_token_slots(tmp_path, fmt):
    g = KVGeometry(**(MHA if fmt == "mha" else MLA))
    b = ShmBackend(PoolSpec(g, 16, 4, 32), directory=str(tmp_path))
    core = KVCore(CoreConfig(16, g.page_size, 4, 32), block_table=b.block_table)
    s = core.add_owner()
    (slot,) = core.open(s, ["req"])
    res = core.step(s, StepBatch.of(alloc_slots=[slot], alloc_needs=[11]))
    kv_loc = res.kv_loc
    parts = ["k", "v"] if fmt == "mha" else ["latent"]
    width = (g.num_kv_heads, g.head_dim) if fmt == "mha" else (g.kv_lora_rank + g.rope_dim,)
    client = Client(b)
    try:
        assert client.backend == "shm"
        # The core's block-table writes are what the client sees.
        assert np.array_equal(client.call("block_table"), b.block_table)
        assert client.call("block_table")[slot, : -(-11 // g.page_size)].tolist() == res.new_pages.tolist()
        # Client writes at kv_loc; the server and this process read them.
        mine = open_mapped(b)
        for layer in range(g.num_layers):
            for i, part in enumerate(parts):
                vals = values_for(layer * 2 + i, (kv_loc.size, *width))
                client.call("write", rank=0, layer=layer, part=part, slots=kv_loc.tolist(), values=vals)
                server = b.kv()[layer, i] if fmt == "mha" else b.kv()[layer]
                assert np.array_equal(server[torch.from_numpy(kv_loc).long()].float().numpy(), vals)
                assert np.array_equal(
                    _view(mine, 0, layer, part)[torch.from_numpy(kv_loc).long()].float().numpy(), vals
                )
        # Nothing else was touched.
        touched = torch.zeros(b.num_tokens, dtype=torch.bool)
        touched[torch.from_numpy(kv_loc).long()] = True
        assert not (b.kv()[:, :, ~touched] if fmt == "mha" else b.kv()[:, ~touched]).any()
        # And the other way: this process writes, the client reads.
        other = np.array([1, 5, b.num_tokens - 1])
        for layer in range(g.num_layers):
            for i, part in enumerate(parts):
                vals = values_for(100 + layer * 2 + i, (3, *width))
                _view(mine, 0, layer, part)[torch.from_numpy(other)] = torch.from_numpy(vals).to(g.torch_dtype)
                assert np.array_equal(client.call("read", rank=0, layer=layer, part=part, slots=other.tolist()), vals)
        # A later step's rows are seen too; a release zeroes the row.
        res2 = core.step(s, StepBatch.of(alloc_slots=[slot], alloc_needs=[g.page_size * 2]))
        assert res2.new_pages.size == 2
        assert np.array_equal(client.call("block_table"), b.block_table)
        core.step(s, StepBatch.of(release_slots=[slot]))
        assert not client.call("block_table").any()
        mine.close()
    finally:
        client.close()
        b.close()
    assert _files(tmp_path) == []


def test_client_views_are_one_mapping(tmp_path):
    with ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path)) as b, open_mapped(b) as mem:
        buf = mem.kv_buffer()
        assert buf.shape == b.kv().shape and mem.num_ranks == 1
        base = buf.untyped_storage().data_ptr()
        layers = mem.kv_cache()
        assert len(layers) == 3
        for k, v in layers:
            assert k.shape == v.shape == (64, 2, 4) and k.is_contiguous() and v.is_contiguous()
            assert k.untyped_storage().data_ptr() == base == v.untyped_storage().data_ptr()
        assert mem.kv_cache() is layers  # built once
        assert layers[1][1].data_ptr() == buf[1, 1].data_ptr()
        assert mem.block_table.shape == (5, 5) and mem.block_table.dtype == torch.int32
        with pytest.raises(RuntimeError, match="no device block table"):
            mem.device_block_table()
        with pytest.raises(IndexError):
            mem.kv_cache(1)


def test_client_refuses_handles_that_disagree_with_geometry(tmp_path):
    with ShmBackend(PoolSpec(KVGeometry(**MHA), 16, 4, 20), directory=str(tmp_path)) as b:
        handles = [to_proto_handle(h) for h in b.handles()]
        geo = to_proto_geometry(b)
        wrong = pb.PoolGeometry()
        wrong.CopyFrom(geo)
        wrong.num_pages = 32
        with pytest.raises(MemoryMapError, match=r"'kv' handle of rank 0 is bfloat16 \[3, 2, 64, 2, 4\]"):
            MappedMemory.open(handles, wrong)
        with pytest.raises(MemoryMapError, match="do not form ranks"):
            MappedMemory.open(handles[:1], geo)
        with pytest.raises(MemoryMapError, match="no KV layout"):
            MappedMemory.open(handles, pb.PoolGeometry(num_pages=16, page_size=4))
        lying = pb.MemoryHandle()
        lying.CopyFrom(handles[0])
        lying.size_bytes += 2
        with pytest.raises(MemoryMapError, match="size_bytes"):
            MappedMemory.open([lying, handles[1]], geo)
        b.close()
        with pytest.raises(MemoryMapError, match="does not exist"):
            MappedMemory.open(handles, geo)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_default_directory_is_dev_shm():
    with ShmBackend(PoolSpec(KVGeometry(**MLA), 8, 2, 16)) as b:
        assert os.path.dirname(b.kv_path) == "/dev/shm"
        for p in (b.kv_path, b.block_table_path, b.lock_path):
            assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
        assert all(b.server_id not in p for p in remove_stale())  # never a live server's
        with open_mapped(b) as mem:
            mem.kv_cache()[1][7] = 2.0
            assert b.kv()[1, 7].sum().item() == 2.0 * 8
            b.block_table[2, 1] = 3
            assert mem.block_table[2, 1].item() == 3
    assert not any(os.path.exists(p) for p in (b.kv_path, b.block_table_path, b.lock_path))


def test_one_gib_pool_maps_fast(tmp_path):
    """Server start (without reserving) and a client's attach-and-map of a 1 GiB pool
    do no per-page work: no byte of the pool is touched (the file stays sparse: the
    proof, whatever the host's speed), and it takes milliseconds, not seconds."""

    def free(d: str) -> int:
        st = os.statvfs(d)
        return st.f_bavail * st.f_frsize

    candidates = [d for d in ("/dev/shm", str(tmp_path)) if os.path.isdir(d) and free(d) > 2**30 + 2**24]
    if not candidates:
        pytest.skip("no directory with 1 GiB free (sparse files still need the space promised)")
    directory = candidates[0]
    g = KVGeometry(format="mha", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    assert g.page_bytes == 2 * 2**20
    t0 = time.perf_counter()
    b = ShmBackend(PoolSpec(g, 512, 64, 4096), directory=directory, reserve=False)
    t1 = time.perf_counter()
    try:
        assert os.path.getsize(b.kv_path) == 2**30
        mem = open_mapped(b)
        t2 = time.perf_counter()
        assert len(mem.kv_cache()) == 32
        touched = os.stat(b.kv_path).st_blocks * 512
        mem.close()
    finally:
        b.close()
    assert touched < 2**20, f"{touched:,} bytes of the 1 GiB pool were touched by start and map"
    assert t1 - t0 < 5, f"server start took {t1 - t0:.3f} s"  # sanity bounds: a write of 1 GiB on a
    assert t2 - t1 < 5, f"attach-and-map took {t2 - t1:.3f} s"  # loaded host could take about this
