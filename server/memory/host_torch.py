"""The host tier of a CUDA pool (``kvmem serve --device cuda:N --host-memory``; one tier
per rank with ``--devices``): :class:`TorchHostPages`, the
:class:`~kvmem.server.memory.host.PageCopier` whose copies are torch ops between a
device's KV allocation and host pages.

The host pages of each rank are one ``uint8`` tensor ``[host page][plane][row bytes]``
(the CPU tier's layout: a page is one run of bytes), **pinned** on a CUDA pool
(``cudaHostRegister`` over ordinary memory: torch's pinned allocator would round a
large size up to a power of two), so the copies are DMA transfers. Each rank copies on
its own CUDA stream (the sidecar's; never a client's), so a copy never waits behind a
client's kernels, nor they behind it.

* A **demotion** (:meth:`TorchHostPages.to_host`, within the call that evicts) gathers
  the pages on the device into a staging buffer page-major, copies it to pinned staging
  memory and from there into the host pages; it synchronises its stream before it
  returns, because the device pages are reused right after. Pages the pool evicts were
  cached by a client, which finished writing them before its Step (a client caches
  only what its kernels have written: docs/DESIGN.md, KV memory).
* A **load** is the copy thread's (:class:`~kvmem.server.memory.host.PageCopier`),
  layer by layer: the layer's planes of the pages are gathered on the host into pinned
  staging memory, copied to the device on the rank's stream and scattered into the
  pool's pages there (``index_copy_``); the thread waits for the stream before it sets
  the layer's **load counters**. The counters are host memory clients map (a small
  shared-memory file beside the pool: :class:`~kvmem.server.memory.shm.CounterFile`),
  so a client waits as on the CPU pool, in its own memory with no round trip, and a
  kernel it launches after its count passed layer ``i`` reads the copied bytes.

Why counters and not CUDA IPC events for the client's wait: an event is waited for as
recorded *when the waiter calls* ``cudaStreamWaitEvent``, and the copy thread records
after the Step answered, so a client could wait on an older record and read a page
before its copy. A counter set after the copy finished has no such window; the cost is
that the client's launch of layer ``i``'s attention (not its GPU) waits for the copy.

The same code runs on CPU tensors (no streams, nothing pinned): the tests check its
layout against :class:`~kvmem.server.memory.host.HostPages` on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import numpy as np
import torch

from kvmem.server.memory.geometry import KVGeometry, format_size
from kvmem.server.memory.host import PageCopier

log = logging.getLogger("kvmem.server.memory")

STAGING_BYTES = 64 << 20  # per rank and direction: a copy of more is made in runs of this size


class TorchHostPages(PageCopier):
    """``num_pages`` host pages per rank behind the KV allocations ``device`` (one tensor
    per rank, any dtype, ``num_device_pages`` pages of ``geometry``: the cuda backend's
    :meth:`~kvmem.server.memory.cuda.CudaBackend.kv`). ``counters`` as
    :class:`~kvmem.server.memory.host.PageCopier`'s. On CUDA tensors the host pages and
    the staging memory are pinned and each rank copies on a stream of its own.
    ``staging_bytes``: the staging memory per rank and direction (a larger copy is made
    in runs of it)."""

    def __init__(
        self,
        device: list[torch.Tensor],
        geometry: KVGeometry,
        num_device_pages: int,
        num_pages: int,
        counters: np.ndarray | None = None,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        super().__init__(geometry, num_device_pages, num_pages, counters)
        planes, row = self._planes, self._row
        self.num_ranks = len(device)
        self._device = [d.view(torch.uint8).view(planes, num_device_pages, row) for d in device]
        self._cuda = [d.device.type == "cuda" for d in device]
        # Pages per staged run: a whole page per demoted page, one layer's planes per loaded one.
        self._run_out = max(1, staging_bytes // geometry.page_bytes)
        self._run_in = max(1, staging_bytes // (self._planes_per_layer * row))
        self._host: list[torch.Tensor] = []
        self._registered: list[torch.Tensor] = []
        self._streams: list[Any] = []
        self._stage_out: list[torch.Tensor] = []  # pinned [run_out, planes, row]
        self._stage_in: list[torch.Tensor] = []  # pinned [run_in, planes per layer, row]
        for dev, on_cuda in zip(self._device, self._cuda, strict=True):
            host = torch.empty((num_pages, planes, row), dtype=torch.uint8)
            if on_cuda:
                self._pin(host)
            self._host.append(host)
            pin = on_cuda
            self._stage_out.append(torch.empty((self._run_out, planes, row), dtype=torch.uint8, pin_memory=pin))
            k = self._planes_per_layer
            self._stage_in.append(torch.empty((self._run_in, k, row), dtype=torch.uint8, pin_memory=pin))
            self._streams.append(torch.cuda.Stream(device=dev.device) if on_cuda else None)

    def _pin(self, host: torch.Tensor) -> None:
        """Page-lock ``host`` for DMA (``cudaHostRegister``); a host that refuses (a
        container's locked-memory limit) leaves it pageable, with a warning: the copies
        stay correct, slower."""
        cudart = torch.cuda.cudart()
        nbytes = host.numel()
        err = cudart.cudaHostRegister(host.data_ptr(), nbytes, 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            log.warning(
                "host tier: could not pin %s of host memory (cudaHostRegister error %s): its copies run from "
                "pageable memory, slower",
                format_size(nbytes),
                int(err),
            )
            return
        self._registered.append(host)

    def to_host(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        """Gather the pages on the device page-major, copy them out, put them in their
        host pages; synchronised before it returns. In runs of the staging size."""
        n = int(device_pages.size)
        if n == 0:
            return
        for rank, dev in enumerate(self._device):
            target = dev.device
            stage = self._stage_out[rank]
            host = self._host[rank]
            with _on(self._streams[rank]):
                for lo in range(0, n, self._run_out):
                    hi = min(n, lo + self._run_out)
                    idx = torch.from_numpy(np.ascontiguousarray(device_pages[lo:hi], dtype=np.int64)).to(target)
                    # [planes, run, row] on the device, page-major for the one copy out.
                    gathered = dev.index_select(1, idx).transpose(0, 1)
                    out = stage[: hi - lo]
                    out.copy_(gathered, non_blocking=self._cuda[rank])
                    _sync(self._streams[rank])
                    dst = torch.from_numpy(np.ascontiguousarray(host_pages[lo:hi], dtype=np.int64))
                    host.index_copy_(0, dst, out)

    def _copy_layer(self, layer: int, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """The layer's planes of the pages: gathered on the host into pinned staging,
        copied to the device, scattered into the pool's pages; every rank's stream
        enqueued first, then each waited for."""
        k = self._planes_per_layer
        lo_plane = layer * k
        n = int(host_pages.size)
        for lo in range(0, n, self._run_in):
            hi = min(n, lo + self._run_in)
            src = torch.from_numpy(np.ascontiguousarray(host_pages[lo:hi], dtype=np.int64))
            dst_np = np.ascontiguousarray(device_pages[lo:hi], dtype=np.int64)
            for rank, dev in enumerate(self._device):
                stage = self._stage_in[rank][: hi - lo]
                torch.index_select(self._host[rank][:, lo_plane : lo_plane + k], 0, src, out=stage)
                with _on(self._streams[rank]):
                    on = self._cuda[rank]
                    staged = stage.to(dev.device, non_blocking=on)  # [run, k, row]
                    dst = torch.from_numpy(dst_np).to(dev.device, non_blocking=on)
                    dev[lo_plane : lo_plane + k].index_copy_(1, dst, staged.transpose(0, 1))
            for stream in self._streams:  # the staging memory is reused by the next run
                _sync(stream)

    def page(self, host_page: int, rank: int = 0) -> np.ndarray:
        """One host page's bytes ``[planes, row]`` (a view): for tests and tools."""
        return self._host[rank][host_page].numpy()

    def buffers(self) -> list[np.ndarray]:
        return [h.numpy().reshape(-1) for h in self._host]

    def close(self) -> None:
        """Stop the copy thread, then unpin the host pages. Idempotent."""
        super().close()
        registered, self._registered = self._registered, []
        for host in registered:
            torch.cuda.cudart().cudaHostUnregister(host.data_ptr())


def _on(stream: Any) -> Any:
    """``torch.cuda.stream(stream)``, or nothing for a CPU rank."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def _sync(stream: Any) -> None:
    if stream is not None:
        stream.synchronize()
