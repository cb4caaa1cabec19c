"""The step's boundary: :class:`StepBatch` in, :class:`StepResult` out.

A :class:`StepBatch` is built once from the wire (the service) or from Python values
(:meth:`StepBatch.of`, for tests and benchmarks) and passed unchanged through the
sessions layer to the core, which validates it once. The prefix cache adds its
columns here.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

import numpy as np

from kvmem.server.errors import KVMemError, Reason

NO_EXPECTATION = -1  # an alloc_expected_lens value: "no expectation for this item"


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


EMPTY = frozen(np.zeros(0, dtype=np.int64))
NO_STATUS = frozen(np.zeros(0, dtype=np.int8))
NO_INT32 = frozen(np.zeros(0, dtype=np.int32))
ZERO_OFFSETS = frozen(np.zeros(1, dtype=np.int32))


def _empty() -> np.ndarray:
    return EMPTY  # shared and read-only: a column left out costs no allocation


class AllocStatus(enum.IntEnum):
    """Per-item result of an alloc. Anything but OK changed nothing for that item."""

    OK = 0
    OUT_OF_PAGES = 1
    CONTEXT_TOO_LONG = 2
    QUOTA_EXCEEDED = 3
    ABORTED = 4  # would have fit, but another item of an atomic step failed


@dataclasses.dataclass(slots=True)
class StepBatch:
    """One scheduler step's items, columnar: int64 1-D arrays (use :meth:`of` for
    anything else). ``alloc_expected_lens`` is None or one value per alloc item,
    :data:`NO_EXPECTATION` meaning none for that item. Not copied by the core."""

    release_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    truncate_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    truncate_lens: np.ndarray = dataclasses.field(default_factory=_empty)
    alloc_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    alloc_needs: np.ndarray = dataclasses.field(default_factory=_empty)
    alloc_expected_lens: np.ndarray | None = None
    atomic: bool = False

    @classmethod
    def of(
        cls,
        *,
        release_slots: Sequence[int] | np.ndarray = (),
        truncate_slots: Sequence[int] | np.ndarray = (),
        truncate_lens: Sequence[int] | np.ndarray = (),
        alloc_slots: Sequence[int] | np.ndarray = (),
        alloc_needs: Sequence[int] | np.ndarray = (),
        alloc_expected_lens: Sequence[int] | np.ndarray | None = None,
        atomic: bool = False,
    ) -> StepBatch:
        """A batch from sequences or integer arrays of any dtype; BAD_VALUE names the
        column of anything that is not a 1-D list of integers."""
        return cls(
            index_array(release_slots, "release_slots"),
            index_array(truncate_slots, "truncate_slots"),
            index_array(truncate_lens, "truncate_lens"),
            index_array(alloc_slots, "alloc_slots"),
            index_array(alloc_needs, "alloc_needs"),
            None if alloc_expected_lens is None else index_array(alloc_expected_lens, "alloc_expected_lens"),
            atomic,
        )

    def expectations(self) -> np.ndarray | None:
        """``alloc_expected_lens``, or None when it is absent or empty (no expectation)."""
        expected = self.alloc_expected_lens
        return expected if expected is not None and expected.size else None

    def check_lengths(self, max_items: int) -> None:
        """No column holds more than ``max_items`` (the server's ``max_requests``: a
        step names a request slot at most once per column, so a longer column cannot be
        valid), checked first; and columns of one kind have one length each. O(1):
        plain comparisons, since every step pays for them."""
        rel, tr, al = self.release_slots.size, self.truncate_slots.size, self.alloc_slots.size
        expected = self.alloc_expected_lens
        if (
            rel > max_items
            or tr > max_items
            or al > max_items
            or self.truncate_lens.size > max_items
            or self.alloc_needs.size > max_items
            or (expected is not None and expected.size > max_items)
        ):
            raise self._too_many_items(max_items)
        if tr != self.truncate_lens.size:
            raise _mismatch("truncate_slots", tr, "truncate_lens", self.truncate_lens.size)
        if al != self.alloc_needs.size:
            raise _mismatch("alloc_slots", al, "alloc_needs", self.alloc_needs.size)
        if expected is not None and expected.size and expected.size != al:
            raise _mismatch("alloc_slots", al, "alloc_expected_lens", expected.size)

    def _too_many_items(self, max_items: int) -> KVMemError:
        """The error naming the first column over ``max_items`` and its count."""
        for name in _COLUMNS:
            column = getattr(self, name)
            if column is not None and column.size > max_items:
                return too_many(name, column.size, max_items, "Step column", column=name)
        raise AssertionError("no column is over the limit")


_COLUMNS = ("release_slots", "truncate_slots", "truncate_lens", "alloc_slots", "alloc_needs", "alloc_expected_lens")


def too_many(name: str, count: int, limit: int, per: str, **metadata: object) -> KVMemError:
    """A list longer than ``max_requests`` (``limit``): it cannot be valid, since it
    would name a request slot twice or more requests than the server has slots."""
    return KVMemError(
        Reason.BAD_VALUE,
        f"{name} has {count} items, at most max_requests = {limit} per {per}",
        count=count,
        limit=limit,
        **metadata,
    )


def _mismatch(name: str, n: int, other: str, m: int) -> KVMemError:
    return KVMemError(Reason.LENGTH_MISMATCH, f"{name} has {n} items but {other} has {m}")


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


def no_allocs(num_pages_released: int = 0) -> StepResult:
    return StepResult(NO_STATUS, NO_INT32, ZERO_OFFSETS, NO_INT32, ZERO_OFFSETS, num_pages_released)


def raise_first(bad: np.ndarray, error: Callable[[int], KVMemError]) -> None:
    """The one "first offending item" rule: raise ``error(i)`` for the first ``i``
    where ``bad`` holds; nothing (one count) when no item is bad. O(n)."""
    if np.count_nonzero(bad):
        raise error(int(np.flatnonzero(bad)[0]))


def index_array(values: Sequence[int] | np.ndarray, name: str) -> np.ndarray:
    """An int64 1-D array from a sequence or array of integers, or BAD_VALUE."""
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values
    if isinstance(values, (tuple, list)) and not values:
        return EMPTY
    try:
        arr = np.asarray(values)
    except (OverflowError, ValueError, TypeError) as exc:
        raise KVMemError(Reason.BAD_VALUE, f"{name} must be a list of integers: {exc}") from None
    if arr.size == 0:
        return EMPTY
    if arr.ndim != 1:
        raise KVMemError(Reason.BAD_VALUE, f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise KVMemError(Reason.BAD_VALUE, f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.dtype == np.uint64 and np.count_nonzero(arr > np.iinfo(np.int64).max):
        raise KVMemError(Reason.BAD_VALUE, f"{name} holds a value beyond int64")
    return arr.astype(np.int64, copy=False)
