"""The step's validation.

:func:`validate` checks a whole :class:`StepBatch` before anything changes and returns
what the apply phase needs; bad input raises :class:`KVMemError` naming the column, the
item and the value (the first offending item, by :func:`raise_first`). Releases and
truncates need no plan beyond it: :class:`~kvmem.server.core.slots.RequestTable` applies
them as the batch gives them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvmem.server.core.batch import NO_EXPECTATION, StepBatch, raise_first
from kvmem.server.core.config import INT32_MAX
from kvmem.server.core.slots import Owner, RequestTable
from kvmem.server.errors import KVMemError, Reason


def validate(
    requests: RequestTable, state: Owner, batch: StepBatch, adopted: np.ndarray | None = None
) -> np.ndarray | None:
    """Check every item of ``batch`` (lengths already checked); change nothing.
    Returns each alloc item's length before its alloc (after this step's truncates),
    or None when there are no allocs. ``adopted``: the slots this step's adopt items
    take over (:mod:`.handoff`), which its alloc items may name too. O(n)."""
    rel, tr, al, ms = batch.release_slots, batch.truncate_slots, batch.alloc_slots, batch.match_slots
    if rel.size:
        requests.check(state, rel, "release_slots")
    if tr.size:
        requests.check(state, tr, "truncate_slots", rel)
        _check_truncate_lens(tr, batch.truncate_lens, requests.alloced[tr])
    if ms.size:
        requests.check(state, ms, "match_slots", rel)
    if not al.size:
        return None
    if adopted is not None and adopted.size:
        _check_allocs_adopting(requests, state, al, adopted, rel)
    else:
        requests.check(state, al, "alloc_slots", rel)
    need = batch.alloc_needs
    raise_first(
        need.view(np.uint64) > INT32_MAX,  # negatives wrap to huge
        lambda i: KVMemError(Reason.BAD_VALUE, f"alloc_needs[{i}] must be in [0, 2^31), got {int(need[i])}", index=i),
    )
    if tr.size:
        lengths = requests.alloced.copy()
        lengths[tr] = batch.truncate_lens
        cur = lengths[al]
    else:
        cur = requests.alloced[al]
    expected = batch.expectations()
    if expected is not None:
        if ms.size:
            check_matched_allocs(requests, batch)
        _check_expected(al, expected, cur)
    return cur


def _check_allocs_adopting(
    requests: RequestTable, state: Owner, al: np.ndarray, adopted: np.ndarray, rel: np.ndarray
) -> None:
    """The alloc slots of a step that adopts: each ``state``'s and not released in the
    step, or adopted in it; each listed once. O(n log n): a sort (adopting steps only)."""
    other = ~np.isin(al, adopted)

    def not_found(why: str) -> Callable[[int], KVMemError]:
        def error(i: int) -> KVMemError:
            slot = int(al[i])
            return KVMemError(Reason.SLOT_NOT_FOUND, f"alloc_slots[{i}]: request slot {slot} {why}", index=i, slot=slot)

        return error

    raise_first(
        other & (requests.owner_of.take(al, mode="clip") != state.index), not_found("is not open in this session")
    )
    if rel.size:
        raise_first(other & np.isin(al, rel), not_found("is released earlier in this step"))
    order = np.argsort(al, kind="stable")
    twice = np.flatnonzero(al[order][1:] == al[order][:-1])
    if twice.size:
        i = int(order[twice + 1].min())
        raise KVMemError(
            Reason.DUPLICATE_SLOT,
            f"alloc_slots[{i}]: request slot {int(al[i])} appears twice",
            index=i,
            slot=int(al[i]),
        )


def check_matched_allocs(requests: RequestTable, batch: StepBatch) -> None:
    """An alloc of a slot matched in the same step carries no expected length (the
    match decides it). Called by :func:`validate` once the alloc and match slots
    are checked, before the alloc expectations. O(n)."""
    expected = batch.expectations()
    if expected is not None and batch.match_slots.size:
        ms = batch.match_slots
        scratch = requests.scratch
        al = batch.alloc_slots
        scratch[al] = 0
        scratch[ms] = 1
        raise_first(
            (scratch[al] == 1) & (expected != NO_EXPECTATION),
            lambda i: KVMemError(
                Reason.BAD_VALUE,
                f"alloc_expected_lens[{i}] = {int(expected[i])}: request slot {int(al[i])} is matched in this step, "
                "so its length is not known in advance; send -1",
                index=i,
            ),
        )


def _check_truncate_lens(tr: np.ndarray, lens: np.ndarray, cur: np.ndarray) -> None:
    raise_first(
        lens < 0,
        lambda i: KVMemError(Reason.BAD_VALUE, f"truncate_lens[{i}] must be >= 0, got {int(lens[i])}", index=i),
    )
    raise_first(lens > cur, _disagreement(Reason.TRUNCATE_BEYOND_ALLOCED, "truncate_lens", lens, "is beyond", tr, cur))


def _check_expected(al: np.ndarray, expected: np.ndarray, cur: np.ndarray) -> None:
    raise_first(
        expected < NO_EXPECTATION,
        lambda i: KVMemError(
            Reason.BAD_VALUE, f"alloc_expected_lens[{i}] must be >= 0 (or -1 for none), got {int(expected[i])}", index=i
        ),
    )
    raise_first(
        (expected != NO_EXPECTATION) & (expected != cur),
        _disagreement(Reason.ALLOCED_LEN_MISMATCH, "alloc_expected_lens", expected, "differs from", al, cur),
    )


def _disagreement(
    reason: Reason, column: str, values: np.ndarray, says: str, slots: np.ndarray, cur: np.ndarray
) -> Callable[[int], KVMemError]:
    """The error of item ``i`` whose length ``values[i]`` disagrees with its slot's."""

    def error(i: int) -> KVMemError:
        value, slot, length = int(values[i]), int(slots[i]), int(cur[i])
        message = f"{column}[{i}] = {value} {says} alloced_len {length} of slot {slot}"
        return KVMemError(reason, message, index=i, slot=slot, alloced_len=length)

    return error
