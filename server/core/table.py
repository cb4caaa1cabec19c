"""The block table: rows of page ids, read and written by flat position."""

from __future__ import annotations

import numpy as np

from kvmem.server.core.config import CoreConfig
from kvmem.server.core.pool import PagePool

_INT32 = np.dtype(np.int32)  # a dtype instance: a view to it skips resolving the type


def segments(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments ``[starts[i], starts[i] + counts[i])`` return (item index, value) of
    every element, in order. O(n + sum(counts))."""
    total = int(counts.sum())
    item = np.repeat(np.arange(counts.size), counts)
    first = np.cumsum(counts) - counts
    values = np.repeat(starts - first, counts) + np.arange(total)
    return item, values


class BlockTable:
    """The int32 ``[max_requests + 1, max_pages_per_request]`` table the core is *given*
    (a plain array in tests, a shared-memory view in the server), and the page
    arithmetic over it.

    Invariant (kept by the step code): for every open slot ``s`` row ``s`` holds exactly
    ``ceil(alloced[s] / page_size)`` non-zero page ids followed by zeros; closed rows and
    row 0 are all zero. Entry ``(row, col)`` is ``flat[row * width + col]``: a 1-D index
    is cheaper than a 2-D one."""

    def __init__(self, config: CoreConfig, pool: PagePool, table: np.ndarray | None) -> None:
        shape = config.block_table_shape
        if table is None:
            table = np.zeros(shape, dtype=np.int32)
        if table.shape != shape or table.dtype != np.int32:
            raise ValueError(f"block_table must be int32 {shape}, got {table.dtype} {table.shape}")
        if not table.flags.c_contiguous:
            raise ValueError("block_table must be C-contiguous (its rows are addressed by flat position)")
        table[...] = 0
        self.array = table
        self.flat = table.reshape(-1)  # a view
        self.width = shape[1]
        self.pool = pool
        ps = config.page_size
        self.page_size = ps
        self.page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None  # None: not a power of two
        self._col = np.arange(self.width, dtype=np.int64)
        self._heads: list[tuple[np.ndarray, np.ndarray] | None] = [None] * (self.width + 1)

    def num_pages_for(self, tokens: np.ndarray) -> np.ndarray:
        return (tokens + (self.page_size - 1)) // self.page_size

    def drop_pages(self, slots: np.ndarray, keep: np.ndarray, have: np.ndarray) -> int:
        """Unreference columns ``[keep, have)`` of each slot's row and zero them.
        Returns the number of entries dropped. O(n + P)."""
        counts = have - keep
        if not np.count_nonzero(counts):
            return 0
        item, cols = segments(keep, counts)
        pos = slots[item] * self.width + cols
        pages = self.flat.take(pos)
        self.pool.unref(pages)
        self.flat[pos] = 0
        return int(pages.size)

    def drop_rows(self, slots: np.ndarray, alloced: np.ndarray, hold: list[np.ndarray] | None = None) -> int:
        """Unreference every page of each slot's row (``alloced`` tokens long) and zero
        the rows: one gather of each row's first ``width`` entries (``width`` pages for
        the longest row) instead of a per-page gather, and one zeroing of the same.
        Pages left unreferenced go to ``hold`` when given (a quarantine, see
        :meth:`PagePool.unref`). Returns the number of entries dropped. O(n * width)."""
        if not alloced.size:
            return 0
        longest = alloced.item(alloced.argmax())  # argmax: a third of max()'s fixed cost
        if longest == 0:
            return 0
        ps = self.page_size
        width = -(-longest // ps)
        heads, zero = self._row_heads(width)
        pages = heads[slots].view(_INT32)  # the rows' first `width` entries, row after row
        if alloced.item(alloced.argmin()) <= (width - 1) * ps:  # some row holds fewer pages
            pages = pages.reshape(-1, width)[self._col[:width] < self.num_pages_for(alloced)[:, None]]
        self.pool.unref(pages, hold)
        heads[slots] = zero
        return int(pages.size)

    def _row_heads(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows cut to their first ``width`` entries, as a 1-D array of ``4 *
        width``-byte items over the same memory, and a zero item. Gathering or zeroing
        n rows' heads is then a 1-D fancy index, one copy per row: a half to a third of
        the 2-D index's cost, most of all for few rows. Built once per width (the
        constructor alone costs about a gather of 256 rows)."""
        cached = self._heads[width]
        if cached is None:
            bt = self.array
            item = np.dtype((np.void, 4 * width))
            view = np.ndarray((bt.shape[0],), dtype=item, buffer=bt, strides=(bt.strides[0],))
            cached = self._heads[width] = (view, np.zeros((), dtype=item))
        return cached

    def kv_loc_by_page(self, slots: np.ndarray, cur: np.ndarray, end: np.ndarray, need: np.ndarray) -> np.ndarray:
        """kv_loc of many tokens per item, by page: each touched page contributes a run
        ``page * page_size + [lo, hi)``, so the whole answer is one ``repeat`` of a base
        per page plus one ``arange`` over the tokens. O(n + P + T), P the pages touched."""
        ps = self.page_size
        busy = need > 0
        slots, cur, end = slots[busy], cur[busy], end[busy]
        first = cur // ps
        touched = (end - 1) // ps - first + 1
        item, cols = segments(first, touched)
        pages = self.array[slots[item], cols].astype(np.int64)
        lo = np.zeros(pages.size, dtype=np.int64)
        hi = np.full(pages.size, ps, dtype=np.int64)
        starts = np.cumsum(touched) - touched
        lo[starts] = cur % ps
        hi[starts + touched - 1] = (end - 1) % ps + 1
        run = hi - lo
        tok0 = np.cumsum(run) - run  # where each page's tokens start in the output
        base = pages * ps + lo - tok0
        total = int(tok0[-1] + run[-1])
        return (np.repeat(base, run) + np.arange(total)).astype(np.int32)
