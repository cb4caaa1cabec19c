"""KV memory backends: the physical KV cache and the block table the core writes.

This layer sits beside the allocation core (:mod:`kvmem.server.core`, pure numpy), which
knows nothing of memory: a backend *gives* the core its int32 host block table and owns
the KV tensors the clients map. The gRPC service translates :class:`HandleInfo` into the
proto ``MemoryHandle``; this module imports no proto and no gRPC.

* :class:`KVGeometry` -- the KV layout (format, layers, heads, dtype, page size) and its
  arithmetic; :func:`check_pool`, :func:`pages_for_budget` and :func:`parse_size` turn
  command-line values into a pool, refusing bad ones with a :class:`GeometryError` that
  names the option and the value.
* :class:`ShmBackend` -- the embedded default: one KV file and one block-table file in
  POSIX shared memory (``/dev/shm``), mode 0600, removed on :meth:`close`, at exit, and
  by :func:`remove_stale` at the next start after a crash.
* :class:`CudaBackend` -- one KV allocation per device (tensor-parallel ranks share one
  page-id space) and a device copy of the block table on each, shared by CUDA IPC.

Layout of one KV allocation (``num_tokens = num_pages * page_size`` token slots, slot
``page_id * page_size + offset``): mha ``[layers, 2, tokens, kv_heads, head_dim]`` (K at
index 0, V at 1), mla ``[layers, tokens, kv_lora_rank + rope_dim]``. A layer's K (or V,
or latent) is one contiguous ``[tokens, ...]`` block indexed by ``kv_loc``.
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import fcntl
import logging
import math
import mmap
import operator
import os
import re
import secrets
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_INT32_MAX = 2**31 - 1

FORMATS = ("mha", "mla")
DTYPES: tuple[str, ...] = tuple(
    name
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn")
    if isinstance(getattr(torch, name, None), torch.dtype)
)


class GeometryError(ValueError):
    """A geometry or pool size that cannot work. The message names the command-line
    option and the value (``--kv-heads must be >= 1, got 0``)."""


# ------------------------------------------------------------------------ geometry


def _as_int(value: Any, option: str) -> int:
    if isinstance(value, bool):
        raise GeometryError(f"{option} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise GeometryError(f"{option} must be an integer, got {value!r}") from None


def format_size(num_bytes: int) -> str:
    """``1610612736`` -> ``'1.50 GiB'`` (for messages)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV layout of every token slot. Fields not used by ``format`` (``kv_lora_rank``
    and ``rope_dim`` for mha; ``num_kv_heads`` and ``head_dim`` for mla) are set to 0, so
    command-line defaults of the other format do no harm.

    ``dtype`` is a torch dtype name (see :data:`DTYPES`). Construction validates every
    field and raises :class:`GeometryError` naming the option (``--layers``,
    ``--kv-heads``, ``--head-dim``, ``--kv-lora-rank``, ``--rope-dim``, ``--dtype``,
    ``--format``, ``--page-size``). All methods are O(1).
    """

    format: str
    num_layers: int
    num_kv_heads: int = 0  # mha
    head_dim: int = 0  # mha
    kv_lora_rank: int = 0  # mla
    rope_dim: int = 0  # mla
    dtype: str = "bfloat16"
    page_size: int = 16

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.format not in FORMATS:
            raise GeometryError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.dtype not in DTYPES:
            raise GeometryError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        checks = [("num_layers", "--layers", 1), ("page_size", "--page-size", 1)]
        if self.format == "mha":
            checks += [("num_kv_heads", "--kv-heads", 1), ("head_dim", "--head-dim", 1)]
            unused = ("kv_lora_rank", "rope_dim")
        else:
            checks += [("kv_lora_rank", "--kv-lora-rank", 1), ("rope_dim", "--rope-dim", 0)]
            unused = ("num_kv_heads", "head_dim")
        for field, option, lowest in checks:
            value = _as_int(getattr(self, field), option)
            if value < lowest:
                raise GeometryError(f"{option} must be >= {lowest}, got {value}")
            set_(self, field, value)
        for field in unused:
            set_(self, field, 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def token_width(self) -> int:
        """Elements per token per layer and per K or V: ``heads * head_dim`` (mha) or
        ``kv_lora_rank + rope_dim`` (mla)."""
        if self.format == "mha":
            return self.num_kv_heads * self.head_dim
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token slot over all layers (K and V for mha)."""
        kv = 2 if self.format == "mha" else 1
        return self.num_layers * kv * self.token_width * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of a KV allocation of ``num_tokens`` token slots: mha
        ``(layers, 2, tokens, kv_heads, head_dim)``, mla ``(layers, tokens, rank + rope)``."""
        if self.format == "mha":
            return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)
        return (self.num_layers, num_tokens, self.kv_lora_rank + self.rope_dim)


def max_pages_per_request(geometry: KVGeometry, max_context_len: int) -> int:
    return -(-max_context_len // geometry.page_size)


def block_table_shape(geometry: KVGeometry, max_requests: int, max_context_len: int) -> tuple[int, int]:
    """int32 ``(max_requests + 1, ceil(max_context_len / page_size))``; row 0 is padding."""
    return (max_requests + 1, max_pages_per_request(geometry, max_context_len))


def block_table_bytes(geometry: KVGeometry, max_requests: int, max_context_len: int) -> int:
    rows, cols = block_table_shape(geometry, max_requests, max_context_len)
    return rows * cols * 4


def _check_requests(max_requests: Any, max_context_len: Any) -> tuple[int, int]:
    max_requests = _as_int(max_requests, "--max-requests")
    max_context_len = _as_int(max_context_len, "--max-context")
    if max_requests < 1:
        raise GeometryError(f"--max-requests must be >= 1, got {max_requests}")
    if max_context_len < 1:
        raise GeometryError(f"--max-context must be >= 1, got {max_context_len}")
    if max_requests > _INT32_MAX - 1:
        raise GeometryError(f"--max-requests must be < {_INT32_MAX}, got {max_requests}")
    return max_requests, max_context_len


def check_pool(geometry: KVGeometry, num_pages: Any, max_requests: Any, max_context_len: Any) -> None:
    """Refuse a pool that cannot work, with a :class:`GeometryError` naming the option:
    fewer than 2 pages (page 0 is padding), token slots beyond int32 (``kv_loc`` is
    int32), no request slot, or a ``--max-context`` longer than the pool's usable
    tokens (``(num_pages - 1) * page_size``): such a request could never be served. O(1).
    """
    num_pages = _as_int(num_pages, "--num-pages")
    max_requests, max_context_len = _check_requests(max_requests, max_context_len)
    ps = geometry.page_size
    if num_pages < 2:
        raise GeometryError(f"--num-pages must be >= 2 (page 0 is padding), got {num_pages}")
    if num_pages > _INT32_MAX // ps:
        raise GeometryError(
            f"--num-pages {num_pages} with --page-size {ps} gives {num_pages * ps} token slots, "
            f"beyond int32 kv_loc; at most {_INT32_MAX // ps} pages"
        )
    pool_tokens = (num_pages - 1) * ps
    if max_context_len > pool_tokens:
        raise GeometryError(
            f"--max-context {max_context_len} exceeds the pool's {pool_tokens} tokens "
            f"({num_pages - 1} usable pages of {ps}); raise --num-pages/--memory or lower --max-context"
        )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


def parse_size(text: str | int, option: str = "--memory") -> int:
    """Bytes from ``"40GiB"``, ``"512MiB"``, ``"1.5G"``, ``"123"`` (case-insensitive).

    ``K/M/G/T``, ``Ki/Mi/Gi/Ti`` and ``KiB/MiB/GiB/TiB`` are powers of 1024 (like
    ``docker --shm-size``); ``KB/MB/GB/TB`` are powers of 1000. Fractions are rounded
    down to whole bytes. Anything else raises :class:`GeometryError` naming ``option``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise GeometryError(f"{option} must be >= 0 bytes, got {text}")
        return text
    if not isinstance(text, str):
        raise GeometryError(f"{option} must be a size such as 40GiB, 512MiB or 123, got {text!r}")
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise GeometryError(
            f"{option} must be a size such as 40GiB, 512MiB, 1.5G or 123 (bytes), got {text!r}"
        )
    number = m.group(1)
    whole, _, frac = number.partition(".")
    scale = _SIZE_UNITS[unit]
    # Exact integer arithmetic: no float rounding for large sizes.
    value = int(whole or "0") * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    return value


def pages_for_budget(
    memory_bytes: int, geometry: KVGeometry, max_requests: int, max_context_len: int
) -> int:
    """The largest ``num_pages`` (including padding page 0) whose KV bytes
    (``num_pages * page_bytes``) plus the block table's bytes (int32
    ``[max_requests + 1, ceil(max_context_len / page_size)]``) fit in ``memory_bytes``,
    capped so token slots fit in int32. With the cuda backend the budget is per device
    (each rank holds a KV allocation and a block-table copy of this size).

    Refuses (:class:`GeometryError`) a budget below 2 pages, naming ``--memory``, its
    value and the size of one page, and any pool :func:`check_pool` refuses. O(1).
    """
    memory_bytes = _as_int(memory_bytes, "--memory")
    max_requests, max_context_len = _check_requests(max_requests, max_context_len)
    table = block_table_bytes(geometry, max_requests, max_context_len)
    page = geometry.page_bytes
    num_pages = max(memory_bytes - table, 0) // page
    if num_pages < 2:
        raise GeometryError(
            f"--memory {memory_bytes} bytes ({format_size(memory_bytes)}) holds {num_pages} page(s); "
            f"at least 2 are needed (page 0 is padding). One page is {page} bytes "
            f"({format_size(page)}: --page-size {geometry.page_size} x {geometry.bytes_per_token} bytes "
            f"per token) and the block table takes {table} bytes, so at least {2 * page + table} bytes"
        )
    num_pages = min(num_pages, _INT32_MAX // geometry.page_size)
    check_pool(geometry, num_pages, max_requests, max_context_len)
    return num_pages


# ------------------------------------------------------------------------ handles


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
    """One allocation a client maps: ``name`` "kv" or "block_table", the rank (index into
    the backend's devices; 0 for shm), the element dtype name and the whole allocation's
    shape and size. Exactly one of ``shm_path`` and ``cuda`` is set."""

    name: str
    rank: int
    dtype: str
    shape: tuple[int, ...]
    size_bytes: int
    shm_path: str | None = None
    cuda: CudaIpcInfo | None = None


class MemoryBackend(abc.ABC):
    """The physical memory of one server: KV tensors per rank and the block table.

    ``block_table`` is the authoritative int32 host table ``[max_requests + 1,
    max_pages_per_request]`` to hand to :class:`kvmem.server.core.KVCore`;
    ``block_table_tensor`` is the same memory as a torch tensor.
    """

    name: str
    geometry: KVGeometry
    num_pages: int
    max_requests: int
    max_context_len: int
    block_table: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.geometry.page_size

    @property
    def max_pages_per_request(self) -> int:
        return self.block_table.shape[1]

    @property
    @abc.abstractmethod
    def num_ranks(self) -> int: ...

    @property
    @abc.abstractmethod
    def block_table_tensor(self) -> torch.Tensor: ...

    @abc.abstractmethod
    def kv(self, rank: int = 0) -> torch.Tensor:
        """The whole KV allocation of ``rank``: shape ``geometry.kv_shape(num_tokens)``."""

    @abc.abstractmethod
    def handles(self) -> list[HandleInfo]:
        """What clients need to map every allocation, for Attach. O(ranks)."""

    syncs_rows: bool  # False when sync_rows is a no-op (the engine then skips it)

    @abc.abstractmethod
    def sync_rows(self, rows: np.ndarray) -> None:
        """Make host block-table ``rows`` visible to clients before returning."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the memory. Idempotent."""

    def __enter__(self) -> MemoryBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_ranks:
            raise IndexError(f"rank {rank} out of range: the {self.name} backend has {self.num_ranks} rank(s)")


# ------------------------------------------------------------------------ shm

_ID_RE = r"(\d+-[0-9a-f]{16})"


def _file_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-{_ID_RE}(\.kv|\.bt|\.lock)$")


def _check_prefix(prefix: str) -> None:
    if not prefix or not re.fullmatch(r"[A-Za-z0-9_.]+", prefix):
        raise ValueError(f"shm file prefix must be letters, digits, '_' or '.', got {prefix!r}")


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def remove_stale(directory: str = "/dev/shm", prefix: str = "kvmem") -> list[str]:
    """Delete the shm files (``{prefix}-{pid}-{id}.kv/.bt/.lock``) of this user's kvmem
    servers that are gone, and return their paths.

    A live server holds an exclusive ``flock`` on its ``.lock`` file for its lifetime,
    so a set is removed only when its lock can be taken (the owner died, e.g. SIGKILL)
    or when its lock file is missing (a set is created lock first and removed lock
    last, so data files without a lock belong to nobody). Files of other users and
    sets whose lock is held are never touched. Cost: one directory listing plus O(1)
    syscalls per kvmem file set.
    """
    _check_prefix(prefix)
    pattern = _file_re(prefix)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    sets: dict[str, list[str]] = {}
    for name in names:
        m = pattern.match(name)
        if m:
            sets.setdefault(m.group(1), []).append(name)
    uid = os.getuid()
    removed: list[str] = []
    for server_id, files in sets.items():
        lock_path = os.path.join(directory, f"{prefix}-{server_id}.lock")
        try:
            fd: int | None = os.open(lock_path, os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = None  # data files without a lock: an abandoned set
        except OSError:
            continue  # not ours (permission) or not a regular file: leave it
        try:
            if fd is not None:
                if os.fstat(fd).st_uid != uid:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live server holds it
            # Data files first, the lock last (the order a set is created in reverse).
            for name in sorted(files, key=lambda n: n.endswith(".lock")):
                path = os.path.join(directory, name)
                try:
                    if os.lstat(path).st_uid != uid:
                        continue
                except FileNotFoundError:
                    continue
                if _unlink_quietly(path):
                    removed.append(path)
        finally:
            if fd is not None:
                os.close(fd)
    if removed:
        log.warning("removed %d stale kvmem shm file(s) in %s: %s", len(removed), directory, removed)
    return removed


def _close_shm_files(paths: tuple[str, ...], lock_fd: int, owner_pid: int) -> None:
    """Finalizer of a :class:`ShmBackend`: unlink its files (lock last), drop the lock.
    Only in the process that created them: a forked child exiting normally runs exit
    hooks too, and must not remove the live server's files."""
    if os.getpid() != owner_pid:
        return
    for path in paths:
        _unlink_quietly(path)
    try:
        os.close(lock_fd)
    except OSError:
        pass


def _create_file(path: str, size: int, reserve: bool) -> int:
    """Create ``path`` (mode 0600, must not exist) of ``size`` bytes and return its fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask did
        if reserve:
            os.posix_fallocate(fd, 0, size)
        else:
            os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise
    return fd


def _map_fd(fd: int, size: int) -> mmap.mmap:
    # The mapping lives as long as a tensor over it; it is never closed explicitly
    # (mmap.close() under a live torch.frombuffer tensor would leave it dangling).
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class ShmBackend(MemoryBackend):
    """The KV cache and the block table in POSIX shared memory (the embedded default).

    Files in ``directory``: ``{prefix}-{pid}-{random}.kv`` (the KV cache, one file for
    all layers), ``.bt`` (the int32 block table) and ``.lock`` (held with an exclusive
    ``flock`` for the backend's life; see :func:`remove_stale`, which the constructor
    runs first). All are mode 0600, so only the server's user can map them.

    Costs: construction is O(1) Python work -- ``posix_fallocate`` (``reserve=True``)
    has the kernel reserve and zero the pages up front (about 0.4 s per GiB on tmpfs),
    so a too-small or later-filled ``/dev/shm`` fails here with a clear error instead of
    as a SIGBUS in a client later; ``reserve=False`` only checks the free space and
    uses ``ftruncate`` (sparse, instant, zero pages on first touch: cheaper, but the pages
    are not promised). Mapping is one ``mmap`` per file.

    :meth:`close` unlinks the files; it also runs when the backend is garbage collected
    and at interpreter exit (``weakref.finalize``). A SIGTERM handler must call
    :meth:`close` (Python does not run exit hooks on an unhandled signal); after a
    SIGKILL the next start removes the files. Mapped memory stays valid for anyone who
    still maps it after the files are unlinked.
    """

    name = "shm"
    syncs_rows = False  # clients map the host table itself

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        max_requests: int,
        max_context_len: int,
        directory: str = "/dev/shm",
        prefix: str = "kvmem",
        *,
        reserve: bool = True,
    ) -> None:
        check_pool(geometry, num_pages, max_requests, max_context_len)
        _check_prefix(prefix)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"shm directory {directory!r} does not exist")
        self.geometry = geometry
        self.num_pages = int(num_pages)
        self.max_requests = int(max_requests)
        self.max_context_len = int(max_context_len)
        self.directory = directory
        remove_stale(directory, prefix)

        kv_shape = geometry.kv_shape(self.num_tokens)
        bt_shape = block_table_shape(geometry, self.max_requests, self.max_context_len)
        kv_bytes = math.prod(kv_shape) * geometry.itemsize
        bt_bytes = math.prod(bt_shape) * 4
        self._needed = kv_bytes + bt_bytes
        # Checked in both modes: refused before fallocate, which on a file system without
        # native support would write its way to ENOSPC.
        self._check_space(self._needed)

        lock_fd, base = self._create_lock(directory, prefix)
        self.server_id = os.path.basename(base)[len(prefix) + 1 :]
        self.kv_path = base + ".kv"
        self.block_table_path = base + ".bt"
        self.lock_path = base + ".lock"
        # Unlinked in this order: data first, the lock last (see remove_stale).
        self._finalizer = weakref.finalize(
            self, _close_shm_files, (self.kv_path, self.block_table_path, self.lock_path), lock_fd, os.getpid()
        )
        try:
            kv_map = self._create_and_map(self.kv_path, kv_bytes, reserve)
            bt_map = self._create_and_map(self.block_table_path, bt_bytes, reserve)
        except BaseException:
            self._finalizer()
            raise
        self._kv: torch.Tensor | None = (
            torch.frombuffer(kv_map, dtype=torch.uint8).view(geometry.torch_dtype).view(kv_shape)
        )
        self.block_table = np.frombuffer(bt_map, dtype=np.int32).reshape(bt_shape)
        self._bt_tensor: torch.Tensor | None = torch.from_numpy(self.block_table)
        self._kv_bytes = kv_bytes
        self._bt_bytes = bt_bytes
        log.info(
            "shm backend: %s KV (%d pages of %d tokens) in %s, block table %s",
            format_size(kv_bytes), self.num_pages, geometry.page_size, self.kv_path, bt_shape,
        )

    # -- construction helpers

    def _check_space(self, needed: int) -> None:
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if needed > free:
            raise GeometryError(self._space_message(needed, free))

    def _space_message(self, needed: int, free: int) -> str:
        return (
            f"the shm pool needs {needed} bytes ({format_size(needed)}) but {self.directory} has "
            f"{free} bytes ({format_size(free)}) free: lower --num-pages/--memory or enlarge "
            f"{self.directory} (docker run --shm-size)"
        )

    def _create_and_map(self, path: str, size: int, reserve: bool) -> mmap.mmap:
        try:
            fd = _create_file(path, size, reserve)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                st = os.statvfs(self.directory)
                raise GeometryError(self._space_message(self._needed, st.f_bavail * st.f_frsize)) from None
            raise
        try:
            return _map_fd(fd, size)
        finally:
            os.close(fd)

    @staticmethod
    def _create_lock(directory: str, prefix: str) -> tuple[int, str]:
        """Create and flock a fresh lock file. A concurrent :func:`remove_stale` may take
        and delete a lock between its creation and our flock; then try another name."""
        for _ in range(8):
            base = os.path.join(directory, f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}")
            try:
                fd = os.open(base + ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            except FileExistsError:
                continue
            try:
                os.fchmod(fd, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.fstat(fd).st_nlink > 0:
                    return fd, base
            except BlockingIOError:
                pass
            os.close(fd)
        raise RuntimeError(f"could not create a kvmem lock file in {directory}")

    # -- interface

    @property
    def num_ranks(self) -> int:
        return 1

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def block_table_tensor(self) -> torch.Tensor:
        if self._bt_tensor is None:
            raise RuntimeError("the shm backend is closed")
        return self._bt_tensor

    def kv(self, rank: int = 0) -> torch.Tensor:
        """The whole KV cache (one mapping). O(1)."""
        self._check_rank(rank)
        if self._kv is None:
            raise RuntimeError("the shm backend is closed")
        return self._kv

    def handles(self) -> list[HandleInfo]:
        """The KV file and the block-table file (rank 0). O(1)."""
        if self.closed:
            raise RuntimeError("the shm backend is closed")
        g = self.geometry
        return [
            HandleInfo("kv", 0, g.dtype, tuple(self._kv.shape), self._kv_bytes, shm_path=self.kv_path),
            HandleInfo(
                "block_table", 0, "int32", tuple(self.block_table.shape), self._bt_bytes,
                shm_path=self.block_table_path,
            ),
        ]

    def sync_rows(self, rows: np.ndarray) -> None:
        """No-op: clients map the host table itself. (The gRPC round trip after the core
        writes the rows orders the stores before the client reads them.)"""

    def close(self) -> None:
        """Unlink the files and drop this backend's mappings (they are unmapped once no
        tensor view of them is left). Idempotent. O(1)."""
        self._finalizer()
        self._kv = None
        self._bt_tensor = None


# ------------------------------------------------------------------------ cuda


def device_uuid(index: int) -> str:
    """The UUID of local CUDA device ``index`` as torch prints it
    (``xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``; ``nvidia-smi -L`` adds ``GPU-``)."""
    return str(torch.cuda.get_device_properties(index).uuid)


class CudaBackend(MemoryBackend):
    """KV tensors on GPUs, shared by CUDA IPC: one KV allocation per device in
    ``devices`` (tensor-parallel rank ``r`` is ``devices[r]``; all ranks share one page-id
    space, so a token slot means the same thing on every rank), plus a device copy of
    the block table on each device. The authoritative table is a pinned host tensor,
    ``block_table`` its numpy view; :meth:`sync_rows` pushes changed rows to the devices.

    Handles are created once, at construction (``UntypedStorage._share_cuda_()``), and
    the same ones go to every client: torch's per-share reference counting and IPC
    event are meaningless for memory that lives as long as the server.

    Costs: construction allocates and zeroes ``num_pages * page_bytes`` per device
    (memory bandwidth, milliseconds per GiB). :meth:`sync_rows` is O(rows * columns)
    bytes of host-to-device copies per device plus one stream synchronisation each
    (tens of microseconds).
    """

    name = "cuda"
    syncs_rows = True  # device copies follow the host table

    def __init__(
        self,
        geometry: KVGeometry,
        num_pages: int,
        max_requests: int,
        max_context_len: int,
        devices: Sequence[int] = (0,),
    ) -> None:
        check_pool(geometry, num_pages, max_requests, max_context_len)
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the cuda memory backend needs a CUDA device, but torch.cuda.is_available() is "
                "False (torch build " + torch.__version__ + "); use the shm backend"
            )
        devices = [_as_int(d, "--devices") for d in devices]
        count = torch.cuda.device_count()
        if not devices:
            raise GeometryError("--devices must name at least one CUDA device, got none")
        if len(set(devices)) != len(devices):
            raise GeometryError(f"--devices must not repeat a device, got {devices}")
        bad = [d for d in devices if not 0 <= d < count]
        if bad:
            raise GeometryError(f"--devices {devices}: no CUDA device {bad[0]} ({count} visible)")
        self.geometry = geometry
        self.num_pages = int(num_pages)
        self.max_requests = int(max_requests)
        self.max_context_len = int(max_context_len)
        self.devices = devices
        kv_shape = geometry.kv_shape(self.num_tokens)
        bt_shape = block_table_shape(geometry, self.max_requests, self.max_context_len)
        self._kv_bytes = math.prod(kv_shape) * geometry.itemsize
        self._bt_bytes = math.prod(bt_shape) * 4
        needed = self._kv_bytes + 3 * self._bt_bytes  # KV, table, staging rows
        for d in devices:
            free, _total = torch.cuda.mem_get_info(d)
            if needed > free:
                raise GeometryError(
                    f"the pool needs {needed} bytes ({format_size(needed)}) on cuda:{d} but it has "
                    f"{free} bytes ({format_size(free)}) free: lower --num-pages/--memory"
                )

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
        for d in devices:
            dev = torch.device("cuda", d)
            with torch.cuda.device(dev):
                # The table first: it is small, so it shares a caching-allocator segment
                # (mapped whole by clients) with the staging buffers only.
                self._bt_dev.append(torch.zeros(bt_shape, dtype=torch.int32, device=dev))
                self._idx_dev.append(torch.zeros(rows, dtype=torch.int64, device=dev))
                self._rows_dev.append(torch.zeros(bt_shape, dtype=torch.int32, device=dev))
                self._kv_dev.append(torch.zeros(kv_shape, dtype=geometry.torch_dtype, device=dev))
                self._streams.append(torch.cuda.Stream(device=dev))
        for d in devices:
            torch.cuda.synchronize(d)
        self._handles = [
            self._share(t, name, rank, dtype)
            for rank in range(len(devices))
            for t, name, dtype in (
                (self._kv_dev[rank], "kv", geometry.dtype),
                (self._bt_dev[rank], "block_table", "int32"),
            )
        ]
        self._closed = False
        log.info(
            "cuda backend: %s KV (%d pages of %d tokens) on each of cuda:%s, block table %s",
            format_size(self._kv_bytes), self.num_pages, geometry.page_size, devices, bt_shape,
        )

    def _share(self, tensor: torch.Tensor, name: str, rank: int, dtype: str) -> HandleInfo:
        assert tensor.is_contiguous() and tensor.storage_offset() == 0
        (
            device, ipc_handle, size_bytes, offset_bytes,
            ref_counter, ref_offset, event_handle, event_sync,
        ) = tensor.untyped_storage()._share_cuda_()  # fmt: skip
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
        """The authoritative host table (pinned; same memory as ``block_table``)."""
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
        """Per rank: its KV allocation, then its device block table. O(ranks)."""
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
        self._kv_dev.clear()
        self._bt_dev.clear()
        self._idx_dev.clear()
        self._rows_dev.clear()
        self._streams.clear()
