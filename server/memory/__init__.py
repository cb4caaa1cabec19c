"""KV memory backends: the physical KV cache and the block table the core writes.

This layer sits beside the allocation core (:mod:`kvmem.server.core`, pure numpy), which
knows nothing of memory: a backend *gives* the core its int32 host block table and owns
the KV tensors the clients map. The gRPC service translates :class:`HandleInfo` into the
proto ``MemoryHandle``; this package imports no proto and no gRPC.

* :mod:`.geometry` -- :class:`KVGeometry`, the KV layout (format, layers, heads, dtype,
  page size) and its arithmetic; :class:`PoolSpec`, the one check of a pool (geometry,
  pages, request slots, context); :func:`pages_for_budget` and :func:`parse_size` turn
  command-line values into a pool, refusing bad ones with a :class:`GeometryError` that
  names the option and the value.
* :mod:`.base` -- :class:`MemoryBackend`, the interface both backends implement, and the
  :class:`HandleInfo` / :class:`CudaIpcInfo` records of what clients map.
* :mod:`.shm` -- :class:`ShmBackend`, the embedded default: one KV file and one
  block-table file in POSIX shared memory (``/dev/shm``), mode 0600, removed on
  ``close``, at exit, and by :func:`remove_stale` at the next start after a crash.
* :mod:`.cuda` -- :class:`CudaBackend`: one KV allocation per device (tensor-parallel
  ranks share one page-id space) and a device copy of the block table on each, shared by
  CUDA IPC.

Only the cuda backend needs torch (to allocate on the GPU and export IPC handles):
``CudaBackend`` and ``device_uuid`` are imported from :mod:`.cuda` on first use (PEP 562),
so the shm backend and ``--device none`` run where torch is not installed. Dtypes are
named as torch names them and sized from a table (:attr:`KVGeometry.itemsize`).

Layout of one KV allocation (``num_tokens = num_pages * page_size`` token slots, slot
``page_id * page_size + offset``): mha ``[layers, 2, tokens, kv_heads, head_dim]`` (K at
index 0, V at 1), mla ``[layers, tokens, kv_lora_rank + rope_dim]``. A layer's K (or V,
or latent) is one contiguous ``[tokens, ...]`` block indexed by ``kv_loc``.
"""

from typing import TYPE_CHECKING, Any

from kvmem.server.memory.base import CudaIpcInfo, HandleInfo, MemoryBackend
from kvmem.server.memory.geometry import (
    DTYPES,
    FORMATS,
    GeometryError,
    KVGeometry,
    MemoryUnavailable,
    PoolSpec,
    block_table_bytes,
    block_table_shape,
    format_size,
    max_pages_per_request,
    pages_for_budget,
    parse_size,
)
from kvmem.server.memory.shm import ShmBackend, remove_stale

if TYPE_CHECKING:
    from kvmem.server.memory.cuda import CudaBackend, device_uuid

_NEED_TORCH = ("CudaBackend", "device_uuid")  # in .cuda, which imports torch

__all__ = [
    "DTYPES",
    "FORMATS",
    "CudaBackend",
    "CudaIpcInfo",
    "GeometryError",
    "HandleInfo",
    "KVGeometry",
    "MemoryBackend",
    "MemoryUnavailable",
    "PoolSpec",
    "ShmBackend",
    "block_table_bytes",
    "block_table_shape",
    "device_uuid",
    "format_size",
    "max_pages_per_request",
    "pages_for_budget",
    "parse_size",
    "remove_stale",
]


def __getattr__(name: str) -> Any:
    """``CudaBackend`` and ``device_uuid``, importing :mod:`.cuda` (and torch) on first use."""
    if name in _NEED_TORCH:
        from kvmem.server.memory import cuda

        return getattr(cuda, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
