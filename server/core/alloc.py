"""Allocation: the general path (any items, per-item results) and the decode fast path.

Both apply the reference allocator's ``alloc``: fill the last page's tail, then new
pages, write the row, return ``need`` token slots in order. They plan (which items are
served, which columns get new pages) and leave the change to
:meth:`RequestTable.grow <kvmem.server.core.slots.RequestTable.grow>`. They agree with the
simple model of ``tests/core/test_core_properties.py`` (a dict of lists and a free list),
which the property tests check them against, the fast path included.
"""

from __future__ import annotations

import numpy as np

from kvmem.server.core.batch import NO_EXPECTATION, NO_INT32, NO_STATUS, ZERO_OFFSETS, AllocStatus, frozen
from kvmem.server.core.config import INT32_MAX, CoreConfig
from kvmem.server.core.pool import PagePool
from kvmem.server.core.slots import Owner, RequestTable
from kvmem.server.core.table import BlockTable, segments
from kvmem.server.core.undo import UndoLog

# What a step's allocs give its result: alloc_status, kv_loc, kv_loc_offsets, new_pages,
# new_page_offsets (the first five fields of StepOutcome) and num_refused. A tuple: the
# decode path builds one per step.
Allocs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]
NO_ALLOCS: Allocs = (NO_STATUS, NO_INT32, ZERO_OFFSETS, NO_INT32, ZERO_OFFSETS, 0)


def _admit(cnt: np.ndarray, too_long: np.ndarray, pool_left: int, quota_left: int | None) -> np.ndarray:
    """Per-item statuses when the pool or the quota is short or an item is too long:
    items are admitted in order (greedy, like per-request calls would be). A loop over
    items, never tokens; only on this slow path."""
    codes = []
    for c, long_ in zip(cnt.tolist(), too_long.tolist(), strict=True):
        if long_:
            codes.append(AllocStatus.CONTEXT_TOO_LONG)
        elif quota_left is not None and c > quota_left:
            codes.append(AllocStatus.QUOTA_EXCEEDED)
        elif c > pool_left:
            codes.append(AllocStatus.OUT_OF_PAGES)
        else:
            codes.append(AllocStatus.OK)
            pool_left -= c
            if quota_left is not None:
                quota_left -= c
    return np.array(codes, dtype=np.int8)


class Allocator:
    """Allocs of one step over the pool, the table and the request table: it reads
    them, and changes them only through :meth:`RequestTable.grow`. Each call returns
    the step's :data:`Allocs`."""

    def __init__(
        self, config: CoreConfig, pool: PagePool, table: BlockTable, requests: RequestTable, undo: UndoLog | None = None
    ) -> None:
        self.pool, self.table, self.requests = pool, table, requests
        self.undo = undo  # a numbered decode Step's lengths go into its undo record (see .undo)
        self.max_context_len = config.max_context_len
        self._ctx_limit = min(config.max_context_len, INT32_MAX)
        n = config.max_requests + 3
        self._ramp = frozen(np.arange(n, dtype=np.int32))  # decode kv_loc offsets
        self._zeros32 = frozen(np.zeros(n, dtype=np.int32))  # decode page offsets, no page taken
        self._zeros8 = frozen(np.zeros(n, dtype=np.int8))  # decode status: all OK
        self._ones_bytes = np.ones(n, dtype=np.int64).tobytes()  # decode needs, as bytes
        # By batch size n: views of the three above cut to n or n + 1, made once (a
        # dict lookup is a seventh of two slicings, paid on every decode step).
        self._decode_views: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def alloc(
        self, state: Owner, slots: np.ndarray, need: np.ndarray, cur: np.ndarray, atomic: bool, quota: int | None
    ) -> Allocs:
        """The general path: any valid items (``cur``: each slot's length before its
        alloc). O(n + T + P); a loop over items only when something does not fit."""
        n = slots.size
        if n == 0:
            return NO_ALLOCS
        table = self.table
        end = cur + need
        have = table.num_pages_for(cur)
        cnt = table.num_pages_for(end) - have
        status = np.zeros(n, dtype=np.int8)
        refused = 0
        total = int(cnt.sum())
        quota_left = None if quota is None else quota - state.num_pages_held
        too_long = end > self.max_context_len
        if (
            np.count_nonzero(too_long)
            or total > self.pool.num_available
            or (quota_left is not None and total > quota_left)
        ):
            status = _admit(cnt, too_long, self.pool.num_available, quota_left)
            ok = status == AllocStatus.OK
            if atomic and not ok.all():
                status[ok] = AllocStatus.ABORTED
                ok[:] = False
            refused = n - int(np.count_nonzero(ok))
            cnt, need, end = np.where(ok, cnt, 0), np.where(ok, need, 0), np.where(ok, end, cur)
            total = int(cnt.sum())
        pages = self.requests.grow(state, slots, end, self._new_columns(slots, have, cnt, total), total)
        kv_loc = self._kv_loc(slots, cur, end, need)
        kv_off = np.zeros(n + 1, dtype=np.int32)
        kv_off[1:] = np.cumsum(need)  # cumsum into an int32 slice is several times slower
        page_off = np.zeros(n + 1, dtype=np.int32)
        page_off[1:] = np.cumsum(cnt)
        return status, kv_loc, kv_off, pages, page_off, refused

    def _new_columns(self, slots: np.ndarray, have: np.ndarray, cnt: np.ndarray, total: int) -> np.ndarray:
        """The flat block-table positions of the ``total`` new pages: columns ``have ..
        have+cnt-1`` of each slot's row, in item order."""
        if not total:
            return NO_INT32
        width = self.table.width
        if total == np.count_nonzero(cnt):  # at most one new page per item (decode)
            mask = cnt > 0
            return slots[mask] * width + have[mask]
        item, cols = segments(have, cnt)
        return slots[item] * width + cols

    def _kv_loc(self, slots: np.ndarray, cur: np.ndarray, end: np.ndarray, need: np.ndarray) -> np.ndarray:
        """The tokens ``[cur, end)`` of each item, through its (updated) row."""
        num_tokens = int(need.sum())
        busy = np.count_nonzero(need)
        if num_tokens != busy:
            return self.table.kv_loc_by_page(slots, cur, end, need)
        ps = self.table.page_size  # at most one token per item: one gather
        idx = np.flatnonzero(need) if busy != need.size else slice(None)
        pos = cur[idx]
        return (self.table.array[slots[idx], pos // ps] * ps + pos % ps).astype(np.int32)

    def decode(
        self,
        state: Owner,
        slots: np.ndarray,
        need: np.ndarray,
        expected: np.ndarray | None,
        quota: int | None,
        seq: int = 0,
    ) -> Allocs | None:
        """A step of allocs only, one token each, every item valid and served: a
        decode step, the one a server makes most. It validates and applies in about
        25 array operations instead of the general path's 35 (a step arrives with the
        caches cold, where each operation's fixed cost dominates at these sizes).
        Returns None, having changed nothing, when anything is off (a bad or
        duplicate slot, a need other than 1, an expectation not met, the pool or the
        quota short, the context limit): the general path then decides, raises or
        answers per item. Its allocs are those of :meth:`alloc` on the same input
        (the property tests check both against one model). ``seq``: the Step's number,
        for its undo record (:mod:`.undo`), begun here before anything changes. O(n).

        An item opens a new page exactly when its length is page-aligned; its token
        goes to ``page * page_size + length % page_size`` of the page its row holds
        at column ``length // page_size``."""
        n = slots.size
        # Comparing bytes and reading the longest length (argmax) cost half of a
        # comparison plus a count each.
        requests = self.requests
        if not self._ones_bytes.startswith(need.tobytes()) or not requests.all_mine(state, slots):
            return None
        undo = self.undo if seq else None
        if undo is not None:  # a numbered Step: its lengths and positions written into its undo record
            lens, at = undo.decode_views(state.record, n)
            cur = requests.alloced.take(slots, mode="clip", out=lens)  # clip: valid slots, and no buffering
        else:
            cur = requests.alloced[slots]
        if expected is not None:
            wrong = expected != cur
            if np.count_nonzero(wrong) and np.count_nonzero(expected[wrong] != NO_EXPECTATION):
                return None
        if cur.item(cur.argmax()) >= self._ctx_limit:
            return None
        table = self.table
        ps = table.page_size
        if table.page_shift is not None:  # a power of two: two cheap ufuncs beat divmod's one
            col, rem = cur >> table.page_shift, cur & (ps - 1)
        else:
            col, rem = np.divmod(cur, ps)
        grow = rem == 0
        total = int(np.count_nonzero(grow))
        if total > self.pool.num_available or (quota is not None and total > quota - state.num_pages_held):
            return None
        status, kv_off, no_pages = self._decode_views.get(n) or self._views(n)
        if undo is not None:
            pos = np.multiply(slots, table.width, out=at)  # flat block-table entries
            pos += col
            undo.activate_decode(state.record, seq, n)
        else:
            pos = slots * table.width + col  # flat block-table entries
        page = table.flat.take(pos)  # int32: the page each token lands in (0 where a new one goes)
        if total:
            pages = requests.grow(state, slots, cur + 1, pos[grow], total)
            page[grow] = pages
            page_off = np.zeros(n + 1, dtype=np.int32)
            np.add.accumulate(grow, dtype=np.int32, out=page_off[1:])  # half np.cumsum's cost
        else:
            pages, page_off = requests.grow(state, slots, cur + 1, pos, 0), no_pages
        kv_loc = page * ps
        kv_loc += rem  # int32 throughout
        return status, kv_loc, kv_off, pages, page_off, 0

    def _views(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The decode's constant columns for ``n`` items, read-only: statuses (all OK),
        kv_loc offsets (``0..n``) and page offsets with no page taken (zeros)."""
        views = self._decode_views[n] = (self._zeros8[:n], self._ramp[: n + 1], self._zeros32[: n + 1])
        return views
