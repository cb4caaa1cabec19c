"""The allocation core: page pool, request slots, block table and batched steps.

Pure numpy. It knows nothing of gRPC, torch or shared memory: the block table is an
int32 array it is *given* (a plain array in tests, a shared-memory view in the server).

Layers, bottom up:

* :class:`PagePool` -- page ids ``[1, num_pages)``, a reference count per page and a
  free stack. Page 0 is the padding page: never handed out, never counted.
* :class:`KVCore` -- request slots ``[1, max_requests]`` and their block-table rows,
  per-owner (session) accounting, and :meth:`KVCore.step`, the one call per scheduler
  step: releases, then truncates, then allocs, validated whole before anything changes.

Costs are stated per method. ``n`` is the number of items in a call, ``T`` the number of
tokens it allocates, ``P`` the number of pages it takes or drops. Nothing is
proportional to ``num_pages`` except :meth:`KVCore.audit` (a debug check) and
construction.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
from collections.abc import Sequence
from typing import NewType

import numpy as np

from kvmem.server.errors import CorruptionError, KVMemError, Reason

PageId = NewType("PageId", int)
RequestSlot = NewType("RequestSlot", int)
OwnerId = NewType("OwnerId", str)

_INT32_MAX = 2**31 - 1
_INT32 = np.dtype(np.int32)  # a dtype instance: a view to it skips resolving the type
_NO_EXPECTATION = -1  # alloc_expected_lens value meaning "no expectation for this item"
_NO_ITEMS: tuple[int, ...] = ()  # the default of step's lists


class AllocStatus(enum.IntEnum):
    """Per-item result of an alloc. Anything but OK changed nothing for that item."""

    OK = 0
    OUT_OF_PAGES = 1
    CONTEXT_TOO_LONG = 2
    QUOTA_EXCEEDED = 3
    ABORTED = 4  # would have fit, but another item of an atomic step failed


@dataclasses.dataclass(frozen=True, slots=True)
class CoreConfig:
    """Pool geometry of the core (token and page counts; memory is not its concern)."""

    num_pages: int  # including the padding page 0
    page_size: int  # tokens per page
    max_requests: int  # request slots 1..max_requests
    max_context_len: int  # tokens per request

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_requests", "max_context_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is padding), got {self.num_pages}")
        if self.num_pages > _INT32_MAX // self.page_size:
            raise ValueError(
                f"num_pages * page_size must fit in int32 token slots, got "
                f"{self.num_pages} * {self.page_size}"
            )

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_context_len // self.page_size)

    @property
    def block_table_shape(self) -> tuple[int, int]:
        return (self.max_requests + 1, self.max_pages_per_request)


@dataclasses.dataclass(slots=True)
class StepResult:
    """What a step did. Per alloc item ``i``: ``alloc_status[i]``, its token slots
    ``kv_loc[kv_loc_offsets[i]:kv_loc_offsets[i+1]]`` and its new pages
    ``new_pages[new_page_offsets[i]:new_page_offsets[i+1]]`` (empty unless OK)."""

    alloc_status: np.ndarray  # int8 [n], AllocStatus values
    kv_loc: np.ndarray  # int32 [T]
    kv_loc_offsets: np.ndarray  # int32 [n + 1]
    new_pages: np.ndarray  # int32 [P]
    new_page_offsets: np.ndarray  # int32 [n + 1]
    num_pages_released: int  # pages dropped by releases and truncates (refs removed)
    num_refused: int = 0  # alloc items whose status is not OK


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerUsage:
    owner: str
    num_requests: int
    num_pages_held: int
    quota_pages: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    num_pages_total: int  # usable pages: num_pages - 1
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int
    num_free_request_slots: int
    num_open_requests: int
    owners: tuple[OwnerUsage, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class AuditReport:
    ok: bool
    problems: tuple[str, ...]
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int


class PagePool:
    """Page ids ``[1, num_pages)`` with a reference count each and a free stack.

    Invariants (only this class changes ``ref_cnt``, ``_free`` and ``_num_free``):
    a page is in ``_free[:_num_free]`` exactly when its ``ref_cnt`` is 0; page 0 is never
    in the stack and its ``ref_cnt`` stays 0. The stack is a preallocated array, so a
    take or a give back of ``P`` pages costs O(P), whatever the pool's size.

    Each page has one 64-bit word: its reference count in the low 32 bits (``ref_cnt``
    is that half, a strided int32 view) and a scratch stamp in the high 32 bits that
    :meth:`unref` uses to find pages listed twice. One word per page lets a free check
    count and stamp with one gather and one comparison: three passes over the pages.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._word = np.zeros(num_pages, dtype=np.int64)
        low = 0 if sys.byteorder == "little" else 1
        self.ref_cnt = self._word.view(np.int32)[low::2]
        self._low = low
        # Descending, so the first pages handed out are 1, 2, 3, ... (readable in tests).
        self._free = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
        self._num_free = num_pages - 1
        self._stamp = self._word.view(np.int32)[1 - low :: 2]
        self._order = np.arange(1 << 16, dtype=np.int32)  # positions, for the stamps
        # The words of pages held once and stamped 0, 1, 2, ...: as bytes, so that a
        # check of n pages is one startswith (no comparison array, no slice copied).
        self._expect_bytes = ((self._order.astype(np.int64) << 32) | 1).tobytes()

    @property
    def num_free(self) -> int:
        return self._num_free

    def take(self, num: int) -> np.ndarray:
        """Pop ``num`` free pages and set their count to 1. O(num). Caller checks space."""
        top = self._num_free
        if num > top:
            raise CorruptionError(f"take({num}) with only {top} free pages")
        pages = self._free[top - num : top][::-1].copy()
        self._num_free = top - num
        self._word[pages] = 1  # count 1, stamp cleared
        return pages

    def unref(self, pages: np.ndarray) -> int:
        """Drop one reference from each entry of ``pages`` (a page may appear several
        times); pages whose count reaches 0 go back to the free stack. A page that is
        already free, page 0, or a page listed more often than it is referenced is a
        double free: nothing changes and :class:`CorruptionError` is raised. Returns the
        number of pages freed.

        Cost O(P), three passes over the pages: each item's position is scattered into
        its page's stamp, one gather reads count and stamp together, and one byte
        comparison with ``position << 32 | 1`` proves at once that every page is held
        once and listed once (a page listed twice keeps only one position); then one
        scatter frees them. Shared pages (counts above 1) take a second look at the counts;
        pages listed more than once are counted with a sort, O(P log P).
        """
        n = pages.size
        if n == 0:
            return 0
        # intp indices (numpy would convert int32 ones on every use), through uint32: a
        # negative id becomes one past the pool and fails the first scatter below; page
        # 0 has count 0, so it is a double free. No pass of its own for either check.
        if pages.dtype == np.int32:
            idx = pages.view(np.uint32).astype(np.intp)
        else:  # not a block table's ids: check the range explicitly
            pages = np.asarray(pages, dtype=np.int64)
            if int(pages.min()) < 0 or int(pages.max()) >= self.num_pages:
                raise self._out_of_range(pages)
            idx = pages.astype(np.intp)
        if n <= self._order.size:
            order, expect = self._order[:n], self._expect_bytes
        else:
            order = np.arange(n, dtype=np.int32)
            expect = ((order.astype(np.int64) << 32) | 1).tobytes()
        try:
            self._stamp[idx] = order  # scratch: changes no count
        except IndexError:
            raise self._out_of_range(pages) from None
        word = self._word
        got = word.take(idx)  # a shade cheaper than word[idx]
        if expect.startswith(got):  # held once, listed once: all become free (got: its buffer, no copy)
            word[idx] = 0
            return self._push(pages)
        halves = got.view(np.int32)
        counts = halves[self._low :: 2]
        if np.count_nonzero(counts < 1):
            bad = pages[counts < 1].tolist()[:16]
            raise CorruptionError(f"double free of page(s) {bad}", pages=bad)
        if np.count_nonzero(halves[1 - self._low :: 2] != order):
            return self._unref_repeated(pages)  # some page listed more than once
        counts = counts - 1
        word[idx] = counts  # new counts, stamps cleared
        return self._push(pages[counts == 0])

    def _out_of_range(self, pages: np.ndarray) -> CorruptionError:
        bad = pages[(pages < 0) | (pages >= self.num_pages)].tolist()[:16]
        return CorruptionError(f"unref of page ids outside [1, {self.num_pages}): {bad}", pages=bad)

    def _unref_repeated(self, pages: np.ndarray) -> int:
        """:meth:`unref` of a list with repeated pages (nothing changed yet). O(P log P)."""
        pages, times = np.unique(pages, return_counts=True)
        idx = pages.astype(np.intp)
        counts = self.ref_cnt[idx]
        short = counts < times
        if np.count_nonzero(short):
            bad = pages[short].tolist()[:16]
            raise CorruptionError(f"double free of page(s) {bad}", pages=bad)
        counts -= times
        self._word[idx] = counts
        return self._push(pages[counts == 0])

    def _push(self, freed: np.ndarray) -> int:
        # A later prefix cache sends cached pages to an evictable LRU here instead.
        top = self._num_free
        self._free[top : top + freed.size] = freed
        self._num_free = top + freed.size
        return int(freed.size)


@dataclasses.dataclass(slots=True)
class _Owner:
    """Accounting of one owner (session). Changed only by KVCore.

    ``num_pages_held`` is the sum over its open requests of their page counts and
    ``num_requests`` their number. ``request_slots`` maps request ids to slots and may
    keep entries of released requests: an entry is live only while the slot is still
    this owner's under that id (:meth:`KVCore._live_slot`). A release therefore costs
    no per-request dict work; the map is compacted when it outgrows twice the open
    requests (amortised O(1) per release)."""

    index: int  # >= 1; written into KVCore._owner_of
    name: str
    quota_pages: int | None
    slot_expect: bytes  # int64 [n_slots] as bytes: the slot word of its slot listed at position i
    num_pages_held: int = 0
    request_slots: dict[str, int] = dataclasses.field(default_factory=dict)
    num_requests: int = 0


def _segments(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For segments ``[starts[i], starts[i] + counts[i])`` return (item index, value) of
    every element, in order. O(n + sum(counts))."""
    total = int(counts.sum())
    item = np.repeat(np.arange(counts.size), counts)
    first = np.cumsum(counts) - counts
    values = np.repeat(starts - first, counts) + np.arange(total)
    return item, values


class KVCore:
    """Request slots, block tables and per-owner accounting over a :class:`PagePool`.

    Not thread-safe: the service calls it from one event loop, so each call is one
    critical section. Slot state lives in arrays indexed by slot; ``_owner_of[slot]`` is
    0 for a closed slot, and has one extra sentinel entry past ``max_requests`` that is
    always 0, so a clipped out-of-range slot is simply "not found".

    Invariants: for every open slot ``s`` the row ``block_table[s]`` holds exactly
    ``ceil(alloced_len[s] / page_size)`` non-zero page ids followed by zeros; closed rows
    and row 0 are all zero.
    """

    def __init__(self, config: CoreConfig, block_table: np.ndarray | None = None) -> None:
        self.config = config
        shape = config.block_table_shape
        if block_table is None:
            block_table = np.zeros(shape, dtype=np.int32)
        if block_table.shape != shape or block_table.dtype != np.int32:
            raise ValueError(
                f"block_table must be int32 {shape}, got {block_table.dtype} {block_table.shape}"
            )
        if not block_table.flags.c_contiguous:
            raise ValueError("block_table must be C-contiguous (its rows are addressed by flat position)")
        block_table[...] = 0
        self.block_table = block_table
        self._bt_flat = block_table.reshape(-1)  # a view: entry (row, col) is row * width + col
        self._width = shape[1]
        self._heads: list[tuple[np.ndarray, np.ndarray] | None] = [None] * (shape[1] + 1)
        self.pool = PagePool(config.num_pages)
        self._ps = config.page_size
        ps = config.page_size
        self._ps_shift = ps.bit_length() - 1 if ps & (ps - 1) == 0 else None
        n_slots = config.max_requests + 2  # slot 0 padding, last entry a sentinel
        # One 64-bit word per slot: the owner index in one half (``_owner_of`` views it)
        # and a scratch stamp in the other, so that a slot check reads both at once.
        self._slot_word = np.zeros(n_slots, dtype=np.int64)
        low = 0 if sys.byteorder == "little" else 1
        self._owner_of = self._slot_word.view(np.int32)[1 - low :: 2]
        self._slot_stamp = self._slot_word.view(np.int32)[low::2]
        self._slot_order = np.arange(n_slots, dtype=np.int32)
        # int32: a length never exceeds the pool's tokens (< 2^31, checked by CoreConfig),
        # and decode arithmetic on it then stays int32 end to end.
        self._alloced = np.zeros(n_slots, dtype=np.int32)
        self._ctx_limit = min(config.max_context_len, _INT32_MAX)
        self._slot_request_id: list[str | None] = [None] * n_slots
        self._slot_scratch = np.zeros(n_slots, dtype=np.int64)
        self._col = np.arange(config.max_pages_per_request, dtype=np.int64)
        self._ramp = _frozen(np.arange(n_slots + 1, dtype=np.int32))  # decode kv_loc offsets
        self._zeros32 = _frozen(np.zeros(n_slots + 1, dtype=np.int32))  # decode page offsets, no page taken
        self._zeros8 = _frozen(np.zeros(n_slots + 1, dtype=np.int8))  # decode status: all OK
        self._ones_bytes = np.ones(n_slots + 1, dtype=np.int64).tobytes()  # decode needs, as bytes
        # Free slots: a stack (the top is handed out first), so a release pushes its
        # slots with one copy. Descending, so the first slots handed out are 1, 2, 3, ...
        self._free_slots = np.arange(config.max_requests, 0, -1, dtype=np.int64)
        self._num_free_slots = config.max_requests
        self._owners: dict[str, _Owner] = {}
        self._next_owner_index = 1
        self.debug = os.environ.get("KVMEM_DEBUG", "") not in ("", "0")

    # ----------------------------------------------------------------- owners

    def add_owner(self, owner: str, quota_pages: int | None = None) -> None:
        """Register an owner (a session). O(max_requests) numpy, once: the slot words
        its slots will hold, which every slot check compares with."""
        if owner in self._owners:
            raise KVMemError(Reason.BAD_VALUE, f"owner {owner!r} already exists", owner=owner)
        if quota_pages is not None and (not isinstance(quota_pages, int) or quota_pages < 0):
            raise KVMemError(Reason.BAD_VALUE, f"quota_pages must be >= 0, got {quota_pages!r}")
        index = self._next_owner_index
        expect = (np.int64(index) << 32) | self._slot_order  # slot word: owner, stamp i
        self._owners[owner] = _Owner(index, owner, quota_pages, expect.tobytes())
        self._next_owner_index += 1

    def remove_owner(self, owner: str) -> int:
        """Release every request of ``owner`` (exactly as a release step would) and
        forget it. O(its requests + their pages). Returns the number of requests."""
        state = self._owner(owner)
        slots = self.slots_of(owner)
        self._release(state, slots)
        del self._owners[owner]
        self._maybe_audit()
        return int(slots.size)

    def pages_held(self, owner: str) -> int:
        """Pages the owner's open requests hold (references). O(1)."""
        return self._owner(owner).num_pages_held

    def has_owner(self, owner: str) -> bool:
        return owner in self._owners

    def slots_of(self, owner: str) -> np.ndarray:
        """The open request slots of ``owner`` (int64). O(max_requests)."""
        state = self._owner(owner)
        return np.flatnonzero(self._owner_of[: self.config.max_requests + 1] == state.index)

    def _live_slot(self, state: _Owner, rid: str) -> int:
        """The slot ``rid`` has open in ``state``, or 0. O(1)."""
        slot = state.request_slots.get(rid, 0)
        if slot and self._owner_of[slot] == state.index and self._slot_request_id[slot] == rid:
            return slot
        return 0

    def _owner(self, owner: str) -> _Owner:
        state = self._owners.get(owner)
        if state is None:
            raise KVMemError(Reason.UNKNOWN_SESSION, f"unknown owner {owner!r}", owner=owner)
        return state

    # ------------------------------------------------------------------- open

    def open(self, owner: str, request_ids: Sequence[str]) -> np.ndarray:
        """Give each request id a slot; an id the owner already has keeps its slot.
        All or nothing. O(n). Returns int32 slots in the order of ``request_ids``."""
        state = self._owner(owner)
        new_ids: dict[str, None] = {}
        for i, rid in enumerate(request_ids):
            if not isinstance(rid, str) or not rid:
                raise KVMemError(Reason.BAD_VALUE, f"request id #{i} must be a non-empty string, got {rid!r}", index=i)
            if not self._live_slot(state, rid):
                new_ids[rid] = None
        k = len(new_ids)
        top = self._num_free_slots
        if k > top:
            raise KVMemError(
                Reason.NO_FREE_REQUEST_SLOT,
                f"no free request slot: {k} new request(s) asked for, "
                f"{top} of {self.config.max_requests} slots free",
                requested=k,
                free=top,
            )
        if k:
            taken = self._free_slots[top - k : top][::-1]
            self._num_free_slots = top - k
            self._owner_of[taken] = state.index
            ids = self._slot_request_id
            for rid, slot in zip(new_ids, taken.tolist()):
                state.request_slots[rid] = slot
                ids[slot] = rid
        state.num_requests += k
        return np.fromiter((state.request_slots[r] for r in request_ids), dtype=np.int32, count=len(request_ids))

    # ------------------------------------------------------------------- step

    def step(
        self,
        owner: str,
        *,
        release_slots: Sequence[int] | np.ndarray = _NO_ITEMS,
        truncate_slots: Sequence[int] | np.ndarray = _NO_ITEMS,
        truncate_lens: Sequence[int] | np.ndarray = _NO_ITEMS,
        alloc_slots: Sequence[int] | np.ndarray = _NO_ITEMS,
        alloc_needs: Sequence[int] | np.ndarray = _NO_ITEMS,
        alloc_expected_lens: Sequence[int] | np.ndarray | None = None,
        atomic: bool = False,
    ) -> StepResult:
        """One scheduler step: releases, then truncates, then allocs.

        The whole step is validated before anything changes; bad input raises
        :class:`KVMemError` naming the list, the item and the value. An alloc that
        cannot be served is a per-item :class:`AllocStatus` and changes nothing; with
        ``atomic`` no alloc is applied unless all are OK.

        Cost: O(n + T + P) numpy work, vectorised across the items; a Python loop over
        items only when the pool or the quota runs short (never over tokens).
        """
        state = self._owner(owner)
        rel = _index_array(release_slots, "release_slots")
        tr = _index_array(truncate_slots, "truncate_slots")
        tr_len = _index_array(truncate_lens, "truncate_lens")
        al = _index_array(alloc_slots, "alloc_slots")
        need = _index_array(alloc_needs, "alloc_needs")
        expected = None if alloc_expected_lens is None else _index_array(alloc_expected_lens, "alloc_expected_lens")
        if tr.size != tr_len.size:
            raise KVMemError(
                Reason.LENGTH_MISMATCH,
                f"truncate_slots has {tr.size} items but truncate_lens has {tr_len.size}",
            )
        if al.size != need.size:
            raise KVMemError(
                Reason.LENGTH_MISMATCH, f"alloc_slots has {al.size} items but alloc_needs has {need.size}"
            )
        if expected is not None and expected.size == 0 and al.size:
            expected = None
        if expected is not None and expected.size != al.size:
            raise KVMemError(
                Reason.LENGTH_MISMATCH,
                f"alloc_slots has {al.size} items but alloc_expected_lens has {expected.size}",
            )

        if al.size and not rel.size and not tr.size:
            result = self._decode(state, al, need, expected)
            if result is not None:
                self._maybe_audit()
                return result

        # --- validate (nothing changes in this block) ---
        if rel.size:
            self._check_slots(state, rel, "release_slots")
        if tr.size:
            self._check_slots(state, tr, "truncate_slots", rel)
            if np.count_nonzero(tr_len < 0):
                i = int(np.flatnonzero(tr_len < 0)[0])
                raise KVMemError(
                    Reason.BAD_VALUE, f"truncate_lens[{i}] must be >= 0, got {int(tr_len[i])}", index=i
                )
            cur = self._alloced[tr]
            if np.count_nonzero(tr_len > cur):
                i = int(np.flatnonzero(tr_len > cur)[0])
                raise KVMemError(
                    Reason.TRUNCATE_BEYOND_ALLOCED,
                    f"truncate_lens[{i}] = {int(tr_len[i])} is beyond alloced_len {int(cur[i])} "
                    f"of slot {int(tr[i])}",
                    index=i,
                    slot=int(tr[i]),
                    alloced_len=int(cur[i]),
                )
        if al.size:
            self._check_slots(state, al, "alloc_slots", rel)
            if np.count_nonzero(need.view(np.uint64) > _INT32_MAX):  # negatives wrap to huge
                i = int(np.flatnonzero((need < 0) | (need > _INT32_MAX))[0])
                raise KVMemError(
                    Reason.BAD_VALUE, f"alloc_needs[{i}] must be in [0, 2^31), got {int(need[i])}", index=i
                )
            if tr.size:
                eff = self._alloced.copy()
                eff[tr] = tr_len
                cur = eff[al]
            else:
                cur = self._alloced[al]
            if expected is not None:
                given = expected != _NO_EXPECTATION
                if np.count_nonzero(expected < _NO_EXPECTATION):
                    i = int(np.flatnonzero(expected < _NO_EXPECTATION)[0])
                    raise KVMemError(
                        Reason.BAD_VALUE,
                        f"alloc_expected_lens[{i}] must be >= 0 (or -1 for none), got {int(expected[i])}",
                        index=i,
                    )
                wrong = given & (expected != cur)
                if np.count_nonzero(wrong):
                    i = int(np.flatnonzero(wrong)[0])
                    raise KVMemError(
                        Reason.ALLOCED_LEN_MISMATCH,
                        f"alloc_expected_lens[{i}] = {int(expected[i])} but slot {int(al[i])} has "
                        f"alloced_len {int(cur[i])}",
                        index=i,
                        slot=int(al[i]),
                        alloced_len=int(cur[i]),
                    )

        # --- apply: releases, truncates (cannot fail on valid input) ---
        dropped = 0
        if rel.size:
            dropped += self._release(state, rel)
        if tr.size:
            dropped += self._truncate(state, tr, tr_len)
        result = self._alloc(state, al, need, cur if al.size else None, atomic)
        result.num_pages_released = dropped
        self._maybe_audit()
        return result

    def _slots_ok(self, state: _Owner, slots: np.ndarray) -> bool:
        """Every slot open, owned by ``state`` and listed once. Raises nothing; the
        decode path and :meth:`_check_slots` share it. O(n), four array operations:
        each item's position is scattered into its slot's stamp, then one gather of
        the slot words and one comparison with ``owner << 32 | position`` prove
        ownership and uniqueness together (a slot listed twice keeps one position).
        The scatter only writes scratch, so a negative slot that wraps around in it is
        harmless; the gather clips, and a clipped slot reads slot 0 or the sentinel,
        which nobody owns."""
        n = slots.size
        if n > self._slot_order.size:  # more items than slots: some slot is bad or repeated
            return False
        try:
            self._slot_stamp[slots] = self._slot_order[:n]
        except IndexError:  # beyond the sentinel
            return False
        # A prefix test of the bytes (the gathered array's buffer; no comparison array,
        # no slice of the expectation, no copy).
        return state.slot_expect.startswith(self._slot_word.take(slots, mode="clip"))

    def _check_slots(self, state: _Owner, slots: np.ndarray, what: str, released: np.ndarray | None = None) -> None:
        """Every slot open and owned by ``state``, no duplicates, none released in this
        step; else the error naming the first bad item. O(n)."""
        if not self._slots_ok(state, slots):
            raise self._first_bad_slot(state, slots, what)
        scratch = self._slot_scratch
        if released is not None and released.size:
            scratch[slots] = 0
            scratch[released] = 1
            hit = scratch[slots] == 1
            if np.count_nonzero(hit):
                i = int(np.flatnonzero(hit)[0])
                raise KVMemError(
                    Reason.SLOT_NOT_FOUND,
                    f"{what}[{i}]: request slot {int(slots[i])} is released earlier in this step",
                    index=i,
                    slot=int(slots[i]),
                )

    def _first_bad_slot(self, state: _Owner, slots: np.ndarray, what: str) -> KVMemError:
        """The error for the first slot :meth:`_slots_ok` refused. O(n)."""
        own = self._owner_of.take(slots, mode="clip")
        if np.count_nonzero(own != state.index):
            i = int(np.flatnonzero(own != state.index)[0])
            return KVMemError(
                Reason.SLOT_NOT_FOUND,
                f"{what}[{i}]: request slot {int(slots[i])} is not open in this session",
                index=i,
                slot=int(slots[i]),
            )
        # Every slot is in [1, max_requests] now, so a list longer than the slot table
        # holds a duplicate too; it needs a position per item to say which.
        order = np.arange(slots.size)
        scratch = self._slot_scratch
        scratch[slots] = order
        i = int(np.flatnonzero(scratch[slots] != order)[0])
        return KVMemError(
            Reason.DUPLICATE_SLOT, f"{what}[{i}]: request slot {int(slots[i])} appears twice", index=i,
            slot=int(slots[i]),
        )

    def _num_pages_for(self, tokens: np.ndarray) -> np.ndarray:
        return (tokens + (self._ps - 1)) // self._ps

    def _drop_pages(self, slots: np.ndarray, keep: np.ndarray, have: np.ndarray) -> int:
        """Unreference columns ``[keep, have)`` of each slot's row and zero them. O(n+P)."""
        counts = have - keep
        if not np.count_nonzero(counts):
            return 0
        item, cols = _segments(keep, counts)
        pos = slots[item] * self._width + cols
        flat = self._bt_flat
        pages = flat.take(pos)
        self.pool.unref(pages)
        flat[pos] = 0
        return int(pages.size)

    def _drop_rows(self, slots: np.ndarray, alloced: np.ndarray) -> int:
        """Unreference every page of each slot's row (``alloced`` tokens long) and zero
        the rows: one gather of each row's first ``width`` entries (``width`` pages for
        the longest row) instead of a per-page gather, and one zeroing of the same.
        O(n * width)."""
        if not alloced.size:
            return 0
        longest = alloced.item(alloced.argmax())  # argmax: a third of max()'s fixed cost
        if longest == 0:
            return 0
        ps = self._ps
        width = -(-longest // ps)
        heads, zero = self._row_heads(width)
        pages = heads[slots].view(_INT32)  # the rows' first `width` entries, row after row
        if alloced.item(alloced.argmin()) <= (width - 1) * ps:  # some row holds fewer pages
            pages = pages.reshape(-1, width)[self._col[:width] < self._num_pages_for(alloced)[:, None]]
        self.pool.unref(pages)
        heads[slots] = zero
        return int(pages.size)

    def _row_heads(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """The block table's rows cut to their first ``width`` entries, as a 1-D array
        of ``4 * width``-byte items over the same memory, and a zero item. Gathering or
        zeroing n rows' heads is then a 1-D fancy index, one copy per row: a half to a
        third of the 2-D index's cost, most of all for few rows. Built once per width
        (the constructor alone costs about a gather of 256 rows)."""
        cached = self._heads[width]
        if cached is None:
            bt = self.block_table
            item = np.dtype((np.void, 4 * width))
            view = np.ndarray((bt.shape[0],), dtype=item, buffer=bt, strides=(bt.strides[0],))
            cached = self._heads[width] = (view, np.zeros((), dtype=item))
        return cached

    def _release(self, state: _Owner, slots: np.ndarray) -> int:
        """End requests: drop their pages, zero their rows, free their slots."""
        dropped = self._drop_rows(slots, self._alloced[slots])
        state.num_pages_held -= dropped
        self._alloced[slots] = 0
        self._slot_word[slots] = 0  # owner and stamp
        top = self._num_free_slots
        self._free_slots[top : top + slots.size] = slots
        self._num_free_slots = top + slots.size
        state.num_requests -= slots.size
        if len(state.request_slots) > 2 * state.num_requests + 64:
            self._compact_request_map(state)
        return dropped

    def _compact_request_map(self, state: _Owner) -> None:
        """Rebuild ``state.request_slots`` from the open slots, dropping released ids.
        O(max_requests) numpy plus O(open requests) Python; called once the map holds
        more stale entries than live ones (plus 64), so amortised O(1) per release."""
        if state.num_requests == 0:
            state.request_slots = {}
            return
        ids = self._slot_request_id
        state.request_slots = {ids[s]: s for s in self.slots_of(state.name).tolist()}

    def _truncate(self, state: _Owner, slots: np.ndarray, new_lens: np.ndarray) -> int:
        have = self._num_pages_for(self._alloced[slots])
        keep = self._num_pages_for(new_lens)
        dropped = self._drop_pages(slots, keep, have)
        state.num_pages_held -= dropped
        self._alloced[slots] = new_lens
        return dropped

    def _alloc(self, state: _Owner, slots: np.ndarray, need: np.ndarray, cur: np.ndarray | None, atomic: bool) -> StepResult:
        n = slots.size
        if n == 0:
            return StepResult(_NO_STATUS, _NO_INT32, _ZERO_OFFSETS, _NO_INT32, _ZERO_OFFSETS, 0)
        assert cur is not None
        ps = self._ps
        cfg = self.config
        end = cur + need
        have = self._num_pages_for(cur)
        cnt = self._num_pages_for(end) - have
        status = np.zeros(n, dtype=np.int8)
        refused = 0
        total = int(cnt.sum())
        quota_left = None if state.quota_pages is None else state.quota_pages - state.num_pages_held
        too_long = end > cfg.max_context_len
        fits = (
            not np.count_nonzero(too_long)
            and total <= self.pool.num_free
            and (quota_left is None or total <= quota_left)
        )
        if not fits:
            # Short on pages or quota, or too long: admit items in order (greedy, like
            # per-request calls would). A loop over items, not tokens.
            pool_left = self.pool.num_free
            q_left = quota_left
            codes = []
            for c, long_ in zip(cnt.tolist(), too_long.tolist()):
                if long_:
                    codes.append(AllocStatus.CONTEXT_TOO_LONG)
                elif q_left is not None and c > q_left:
                    codes.append(AllocStatus.QUOTA_EXCEEDED)
                elif c > pool_left:
                    codes.append(AllocStatus.OUT_OF_PAGES)
                else:
                    codes.append(AllocStatus.OK)
                    pool_left -= c
                    if q_left is not None:
                        q_left -= c
            status[:] = codes
            ok = status == AllocStatus.OK
            if atomic and not ok.all():
                status[ok] = AllocStatus.ABORTED
                ok[:] = False
            refused = n - int(np.count_nonzero(ok))
            cnt = np.where(ok, cnt, 0)
            need = np.where(ok, need, 0)
            end = np.where(ok, end, cur)
            total = int(cnt.sum())

        # Take pages and write them into the rows (columns have .. have+cnt-1).
        bt = self.block_table
        if total:
            if total == np.count_nonzero(cnt):  # at most one new page per item (decode)
                mask = cnt > 0
                where = slots[mask] * self._width + have[mask]
            else:
                item, cols = _segments(have, cnt)
                where = slots[item] * self._width + cols
            pages = self.pool.take(total)
            self._bt_flat[where] = pages  # 1-D: cheaper than bt[rows, cols] = pages
        else:
            pages = self.pool.take(0)
        self._alloced[slots] = end
        state.num_pages_held += total

        # kv_loc: the tokens [cur, end) of each item, through its (updated) row.
        num_tokens = int(need.sum())
        busy = np.count_nonzero(need)
        if num_tokens == busy:  # at most one token per item: one gather
            idx = np.flatnonzero(need) if busy != n else slice(None)
            pos = cur[idx]
            kv_loc = (bt[slots[idx], pos // ps] * ps + pos % ps).astype(np.int32)
        else:
            kv_loc = self._kv_loc_by_page(slots, cur, end, need)
        kv_off = np.zeros(n + 1, dtype=np.int32)
        kv_off[1:] = np.cumsum(need)  # cumsum into an int32 slice is several times slower
        page_off = np.zeros(n + 1, dtype=np.int32)
        page_off[1:] = np.cumsum(cnt)
        return StepResult(status, kv_loc, kv_off, pages, page_off, 0, refused)

    def _decode(
        self, state: _Owner, slots: np.ndarray, need: np.ndarray, expected: np.ndarray | None
    ) -> StepResult | None:
        """A step of allocs only, one token each, every item valid and served: a
        decode step, the one a server makes most. It validates and applies in about
        25 array operations instead of the general path's 35 (a step arrives with the
        caches cold, where each operation's fixed cost dominates at these sizes).
        Returns None, having changed nothing, when anything is off (a bad or
        duplicate slot, a need other than 1, an expectation not met, the pool or the
        quota short, the context limit): the general path then decides, raises or
        answers per item. O(n).

        An item opens a new page exactly when its length is page-aligned; its token
        goes to ``page * page_size + length % page_size`` of the page its row holds
        at column ``length // page_size``."""
        n = slots.size
        # Comparing bytes and reading the longest length (argmax) cost half of a
        # comparison plus a count each.
        if not self._ones_bytes.startswith(need.tobytes()) or not self._slots_ok(state, slots):
            return None
        cur = self._alloced[slots]
        if expected is not None:
            wrong = expected != cur
            if np.count_nonzero(wrong) and np.count_nonzero(expected[wrong] != _NO_EXPECTATION):
                return None
        if cur.item(cur.argmax()) >= self._ctx_limit:
            return None
        ps = self._ps
        if self._ps_shift is not None:  # a power of two: two cheap ufuncs beat divmod's one
            col = cur >> self._ps_shift
            rem = cur & (ps - 1)
        else:
            col, rem = np.divmod(cur, ps)
        grow = rem == 0
        total = int(np.count_nonzero(grow))
        quota = state.quota_pages
        if total > self.pool.num_free or (quota is not None and total > quota - state.num_pages_held):
            return None
        pos = slots * self._width + col  # flat block-table entries: 1-D indexing is cheaper
        flat = self._bt_flat
        page = flat.take(pos)  # int32: the page each token lands in (0 where a new one goes)
        if total:
            new_pos = pos[grow]
            pages = self.pool.take(total)
            page[grow] = pages
            flat[new_pos] = pages
            page_off = np.zeros(n + 1, dtype=np.int32)
            np.add.accumulate(grow, dtype=np.int32, out=page_off[1:])  # half np.cumsum's cost
            state.num_pages_held += total
        else:
            pages = _NO_INT32
            page_off = self._zeros32[: n + 1]
        self._alloced[slots] = cur + 1
        kv_loc = page * ps
        kv_loc += rem  # int32 throughout
        return StepResult(self._zeros8[:n], kv_loc, self._ramp[: n + 1], pages, page_off, 0)

    def _kv_loc_by_page(self, slots: np.ndarray, cur: np.ndarray, end: np.ndarray, need: np.ndarray) -> np.ndarray:
        """kv_loc of many tokens per item, by page: each touched page contributes a run
        ``page * page_size + [lo, hi)``, so the whole answer is one ``repeat`` of a base
        per page plus one ``arange`` over the tokens. O(n + P + T), P the pages touched."""
        ps = self._ps
        busy = need > 0
        slots, cur, end = slots[busy], cur[busy], end[busy]
        first = cur // ps
        touched = (end - 1) // ps - first + 1
        item, cols = _segments(first, touched)
        pages = self.block_table[slots[item], cols].astype(np.int64)
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

    # ------------------------------------------------------------ inspection

    def alloced_len(self, owner: str, slot: int) -> int:
        state = self._owner(owner)
        if not (1 <= slot <= self.config.max_requests) or self._owner_of[slot] != state.index:
            raise KVMemError(Reason.SLOT_NOT_FOUND, f"request slot {slot} is not open in this session", slot=slot)
        return int(self._alloced[slot])

    def stats(self) -> PoolStats:
        """Pool counters and per-owner usage. O(owners)."""
        num_free = self.pool.num_free
        total = self.config.num_pages - 1
        return PoolStats(
            num_pages_total=total,
            num_free_pages=num_free,
            num_cached_pages=0,
            num_used_pages=total - num_free,
            num_free_request_slots=self._num_free_slots,
            num_open_requests=self.config.max_requests - self._num_free_slots,
            owners=tuple(
                OwnerUsage(o.name, o.num_requests, o.num_pages_held, o.quota_pages)
                for o in self._owners.values()
            ),
        )

    def audit(self) -> AuditReport:
        """Check every invariant of the pool. O(num_pages + max_requests *
        max_pages_per_request): a debug check, run after every step in tests and when
        ``KVMEM_DEBUG=1``; Stats runs it on demand."""
        problems: list[str] = []
        cfg = self.config
        pool = self.pool
        bt = self.block_table
        ref = pool.ref_cnt
        free = pool._free[: pool.num_free]
        if ref[0] != 0:
            problems.append(f"page 0 has ref_cnt {int(ref[0])}")
        if np.count_nonzero(ref < 0):
            problems.append(f"negative ref_cnt on pages {np.flatnonzero(ref < 0).tolist()[:16]}")
        if free.size and (np.count_nonzero(free <= 0) or np.count_nonzero(free >= cfg.num_pages)):
            problems.append("free stack holds ids outside [1, num_pages)")
        else:
            in_free = np.bincount(free, minlength=cfg.num_pages)
            if np.count_nonzero(in_free > 1):
                problems.append(f"pages in the free stack twice: {np.flatnonzero(in_free > 1).tolist()[:16]}")
            both = (in_free > 0) & (ref > 0)
            if np.count_nonzero(both):
                problems.append(f"free pages with references: {np.flatnonzero(both).tolist()[:16]}")
        num_used = int(np.count_nonzero(ref[1:] > 0))
        num_cached = 0
        if pool.num_free + num_cached + num_used != cfg.num_pages - 1:
            problems.append(
                f"free {pool.num_free} + cached {num_cached} + used {num_used} != {cfg.num_pages - 1} pages"
            )
        # Block table against reference counts.
        have = self._num_pages_for(self._alloced[: cfg.max_requests + 1])
        open_ = self._owner_of[: cfg.max_requests + 1] != 0
        if np.count_nonzero(have[~open_]):
            problems.append("closed request slots with alloced_len > 0")
        valid = np.arange(bt.shape[1])[None, :] < np.where(open_, have, 0)[:, None]
        if np.count_nonzero(bt[~valid]):
            rows = np.flatnonzero((bt * ~valid).any(axis=1))
            problems.append(f"non-zero block-table entries past a request's pages in rows {rows.tolist()[:16]}")
        held = bt[valid]
        if np.count_nonzero(held <= 0) or np.count_nonzero(held >= cfg.num_pages):
            problems.append("block table holds page ids outside [1, num_pages) within a request's pages")
        else:
            refs = np.bincount(held, minlength=cfg.num_pages)
            if not np.array_equal(refs, ref):
                diff = np.flatnonzero(refs != ref)
                problems.append(f"ref_cnt differs from block-table references on pages {diff.tolist()[:16]}")
        # Per-owner totals.
        owner_index = {o.index: o for o in self._owners.values()}
        for o in self._owners.values():
            slots = self.slots_of(o.name)
            if slots.size != o.num_requests:
                problems.append(f"owner {o.name!r} counts {o.num_requests} requests but owns {slots.size} slots")
            lost = [int(x) for x in slots.tolist() if self._live_slot(o, self._slot_request_id[x] or "") != x]
            if lost:
                problems.append(f"owner {o.name!r} has open slots its request ids do not map to: {lost[:16]}")
            if int(have[slots].sum()) != o.num_pages_held:
                problems.append(
                    f"owner {o.name!r} holds {o.num_pages_held} pages by its count, "
                    f"{int(have[slots].sum())} by its rows"
                )
        owned = self._owner_of[1 : cfg.max_requests + 1]
        unknown = set(np.unique(owned[owned != 0]).tolist()) - set(owner_index)
        if unknown:
            problems.append(f"slots owned by unknown owner indices {sorted(unknown)}")
        if self._num_free_slots + int(np.count_nonzero(owned)) != cfg.max_requests:
            problems.append("free request slots + open request slots != max_requests")
        free_slots = self._free_slots[: self._num_free_slots]
        if free_slots.size and (int(free_slots.min()) < 1 or int(free_slots.max()) > cfg.max_requests):
            problems.append("free request slot stack holds slots outside [1, max_requests]")
        elif np.count_nonzero(self._owner_of[free_slots]) or np.unique(free_slots).size != free_slots.size:
            problems.append("free request slot stack holds open or repeated slots")
        return AuditReport(not problems, tuple(problems), pool.num_free, num_cached, num_used)

    def _maybe_audit(self) -> None:
        if self.debug:
            report = self.audit()
            if not report.ok:
                raise CorruptionError("audit failed: " + "; ".join(report.problems))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_EMPTY = _frozen(np.zeros(0, dtype=np.int64))
_NO_STATUS = _frozen(np.zeros(0, dtype=np.int8))
_NO_INT32 = _frozen(np.zeros(0, dtype=np.int32))
_ZERO_OFFSETS = _frozen(np.zeros(1, dtype=np.int32))


def _index_array(values: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """An int64 1-D array from a sequence or array of integers, or INVALID_ARGUMENT."""
    if values is _NO_ITEMS:  # an argument left out: the common case of a one-kind step
        return _EMPTY
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values
    if isinstance(values, (tuple, list)) and not values:
        return _EMPTY
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError, TypeError) as exc:
        raise KVMemError(Reason.BAD_VALUE, f"{name} must be a list of integers: {exc}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1:
        raise KVMemError(Reason.BAD_VALUE, f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise KVMemError(Reason.BAD_VALUE, f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and np.count_nonzero(arr > np.iinfo(np.int64).max):
        raise KVMemError(Reason.BAD_VALUE, f"{name} holds a value beyond int64")
    return arr.astype(np.int64, copy=False)
