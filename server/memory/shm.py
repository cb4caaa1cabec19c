"""The shm backend: the KV cache and the block table in POSIX shared memory
(``/dev/shm``), the embedded default, and :func:`remove_stale`, which removes the files
of servers that died.

No torch: the server never computes on the KV bytes, so it sizes them from the dtype's
name (:attr:`KVGeometry.itemsize`) and holds them as a flat numpy ``uint8`` view of the
mapping; clients map the same file as torch tensors of the KV dtype. Only :meth:`ShmBackend.kv`
(for tests and in-process users) imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import re
import secrets
import weakref
from typing import TYPE_CHECKING

import numpy as np

from kvmem.server.memory.base import HandleInfo, MemoryBackend, log
from kvmem.server.memory.geometry import GeometryError, MemoryUnavailable, PoolSpec, format_size

if TYPE_CHECKING:
    import torch

_ID_RE = r"(\d+-[0-9a-f]{16})"


def _file_re(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"^{re.escape(prefix)}-{_ID_RE}(\.kv|\.bt|\.st|\.sl|\.lc|\.lock)$")


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
        if server_id.startswith(KEPT_PID):  # a kept state (--keep-state): only --discard-state removes it
            continue
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


KEPT_PID = "0-"  # the "pid" part of a kept state's file names: ``{prefix}-0-{key}.*``


def kept_key(*addresses: str | None) -> str:
    """The 16 hex digits naming the kept state of a server listening at ``addresses``."""
    return hashlib.sha256("|".join(a or "" for a in addresses).encode()).hexdigest()[:16]


def _close_shm_files(paths: tuple[str, ...], lock_fd: int, owner_pid: int, keep: bool = False) -> None:
    """Finalizer of a :class:`ShmBackend`: unlink its files (lock last; none when they
    are a kept state), drop the lock. Only in the process that created them: a forked
    child exiting normally runs exit hooks too, and must not remove the live server's
    files."""
    if os.getpid() != owner_pid:
        return
    for path in () if keep else paths:
        _unlink_quietly(path)
    with contextlib.suppress(OSError):
        os.close(lock_fd)


def _create_file(path: str, size: int, reserve: bool, mode: int = 0o600, gid: int | None = None) -> int:
    """Create ``path`` (``mode``, must not exist; group ``gid`` when given) of ``size``
    bytes and return its fd."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)  # whatever the umask did
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
    # The mapping lives as long as an array over it; it is never closed explicitly
    # (mmap refuses to close while a numpy view exports its buffer, and a torch tensor
    # over that view would be left dangling if it could).
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class ShmBackend(MemoryBackend):
    """The KV cache and the block table in POSIX shared memory (the embedded default).

    Files in ``directory``: ``{prefix}-{pid}-{random}.kv`` (the KV cache, one file for
    all layers), ``.bt`` (the int32 block table) and ``.lock`` (held with an exclusive
    ``flock`` for the backend's life; see :func:`remove_stale`, which the constructor
    runs first). All are mode 0600, so only the server's user can map them; ``mode``
    0660 and ``gid`` give the KV and block-table files to a group as well (the lock
    file stays 0600: clients never open it).

    ``pool`` is a :class:`PoolSpec`, validated when it was built; it is not checked again.

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
        pool: PoolSpec,
        directory: str = "/dev/shm",
        prefix: str = "kvmem",
        *,
        reserve: bool = True,
        mode: int = 0o600,
        gid: int | None = None,
        keep: str | None = None,
        discard: bool = False,
        state_bytes: int = 0,
        log_bytes: int = 0,
        load_counters: bool = False,
        host_bytes: int = 0,
    ) -> None:
        _check_prefix(prefix)
        if mode & ~0o660 or mode & 0o600 != 0o600:
            raise ValueError(f"shm file mode must be 0600 or 0660, got {mode:04o}")
        self._mode, self._gid = mode, gid
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"shm directory {directory!r} does not exist")
        super().__init__(pool)
        self.directory = directory
        remove_stale(directory, prefix)

        kv_bytes, bt_bytes = pool.kv_bytes, pool.block_table_bytes
        # --host-memory: the host tier's load counters, int32 per page after the table (see
        # kvmem.server.memory.host): in the file clients map already.
        counter_bytes = 4 * pool.num_pages if load_counters else 0
        self._needed = kv_bytes + bt_bytes + counter_bytes + state_bytes + host_bytes
        lock_fd, base = (
            self._create_lock(directory, prefix) if keep is None else self._kept_lock(directory, prefix, keep)
        )
        self.server_id = os.path.basename(base)[len(prefix) + 1 :]
        self.kv_path = base + ".kv"
        self.block_table_path = base + ".bt"
        self.lock_path = base + ".lock"
        self.state_path = base + ".st" if keep is not None else None
        # The step log (kvmem.server.steplog), beside the state: sparse, never reserved (a
        # region per session, mostly untouched).
        self.log_path = base + ".sl" if keep is not None and log_bytes > 0 else None
        # The host tier's pages (--host-memory with --keep-state): kept beside the pool.
        self.host_path = base + ".ht" if keep is not None and host_bytes > 0 else None
        sizes = {self.kv_path: kv_bytes, self.block_table_path: bt_bytes + counter_bytes}
        if self.state_path is not None:
            sizes[self.state_path] = state_bytes
        if self.log_path is not None:
            sizes[self.log_path] = log_bytes
        if self.host_path is not None:
            sizes[self.host_path] = host_bytes
        # Unlinked in this order: data first, the lock last (see remove_stale); a kept state never.
        self._finalizer = weakref.finalize(
            self, _close_shm_files, (*sizes, self.lock_path), lock_fd, os.getpid(), keep is not None
        )
        try:
            self.reopened = keep is not None and not discard and self._kept_files(sizes)
            if not self.reopened:
                for path in sizes:  # a kept state discarded, or one half created before a crash
                    if _unlink_quietly(path) and discard:
                        log.warning("--discard-state: removed the kept %s", path)
                # Checked in both modes: refused before fallocate, which on a file system without
                # native support would write its way to ENOSPC.
                self._check_space(self._needed)
            maps: dict[str, mmap.mmap] = {}
            for path, size in sizes.items():
                if self.reopened:
                    maps[path] = self._map_existing(path, size)
                else:
                    # Never reserved: the step log (mostly untouched) and the host tier (touched as
                    # pages are demoted; --host-memory's size was checked against the host).
                    sparse = path in (self.log_path, self.host_path)
                    maps[path] = self._create_and_map(path, size, reserve and not sparse)
        except BaseException:
            self._finalizer()
            raise
        kv_map, bt_map = maps[self.kv_path], maps[self.block_table_path]
        # The state image's mapping (--keep-state): the core keeps its state there.
        self.state: mmap.mmap | None = None if self.state_path is None else maps[self.state_path]
        self.step_log: mmap.mmap | None = None if self.log_path is None else maps[self.log_path]
        # The host tier's pages, flat bytes (None: not kept, the tier has memory of its own).
        self.host_raw: np.ndarray | None = (
            None if self.host_path is None else np.frombuffer(maps[self.host_path], dtype=np.uint8)
        )
        # The KV bytes, flat (the server sizes them but never reads them); this array and
        # block_table keep the two mappings alive. None once closed.
        self._kv_raw: np.ndarray | None = np.frombuffer(kv_map, dtype=np.uint8)
        self._kv: torch.Tensor | None = None  # kv()'s torch view of _kv_raw, built on first use
        self.block_table = np.frombuffer(bt_map, dtype=np.int32, count=bt_bytes // 4).reshape(pool.block_table_shape)
        # None without a host tier.
        self.load_counters: np.ndarray | None = (
            np.frombuffer(bt_map, dtype=np.int32, count=pool.num_pages, offset=bt_bytes) if load_counters else None
        )
        self._kv_bytes = kv_bytes
        self._bt_bytes = bt_bytes
        self._log_created(f"in {self.kv_path}")

    # -- construction helpers

    def _check_space(self, needed: int) -> None:
        """GeometryError if the pool can never fit the directory's filesystem;
        MemoryUnavailable if it fits but not in what is free now."""
        st = os.statvfs(self.directory)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        if needed > total:
            raise GeometryError(self._space_message(needed, free) + f" (it holds {format_size(total)} in all)")
        if needed > free:
            raise MemoryUnavailable(self._space_message(needed, free), needed, free)

    def _space_message(self, needed: int, free: int) -> str:
        return (
            f"the shm pool needs {needed} bytes ({format_size(needed)}) but {self.directory} has "
            f"{free} bytes ({format_size(free)}) free: lower --num-pages/--memory or enlarge "
            f"{self.directory} (docker run --shm-size)"
        )

    def _create_and_map(self, path: str, size: int, reserve: bool) -> mmap.mmap:
        try:
            fd = _create_file(path, size, reserve, self._mode, self._gid)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG):
                free = os.statvfs(self.directory).f_bavail * os.statvfs(self.directory).f_frsize
                raise MemoryUnavailable(self._space_message(self._needed, free), self._needed, free) from None
            raise
        try:
            return _map_fd(fd, size)
        finally:
            os.close(fd)

    @staticmethod
    def _kept_lock(directory: str, prefix: str, key: str) -> tuple[int, str]:
        """The lock of the kept state ``key``: taken, or refused while a running server
        holds it (a live server's state is never restored)."""
        base = os.path.join(directory, f"{prefix}-{KEPT_PID}{key}")
        fd = os.open(base + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.fchmod(fd, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(
                f"the kept state {base}.* is in use by a running kvmem server: stop it first (one server per state)"
            ) from None
        return fd, base

    def _kept_files(self, sizes: dict[str, int]) -> bool:
        """Whether a whole kept state is there to restore. A file of another size than
        this pool's is refused (another geometry), naming both sizes."""
        have = {path: os.stat(path).st_size for path in sizes if os.path.exists(path)}
        if len(have) < len(sizes):
            return False
        differ = [f"{os.path.basename(p)} {have[p]} bytes (this pool's {n})" for p, n in sizes.items() if have[p] != n]
        if differ:
            raise GeometryError(
                f"the kept state does not fit this pool: {', '.join(differ)}; start it with the geometry it was "
                f"kept with, or with --discard-state to drop it"
            )
        return True

    @staticmethod
    def _map_existing(path: str, size: int) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
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

    def kv_raw(self, rank: int = 0) -> np.ndarray:
        """The whole KV cache as flat ``uint8`` bytes (``pool.kv_bytes`` of them) over the
        one mapping: no torch, whatever the dtype (bfloat16 and float8 have no numpy
        dtype). O(1)."""
        self._check_rank(rank)
        if self._kv_raw is None:
            raise RuntimeError("the shm backend is closed")
        return self._kv_raw

    def kv(self, rank: int = 0) -> torch.Tensor:
        """The whole KV cache as a torch tensor of the KV dtype, shape ``pool.kv_shape``,
        over the same mapping as :meth:`kv_raw` (what a client maps). Imports torch on
        first use; the server never calls it. O(1)."""
        raw = self.kv_raw(rank)
        if self._kv is None:
            import torch  # only here: the backend itself needs no torch

            self._kv = torch.from_numpy(raw).view(self.geometry.torch_dtype).view(self.pool.kv_shape)
        return self._kv

    def handles(self) -> list[HandleInfo]:
        """The KV file and the block-table file (rank 0), and the load counters in the
        latter when there are any. O(1)."""
        if self.closed or self._kv_raw is None:
            raise RuntimeError("the shm backend is closed")
        g = self.geometry
        counters = self.load_counters
        extra = (
            []
            if counters is None
            else [
                HandleInfo(
                    "load_counters",
                    0,
                    "int32",
                    (self.num_pages,),
                    counters.nbytes,
                    shm_path=self.block_table_path,
                    offset_bytes=self._bt_bytes,
                )
            ]
        )
        return [
            HandleInfo("kv", 0, g.dtype, self.pool.kv_shape, self._kv_bytes, shm_path=self.kv_path),
            HandleInfo(
                "block_table",
                0,
                "int32",
                tuple(self.block_table.shape),
                self._bt_bytes,
                shm_path=self.block_table_path,
            ),
            *extra,
        ]

    def sync_rows(self, rows: np.ndarray) -> None:
        """No-op: clients map the host table itself. (The gRPC round trip after the core
        writes the rows orders the stores before the client reads them.)"""

    def close(self) -> None:
        """Unlink the files and drop this backend's mappings (they are unmapped once no
        array or tensor view of them is left). Idempotent. O(1)."""
        self._finalizer()
        self._kv_raw = None
        self._kv = None
        self.load_counters = None
        self.host_raw = None


class CounterFile:
    """The host tier's load counters of a CUDA pool (``--device cuda:N --host-memory``):
    int32 per device page in a small shared-memory file clients map, ``{prefix}-{pid}-
    {random}.lc`` beside its ``.lock`` in ``directory`` (the shm backend has them in its
    block-table file instead). Mode and group as the shm backend's files; unlinked by
    :meth:`close`, at exit, or by the next server's :func:`remove_stale` after a SIGKILL.
    O(1) to create: ``4 * num_pages`` bytes."""

    def __init__(
        self,
        num_pages: int,
        directory: str = "/dev/shm",
        prefix: str = "kvmem",
        mode: int = 0o600,
        gid: int | None = None,
    ) -> None:
        _check_prefix(prefix)
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"shm directory {directory!r} does not exist")
        remove_stale(directory, prefix)
        lock_fd, base = ShmBackend._create_lock(directory, prefix)
        self.path = base + ".lc"
        self._finalizer = weakref.finalize(self, _close_shm_files, (self.path, base + ".lock"), lock_fd, os.getpid())
        try:
            fd = _create_file(self.path, 4 * num_pages, True, mode, gid)
            try:
                self.counters: np.ndarray | None = np.frombuffer(_map_fd(fd, 4 * num_pages), dtype=np.int32)
            finally:
                os.close(fd)
        except BaseException:
            self._finalizer()
            raise
        self.num_pages = num_pages

    def handle(self) -> HandleInfo:
        """The ``"load_counters"`` handle (shm, rank 0) clients map."""
        return HandleInfo("load_counters", 0, "int32", (self.num_pages,), 4 * self.num_pages, shm_path=self.path)

    def close(self) -> None:
        """Unlink the file (a client's mapping stays valid). Idempotent."""
        self._finalizer()
        self.counters = None
