"""Map the server's KV memory and block tables into this process as torch tensors.

Shares no Python code with the server: the only contract is the proto
(``kvmem.v1.kvmem_pb2``): the ``MemoryHandle`` list and the ``PoolGeometry`` of an
``AttachResponse``.

>>> mem = MappedMemory.open(attach.memory, attach.geometry)
>>> k, v = mem.kv_cache(rank)[layer]      # mha: [num_tokens, kv_heads, head_dim] each
>>> k[kv_loc] = new_k                     # kv_loc: the token slots a Step returned
>>> mem.block_table                       # int32 [max_requests + 1, max_pages_per_request]

Every allocation is mapped once (one ``mmap`` per shared-memory file, one CUDA IPC
open per device allocation); the per-layer views are built once at open, O(layers).
Mapping does no per-page work: a 1 GiB pool maps in milliseconds.

Shared-memory files must be reachable at the path the server names (same host and the
same ``/dev/shm``, e.g. a shared volume between containers) and readable by this user.
CUDA handles name the GPU by UUID; the local device with that UUID is opened, whatever
this process's ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import math
import mmap
import os
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from kvmem.v1 import kvmem_pb2

from .loads import PageLoads

__all__ = ["KVLayer", "MappedMemory", "MemoryMapError"]

KVLayer = tuple[torch.Tensor, torch.Tensor] | torch.Tensor
"""One layer's views: ``(k, v)``, each ``[num_tokens, kv_heads, head_dim]`` (mha), or the latent (mla)."""

_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int32")


class MemoryMapError(RuntimeError):
    """The handles cannot be mapped: they disagree with the geometry, a file is missing
    or of the wrong size, or no visible GPU has the handle's UUID."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name in _DTYPES else None
    if not isinstance(dtype, torch.dtype):
        raise MemoryMapError(f"unsupported dtype {name!r} in a memory handle (this torch is {torch.__version__})")
    return dtype


def _norm_uuid(uuid: str) -> str:
    uuid = uuid.strip().lower()
    return uuid[4:] if uuid.startswith("gpu-") else uuid


def _local_cuda_device(uuid: str) -> int:
    """The local index of the CUDA device whose UUID is ``uuid``. O(visible devices)."""
    if not torch.cuda.is_available():
        raise MemoryMapError(f"the server shares GPU {uuid} by CUDA IPC, but this process sees no CUDA device")
    want = _norm_uuid(uuid)
    seen = []
    for i in range(torch.cuda.device_count()):
        have = str(torch.cuda.get_device_properties(i).uuid)
        if _norm_uuid(have) == want:
            return i
        seen.append(have)
    raise MemoryMapError(
        f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES="
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!s}; visible: {seen})"
    )


def _map_shm(handle: kvmem_pb2.MemoryHandle, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """One ``mmap`` of the whole file, viewed as ``shape`` from ``offset_bytes``. O(1).
    The block table (and the load counters after it) is mapped read-only: it is the
    server's own state, and a client writing to it would corrupt every session's
    requests (such a write faults in the client instead)."""
    path = handle.shm.path
    writable = handle.name == "kv"  # the block table and the load counters are the server's to write
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MemoryMapError(
            f"shared-memory file {path!r} ({handle.name}) does not exist: the server is gone, or "
            f"this process does not share its /dev/shm"
        ) from None
    except PermissionError:
        raise MemoryMapError(
            f"shared-memory file {path!r} ({handle.name}) is private to the server's user (mode 0600) "
            f"and this process runs as uid {os.getuid()}"
        ) from None
    end = handle.offset_bytes + handle.size_bytes  # the load counters follow the table in its file
    try:
        size = os.fstat(fd).st_size
        if size < end or (handle.name == "kv" and size != end):
            raise MemoryMapError(
                f"shared-memory file {path!r} has {size} bytes, the handle says {handle.size_bytes} from byte "
                f"{handle.offset_bytes}"
            )
        # Never closed explicitly: a tensor over it keeps it alive, and it is unmapped
        # when the last view is gone (closing under a live view would leave it dangling).
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        buf = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # read-only by design for the block table (see above)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        if handle.offset_bytes or end != size:
            raw = raw[handle.offset_bytes : end]
        return raw.view(dtype).view(shape)


def _map_cuda(handle: kvmem_pb2.MemoryHandle, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Open the CUDA IPC handle on the local device with the handle's UUID. O(1)."""
    c = handle.cuda
    device = _local_cuda_device(c.device_uuid)  # initialises CUDA in this process
    if c.storage_size_bytes < handle.size_bytes:
        raise MemoryMapError(
            f"CUDA handle {handle.name!r} rank {handle.rank}: storage of {c.storage_size_bytes} bytes "
            f"is smaller than the {handle.size_bytes} bytes of its shape"
        )
    storage = torch.UntypedStorage._new_shared_cuda(
        device,
        bytes(c.ipc_handle),
        int(c.storage_size_bytes),
        int(c.storage_offset_bytes),
        bytes(c.ref_counter_handle),
        int(c.ref_counter_offset),
        bytes(c.event_handle),
        bool(c.event_sync_required),
    )
    # set_(storage, offset, size) takes contiguous strides; torch's stubs list only the form with strides.
    return torch.empty(0, dtype=dtype, device=torch.device("cuda", device)).set_(storage, 0, shape)  # type: ignore[call-overload]


def _layers(kv: torch.Tensor, fmt: int) -> list[KVLayer]:
    if fmt == kvmem_pb2.KV_FORMAT_MHA:
        return [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]
    return [kv[i] for i in range(kv.shape[0])]


class _Maps(NamedTuple):
    kv: list[torch.Tensor]  # per rank
    block_tables: list[torch.Tensor]  # shm: one; cuda: per rank
    views: list[list[KVLayer]]  # per rank, per layer
    load_counters: torch.Tensor | None  # int32 [num_pages] (kvmem serve --host-memory), else None


class MappedMemory:
    """The server's KV caches and block tables, mapped into this process.

    ``backend`` is ``"shm"`` or ``"cuda"``; ``num_ranks`` the number of tensor-parallel
    ranks (1 for shm). Use :meth:`open`; :meth:`close` (or ``with``) drops the mappings.
    """

    def __init__(
        self,
        geometry: kvmem_pb2.PoolGeometry,
        backend: str,
        kv: list[torch.Tensor],
        block_tables: list[torch.Tensor],
        load_counters: torch.Tensor | None = None,
    ) -> None:
        self.geometry = geometry
        self.backend = backend
        views = [_layers(t, geometry.layout.format) for t in kv]
        self._maps: _Maps | None = _Maps(kv, block_tables, views, load_counters)

    @classmethod
    def open(cls, handles: Sequence[kvmem_pb2.MemoryHandle], geometry: kvmem_pb2.PoolGeometry) -> MappedMemory:
        """Map every handle once, after checking it against ``geometry``.

        Expects, per rank ``0..n-1``, one ``"kv"`` handle and a ``"block_table"`` handle
        (shm: one table, rank 0; cuda: one device copy per rank), all of one kind; and
        with a host tier one ``"load_counters"`` handle (shm, rank 0: in the block-table
        file, after the table; on a CUDA pool a small file of its own).
        Raises :class:`MemoryMapError` naming the handle and what disagrees.
        Cost: one map per allocation plus O(layers) views; nothing per page.
        """
        layout = geometry.layout
        if not geometry.HasField("layout") or layout.format == kvmem_pb2.KV_FORMAT_UNSPECIFIED:
            raise MemoryMapError("the pool geometry has no KV layout: the server runs without KV memory")
        num_tokens = geometry.num_pages * geometry.page_size
        kv_shape: tuple[int, ...]
        if layout.format == kvmem_pb2.KV_FORMAT_MHA:
            kv_shape = (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)
        elif layout.format == kvmem_pb2.KV_FORMAT_MLA:
            kv_shape = (layout.num_layers, num_tokens, layout.kv_lora_rank + layout.rope_dim)
        else:
            raise MemoryMapError(f"unknown KV format {layout.format} in the pool geometry")
        bt_shape = (geometry.max_requests + 1, geometry.max_pages_per_request)
        # The load counters are host memory whatever the pool's kind: checked below.
        kinds = {h.WhichOneof("handle") for h in handles if h.name != "load_counters"}
        if len(kinds) != 1 or None in kinds:
            raise MemoryMapError(f"memory handles must all be shm or all cuda, got {sorted(map(str, kinds))}")
        (kind,) = kinds
        by_key: dict[tuple[str, int], kvmem_pb2.MemoryHandle] = {}
        for h in handles:
            if h.name not in ("kv", "block_table", "load_counters"):
                raise MemoryMapError(f"unknown memory handle name {h.name!r}")
            if (h.name, h.rank) in by_key:
                raise MemoryMapError(f"two {h.name!r} handles for rank {h.rank}")
            by_key[(h.name, h.rank)] = h
        num_ranks = sum(1 for name, _ in by_key if name == "kv")
        bt_ranks = num_ranks if kind == "cuda" else 1
        expected = {("kv", r) for r in range(num_ranks)} | {("block_table", r) for r in range(bt_ranks)}
        has_counters = ("load_counters", 0) in by_key
        if has_counters:
            expected.add(("load_counters", 0))
        if num_ranks == 0 or set(by_key) != expected:
            raise MemoryMapError(
                f"{kind} memory handles {sorted(by_key)} do not form ranks 0..{num_ranks - 1} "
                f"each with a KV allocation and {'a' if kind == 'cuda' else 'one shared'} block table"
            )
        mapper = _map_shm if kind == "shm" else _map_cuda

        def map_one(name: str, rank: int, dtype_name: str, shape: tuple[int, ...], via: Any = None) -> torch.Tensor:
            h = by_key[(name, rank)]
            if h.dtype != dtype_name or tuple(h.shape) != shape:
                raise MemoryMapError(
                    f"{name!r} handle of rank {rank} is {h.dtype} {list(h.shape)}, the geometry "
                    f"implies {dtype_name} {list(shape)}"
                )
            dtype = _dtype(dtype_name)
            if h.size_bytes != math.prod(shape) * dtype.itemsize:
                raise MemoryMapError(
                    f"{name!r} handle of rank {rank}: size_bytes {h.size_bytes} != "
                    f"{math.prod(shape) * dtype.itemsize} for {dtype_name} {list(shape)}"
                )
            return (via or mapper)(h, dtype, shape)

        kv = [map_one("kv", r, layout.dtype, kv_shape) for r in range(num_ranks)]
        tables = [map_one("block_table", r, "int32", bt_shape) for r in range(bt_ranks)]
        counters = None
        if has_counters:
            if by_key[("load_counters", 0)].WhichOneof("handle") != "shm":
                raise MemoryMapError("the 'load_counters' handle must be a shared-memory file")
            # Host memory on a CUDA pool too.
            counters = map_one("load_counters", 0, "int32", (geometry.num_pages,), via=_map_shm)
        return cls(geometry, kind, kv, tables, counters)

    # ------------------------------------------------------------------ access

    def _live(self) -> _Maps:
        if self._maps is None:
            raise RuntimeError("the mapped memory is closed")
        return self._maps

    @property
    def num_ranks(self) -> int:
        """KV allocations mapped: one per tensor-parallel rank (1 on the shm backend)."""
        return len(self._live().kv)

    def kv_buffer(self, rank: int = 0) -> torch.Tensor:
        """The whole KV allocation of ``rank``: mha ``[layers, 2, tokens, heads, head_dim]``,
        mla ``[layers, tokens, rank + rope]``. O(1)."""
        return self._live().kv[self._rank(rank)]

    def kv_cache(self, rank: int = 0) -> list[KVLayer]:
        """Per-layer views indexed by token slot (``kv_loc``): mha a list of ``(k, v)``,
        each ``[num_tokens, kv_heads, head_dim]``; mla a list of ``[num_tokens,
        kv_lora_rank + rope_dim]``. Built once at open; O(1)."""
        return self._live().views[self._rank(rank)]

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``[max_requests + 1, max_pages_per_request]``. shm: the server's host table
        itself; cuda: rank 0's device copy (see :meth:`device_block_table`)."""
        return self._live().block_tables[0]

    @property
    def load_counters(self) -> torch.Tensor | None:
        """int32 ``[num_pages]``: per page, the layers a load from the server's host tier
        has copied in (``num_layers``: not loading); None when the server has no host
        tier. Read-only. See :mod:`kvmem.client.loads`."""
        return self._live().load_counters

    def page_loads(self) -> PageLoads | None:
        """A :class:`~kvmem.client.loads.PageLoads` over :attr:`load_counters` (None
        without a host tier). O(1)."""
        counters = self._live().load_counters
        if counters is None:
            return None
        return PageLoads(counters, self.geometry.layout.num_layers, self.geometry.page_size)

    def device_block_table(self, rank: int = 0) -> torch.Tensor:
        """The block-table copy on ``rank``'s GPU (cuda only). The server updates it before
        the Step response that changed it arrives."""
        tables = self._live().block_tables
        if self.backend != "cuda":
            raise RuntimeError(f"the {self.backend} backend has no device block table; use block_table")
        return tables[self._rank(rank)]

    def _rank(self, rank: int) -> int:
        num_ranks = self.num_ranks
        if not 0 <= rank < num_ranks:
            raise IndexError(f"rank {rank} out of range: {num_ranks} rank(s) mapped")
        return rank

    def close(self) -> None:
        """Drop this object's mappings. Idempotent. Memory is unmapped (shm) or released
        (cuda) once no view obtained from it is alive either, so a view kept by the
        caller never dangles."""
        self._maps = None

    @property
    def closed(self) -> bool:
        """The mappings were dropped (:meth:`close`, or the session's server is gone)."""
        return self._maps is None

    def __enter__(self) -> MappedMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._maps is None else f"{len(self._maps.kv)} rank(s)"
        return f"MappedMemory({self.backend}, {state})"
