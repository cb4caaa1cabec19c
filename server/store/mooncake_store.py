"""Mooncake Store as kvmem's store, over Mooncake's own Python client
(``mooncake.store.MooncakeDistributedStore``: ``pip install 'kvmem[mooncake-cpu]'`` for the
CPU/TCP wheel; a GPU node installs Mooncake's CUDA wheel instead).

``mooncake://MASTER:PORT?protocol=tcp&metadata=P2PHANDSHAKE&local_hostname=HOST&segment=0&local_buffer=64MB&rdma_devices=``

* ``MASTER:PORT``: the master's RPC address (``mooncake_master --rpc_port``); there is no
  default port;
* ``protocol``: ``tcp`` (default) or ``rdma`` (then ``rdma_devices``, e.g. ``mlx5_0``);
* ``metadata``: the transfer engine's metadata service (default ``P2PHANDSHAKE``: the
  peers tell each other, no separate service);
* ``local_hostname``: the address this node's peers reach it at (they connect to it to
  move the bytes); 127.0.0.1 by default only when the master is on 127.0.0.1/localhost,
  required otherwise;
* ``segment``: memory kvmem's own process contributes to the store (default 0: none; the
  store's memory is held by other processes, e.g. ``mooncake_client
  --global_segment_size``, or other nodes' segments). A segment lives as long as the
  process that mounted it: kvmem's goes when kvmem stops;
* ``local_buffer``: the client's staging buffer, used where a value's parts do not lie
  in registered memory (default 64MB). Sizes: ``64MB``, ``1GiB``, bytes.

**Zero copy.** :meth:`MooncakeStore.register` registers memory (the host tier's pages,
kvmem's header buffers) with the transfer engine; a value whose every part lies in it is
put with ``batch_put_from_multi_buffers`` and read with
``batch_get_into_multi_buffers``, straight from and into those parts. Any other value is
joined and put with ``put_batch``, or read with ``get_batch`` and copied.

**Codes.** Mooncake answers per key with a byte count or a negative ``ErrorCode``:
``OBJECT_NOT_FOUND`` (-704) is a miss; a put of a key the store holds keeps the first
value (the client answers 0; ``OBJECT_ALREADY_EXISTS``, -705, is taken as stored too);
``RPC_FAIL`` (-900), ``RPC_TIMEOUT`` (-901) and the like for every key of a batch is the
store unreachable (:class:`StoreError`); a full store answers ``NO_AVAILABLE_HANDLE``
(-200) per key (not stored: Mooncake evicts in the background, not to make room for a
put). A value whose size differs from its parts' total fails the transfer (-600 when it
is larger, -800 when smaller); its size is then asked for (``get_size``) and reported, and
nothing copied is trusted.

**Time.** Mooncake's Python calls take no timeout, but its client bounds each RPC to
the master by ``MC_RPC_TIMEOUT_MS``, read when a client is set up: :meth:`connect` sets it
to ``timeout_s`` for its setup, so a call to a master that hangs answers ``RPC_TIMEOUT``
(-901) after ``timeout_s``. A master that is *gone* (connection refused) is not bounded so:
a put or an exists then takes Mooncake's own reconnect time, about 4.3 s on a 2-core
machine (a read into registered memory fails at once); the caller's store thread bounds
that, abandoning a call past ``--store-timeout-ms``. :meth:`connect` against a master that is
down retries ``MC_STORE_CLIENT_SETUP_RETRIES`` times, about 4.5 s each (Mooncake's default,
20, is 90 s): 1 here unless the environment names it, since the caller reconnects with
backoff anyway. Both variables are set only around the setup call and restored after it.
Never touch a client after ``close()`` (Mooncake crashes the process): this adapter drops
its client on close, and a call after it is a :class:`StoreError`; nor close a client while
another thread is in a call on it.
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
from collections.abc import Callable, Sequence

import numpy as np

from kvmem.server.memory.geometry import GeometryError, parse_size
from kvmem.server.store.base import (
    SCHEMES,
    Parts,
    Store,
    StoreError,
    StoreURL,
    StoreURLError,
    scatter,
    total_bytes,
)

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as exc:  # the wheel, or a system library it loads (libibverbs1, libnuma1, libcurl4)
    raise ImportError(
        f"mooncake:// needs Mooncake Store's Python client ({exc}): pip install 'kvmem[mooncake-cpu]' (the "
        "CPU/TCP wheel; on Debian it also needs libibverbs1, libnuma1 and libcurl4), or Mooncake's CUDA wheel "
        "on a GPU node"
    ) from exc

log = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
# Mooncake's ErrorCode names (mooncake-store/include/types.h) for the codes a message may show.
CODE_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
# Codes that say the store (its master) could not be asked at all, not that a key failed;
# every key of a batch answering one of these is the batch failing.
UNREACHABLE = frozenset({-1, -601, -900, -901, -1000, -1001, -1002, -1003, -1010, -1011})
SETUP_RETRIES_ENV = "MC_STORE_CLIENT_SETUP_RETRIES"
RPC_TIMEOUT_ENV = "MC_RPC_TIMEOUT_MS"
PROTOCOLS = ("tcp", "rdma")
PARAMETERS = ("protocol", "metadata", "local_hostname", "segment", "local_buffer", "rdma_devices")
LOOPBACK = ("127.0.0.1", "localhost")


def code_name(code: int) -> str:
    """``-704 (OBJECT_NOT_FOUND)``."""
    return f"{code} ({CODE_NAMES.get(code, 'unknown')})"


class MooncakeStore(Store):
    """Mooncake Store through one ``MooncakeDistributedStore`` client (see the module)."""

    name = "mooncake"

    def __init__(self, url: StoreURL, password: str | None, timeout_s: float) -> None:
        super().__init__(url, password, timeout_s)
        where = f"--store {url.redacted()!r}"
        if len(url.hosts) != 1:
            raise StoreURLError(f"{where}: mooncake:// names one master, got {len(url.hosts)}")
        if url.path.strip("/"):
            raise StoreURLError(f"{where}: a mooncake:// URL has no path, got {url.path!r}")
        if url.username is not None or password is not None:
            raise StoreURLError(
                f"{where}: Mooncake Store has no users or passwords; drop the user name, "
                "--store-password-file and KVMEM_STORE_PASSWORD (a network only the cluster reaches is its protection)"
            )
        unknown = sorted(set(url.query) - set(PARAMETERS))
        if unknown:
            raise StoreURLError(f"{where}: unknown query parameter(s) {unknown}; known: {', '.join(PARAMETERS)}")
        q = url.query
        master_host, master_port = url.hosts[0]
        self.master = f"{master_host}:{master_port}"
        self.protocol = q.get("protocol", "tcp").lower()
        if self.protocol not in PROTOCOLS:
            raise StoreURLError(f"{where}: protocol={q['protocol']!r}; choose one of {', '.join(PROTOCOLS)}")
        self.metadata = q.get("metadata", "P2PHANDSHAKE")
        if not self.metadata:
            raise StoreURLError(f"{where}: metadata= is empty; P2PHANDSHAKE needs no metadata service")
        hostname = q.get("local_hostname")
        if not hostname:
            if master_host not in LOOPBACK:
                raise StoreURLError(
                    f"{where}: local_hostname= is required when the master ({master_host}) is not on this "
                    "machine: the other nodes connect to that address to read and write this node's bytes"
                )
            hostname = "127.0.0.1"
        self.local_hostname = hostname
        self.segment = _size(q, "segment", 0, where)
        self.local_buffer = _size(q, "local_buffer", 64 * 1000**2, where)
        self.rdma_devices = q.get("rdma_devices", "")
        self._client: MooncakeDistributedStore | None = None
        self._buffers: dict[tuple[int, int], np.ndarray] = {}  # (address, bytes) -> the array, kept alive
        self._starts: list[int] = []  # the ranges registered with this client, sorted by start
        self._ends: list[int] = []

    # connection and registered memory

    def connect(self) -> None:
        """Set the client up once; a reconnect after a failure asks the master about one
        key instead. Mooncake's ``setup`` and ``close`` hold Python's interpreter lock
        while they wait for the master (4.4 s and 0.8 s measured with the master down),
        which would stop the server's event loop, while its client recovers on its own
        once the master answers again (its data gone if the master restarted). Before
        the first ``setup``, a TCP connect to the master, bounded by the timeout, fails
        fast on a master that is not there."""
        if self._client is not None:
            self.exists(["kvmem/ping"])  # StoreError while the master does not answer
            return
        host, port = self.master.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=self.timeout_s).close()
        except OSError as exc:
            raise StoreError(
                f"{self.describe()}: connect failed: no master answering at {self.master} ({exc})"
            ) from None
        client = MooncakeDistributedStore()
        settings = {
            RPC_TIMEOUT_ENV: str(max(1, round(self.timeout_s * 1000))),
            SETUP_RETRIES_ENV: os.environ.get(SETUP_RETRIES_ENV, "1"),
        }
        saved = {name: os.environ.get(name) for name in settings}
        os.environ.update(settings)  # Mooncake reads them in setup, for this client
        try:
            code = client.setup(
                self.local_hostname,
                self.metadata,
                self.segment,
                self.local_buffer,
                self.protocol,
                self.rdma_devices,
                self.master,
            )
        finally:
            for name, before in saved.items():
                if before is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = before
        if code != 0:
            raise StoreError(
                f"{self.describe()}: connect failed: setup answered {code} (no master answering at {self.master}, "
                f"or local_hostname={self.local_hostname!r} / protocol={self.protocol!r} unusable here)"
            )
        self._client = client
        self._starts, self._ends = [], []
        self._register_kept()

    def register(self, buffers: Sequence[np.ndarray]) -> None:
        """Register each buffer (a contiguous array that outlives the store) with the
        transfer engine, keeping it for the next :meth:`connect`, which registers the
        kept ones again. Calling it again with the same buffers is harmless; a buffer
        Mooncake refuses (e.g. one that overlaps another) is logged and its parts take
        the copying path."""
        for buf in buffers:
            if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
                raise ValueError(f"{self.describe()}: register takes contiguous numpy arrays, got {type(buf).__name__}")
            if buf.nbytes:
                self._buffers[(int(buf.ctypes.data), int(buf.nbytes))] = buf
        if self._client is not None:
            self._register_kept()

    def _register_kept(self) -> None:
        client = self._client
        assert client is not None
        for address, nbytes in sorted(self._buffers):
            if self._inside(address, nbytes):
                continue  # registered already (this buffer, or one holding it)
            code = client.register_buffer(address, nbytes)
            if code != 0:
                log.warning(
                    "store: %s refused to register %d bytes at %#x: %s; values there are copied",
                    self.describe(),
                    nbytes,
                    address,
                    code_name(code),
                )
                continue
            i = bisect.bisect(self._starts, address)
            self._starts.insert(i, address)
            self._ends.insert(i, address + nbytes)

    def _inside(self, address: int, nbytes: int) -> bool:
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + nbytes <= self._ends[i]

    def zero_copy(self, parts: Parts) -> bool:
        """Whether a value's parts all lie in registered memory (it moves with no copy)."""
        return self._spans(parts) is not None

    def _spans(self, parts: Parts) -> tuple[list[int], list[int]] | None:
        """The addresses and sizes of a value's parts when every one lies in registered
        memory (empty parts left out), else None."""
        addresses, sizes = [], []
        for part in parts:
            n = part.nbytes
            if not n:
                continue
            try:
                address = int(np.frombuffer(part, dtype=np.uint8).ctypes.data)
            except (BufferError, ValueError, TypeError):  # not contiguous: it cannot be moved in place
                return None
            if not self._inside(address, n):
                return None
            addresses.append(address)
            sizes.append(n)
        return (addresses, sizes) if sizes else None

    def close(self) -> None:
        client, self._client = self._client, None
        self._starts, self._ends = [], []
        if client is not None:
            client.close()

    def _connected(self, what: str) -> MooncakeDistributedStore:
        if self._client is None:
            raise StoreError(f"{self.describe()}: {what}: not connected")
        return self._client

    def _check(self, what: str, codes: Sequence[int]) -> None:
        """:class:`StoreError` when every key answered a code that means the store could not be asked."""
        if codes and all(c in UNREACHABLE for c in codes):
            raise StoreError(f"{self.describe()}: {what} of {len(codes)} keys failed: {code_name(codes[0])}")

    # the calls

    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[bool]:
        if not keys:
            return []
        client = self._connected("put")
        if len(values) != len(keys):
            raise ValueError(f"put: {len(keys)} keys, {len(values)} values")
        codes = [0] * len(keys)
        direct, copied = _split(keys, values, self._spans)
        if direct:
            index, spans = zip(*direct, strict=True)
            answers = client.batch_put_from_multi_buffers(
                [keys[i] for i in index], [s[0] for s in spans], [s[1] for s in spans]
            )
            for i, code in zip(index, answers, strict=True):
                codes[i] = code
        if copied:
            code = client.put_batch([keys[i] for i in copied], [b"".join(values[i]) for i in copied])
            for i in copied:
                codes[i] = code
        self._check("put", codes)
        return [c in (0, OBJECT_ALREADY_EXISTS) for c in codes]

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._connected("exists").batch_is_exist(list(keys))
        self._check("exists", codes)
        return [c == 1 for c in codes]

    def get_into(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        if not keys:
            return []
        client = self._connected("get")
        if len(values) != len(keys):
            raise ValueError(f"get_into: {len(keys)} keys, {len(values)} values")
        sizes = [-1] * len(keys)
        unreachable = [False] * len(keys)
        direct, copied = _split(keys, values, self._spans)
        mismatched = []
        if direct:
            index, spans = zip(*direct, strict=True)
            answers = client.batch_get_into_multi_buffers(
                [keys[i] for i in index], [s[0] for s in spans], [s[1] for s in spans]
            )
            for i, code in zip(index, answers, strict=True):
                if code >= 0:
                    sizes[i] = code
                elif code in UNREACHABLE:
                    unreachable[i] = True
                elif code != OBJECT_NOT_FOUND:
                    mismatched.append(i)  # a transfer that failed: most often a value of another size
        if copied:
            blobs = client.get_batch([keys[i] for i in copied])
            for i, blob in zip(copied, blobs, strict=True):
                if not blob:
                    continue  # missing (get_batch answers b"" for a miss, and for a master it cannot reach)
                if len(blob) == total_bytes(values[i]):
                    scatter(blob, values[i])
                sizes[i] = len(blob)
            if all(sizes[i] < 0 for i in copied):
                # Every key came back empty (a miss, or a master get_batch could not reach):
                # the direct keys' codes say which, else ask whether the store answers at all.
                if direct:
                    down = all(unreachable[i] for i, _ in direct)
                    for i in copied:
                        unreachable[i] = down
                else:
                    for i, code in zip(copied, client.batch_is_exist([keys[i] for i in copied]), strict=True):
                        unreachable[i] = code in UNREACHABLE
        if all(unreachable):
            raise StoreError(f"{self.describe()}: get of {len(keys)} keys failed: the master did not answer")
        for i in mismatched:
            size = client.get_size(keys[i])
            if size in UNREACHABLE:
                break  # the master went away meanwhile: the rest stay misses
            if size >= 0 and size != total_bytes(values[i]):
                sizes[i] = size  # reported, never copied: the caller rejects it
        return sizes


def _size(query: dict[str, str], name: str, default: int, where: str) -> int:
    if name not in query:
        return default
    try:
        return parse_size(query[name], f"{name}=")
    except GeometryError as exc:
        raise StoreURLError(f"{where}: {exc}") from None


Spans = tuple[list[int], list[int]]  # a value's parts' addresses and sizes


def _split(
    keys: Sequence[str], values: Sequence[Parts], spans: Callable[[Parts], Spans | None]
) -> tuple[list[tuple[int, Spans]], list[int]]:
    """The values that lie in registered memory (index, their spans) and the others' indices."""
    direct: list[tuple[int, Spans]] = []
    copied: list[int] = []
    for i, parts in enumerate(values):
        found = spans(parts)
        if found is None:
            copied.append(i)
        else:
            direct.append((i, found))
    return direct, copied


SCHEMES["mooncake"] = MooncakeStore
