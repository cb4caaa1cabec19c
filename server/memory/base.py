"""What both memory backends share: the handle records the service turns into proto
``MemoryHandle`` messages, and the :class:`MemoryBackend` interface over a
:class:`~kvmem.server.memory.geometry.PoolSpec`."""

from __future__ import annotations

import abc
import dataclasses
import logging
from typing import TYPE_CHECKING, Self

import numpy as np

from kvmem.server.memory.geometry import KVGeometry, PoolSpec, format_size

if TYPE_CHECKING:
    import torch  # annotations only: of the backends, only cuda needs torch at run time

log = logging.getLogger("kvmem.server.memory")


@dataclasses.dataclass(frozen=True, slots=True)
class CudaIpcInfo:
    """What ``torch.UntypedStorage._share_cuda_()`` returns, minus the local device index
    (replaced by the device UUID). Field names equal the proto ``CudaIpcHandle``'s, so
    ``kvmem_pb2.CudaIpcHandle(**dataclasses.asdict(info))`` builds it."""

    device_uuid: str
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


@dataclasses.dataclass(frozen=True, slots=True)
class HandleInfo:
    """One allocation a client maps: ``name`` "kv", "block_table" or "load_counters", the rank (index into
    the backend's devices; 0 for shm), the element dtype name and the whole allocation's
    shape and size. Exactly one of ``shm_path`` and ``cuda`` is set."""

    name: str
    rank: int
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int
    shm_path: str | None = None
    cuda: CudaIpcInfo | None = None
    offset_bytes: int = 0  # where it starts in its shm file (the load counters follow the block table)


class MemoryBackend(abc.ABC):
    """The physical memory of one server: KV tensors per rank and the block table.

    ``pool`` is the validated :class:`PoolSpec` the backend was built for (its fields are
    copied to attributes of the same names). ``block_table`` is the authoritative int32 host table
    ``[max_requests + 1, max_pages_per_request]`` to hand to
    :class:`kvmem.server.core.KVCore`.
    """

    name: str
    pool: PoolSpec
    block_table: np.ndarray
    syncs_rows: bool  # False when sync_rows is a no-op (the sessions layer then skips it)

    def __init__(self, pool: PoolSpec) -> None:
        self.pool = pool
        self.geometry: KVGeometry = pool.geometry
        self.num_pages: int = pool.num_pages
        self.max_requests: int = pool.max_requests
        self.max_context_len: int = pool.max_context_len

    @property
    def num_tokens(self) -> int:
        return self.pool.num_tokens

    @property
    def max_pages_per_request(self) -> int:
        return self.block_table.shape[1]

    @property
    @abc.abstractmethod
    def num_ranks(self) -> int: ...

    @abc.abstractmethod
    def kv(self, rank: int = 0) -> torch.Tensor:
        """The whole KV allocation of ``rank`` as a torch tensor of the KV dtype: shape
        ``geometry.kv_shape(num_tokens)``. The server itself never calls it (it does not
        touch KV bytes); it is for tests and in-process users, and imports torch."""

    @abc.abstractmethod
    def handles(self) -> list[HandleInfo]:
        """What clients need to map every allocation, for Attach. O(ranks)."""

    @abc.abstractmethod
    def sync_rows(self, rows: np.ndarray) -> None:
        """Make host block-table ``rows`` visible to clients before returning."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the memory. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} out of range: the {self.name} backend has {self.num_ranks} rank(s)")

    def _log_created(self, where: str) -> None:
        """One info line once the memory exists; ``where`` says where the KV lives."""
        log.info(
            "%s backend: %s KV (%d pages of %d tokens) %s, block table %s",
            self.name,
            format_size(self.pool.kv_bytes),
            self.num_pages,
            self.geometry.page_size,
            where,
            self.pool.block_table_shape,
        )
