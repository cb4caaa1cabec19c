"""The host tier's memory (``kvmem serve --host-memory``): pages with the device pool's
geometry in memory only the server maps, and the copies between them and the device
pool's pages (:class:`HostPages`, the core's :class:`~kvmem.server.core.tier.PageMover`).

A device page is not contiguous: the pool is laid out ``(layers, 2, tokens, ...)`` (mha)
or ``(layers, tokens, ...)`` (mla), so one page is one row of ``page_size`` token slots
in each of ``planes`` planes (``layers * 2`` or ``layers``). A host page is contiguous,
its planes one after another: ``[rank][host page][plane][row bytes]``, so that a page is
one run of bytes (what a store outside the node would take whole).

The CPU pool (shared memory) is copied with numpy. A demotion (device to host) is
copied in the calling thread, within the call that evicts (the page is reused right
after). A load (host to device, :meth:`HostPages.start_load`) is copied by the copy
thread, off the Step's path, **layer by layer**: once layer ``i`` of a load's pages is
in, their entries in :attr:`HostPages.counters` become ``i + 1``; ``num_layers`` means
"not loading". The counters are an int32 array per device page in the block-table file
(what clients map already), so a client reading layer ``i`` of a page waits for its
count to pass ``i`` in its own memory, with no round trip. The copy writes a layer's
bytes before its counter (a plain store after the copy: x86's and the kernel's store
order; a reader loads the counter before the bytes). A finished load is handed back to
the core's thread (:attr:`HostPages.finished`, then :attr:`HostPages.notify`), which
drops the references the load held.

Host memory is allocated lazily by the kernel (the pages of the array are touched as
pages are demoted); :func:`check_host_memory` refuses at start a size the host cannot
provide.
"""

from __future__ import annotations

import abc
import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvmem.server.memory.geometry import GeometryError, KVGeometry, format_size

log = logging.getLogger("kvmem.server.memory")


def planes_of(geometry: KVGeometry) -> int:
    """Planes a page spans: K and V per layer (mha), one latent per layer (mla)."""
    return geometry.num_layers * (2 if geometry.format == "mha" else 1)


def pages_for(host_bytes: int, geometry: KVGeometry) -> int:
    """Host pages that ``host_bytes`` hold (per rank: each rank has its tier)."""
    return host_bytes // geometry.page_bytes


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is no such file)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(host_bytes: int, geometry: KVGeometry, num_ranks: int, text: str) -> int:
    """The host pages ``--host-memory text`` (``host_bytes`` per rank) gives, or a
    :class:`GeometryError` saying in one line why the host cannot provide it."""
    pages = pages_for(host_bytes, geometry)
    if pages < 1:
        raise GeometryError(
            f"--host-memory {text} holds no page: a page of this geometry is {format_size(geometry.page_bytes)} "
            "(all layers, K and V)"
        )
    total = pages * geometry.page_bytes * num_ranks
    free = available_bytes()
    if free is not None and total > free:
        raise GeometryError(
            f"--host-memory {text} needs {format_size(total)} of host memory ({num_ranks} rank(s)), more than the "
            f"{format_size(free)} this host has available (MemAvailable in /proc/meminfo)"
        )
    return pages


class PageCopier(abc.ABC):
    """What both hosts of a tier share: the load counters, the copy thread that makes the
    loads layer by layer (:meth:`start_load`), its statistics and its test hooks. A
    subclass holds the memory and copies one layer (:meth:`_copy_layer`) and whole pages
    (:meth:`to_host`): :class:`HostPages` numpy over the CPU pool, :class:`TorchHostPages`
    torch over a CUDA pool (or any torch device).

    ``counters``: the int32 ``[num_device_pages]`` load counters (a view into a file
    clients map; None: an array of its own), set to ``num_layers`` here unless
    ``reopened``."""

    num_ranks: int

    def __init__(
        self,
        geometry: KVGeometry,
        num_device_pages: int,
        num_pages: int,
        counters: np.ndarray | None = None,
        reopened: bool = False,
    ) -> None:
        self.num_pages = num_pages
        self.page_bytes = geometry.page_bytes
        self.num_layers = geometry.num_layers
        self._planes = planes_of(geometry)
        self._row = geometry.page_bytes // self._planes
        self._planes_per_layer = self._planes // geometry.num_layers
        if counters is None:
            counters = np.empty(num_device_pages, dtype=np.int32)
        if counters.shape != (num_device_pages,) or counters.dtype != np.int32:
            raise ValueError(f"load counters must be int32 [{num_device_pages}], got {counters.dtype} {counters.shape}")
        if not reopened:  # a kept state's counters say which loads a crash cut (.restore reads them)
            counters[:] = self.num_layers
        self.counters = counters
        # Loads the copy thread finished, their tokens in order; the core's thread takes them.
        self.finished: collections.deque[Any] = collections.deque()
        # Called by the copy thread after each finished load (the server: wake its loop).
        self.notify: Callable[[], None] | None = None
        self._queue: queue.SimpleQueue[tuple[np.ndarray, np.ndarray, Any, float] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Condition()
        self._pending = 0  # loads queued and not finished
        # Tests hold the copy thread between layers (hold / allow / resume); None: it runs.
        self._permits: threading.Semaphore | None = None
        self._abandoned = False  # tests: the process "died" with loads held (abandon)
        # Recent loads: (pages, seconds from start_load to the last layer, seconds copying).
        self._recent: collections.deque[tuple[int, float, float]] = collections.deque(maxlen=1024)

    @abc.abstractmethod
    def to_host(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        """Copy whole ``device_pages`` (every layer and rank) into ``host_pages``, in the
        calling thread: done when this returns (the device pages are reused right after)."""
        raise NotImplementedError

    @abc.abstractmethod
    def _copy_layer(self, layer: int, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """Copy layer ``layer`` of ``host_pages`` into ``device_pages``, every rank: in
        place when this returns (its counters are set right after)."""

    @abc.abstractmethod
    def page(self, host_page: int, rank: int = 0) -> np.ndarray:
        """One host page's bytes ``[planes, row]`` (a contiguous view): the store's
        thread reads and writes pages through it; tests and tools."""

    @abc.abstractmethod
    def buffers(self) -> list[np.ndarray]:
        """Each rank's host pages whole, flat ``uint8`` (a store registers them)."""

    # ------------------------------------------------------------ loads

    def start_load(self, host_pages: np.ndarray, device_pages: np.ndarray, token: Any) -> None:
        """Copy ``host_pages`` into ``device_pages`` on the copy thread, layer by layer;
        ``token`` goes to :attr:`finished` when the last layer is in. The pages' counters
        are 0 when this returns (before the Step that took them answers). The caller
        keeps both sets of pages from reuse until then. O(pages) here."""
        self.counters[device_pages] = 0
        with self._idle:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvmem-tier-copy", daemon=True)
            self._thread.start()
        self._queue.put((host_pages, device_pages, token, time.perf_counter()))

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            host_pages, device_pages, token, queued = job
            started = time.perf_counter()
            try:
                self._copy_in(host_pages, device_pages)
            except Exception:  # the memory was closed under it: its readers time out
                log.exception("host tier: a load of %d page(s) failed; its pages stay unreadable", host_pages.size)
            if self._abandoned:
                return
            done = time.perf_counter()
            self._recent.append((int(host_pages.size), done - queued, done - started))
            self.finished.append(token)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()
            notify = self.notify
            if notify is not None:
                notify()

    def _copy_in(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """Layer by layer, every page (and rank) of the layer, then its counters."""
        counters = self.counters
        for layer in range(self.num_layers):
            permits = self._permits
            if permits is not None:
                permits.acquire()
            if self._abandoned:
                return
            self._copy_layer(layer, host_pages, device_pages)
            counters[device_pages] = layer + 1

    def copy_now(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        """Copy ``host_pages`` into ``device_pages`` in the calling thread, every layer
        (a restart copying again what a crash cut; nothing reads them meanwhile)."""
        self._copy_in(host_pages, device_pages)

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until every load started has finished (tests, tools, shutdown)."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._pending == 0, timeout):
                raise TimeoutError(f"{self._pending} host-tier load(s) still copying after {timeout:.0f} s")

    def hold(self) -> None:
        """Tests: the copy thread stops before each layer until :meth:`allow` lets it on."""
        self._permits = threading.Semaphore(0)

    def allow(self, layers: int) -> None:
        """Tests: let the held copy thread copy ``layers`` more layers (of any loads)."""
        assert self._permits is not None, "allow() without hold()"
        self._permits.release(layers)

    def resume(self) -> None:
        """Tests: the copy thread runs freely again."""
        permits, self._permits = self._permits, None
        if permits is not None:
            permits.release()  # the one thread waiting on it, if any; it reads no semaphore after

    def abandon(self) -> None:
        """Tests: the process died with loads held in copy: the copy thread ends without
        copying another layer (what a killed server's does), its loads never finished."""
        self._abandoned = True
        thread, self._thread = self._thread, None
        permits, self._permits = self._permits, None
        if thread is not None:
            self._queue.put(None)
            if permits is not None:
                permits.release()  # the one thread waiting on it, if any; it reads no semaphore after
            thread.join(timeout=10)

    def load_stats(self) -> tuple[float, float, float]:
        """Recent loads (the last 1024): time from start to last layer, p50 and p99 in
        ms, and the copy bandwidth in GiB/s (0s before any). O(1024)."""
        recent = list(self._recent)
        if not recent:
            return 0.0, 0.0, 0.0
        waits = np.array([r[1] for r in recent]) * 1e3
        copying = sum(r[2] for r in recent)
        moved = sum(r[0] for r in recent) * self.page_bytes * self.num_ranks
        p50, p99 = np.percentile(waits, [50, 99]).tolist()
        return p50, p99, (moved / copying / 2**30 if copying > 0 else 0.0)

    def close(self) -> None:
        """Stop the copy thread once the loads queued are copied (before the memory goes). Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self.resume()
            self._queue.put(None)
            thread.join(timeout=30)


class HostPages(PageCopier):
    """``num_pages`` host pages per rank for the CPU pools ``device`` (one flat ``uint8``
    array per rank: the whole KV allocation, ``num_device_pages`` pages of ``geometry``),
    copied with numpy. ``host``: the host pages' memory (a flat ``uint8`` array per rank:
    a kept file, ``--keep-state``); None: memory of its own."""

    def __init__(
        self,
        device: list[np.ndarray],
        geometry: KVGeometry,
        num_device_pages: int,
        num_pages: int,
        counters: np.ndarray | None = None,
        host: list[np.ndarray] | None = None,
        reopened: bool = False,
    ) -> None:
        super().__init__(geometry, num_device_pages, num_pages, counters, reopened)
        planes, row = self._planes, self._row
        self.num_ranks = len(device)
        self._device = [d.reshape(planes, num_device_pages, row) for d in device]
        if host is None:
            self._host = [np.empty((num_pages, planes, row), dtype=np.uint8) for _ in device]
        else:  # kept memory (--keep-state): a flat uint8 array per rank
            if len(host) != len(device) or any(h.size != num_pages * geometry.page_bytes for h in host):
                raise ValueError(f"host memory must be {num_pages} pages of {geometry.page_bytes} bytes per rank")
            self._host = [h.reshape(num_pages, planes, row) for h in host]

    def to_host(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        # A page at a time, straight from its planes into its host page: one copy of its
        # bytes (a gather of all pages first, then a transposing scatter, copies twice:
        # 0.33x a memcpy's speed against this loop's 0.85x, bench/tier_bench.py's copy part).
        # The loop is over pages, never tokens: a page is planes x row bytes (KiBs).
        for dev, host in zip(self._device, self._host, strict=True):
            for d, h in zip(device_pages.tolist(), host_pages.tolist(), strict=True):
                host[h] = dev[:, d]

    def _copy_layer(self, layer: int, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        k = self._planes_per_layer
        lo, hi = layer * k, layer * k + k
        for dev, hst in zip(self._device, self._host, strict=True):
            for h, d in zip(host_pages.tolist(), device_pages.tolist(), strict=True):
                dev[lo:hi, d] = hst[h, lo:hi]

    def page(self, host_page: int, rank: int = 0) -> np.ndarray:
        """One host page's bytes ``[planes, row]`` (a view): for tests and tools."""
        return self._host[rank][host_page]

    def buffers(self) -> list[np.ndarray]:
        return [h.reshape(-1) for h in self._host]
