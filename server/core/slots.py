"""The request table: request slots ``[1, max_requests]``, their owners, lengths and rows.

:class:`RequestTable` is the one owner of a request's state: the step, alloc and prefix
modules work out what to change and call its methods, which change it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from kvmem.server.core import crash
from kvmem.server.core.batch import NO_INT32, raise_first, too_many
from kvmem.server.core.config import OwnerId
from kvmem.server.core.image import CoreImage
from kvmem.server.core.owner import Owner
from kvmem.server.core.pool import PagePool
from kvmem.server.core.slot_errors import MAX_REQUEST_ID_BYTES, raise_first_bad_slot
from kvmem.server.core.slot_errors import check_id_length as _check_id_length
from kvmem.server.core.table import BlockTable, segments
from kvmem.server.core.undo import UndoLog
from kvmem.server.core.words import StampedWords
from kvmem.server.errors import KVMemError, Reason

_ID_CHARS_ALWAYS_OK = MAX_REQUEST_ID_BYTES // 4  # no longer than this: within the limit, whatever the characters
_INT32 = np.dtype(np.int32)  # a dtype instance: a view to it skips resolving the type


class RequestTable:
    """The open requests, by slot, and their owners.

    Invariants (only this class changes the block-table rows, ``alloced``,
    ``owner_of``, ``request_id``, the free slot stack and every :class:`Owner`'s
    fields; the step, alloc and prefix modules plan and call its methods): for every
    open slot ``s``, row ``s`` of the block table holds exactly ``ceil(alloced[s] /
    page_size)`` non-zero page ids followed by zeros, each page's reference counted
    once per row that holds it (the :class:`PagePool` counts, through :meth:`PagePool.take`,
    :meth:`~PagePool.share` and :meth:`~PagePool.unref`); closed rows and row 0 are all
    zero; an owner's ``num_pages_held`` is the sum of its rows' page counts and its
    ``request_slots`` maps exactly its open slots' request ids. (A test scans the core's
    sources for writes to them elsewhere, and for the pool's ``ref_cnt``.)

    ``owner_of[slot]`` (the value half of each slot's stamped word) is 0 for a closed
    slot; one sentinel entry past ``max_requests`` is always 0, so a clipped
    out-of-range slot reads "not found". ``alloced[slot]`` is the slot's length in
    tokens (0 when closed; int32: a length never exceeds the pool's tokens). Free slots
    are a stack whose top is handed out first; descending, so the first slots are 1,
    2, 3, ... ``scratch`` is scratch per slot, for any check."""

    def __init__(
        self,
        max_requests: int,
        table: BlockTable,
        pool: PagePool,
        image: CoreImage | None = None,
        undo: UndoLog | None = None,
    ) -> None:
        self.max_requests = max_requests
        self._undo = undo  # a Step's row entries, before it changes them (see .undo)
        self.table, self.pool = table, pool
        table.array[...] = 0  # every row empty
        n_slots = max_requests + 2  # slot 0 padding, last entry a sentinel
        self._image = image  # owners, lengths, request ids and the free slots live there (see .image)
        self._words = StampedWords(n_slots, n_slots, None if image is None else image.slot_word)
        self.owner_of = self._words.value
        self.alloced = np.zeros(n_slots, dtype=np.int32) if image is None else image.alloced
        # The request id of each open slot, None when closed: an object array, so a
        # release reads and clears its slots' ids in two array operations.
        self.request_id = np.full(n_slots, None, dtype=object)
        self.scratch = np.zeros(n_slots, dtype=np.int64)
        self._free = np.arange(max_requests, 0, -1, dtype=np.int64)
        self.num_free = max_requests
        self.owners: dict[int, Owner] = {}
        self._next_owner = 1
        self._records: list[int] = []  # free owner records of the image, lowest last
        if image is not None:
            self._free = image.free_slots
            self._free[:] = np.arange(max_requests, 0, -1, dtype=np.int64)
            image.set("num_free_slots", max_requests)
            self._records = list(range(image.layout.max_owners - 1, -1, -1))
        self._col = np.arange(table.width, dtype=np.int64)
        self._heads: list[tuple[np.ndarray, np.ndarray] | None] = [None] * (table.width + 1)

    def free_slots(self) -> np.ndarray:
        """The free slot stack (a view). For the audit and tests."""
        return self._free[: self.num_free]

    # ----------------------------------------------------------------- owners

    def add_owner(self, namespace: str = "") -> OwnerId:
        """A new owner's index. O(max_requests) numpy, once: the slot words its slots
        will hold, which every slot check compares with."""
        index = OwnerId(self._next_owner)
        self._make_owner(index, namespace)
        self._next_owner += 1
        if self._image is not None:
            self._image.set("next_owner", self._next_owner)
        return index

    def _make_owner(self, index: OwnerId, namespace: str) -> None:
        """The owner ``index``, with its record in the image when there is one."""
        state = Owner(index, StampedWords.expected(index, self._words.order_size), namespace=namespace)
        image = self._image
        if image is not None:
            if not self._records:
                raise KVMemError(
                    Reason.TOO_MANY_SESSIONS,
                    f"the state image holds {image.layout.max_owners} owners at once, all in use",
                )
            state.record = self._records.pop()
            if image.get("undo_record") == state.record:  # a stale undo record of the record's last owner
                image.set("undo_seq", 0)
            image.owner_seq[state.record] = 0
            image.write_session(state.record, "", "", None)
            image.owner_ns[state.record] = image.namespace_id(namespace)
            image.owner_id[state.record] = index
        self.owners[index] = state

    def install(
        self,
        owners: list[tuple[int, str]],
        next_owner: int,
        slots: np.ndarray,
        owner_of: np.ndarray,
        alloced: np.ndarray,
        rows: np.ndarray,
        request_ids: list[str],
        free_order: np.ndarray,
    ) -> None:
        """A restored state (:mod:`.restore`, which checked it): the owners ``(index,
        namespace)``, open ``slots`` with their owners, lengths, rows and ids, and the
        free slot stack (the top last). The pool's counts are installed apart. O(n *
        width), once."""
        for index, namespace in owners:
            self._make_owner(OwnerId(index), namespace)
        self._next_owner = next_owner
        if self._image is not None:
            self._image.set("next_owner", next_owner)
        if slots.size:
            if self._image is not None:
                self._image.write_request_ids(slots, request_ids)
            self.table.array[slots] = rows
            self.alloced[slots] = alloced
            self.owner_of[slots] = owner_of
            self.request_id[slots] = np.array(request_ids, dtype=object)
        pages = self.table.num_pages_for(alloced)
        for slot, owner, rid, n in zip(slots.tolist(), owner_of.tolist(), request_ids, pages.tolist(), strict=True):
            state = self.owners[owner]
            state.request_slots[rid] = slot
            state.num_requests += 1
            state.num_pages_held += n
        self._free[: free_order.size] = free_order
        self.num_free = int(free_order.size)
        if self._image is not None:
            self._image.set("num_free_slots", self.num_free)

    def remove_owner(self, state: Owner, hold: list[np.ndarray] | None = None) -> int:
        """Release every request of ``state`` (as :meth:`release` would, pages into
        ``hold`` when given) and forget it. Returns the number of requests released.
        O(max_requests + their pages)."""
        open_slots = self.slots_of(state)
        self.release(state, open_slots, hold)
        del self.owners[state.index]
        if self._image is not None:
            self._image.owner_id[state.record] = 0
            self._records.append(state.record)
        return int(open_slots.size)

    def owner(self, index: int) -> Owner:
        state = self.owners.get(index)
        if state is None:
            raise KVMemError(Reason.UNKNOWN_SESSION, f"unknown owner {index!r}", owner=index)
        return state

    def slots_of(self, state: Owner) -> np.ndarray:
        """The open request slots of an owner (int64). O(max_requests)."""
        return np.flatnonzero(self.owner_of[: self.max_requests + 1] == state.index)

    def live_slot(self, state: Owner, rid: str) -> int:
        """The slot ``rid`` has open in ``state``, or 0. O(1). (The map holds only open
        requests; the checks against the slot arrays are for the audit.)"""
        slot = state.request_slots.get(rid, 0)
        if slot and self.owner_of[slot] == state.index and self.request_id[slot] == rid:
            return slot
        return 0

    def count_queries(self, state: Owner, tokens: int) -> None:
        """Tokens ``state``'s match items asked for (:meth:`attach` counts the hits)."""
        state.prefix_query_tokens += tokens

    def count_evictions(self, state: Owner, evicted: int) -> None:
        """Cached pages ``state``'s allocs evicted."""
        state.num_evictions += evicted

    # ------------------------------------------------------------------ open

    def open(self, state: Owner, request_ids: Sequence[str]) -> np.ndarray:
        """Give each request id a slot; an id the owner already has keeps its slot.
        All or nothing. O(n). Returns int32 slots in the order of ``request_ids``.

        Limits, checked first: at most ``max_requests`` ids per call (a longer list
        cannot fit the slot table), each at most :data:`MAX_REQUEST_ID_BYTES` bytes of
        UTF-8."""
        n, limit = len(request_ids), self.max_requests
        if n > limit:
            raise too_many("request_ids", n, limit, "Open")
        live = state.request_slots
        new_ids: dict[str, None] = {}
        for i, rid in enumerate(request_ids):
            if not isinstance(rid, str) or not rid:
                raise KVMemError(Reason.BAD_VALUE, f"request id #{i} must be a non-empty string, got {rid!r}", index=i)
            if len(rid) > _ID_CHARS_ALWAYS_OK:
                _check_id_length(i, rid)
            if rid not in live:
                new_ids[rid] = None
        k, top = len(new_ids), self.num_free
        if k > top:
            raise KVMemError(
                Reason.NO_FREE_REQUEST_SLOT,
                f"no free request slot: {k} new request(s) asked for, {top} of {self.max_requests} slots free",
                requested=k,
                free=top,
            )
        if k:
            taken = self._free[top - k : top][::-1]
            self.num_free = top - k
            if self._image is not None:  # the ids first: a slot with an owner has its id
                self._image.write_request_ids(taken, list(new_ids))
                self._image.set("num_free_slots", top - k)
            self.owner_of[taken] = state.index
            live.update(zip(new_ids, taken.tolist(), strict=True))
            self.request_id[taken] = np.fromiter(new_ids, dtype=object, count=k)
        state.num_requests += k
        return np.fromiter(map(live.__getitem__, request_ids), dtype=np.int32, count=n)

    # --------------------------------------------------- the step's changes

    def release(self, state: Owner, which: np.ndarray, hold: list[np.ndarray] | None = None) -> int:
        """End the requests of slots ``which`` (open, ``state``'s, distinct): drop their
        pages (into ``hold``, a quarantine, when given), zero their rows, free their
        slots. Returns the pages dropped. O(n * width)."""
        dropped = self._drop_rows(which, self.alloced[which], hold)
        state.num_pages_held -= dropped
        self._close(state, which)
        return dropped

    def truncate(self, state: Owner, which: np.ndarray, lens: np.ndarray) -> int:
        """Shrink requests to ``lens`` tokens (each within its length): pages past
        ``ceil(len / page_size)`` are dropped. Returns the pages dropped. O(n + P)."""
        table = self.table
        have = table.num_pages_for(self.alloced[which])
        dropped = self._drop_pages(which, table.num_pages_for(lens), have)
        state.num_pages_held -= dropped
        self.alloced[which] = lens
        return dropped

    def grow(self, state: Owner, which: np.ndarray, end: np.ndarray, where: np.ndarray, num_pages: int) -> np.ndarray:
        """Allocs: take ``num_pages`` pages from the pool (the caller checked they are
        there), write them at the flat block-table positions ``where`` (one each, in
        order: each slot's next columns), and set the lengths of slots ``which`` to
        ``end``. Returns the pages taken (int32). O(n + P)."""
        if num_pages:
            pages = self.pool.take(num_pages)
            self.table.flat[where] = pages
            state.num_pages_held += num_pages
        else:
            pages = NO_INT32
        if crash.armed:
            crash.at("mid-allocs")
        self.alloced[which] = end
        return pages

    def attach(self, state: Owner, which: list[int], runs: list[list[int]]) -> None:
        """Matches: each fresh slot of ``which`` gets the cached pages of its run in
        its first columns, one more reference each, and the length of its full pages.
        O(n + P): a row write per item."""
        array, ps = self.table.array, self.table.page_size
        attached: list[int] = []
        for slot, run in zip(which, runs, strict=True):
            m = len(run)
            array[slot, :m] = run
            self.alloced[slot] = m * ps
            attached.extend(run)
        if attached:
            self.pool.share(np.array(attached, dtype=np.int32))
            state.num_pages_held += len(attached)
            state.prefix_hit_tokens += len(attached) * ps

    def attach_loaded(self, state: Owner, slot: int, col: int, pages: np.ndarray) -> None:
        """A match's pages loaded from the host tier: ``pages`` (just taken, one
        reference each: the row's) go into ``slot``'s row from column ``col`` (after the
        run :meth:`attach` wrote), and the length covers them. O(P)."""
        n = int(pages.size)
        self.table.array[slot, col : col + n] = pages
        self.alloced[slot] = (col + n) * self.table.page_size
        state.num_pages_held += n
        state.prefix_hit_tokens += n * self.table.page_size

    def move(self, src: Owner, dst: Owner, slots: np.ndarray, ids: list[str], *, rename: bool) -> int:
        """Hand-offs and adoptions (:mod:`.handoff`): slots ``slots`` (open, ``src``'s,
        distinct) become ``dst``'s under request ids ``ids``, with their rows, lengths
        and pages as they are (no reference changes: nothing is copied). ``rename``
        writes the ids into the state image too (an adoption; a hand-off's ticket stays
        out of it, see :mod:`.handoff`). Returns the pages the rows hold. O(n)."""
        n = int(slots.size)
        if not n:
            return 0
        pages = int(self.table.num_pages_for(self.alloced[slots]).sum())
        if rename and self._image is not None:
            self._image.write_request_ids(slots, ids)
        collections.deque(map(src.request_slots.pop, self.request_id[slots].tolist()), maxlen=0)
        src.num_requests -= n
        src.num_pages_held -= pages
        self.owner_of[slots] = dst.index
        self.request_id[slots] = np.array(ids, dtype=object)
        dst.request_slots.update(zip(ids, slots.tolist(), strict=True))
        dst.num_requests += n
        dst.num_pages_held += pages
        return pages

    def switch(self, where: np.ndarray, pages: np.ndarray) -> None:
        """Point the flat block-table positions ``where`` at ``pages`` (cached pages
        equal to those there): the new ones gain a reference, the old ones lose theirs.
        Lengths and page counts stay. O(P)."""
        flat = self.table.flat
        old = flat.take(where)
        if self._undo is not None:
            self._undo.entries(where, old)
        flat[where] = pages
        self.pool.share(pages)
        self.pool.unref(old)

    def _close(self, state: Owner, slots: np.ndarray) -> None:
        """Free slots (open, ``state``'s, distinct) whose rows are dropped: lengths 0,
        owner 0, pushed on the free stack with one copy; their request ids leave the
        slot array and the owner's map (released ids keep no memory). O(n): array
        operations, and a dict pop per id in C (one ``clear`` when the owner releases
        every request it has)."""
        self.alloced[slots] = 0
        self._words.word[slots] = 0  # owner and stamp
        top = self.num_free
        self._free[top : top + slots.size] = slots
        self.num_free = top + slots.size
        if self._image is not None:
            self._image.rid_len[slots] = 0
            self._image.set("num_free_slots", self.num_free)
        state.num_requests -= slots.size
        if state.num_requests:
            collections.deque(map(state.request_slots.pop, self.request_id[slots].tolist()), maxlen=0)
        else:
            state.request_slots.clear()
        self.request_id[slots] = None

    def _drop_pages(self, slots: np.ndarray, keep: np.ndarray, have: np.ndarray) -> int:
        """Unreference columns ``[keep, have)`` of each slot's row and zero them.
        Returns the number of entries dropped. O(n + P)."""
        counts = have - keep
        if not np.count_nonzero(counts):
            return 0
        item, cols = segments(keep, counts)
        flat = self.table.flat
        pos = slots[item] * self.table.width + cols
        pages = flat.take(pos)
        if self._undo is not None:
            self._undo.entries(pos, pages)
        self.pool.unref(pages)
        flat[pos] = 0
        return int(pages.size)

    def _drop_rows(self, slots: np.ndarray, alloced: np.ndarray, hold: list[np.ndarray] | None) -> int:
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
        ps = self.table.page_size
        width = -(-longest // ps)
        heads, zero = self._row_heads(width)
        pages = heads[slots].view(_INT32)  # the rows' first `width` entries, row after row
        if self._undo is not None:
            self._undo.rows(slots, width, pages)
        if alloced.item(alloced.argmin()) <= (width - 1) * ps:  # some row holds fewer pages
            pages = pages.reshape(-1, width)[self._col[:width] < self.table.num_pages_for(alloced)[:, None]]
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
            bt = self.table.array
            item = np.dtype((np.void, 4 * width))
            view = np.ndarray((bt.shape[0],), dtype=item, buffer=bt, strides=(bt.strides[0],))
            cached = self._heads[width] = (view, np.zeros((), dtype=item))
        return cached

    # ----------------------------------------------------------------- checks

    def all_mine(self, state: Owner, slots: np.ndarray) -> bool:
        """Every slot open, owned by ``state`` and listed once: the stamped-word check
        (scatter positions, one clipped gather, one byte comparison with ``position <<
        32 | owner``). Raises nothing. The scatter writes only scratch, so a negative
        slot that wraps around in it is harmless; the gather clips, and a clipped slot
        reads slot 0 or the sentinel, which nobody owns. O(n), four array operations."""
        n = slots.size
        words = self._words
        if n > words.order_size:  # more items than slots: some slot is bad or repeated
            return False
        try:
            words.stamp_positions(slots, words.positions(n))
        except IndexError:  # beyond the sentinel
            return False
        return state.slot_expect.startswith(words.word.take(slots, mode="clip"))  # type: ignore[arg-type]  # a buffer

    def check(self, state: Owner, slots: np.ndarray, what: str, released: np.ndarray | None = None) -> None:
        """Every slot open and owned by ``state``, no duplicates, none released in this
        step; else the error naming the first bad item. O(n)."""
        if not self.all_mine(state, slots):
            self._raise_first_bad(state, slots, what)
        if released is not None and released.size:
            scratch = self.scratch
            scratch[slots] = 0
            scratch[released] = 1
            raise_first(
                scratch[slots] == 1,
                lambda i: KVMemError(
                    Reason.SLOT_NOT_FOUND,
                    f"{what}[{i}]: request slot {int(slots[i])} is released earlier in this step",
                    index=i,
                    slot=int(slots[i]),
                ),
            )

    def _raise_first_bad(self, state: Owner, slots: np.ndarray, what: str) -> None:
        """The error for the first slot :meth:`all_mine` refused. O(n)."""
        raise_first_bad_slot(self.owner_of, self.scratch, state.index, slots, what)
