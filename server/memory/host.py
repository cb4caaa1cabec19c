"""The host tier's memory (``kvmem serve --host-memory``): pages with the device pool's
geometry in memory only the server maps, and the copies between them and the device
pool's pages (:class:`HostPages`, the core's :class:`~kvmem.server.core.tier.PageMover`).

A device page is not contiguous: the pool is laid out ``(layers, 2, tokens, ...)`` (mha)
or ``(layers, tokens, ...)`` (mla), so one page is one row of ``page_size`` token slots
in each of ``planes`` planes (``layers * 2`` or ``layers``). A host page is contiguous,
its planes one after another: ``[rank][host page][plane][row bytes]``, so that a page is
one run of bytes (what a store outside the node would take whole).

The CPU pool (shared memory) is copied with numpy, one gather and one scatter per
call, in the calling thread. Host memory is allocated lazily by the kernel (the pages of
the array are touched as pages are demoted); :func:`check_host_memory` refuses at start a
size the host cannot provide.
"""

from __future__ import annotations

import numpy as np

from kvmem.server.memory.geometry import GeometryError, KVGeometry, format_size


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


class HostPages:
    """``num_pages`` host pages per rank for the device pools ``device`` (one flat
    ``uint8`` array per rank: the whole KV allocation, ``num_device_pages`` pages of
    ``geometry``), and the copies both ways."""

    def __init__(self, device: list[np.ndarray], geometry: KVGeometry, num_device_pages: int, num_pages: int) -> None:
        planes = planes_of(geometry)
        row = geometry.page_bytes // planes
        self.num_pages = num_pages
        self.page_bytes = geometry.page_bytes
        self._device = [d.reshape(planes, num_device_pages, row) for d in device]
        self._host = [np.empty((num_pages, planes, row), dtype=np.uint8) for _ in device]

    def to_host(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None:
        # A page at a time, straight from its planes into its host page: one copy of its
        # bytes (a gather of all pages first, then a transposing scatter, copies twice:
        # 0.33x a memcpy's speed against this loop's 0.85x, bench/tier_bench.py's copy part).
        # The loop is over pages, never tokens: a page is planes x row bytes (KiBs).
        for dev, host in zip(self._device, self._host, strict=True):
            for d, h in zip(device_pages.tolist(), host_pages.tolist(), strict=True):
                host[h] = dev[:, d]

    def to_device(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None:
        for dev, host in zip(self._device, self._host, strict=True):
            for h, d in zip(host_pages.tolist(), device_pages.tolist(), strict=True):
                dev[:, d] = host[h]

    def page(self, host_page: int, rank: int = 0) -> np.ndarray:
        """One host page's bytes ``[planes, row]`` (a view): for tests and tools."""
        return self._host[rank][host_page]
