"""The block table: rows of page ids, addressed by flat position, and the page arithmetic."""

from __future__ import annotations

import numpy as np

from kvmem.server.core.config import CoreConfig


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
    arithmetic over it. It only reads the rows: their contents and invariant belong to
    :class:`~kvmem.server.core.slots.RequestTable`, the only code that writes them
    (it zeroes the given table first). Entry ``(row, col)`` is ``flat[row * width +
    col]``: a 1-D index is cheaper than a 2-D one."""

    def __init__(self, config: CoreConfig, table: np.ndarray | None) -> None:
        shape = config.block_table_shape
        if table is None:
            table = np.zeros(shape, dtype=np.int32)
        if table.shape != shape or table.dtype != np.int32:
            raise ValueError(f"block_table must be int32 {shape}, got {table.dtype} {table.shape}")
        if not table.flags.c_contiguous:
            raise ValueError("block_table must be C-contiguous (its rows are addressed by flat position)")
        self.array = table
        self.flat = table.reshape(-1)  # a view
        self.width = shape[1]
        ps = config.page_size
        self.page_size = ps
        self.page_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None  # None: not a power of two

    def num_pages_for(self, tokens: np.ndarray) -> np.ndarray:
        return (tokens + (self.page_size - 1)) // self.page_size

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
