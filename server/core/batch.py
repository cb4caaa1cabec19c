"""The step's boundary: :class:`StepBatch` in, :class:`StepOutcome` out.

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


def _no_int32() -> np.ndarray:
    return NO_INT32


def _empty() -> np.ndarray:
    return EMPTY  # shared and read-only: a column left out costs no allocation


@dataclasses.dataclass(frozen=True, slots=True)
class TokenLists:
    """Token ids of several items, concatenated: item ``i`` is
    ``ids[offsets[i]:offsets[i + 1]]``. ``ids`` is int32 (native order; the wire's
    little-endian bytes on every platform numpy ships on), ``offsets`` int64 ``[n + 1]``,
    non-decreasing from 0 to ``ids.size`` (checked by :meth:`of` and :meth:`from_wire`)."""

    ids: np.ndarray
    offsets: np.ndarray

    @property
    def num_items(self) -> int:
        return int(self.offsets.size) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def item(self, i: int) -> np.ndarray:
        return self.ids[int(self.offsets[i]) : int(self.offsets[i + 1])]

    @classmethod
    def of(cls, lists: Sequence[Sequence[int] | np.ndarray | None], name: str = "token_ids") -> TokenLists:
        """From one sequence (or array) of token ids per item; None is an empty item."""
        parts = [np.zeros(0, dtype=np.int32) if x is None else np.asarray(x) for x in lists]
        for i, part in enumerate(parts):
            if part.size and (part.ndim != 1 or part.dtype.kind not in "iu"):
                raise KVMemError(Reason.BAD_VALUE, f"{name}[{i}] must be a 1-D list of integers", index=i)
            if part.size and (int(part.min()) < -(2**31) or int(part.max()) > INT32_LIMIT):
                raise KVMemError(Reason.BAD_VALUE, f"{name}[{i}] holds a token id outside int32", index=i)
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([p.size for p in parts]) if parts else EMPTY
        ids = np.concatenate([p.astype(np.int32) for p in parts]) if parts else np.zeros(0, dtype=np.int32)
        return cls(ids, offsets)

    @classmethod
    def from_wire(cls, ids: bytes, offsets: bytes, num_items: int, name: str) -> TokenLists | None:
        """From a request's ``<name>_ids`` and ``<name>_offsets`` bytes (int32 LE);
        None when both are empty. BAD_VALUE or LENGTH_MISMATCH naming the field."""
        if not ids and not offsets:
            return None
        if len(ids) % 4 or len(offsets) % 4:
            bad, size = (f"{name}_ids", len(ids)) if len(ids) % 4 else (f"{name}_offsets", len(offsets))
            raise KVMemError(Reason.BAD_VALUE, f"{bad} is {size} bytes long, not a multiple of 4 (int32 LE)")
        off = np.frombuffer(offsets, dtype="<i4").astype(np.int64)
        if off.size != num_items + 1:
            raise _mismatch(f"{name}_offsets", off.size, f"the {num_items} items (+ 1)", num_items + 1)
        tokens = np.frombuffer(ids, dtype="<i4").astype(np.int32, copy=False)
        check_offsets(off, tokens.size, f"{name}_offsets")
        return cls(tokens, off)


INT32_LIMIT = 2**31 - 1


def check_offsets(off: np.ndarray, total: int, name: str) -> None:
    """Offsets start at 0, never decrease and end at ``total``; else BAD_VALUE."""
    if off.size and (int(off[0]) != 0 or int(off[-1]) != total):
        raise KVMemError(
            Reason.BAD_VALUE,
            f"{name} must run from 0 to {total} (the token count), got {int(off[0])} .. {int(off[-1])}",
        )
    raise_first(
        np.diff(off) < 0,
        lambda i: KVMemError(
            Reason.BAD_VALUE, f"{name}[{i + 1}] = {int(off[i + 1])} is below {name}[{i}] = {int(off[i])}", index=i
        ),
    )


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
    release_tokens: TokenLists | None = None  # None: no release item carries tokens
    cache_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    cache_tokens: TokenLists | None = None  # one list per cache item (None only when there are none)
    match_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    match_tokens: TokenLists | None = None  # one list per match item (None only when there are none)
    match_max_tokens: np.ndarray | None = None  # None, or one per match item: -1 = no limit
    # Hand-offs and adoptions (see :mod:`kvmem.server.core.handoff`)
    handoff_slots: np.ndarray = dataclasses.field(default_factory=_empty)
    handoff_states: tuple[bytes, ...] = ()  # empty, or one opaque state per hand-off item
    adopt_tickets: tuple[str, ...] = ()
    adopt_request_ids: tuple[str, ...] = ()  # one per adopt item

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
        release_tokens: Sequence[Sequence[int] | np.ndarray | None] | None = None,
        cache: Sequence[tuple[int, Sequence[int] | np.ndarray]] = (),
        match: Sequence[tuple[int, Sequence[int] | np.ndarray] | tuple[int, Sequence[int] | np.ndarray, int]] = (),
        handoff: Sequence[int] | np.ndarray = (),
        handoff_states: Sequence[bytes] = (),
        adopt: Sequence[tuple[str, str]] = (),
    ) -> StepBatch:
        """A batch from sequences or integer arrays of any dtype; BAD_VALUE names the
        column of anything that is not a 1-D list of integers. ``cache`` items are
        ``(slot, token_ids)``, ``match`` items ``(slot, token_ids[, max_tokens])``,
        ``adopt`` items ``(ticket, request_id)``."""
        limits = [m[2] if len(m) > 2 else NO_EXPECTATION for m in match]
        return cls(
            index_array(release_slots, "release_slots"),
            index_array(truncate_slots, "truncate_slots"),
            index_array(truncate_lens, "truncate_lens"),
            index_array(alloc_slots, "alloc_slots"),
            index_array(alloc_needs, "alloc_needs"),
            None if alloc_expected_lens is None else index_array(alloc_expected_lens, "alloc_expected_lens"),
            atomic,
            None if release_tokens is None else TokenLists.of(release_tokens, "release_token_ids"),
            index_array([c[0] for c in cache], "cache_slots"),
            TokenLists.of([c[1] for c in cache], "cache_token_ids") if cache else None,
            index_array([m[0] for m in match], "match_slots"),
            TokenLists.of([m[1] for m in match], "match_token_ids") if match else None,
            index_array(limits, "match_max_tokens") if any(x != NO_EXPECTATION for x in limits) else None,
            index_array(handoff, "handoff_slots"),
            tuple(handoff_states),
            tuple(a[0] for a in adopt),
            tuple(a[1] for a in adopt),
        )

    def expectations(self) -> np.ndarray | None:
        """``alloc_expected_lens``, or None when it is absent or empty (no expectation)."""
        expected = self.alloc_expected_lens
        return expected if expected is not None and expected.size else None

    def check_lengths(self, max_items: int) -> bool:
        """No column holds more than ``max_items`` (the server's ``max_requests``: a
        step names a request slot at most once per column, so a longer column cannot be
        valid), checked first; and columns of one kind have one length each. O(1):
        plain comparisons, since every step pays for them. Returns whether the step
        carries prefix-cache columns (release tokens, cache or match items): the one
        place that is decided, so the step's path (the decode fast path or not) follows
        from its check."""
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
        prefix = bool(
            self.release_tokens is not None
            or self.cache_slots.size
            or self.match_slots.size
            or self.cache_tokens is not None
            or self.match_tokens is not None
            or self.match_max_tokens is not None
        )
        if prefix:
            self._check_prefix_lengths(max_items)
        if tr != self.truncate_lens.size:
            raise _mismatch("truncate_slots", tr, "truncate_lens", self.truncate_lens.size)
        if al != self.alloc_needs.size:
            raise _mismatch("alloc_slots", al, "alloc_needs", self.alloc_needs.size)
        if expected is not None and expected.size and expected.size != al:
            raise _mismatch("alloc_slots", al, "alloc_expected_lens", expected.size)
        return prefix

    def _check_prefix_lengths(self, max_items: int) -> None:
        """The prefix columns: at most ``max_items`` each, one token list per item."""
        cs, ms = self.cache_slots.size, self.match_slots.size
        if cs > max_items or ms > max_items:
            name, count = ("cache_slots", cs) if cs > max_items else ("match_slots", ms)
            raise too_many(name, count, max_items, "Step column", column=name)
        rel = self.release_slots.size
        for name, tokens, n in (
            ("release_token_offsets", self.release_tokens, rel),
            ("cache_token_offsets", self.cache_tokens, cs),
            ("match_token_offsets", self.match_tokens, ms),
        ):
            have = 0 if tokens is None else tokens.num_items
            if have != n and not (tokens is None and name.startswith("release")):
                raise _mismatch(f"{name.split('_')[0]}_slots", n, name, have + 1 if tokens is not None else 0)
        limits = self.match_max_tokens
        if limits is not None and limits.size and limits.size != ms:
            raise _mismatch("match_slots", ms, "match_max_tokens", limits.size)

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
class StepOutcome:
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
    match_lens: np.ndarray = dataclasses.field(default_factory=_no_int32)  # int32 [m]: tokens each match item matched
    cache_switched: np.ndarray = dataclasses.field(
        default_factory=_no_int32
    )  # int32 [c]: pages of each cache item's row switched to a cached one
    num_pages_cached: int = 0  # pages the step inserted into the prefix cache
    num_pages_evicted: int = 0  # cached pages its allocs evicted
    changed_rows: np.ndarray = dataclasses.field(
        default_factory=_no_int32
    )  # slots whose rows matches and cache items rewrote (int64 or int32)
    tickets: tuple[str, ...] = ()  # one per hand-off item
    adopt_slots: np.ndarray = dataclasses.field(default_factory=_no_int32)  # int32 [a]: each adoption's slot
    adopt_lens: np.ndarray = dataclasses.field(default_factory=_no_int32)  # int32 [a]: its alloced_len
    adopt_states: tuple[bytes, ...] = ()  # the state each ticket was handed off with (b"" if none)
    match_loading: np.ndarray = dataclasses.field(
        default_factory=_no_int32
    )  # int32 [m] with a host tier: of each match's tokens, the last ones still being copied in
    match_fetching: np.ndarray = dataclasses.field(
        default_factory=_no_int32
    )  # int32 [m] with a store: tokens after each match's that are being fetched from the store


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
