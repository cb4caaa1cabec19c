"""The cuda backend: one KV allocation per device (tensor-parallel ranks share one
page-id space) and a device copy of the block table on each, shared by CUDA IPC."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvmem.server.memory.base import CudaIpcInfo, HandleInfo, MemoryBackend
from kvmem.server.memory.geometry import GeometryError, MemoryUnavailable, PoolSpec, _as_int, format_size
from kvmem.server.memory.shm import CounterFile


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device ``index`` as torch prints it
    (``xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``; ``nvidia-smi -L`` adds ``GPU-``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _check_devices(devices: Sequence[int]) -> list[int]:
    """``devices`` as ints: at least one, none repeated, each a visible CUDA device;
    a :class:`GeometryError` naming ``--devices`` otherwise."""
    checked = [_as_int(d, "--devices") for d in devices]
    count = torch.cuda.device_count()
    if not checked:
        raise GeometryError("--devices must name at least one CUDA device, got none")
    if len(set(checked)) != len(checked):
        raise GeometryError(f"--devices must not repeat a device, got {checked}")
    bad = [d for d in checked if not 0 <= d < count]
    if bad:
        raise GeometryError(f"--devices {checked}: no CUDA device {bad[0]} ({count} visible)")
    return checked


class CudaBackend(MemoryBackend):
    """KV tensors on GPUs, shared by CUDA IPC: one KV allocation per device in
    ``devices`` (tensor-parallel rank ``r`` is ``devices[r]``; all ranks share one page-id
    space, so a token slot means the same thing on every rank), plus a device copy of
    the block table on each device. The authoritative table is a pinned host tensor,
    ``block_table`` its numpy view; :meth:`sync_rows` pushes changed rows to the devices.

    Handles are created once, at construction (``UntypedStorage._share_cuda_()``), and
    the same ones go to every client: torch's per-share reference counting and IPC
    event are meaningless for memory that lives as long as the server.

    ``pool`` is a :class:`PoolSpec`, validated when it was built; it is not checked again.

    Costs: construction allocates and zeroes ``num_pages * page_bytes`` per device
    (memory bandwidth, milliseconds per GiB). :meth:`sync_rows` is O(rows * columns)
    bytes of host-to-device copies per device plus one stream synchronisation each
    (tens of microseconds).
    """

    name = "cuda"
    syncs_rows = True  # device copies follow the host table

    def __init__(self, pool: PoolSpec, devices: Sequence[int] = (0,), load_counters: CounterFile | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the cuda memory backend needs a CUDA device, but torch.cuda.is_available() is "
                "False (torch build " + torch.__version__ + "); use the shm backend"
            )
        super().__init__(pool)
        self.devices = _check_devices(devices)
        self._kv_bytes = pool.kv_bytes
        self._bt_bytes = pool.block_table_bytes
        self._check_free(self._kv_bytes + 3 * self._bt_bytes)  # KV, table, staging rows
        self._allocate()
        self._handles = [
            self._share(t, name, rank, dtype)
            for rank in range(len(self.devices))
            for t, name, dtype in (
                (self._kv_dev[rank], "kv", pool.geometry.dtype),
                (self._bt_dev[rank], "block_table", "int32"),
            )
        ]
        # --host-memory: the host tier's load counters, host memory clients map (kvmem.server.memory.host_torch).
        self.counter_file = load_counters
        self.load_counters = None if load_counters is None else load_counters.counters
        if load_counters is not None:
            self._handles.append(load_counters.handle())
        self._closed = False
        self._log_created(f"on each of cuda:{self.devices}")

    def _check_free(self, needed: int) -> None:
        for d in self.devices:
            free, total = torch.cuda.mem_get_info(d)
            message = (
                f"the pool needs {needed} bytes ({format_size(needed)}) on cuda:{d} but it has "
                f"{free} bytes ({format_size(free)}) free: lower --num-pages/--memory"
            )
            if needed > total:
                raise GeometryError(f"{message} (it has {format_size(total)} in all)")
            if needed > free:
                raise MemoryUnavailable(message, needed, free)

    def _allocate(self) -> None:
        """The pinned host table and its staging rows, then per device its table copy,
        staging buffers, KV allocation and copy stream (zeroed, synchronised)."""
        bt_shape = self.pool.block_table_shape
        rows = bt_shape[0]
        self._host = torch.zeros(bt_shape, dtype=torch.int32, pin_memory=True)
        self.block_table = self._host.numpy()
        self._idx_host = torch.zeros(rows, dtype=torch.int64, pin_memory=True)
        self._rows_host = torch.zeros(bt_shape, dtype=torch.int32, pin_memory=True)
        self._kv_dev: list[torch.Tensor] = []
        self._bt_dev: list[torch.Tensor] = []
        self._idx_dev: list[torch.Tensor] = []
        self._rows_dev: list[torch.Tensor] = []
        self._streams: list[torch.cuda.Stream] = []
        for d in self.devices:
            dev = torch.device("cuda", d)
            with torch.cuda.device(dev):
                # The table first: it is small, so it shares a caching-allocator segment
                # (mapped whole by clients) with the staging buffers only.
                self._bt_dev.append(torch.zeros(bt_shape, dtype=torch.int32, device=dev))
                self._idx_dev.append(torch.zeros(rows, dtype=torch.int64, device=dev))
                self._rows_dev.append(torch.zeros(bt_shape, dtype=torch.int32, device=dev))
                self._kv_dev.append(torch.zeros(self.pool.kv_shape, dtype=self.geometry.torch_dtype, device=dev))
                self._streams.append(torch.cuda.Stream(device=dev))
        for d in self.devices:
            torch.cuda.synchronize(d)

    def _share(self, tensor: torch.Tensor, name: str, rank: int, dtype: str) -> HandleInfo:
        assert tensor.is_contiguous() and tensor.storage_offset() == 0
        shared = tensor.untyped_storage()._share_cuda_()
        device, ipc_handle, size_bytes, offset_bytes, ref_counter, ref_offset, event_handle, event_sync = shared
        info = CudaIpcInfo(
            device_uuid=device_uuid(device),
            ipc_handle=bytes(ipc_handle),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_counter),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle),
            event_sync_required=bool(event_sync),
        )
        nbytes = tensor.numel() * tensor.element_size()
        return HandleInfo(name, rank, dtype, tuple(tensor.shape), nbytes, cuda=info)

    @property
    def num_ranks(self) -> int:
        return len(self.devices)

    @property
    def block_table_tensor(self) -> torch.Tensor:
        """The authoritative host table as a tensor: pinned, so the copies to the devices
        run asynchronously; the same memory as ``block_table``."""
        return self._host

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the cuda backend is closed")

    def kv(self, rank: int = 0) -> torch.Tensor:
        """The KV allocation of ``rank`` (on ``cuda:devices[rank]``). O(1)."""
        self._check_open()
        self._check_rank(rank)
        return self._kv_dev[rank]

    def device_block_table(self, rank: int = 0) -> torch.Tensor:
        """The block-table copy on ``rank``'s device (as of the last :meth:`sync_rows`)."""
        self._check_open()
        self._check_rank(rank)
        return self._bt_dev[rank]

    def handles(self) -> list[HandleInfo]:
        """Per rank: its KV allocation, then its device block table; with a host tier
        the load counters' shm file last. O(ranks)."""
        self._check_open()
        return list(self._handles)

    def sync_rows(self, rows: np.ndarray) -> None:
        """Copy host block-table ``rows`` to every device and wait until the copies are
        done, so a kernel any process launches afterwards reads the new rows.

        The rows are gathered into pinned staging memory, copied to each device on its
        own stream and scattered there with ``index_copy_`` (over half the table: one
        whole-table copy instead). Cost: O(len(rows) * columns) bytes per device, the
        devices in parallel, plus one stream synchronisation each.
        """
        self._check_open()
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = rows.size
        if n == 0:
            return
        total = self.block_table.shape[0]
        if np.count_nonzero((rows < 0) | (rows >= total)):
            raise IndexError(f"block-table rows must be in [0, {total}), got {rows[(rows < 0) | (rows >= total)][:8]}")
        whole = 2 * n >= total
        if not whole:
            self._idx_host.numpy()[:n] = rows
            np.take(self.block_table, rows, axis=0, out=self._rows_host.numpy()[:n], mode="clip")
        for rank, stream in enumerate(self._streams):
            with torch.cuda.stream(stream):
                table = self._bt_dev[rank]
                if whole:
                    table.copy_(self._host, non_blocking=True)
                else:
                    idx = self._idx_dev[rank][:n]
                    vals = self._rows_dev[rank][:n]
                    idx.copy_(self._idx_host[:n], non_blocking=True)
                    vals.copy_(self._rows_host[:n], non_blocking=True)
                    table.index_copy_(0, idx, vals)
        for stream in self._streams:
            stream.synchronize()

    def close(self) -> None:
        """Drop the server's references to the device memory. Idempotent. Memory that
        was shared stays reserved (torch's IPC "limbo") until no client maps it or the
        process exits; the server is expected to exit soon after."""
        if self._closed:
            return
        self._closed = True
        for d in self.devices:
            torch.cuda.synchronize(d)
        if self.counter_file is not None:
            self.counter_file.close()
            self.load_counters = None
        self._kv_dev.clear()
        self._bt_dev.clear()
        self._idx_dev.clear()
        self._rows_dev.clear()
        self._streams.clear()
