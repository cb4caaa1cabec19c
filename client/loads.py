"""Waiting for pages a match loads from the server's host tier (``kvmem serve
--host-memory``), in the client's own memory: no round trip.

A match whose prefix continues on the host tier gets device pages for it in its Step,
and the server copies the K/V in after the Step answers, on its copy thread, layer by
layer. ``StepResult.match_loading`` says, per match item, how many of its matched
tokens (the last ones) were still loading. The server counts each device page's
layers copied in the *load counters*: int32 per page, in the block-table file the
client maps already (:meth:`kvmem.client.MappedMemory.load_counters`); a page's count
is ``num_layers`` when it is not loading, and layer ``i`` of it may be read once its
count is above ``i``. So a model's attention for layer ``i`` waits only for layer ``i``'s
copy (:meth:`PageLoads.wait` with ``layer=i``), and a reader of the whole page for all
of them (``layer=None``).

A page's count only grows while the pages are held (a load holds its pages until the
copy ends; a count is reset only when a later load takes the page, which cannot happen
while a request holds it). The server writes a layer's bytes before its count; x86's
store order and a load of the count before the bytes make a reader that saw the count
see the bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["LoadTimeout", "PageLoads"]


class LoadTimeout(TimeoutError):
    """Pages were still loading when the wait's time ran out: the server is gone or
    stuck (a copy of a few MiB takes milliseconds)."""


class PageLoads:
    """The load counters of one server (``counters``: int32 ``[num_pages]``, a numpy
    array or a CPU tensor over the mapped file) and what a reader does with them."""

    def __init__(self, counters: Any, num_layers: int, page_size: int) -> None:
        self.counters = counters.numpy() if hasattr(counters, "numpy") else np.asarray(counters)
        if self.counters.dtype != np.int32 or self.counters.ndim != 1:
            have = f"{self.counters.dtype} {self.counters.shape}"
            raise ValueError(f"load counters must be int32 [num_pages], got {have}")
        self.num_layers = num_layers
        self.page_size = page_size

    def pages_of(self, row: Any, match_len: int, loading: int) -> np.ndarray:
        """The pages a match item must wait for: block-table ``row``'s pages holding the
        last ``loading`` of its ``match_len`` matched tokens (both whole pages). O(pages)."""
        if loading <= 0:
            return np.zeros(0, dtype=np.int64)
        if loading > match_len or match_len % self.page_size or loading % self.page_size:
            raise ValueError(
                f"loading {loading} of match_len {match_len}: both must be whole pages of {self.page_size} tokens, "
                "loading <= match_len"
            )
        row = row.cpu().numpy() if hasattr(row, "cpu") else np.asarray(row)  # a CUDA pool's row: copied out
        ps = self.page_size
        return row[(match_len - loading) // ps : match_len // ps].astype(np.int64)

    def ready(self, pages: np.ndarray, layer: int | None = None) -> bool:
        """Whether layer ``layer`` (None: every layer) of every page of ``pages`` is in. O(pages)."""
        if not pages.size:
            return True
        need = self.num_layers if layer is None else layer + 1
        return bool(self.counters[pages].min() >= need)

    def wait(self, pages: np.ndarray, layer: int | None = None, timeout: float = 60.0) -> float:
        """Until :meth:`ready`; returns the seconds waited (0.0 when ready at once). The
        wait polls the counters, sleeping 20 us at first and at most 1 ms between looks.
        :class:`LoadTimeout` after ``timeout`` seconds. O(pages) per look."""
        if self.ready(pages, layer):
            return 0.0
        start = time.perf_counter()
        for pause in self._pauses(pages, layer, start, timeout):
            time.sleep(pause)
        return time.perf_counter() - start

    async def wait_async(self, pages: np.ndarray, layer: int | None = None, timeout: float = 60.0) -> float:
        """:meth:`wait` for an asyncio caller: the looks are ``asyncio.sleep`` apart, so
        the event loop runs meanwhile."""
        if self.ready(pages, layer):
            return 0.0
        start = time.perf_counter()
        for pause in self._pauses(pages, layer, start, timeout):
            await asyncio.sleep(pause)
        return time.perf_counter() - start

    def _pauses(self, pages: np.ndarray, layer: int | None, start: float, timeout: float) -> Iterator[float]:
        """The pauses between looks until :meth:`ready`; :class:`LoadTimeout` past
        ``timeout``."""
        pause = 20e-6
        while not self.ready(pages, layer):
            waited = time.perf_counter() - start
            if waited > timeout:
                need = self.num_layers if layer is None else layer + 1
                behind = pages[self.counters[pages] < need]
                raise LoadTimeout(
                    f"{behind.size} page(s) still loading from the host tier after {waited:.1f} s "
                    f"(layer {layer if layer is not None else 'all'}; pages {behind[:8].tolist()}): "
                    "the server is gone or stuck"
                )
            yield pause
            pause = min(pause * 2, 1e-3)
