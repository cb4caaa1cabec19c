"""Request slots ``[1, max_requests]``, their owners and their lengths."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvmem.server.core.batch import raise_first
from kvmem.server.core.config import OwnerId
from kvmem.server.core.words import StampedWords
from kvmem.server.errors import CorruptionError, KVMemError, Reason


@dataclasses.dataclass(slots=True)
class Owner:
    """Accounting of one owner (a session, known here by its small integer).

    ``num_pages_held`` is the sum over its open requests of their page counts, changed
    only by the step code; ``num_requests`` their number. ``request_slots`` maps request
    ids to slots and may keep entries of released requests: an entry is live only while
    the slot is still this owner's under that id (:meth:`RequestSlots.live_slot`). A
    release therefore costs no per-request dict work; the map is compacted when it
    outgrows twice the open requests (amortised O(1) per release)."""

    index: OwnerId
    slot_expect: bytes  # the slot words of its slots listed at positions 0, 1, 2, ...
    num_pages_held: int = 0
    num_requests: int = 0
    request_slots: dict[str, int] = dataclasses.field(default_factory=dict)


class RequestSlots:
    """Slot state in arrays indexed by slot, and the owners.

    ``owner_of[slot]`` (the value half of each slot's stamped word) is 0 for a closed
    slot; one sentinel entry past ``max_requests`` is always 0, so a clipped
    out-of-range slot reads "not found". ``alloced[slot]`` is the slot's length in
    tokens (0 when closed; int32: a length never exceeds the pool's tokens). Free slots
    are a stack whose top is handed out first; descending, so the first slots are 1,
    2, 3, ... Only this class and the step code change these arrays."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        n_slots = max_requests + 2  # slot 0 padding, last entry a sentinel
        self._words = StampedWords(n_slots, n_slots)
        self.owner_of = self._words.value
        self.alloced = np.zeros(n_slots, dtype=np.int32)
        self.request_id: list[str | None] = [None] * n_slots
        self.scratch = np.zeros(n_slots, dtype=np.int64)  # scratch per slot, for checks
        self._free = np.arange(max_requests, 0, -1, dtype=np.int64)
        self.num_free = max_requests
        self.owners: dict[int, Owner] = {}
        self._next_owner = 1

    def free_slots(self) -> np.ndarray:
        """The free slot stack (a view). For the audit and tests."""
        return self._free[: self.num_free]

    # ----------------------------------------------------------------- owners

    def add_owner(self) -> OwnerId:
        """A new owner's index. O(max_requests) numpy, once: the slot words its slots
        will hold, which every slot check compares with."""
        index = OwnerId(self._next_owner)
        self._next_owner += 1
        self.owners[index] = Owner(index, StampedWords.expected(index, self._words.order_size))
        return index

    def owner(self, index: int) -> Owner:
        state = self.owners.get(index)
        if state is None:
            raise KVMemError(Reason.UNKNOWN_SESSION, f"unknown owner {index!r}", owner=index)
        return state

    def slots_of(self, state: Owner) -> np.ndarray:
        """The open request slots of an owner (int64). O(max_requests)."""
        return np.flatnonzero(self.owner_of[: self.max_requests + 1] == state.index)

    def live_slot(self, state: Owner, rid: str) -> int:
        """The slot ``rid`` has open in ``state``, or 0. O(1)."""
        slot = state.request_slots.get(rid, 0)
        if slot and self.owner_of[slot] == state.index and self.request_id[slot] == rid:
            return slot
        return 0

    # ------------------------------------------------------------ open, close

    def open(self, state: Owner, request_ids: Sequence[str]) -> np.ndarray:
        """Give each request id a slot; an id the owner already has keeps its slot.
        All or nothing. O(n). Returns int32 slots in the order of ``request_ids``."""
        new_ids: dict[str, None] = {}
        for i, rid in enumerate(request_ids):
            if not isinstance(rid, str) or not rid:
                raise KVMemError(Reason.BAD_VALUE, f"request id #{i} must be a non-empty string, got {rid!r}", index=i)
            if not self.live_slot(state, rid):
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
            self.owner_of[taken] = state.index
            for rid, slot in zip(new_ids, taken.tolist(), strict=True):
                state.request_slots[rid] = slot
                self.request_id[slot] = rid
        state.num_requests += k
        return np.fromiter((state.request_slots[r] for r in request_ids), dtype=np.int32, count=len(request_ids))

    def close(self, state: Owner, slots: np.ndarray) -> None:
        """Free slots whose rows the caller has dropped: lengths 0, owner 0, pushed on
        the free stack with one copy. O(n)."""
        self.alloced[slots] = 0
        self._words.word[slots] = 0  # owner and stamp
        top = self.num_free
        self._free[top : top + slots.size] = slots
        self.num_free = top + slots.size
        state.num_requests -= slots.size
        if len(state.request_slots) > 2 * state.num_requests + 64:
            self._compact_request_map(state)

    def _compact_request_map(self, state: Owner) -> None:
        """Rebuild ``state.request_slots`` from the open slots, dropping released ids.
        O(max_requests) numpy plus O(open requests) Python; called once the map holds
        more stale entries than live ones (plus 64), so amortised O(1) per release."""
        ids = self.request_id
        state.request_slots = {ids[s] or "": s for s in self.slots_of(state).tolist()} if state.num_requests else {}

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
        raise_first(
            self.owner_of.take(slots, mode="clip") != state.index,
            lambda i: KVMemError(
                Reason.SLOT_NOT_FOUND,
                f"{what}[{i}]: request slot {int(slots[i])} is not open in this session",
                index=i,
                slot=int(slots[i]),
            ),
        )
        # Every slot is in [1, max_requests] now, so a list longer than the slot table
        # holds a duplicate too; it needs a position per item to say which.
        order = np.arange(slots.size)
        self.scratch[slots] = order
        raise_first(
            self.scratch[slots] != order,
            lambda i: KVMemError(
                Reason.DUPLICATE_SLOT, f"{what}[{i}]: request slot {int(slots[i])} appears twice", index=i,
                slot=int(slots[i]),
            ),
        )  # fmt: skip
        raise CorruptionError(f"{what}: the slot check refused slots it then found valid")
