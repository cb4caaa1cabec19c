"""The cuda memory backend: CUDA IPC handles opened in other processes, tensor-parallel
ranks, and the device block tables. Skipped without a CUDA device.

Self-contained on purpose (no import from test_memory): children are spawned with the
environment they need (CUDA_VISIBLE_DEVICES) and import this module to find the worker.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import traceback

import numpy as np
import pytest
import torch

from kvmem.client.memory import MappedMemory, MemoryMapError
from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.edge.service import geometry_to_proto, handle_to_proto
from kvmem.server.memory import CudaBackend, GeometryError, HandleInfo, KVGeometry
from kvmem.v1 import kvmem_pb2 as pb

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MHA = dict(format="mha", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
MLA = dict(format="mla", num_layers=2, kv_lora_rank=12, rope_dim=4, dtype="float16", page_size=8)


def to_proto_handle(info: HandleInfo) -> pb.MemoryHandle:
    return handle_to_proto(info)  # the service's own translation


def to_proto_geometry(backend) -> pb.PoolGeometry:
    core = CoreConfig(backend.num_pages, backend.geometry.page_size, backend.max_requests, backend.max_context_len)
    return geometry_to_proto(core, backend.geometry)  # the service's own translation


def _view(mem: MappedMemory, rank: int, layer: int, part: str) -> torch.Tensor:
    entry = mem.kv_cache(rank)[layer]
    if part == "latent":
        return entry
    return entry[0] if part == "k" else entry[1]


def cuda_client_worker(conn, handles: list[bytes], geometry: bytes) -> None:
    """A scheduler-worker stand-in in its own process: maps the handles through
    kvmem.client.memory and serves commands; every write is synchronised before the
    reply, as a kernel the scheduler waits for would be."""
    try:
        mem = MappedMemory.open([pb.MemoryHandle.FromString(b) for b in handles], pb.PoolGeometry.FromString(geometry))
        devices = [mem.kv_buffer(r).device.index for r in range(mem.num_ranks)]
        conn.send(("ok", {"backend": mem.backend, "devices": devices}))
        while True:
            op, args = conn.recv()
            if op == "write":
                view = _view(mem, args["rank"], args["layer"], args["part"])
                idx = torch.as_tensor(args["slots"], dtype=torch.int64).to(view.device)
                view[idx] = torch.from_numpy(args["values"]).to(device=view.device, dtype=view.dtype)
                torch.cuda.synchronize(view.device)
                conn.send(("ok", None))
            elif op == "read":
                view = _view(mem, args["rank"], args["layer"], args["part"])
                idx = torch.as_tensor(args["slots"], dtype=torch.int64).to(view.device)
                conn.send(("ok", view[idx].float().cpu().numpy()))
            elif op == "device_block_table":
                # A fresh kernel launched after the server's sync_rows returned.
                table = mem.device_block_table(args["rank"])
                conn.send(("ok", table.clone().cpu().numpy()))
            elif op == "close":
                mem.close()
                conn.send(("ok", None))
                return
    except Exception:
        conn.send(("error", traceback.format_exc()))


@contextlib.contextmanager
def _env(**values: str | None):
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Client:
    """A :func:`cuda_client_worker` in a spawned process (a clean CUDA context)."""

    def __init__(self, backend, visible_devices: str | None = None) -> None:
        ctx = mp.get_context("spawn")
        handles = [to_proto_handle(h).SerializeToString() for h in backend.handles()]
        geometry = to_proto_geometry(backend).SerializeToString()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=cuda_client_worker, args=(child, handles, geometry), daemon=True)
        env = {} if visible_devices is None else {"CUDA_VISIBLE_DEVICES": visible_devices}
        with _env(**env):
            self.proc.start()
        child.close()
        self.info = self._reply()

    def _reply(self):
        if not self.conn.poll(180):
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
            if self.proc.is_alive():
                self.call("close")
        finally:
            self.proc.join(60)
            if self.proc.is_alive():
                self.proc.kill()


def values_for(seed: int, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers: exact in bfloat16 and float16."""
    n = int(np.prod(shape))
    return ((np.arange(n) * 7 + seed * 13) % 199 - 99).astype(np.float32).reshape(shape)


def _alloc(backend, tokens: int) -> tuple[KVCore, int, int, np.ndarray]:
    g = backend.geometry
    core = KVCore(
        CoreConfig(backend.num_pages, g.page_size, backend.max_requests, backend.max_context_len),
        block_table=backend.block_table,
    )
    s = core.add_owner()
    (slot,) = core.open(s, ["req"])
    res = core.step(s, StepBatch.of(alloc_slots=[slot], alloc_needs=[tokens]))
    backend.sync_rows(np.array([slot]))
    return core, s, int(slot), res.kv_loc


def _parts(g: KVGeometry) -> tuple[list[str], tuple[int, ...]]:
    if g.format == "mha":
        return ["k", "v"], (g.num_kv_heads, g.head_dim)
    return ["latent"], (g.kv_lora_rank + g.rope_dim,)


def _server_view(backend, rank: int, layer: int, i: int) -> torch.Tensor:
    kv = backend.kv(rank)
    return kv[layer, i] if backend.geometry.format == "mha" else kv[layer]


# ------------------------------------------------------------------ tests


def test_handles_name_the_device_by_uuid():
    with CudaBackend(PoolSpec(KVGeometry(**MHA), 32, 4, 32), devices=[0]) as b:
        assert b.name == "cuda" and b.num_ranks == 1
        handles = b.handles()
        assert [(h.name, h.rank, h.dtype) for h in handles] == [("kv", 0, "bfloat16"), ("block_table", 0, "int32")]
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        for h in handles:
            assert h.shm_path is None and h.cuda is not None
            assert h.cuda.device_uuid == uuid
            assert isinstance(h.cuda.ipc_handle, bytes) and h.cuda.ipc_handle
            assert h.cuda.storage_size_bytes >= h.size_bytes
        assert handles[0].shape == KVGeometry(**MHA).kv_shape(128)
        assert handles[1].shape == (5, 8)
        assert b.kv(0).device == torch.device("cuda", 0) and b.kv(0).shape == handles[0].shape
        assert b.block_table_tensor.is_pinned()
        assert b.block_table_tensor.data_ptr() == b.block_table.ctypes.data
        assert b.handles() == handles  # shared once, the same for every client
    b.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        b.kv(0)


def test_refused_devices_and_sizes():
    g = KVGeometry(**MHA)
    with pytest.raises(GeometryError, match=re.escape("--devices [99]: no CUDA device 99")):
        CudaBackend(PoolSpec(g, 32, 4, 32), devices=[99])
    with pytest.raises(GeometryError, match="must not repeat"):
        CudaBackend(PoolSpec(g, 32, 4, 32), devices=[0, 0])
    with pytest.raises(GeometryError, match="at least one"):
        CudaBackend(PoolSpec(g, 32, 4, 32), devices=[])
    big = KVGeometry(format="mha", num_layers=64, num_kv_heads=64, head_dim=256, dtype="float32", page_size=64)
    total = torch.cuda.get_device_properties(0).total_memory
    pages = total // big.page_bytes + 8
    with pytest.raises(GeometryError, match=r"the pool needs \d+ bytes .* on cuda:0"):
        CudaBackend(PoolSpec(big, pages, 4, 64), devices=[0])


def test_unknown_uuid_is_a_clear_error():
    with CudaBackend(PoolSpec(KVGeometry(**MHA), 32, 4, 32)) as b:
        handles = [to_proto_handle(h) for h in b.handles()]
        for h in handles:
            h.cuda.device_uuid = "00000000-0000-0000-0000-000000000000"
        with pytest.raises(MemoryMapError, match="GPU 00000000-0000-0000-0000-000000000000 is not visible"):
            MappedMemory.open(handles, to_proto_geometry(b))


@pytest.mark.parametrize("fmt", ["mha", "mla"])
def test_write_in_one_process_read_in_another(fmt):
    g = KVGeometry(**(MHA if fmt == "mha" else MLA))
    b = CudaBackend(PoolSpec(g, 32, 4, 64), devices=[0])
    core, _, slot, kv_loc = _alloc(b, 13)
    parts, width = _parts(g)
    writer = Client(b)
    reader = None
    try:
        assert writer.info == {"backend": "cuda", "devices": [0]}
        reader = Client(b)
        # The device table the writer sees is the host's after sync_rows.
        assert np.array_equal(writer.call("device_block_table", rank=0), b.block_table)
        for layer in range(g.num_layers):
            for i, part in enumerate(parts):
                vals = values_for(layer * 3 + i, (kv_loc.size, *width))
                writer.call("write", rank=0, layer=layer, part=part, slots=kv_loc.tolist(), values=vals)
                got = reader.call("read", rank=0, layer=layer, part=part, slots=kv_loc.tolist())
                assert np.array_equal(got, vals)
                idx = torch.from_numpy(kv_loc).long().cuda(0)
                assert np.array_equal(_server_view(b, 0, layer, i)[idx].float().cpu().numpy(), vals)
        # Only the written slots changed.
        touched = torch.zeros(b.num_tokens, dtype=torch.bool, device="cuda:0")
        touched[torch.from_numpy(kv_loc).long().cuda(0)] = True
        rest = b.kv(0)[:, :, ~touched] if fmt == "mha" else b.kv(0)[:, ~touched]
        assert not rest.any().item()
        # The other way: the server process writes, a client reads.
        other = [2, 9, b.num_tokens - 1]
        vals = values_for(77, (3, *width))
        _server_view(b, 0, 0, 0)[torch.tensor(other, device="cuda:0")] = torch.from_numpy(vals).to(
            device="cuda:0", dtype=g.torch_dtype
        )
        torch.cuda.synchronize(0)
        assert np.array_equal(reader.call("read", rank=0, layer=0, part=parts[0], slots=other), vals)
    finally:
        writer.close()
        if reader is not None:
            reader.close()
        b.close()


def test_device_block_table_equals_host_after_sync_rows():
    g = KVGeometry(**MHA)
    b = CudaBackend(PoolSpec(g, 64, 16, 64), devices=[0])
    core = KVCore(CoreConfig(64, g.page_size, 16, 64), block_table=b.block_table)
    s = core.add_owner()
    slots = core.open(s, [f"r{i}" for i in range(16)])
    client = Client(b)
    try:
        # Few rows (the scatter path), then most rows (the whole-table path).
        res = core.step(s, StepBatch.of(alloc_slots=slots[:3], alloc_needs=[5, 9, 1]))
        assert res.alloc_status.tolist() == [0, 0, 0]
        b.sync_rows(slots[:3])
        assert np.array_equal(b.device_block_table(0).cpu().numpy(), b.block_table)
        assert np.array_equal(client.call("device_block_table", rank=0), b.block_table)
        res = core.step(s, StepBatch.of(alloc_slots=slots[3:], alloc_needs=[4] * 13))
        assert (res.alloc_status == 0).all()
        b.sync_rows(slots[3:])
        assert np.array_equal(client.call("device_block_table", rank=0), b.block_table)
        # Releases zero rows; truncates drop pages.
        core.step(s, StepBatch.of(release_slots=slots[:2], truncate_slots=[slots[2]], truncate_lens=[0]))
        b.sync_rows(slots[:3])
        assert not b.block_table[slots[:3]].any()
        assert np.array_equal(client.call("device_block_table", rank=0), b.block_table)
        b.sync_rows(np.zeros(0, dtype=np.int64))  # nothing to do
        with pytest.raises(IndexError, match="rows must be in"):
            b.sync_rows(np.array([17]))
    finally:
        client.close()
        b.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_tensor_parallel_two_devices_share_one_page_space():
    g = KVGeometry(**MHA)
    b = CudaBackend(PoolSpec(g, 32, 4, 64), devices=[0, 1])
    core, owner, slot, kv_loc = _alloc(b, 10)
    parts, width = _parts(g)
    writer = Client(b)
    # The third process sees the GPUs in the other order: handles name them by UUID.
    reader = None
    try:
        handles = b.handles()
        assert [(h.name, h.rank) for h in handles] == [("kv", 0), ("block_table", 0), ("kv", 1), ("block_table", 1)]
        assert handles[0].cuda.device_uuid == str(torch.cuda.get_device_properties(0).uuid)
        assert handles[2].cuda.device_uuid == str(torch.cuda.get_device_properties(1).uuid)
        assert handles[0].cuda.device_uuid != handles[2].cuda.device_uuid
        reader = Client(b, visible_devices="1,0")
        assert writer.info["devices"] == [0, 1]
        assert reader.info["devices"] == [1, 0]
        for rank in (0, 1):
            assert np.array_equal(writer.call("device_block_table", rank=rank), b.block_table)
            assert np.array_equal(reader.call("device_block_table", rank=rank), b.block_table)
            for layer in range(g.num_layers):
                for i, part in enumerate(parts):
                    vals = values_for(rank * 50 + layer * 3 + i, (kv_loc.size, *width))
                    writer.call("write", rank=rank, layer=layer, part=part, slots=kv_loc.tolist(), values=vals)
        for rank in (0, 1):
            idx = torch.from_numpy(kv_loc).long().cuda(rank)
            for layer in range(g.num_layers):
                for i, part in enumerate(parts):
                    vals = values_for(rank * 50 + layer * 3 + i, (kv_loc.size, *width))
                    assert np.array_equal(
                        reader.call("read", rank=rank, layer=layer, part=part, slots=kv_loc.tolist()), vals
                    )
                    assert np.array_equal(_server_view(b, rank, layer, i)[idx].float().cpu().numpy(), vals)
        # A later step reaches every device's table.
        core.step(owner, StepBatch.of(alloc_slots=[slot], alloc_needs=[g.page_size * 3]))
        b.sync_rows(np.array([slot]))
        for rank in (0, 1):
            assert np.array_equal(b.device_block_table(rank).cpu().numpy(), b.block_table)
            assert np.array_equal(reader.call("device_block_table", rank=rank), b.block_table)
    finally:
        writer.close()
        if reader is not None:
            reader.close()
        b.close()
