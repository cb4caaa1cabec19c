"""The core's front door: :class:`KVCore`, what the sessions layer calls."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvmem.server.core import step as steps
from kvmem.server.core.alloc import Allocator
from kvmem.server.core.audit import audit
from kvmem.server.core.batch import StepBatch, StepResult, no_allocs
from kvmem.server.core.config import AuditReport, CoreConfig, OwnerId, OwnerUsage, PoolStats
from kvmem.server.core.pool import PagePool
from kvmem.server.core.slots import RequestSlots
from kvmem.server.core.table import BlockTable
from kvmem.server.errors import CorruptionError, KVMemError, Reason


class KVCore:
    """Request slots, block table and per-owner accounting over a :class:`PagePool`.

    Owners are small integers (:meth:`add_owner`); who they are (sessions, names,
    leases, quotas) is the sessions layer's business. Not thread-safe: the server calls
    it from one event loop, so each call is one critical section.

    ``audit_every_step`` runs :meth:`audit` after every mutating call (O(pool): a debug
    switch that the tests and ``KVMEM_DEBUG=1`` turn on).

    Costs are stated per method: ``n`` items in a call, ``T`` tokens it allocates, ``P``
    pages it takes or drops. Nothing is proportional to ``num_pages`` except
    :meth:`audit` and construction.
    """

    def __init__(
        self, config: CoreConfig, block_table: np.ndarray | None = None, *, audit_every_step: bool = False
    ) -> None:
        self.config = config
        self.pool = PagePool(config.num_pages)
        self.table = BlockTable(config, self.pool, block_table)
        self.block_table = self.table.array
        self.slots = RequestSlots(config.max_requests)
        self._allocator = Allocator(config, self.pool, self.table, self.slots)
        self.audit_every_step = audit_every_step
        # Pages of removed owners that no one may take yet, by owner (see remove_owner).
        self._quarantine: dict[int, list[np.ndarray]] = {}

    # ----------------------------------------------------------------- owners

    def add_owner(self) -> OwnerId:
        """A new owner (a session); its index, never reused. O(max_requests), once."""
        return self.slots.add_owner()

    def remove_owner(self, owner: int, *, quarantine: bool = False) -> int:
        """Release every request of ``owner`` (exactly as a release step would) and
        forget it. With ``quarantine`` the pages this leaves unreferenced are not free:
        they are held for ``owner`` (its process may still write into them) until
        :meth:`release_quarantine`. O(its requests + their pages). Returns the number of
        requests."""
        state = self.slots.owner(owner)
        open_slots = self.slots.slots_of(state)
        hold: list[np.ndarray] | None = [] if quarantine else None
        steps.release(self.slots, self.table, state, open_slots, hold)
        del self.slots.owners[owner]
        if hold:
            self._quarantine[owner] = hold
        self._maybe_audit()
        return int(open_slots.size)

    def quarantined_pages(self, owner: int) -> int:
        """Pages held in ``owner``'s quarantine (0 if none). O(its arrays)."""
        return sum(int(a.size) for a in self._quarantine.get(owner, ()))

    def release_quarantine(self, owner: int) -> int:
        """Free the pages held in ``owner``'s quarantine; returns how many (0 if none).
        O(those pages)."""
        hold = self._quarantine.pop(owner, None)
        freed = 0 if hold is None else self.pool.release_held(hold)
        self._maybe_audit()
        return freed

    def has_owner(self, owner: int) -> bool:
        return owner in self.slots.owners

    def pages_held(self, owner: int) -> int:
        """Pages the owner's open requests hold (references). O(1)."""
        return self.slots.owner(owner).num_pages_held

    def slots_of(self, owner: int) -> np.ndarray:
        """The open request slots of ``owner`` (int64). O(max_requests)."""
        return self.slots.slots_of(self.slots.owner(owner))

    # --------------------------------------------------------- open and step

    def open(self, owner: int, request_ids: Sequence[str]) -> np.ndarray:
        """Give each request id a slot; an id the owner already has keeps its slot.
        All or nothing. O(n). Returns int32 slots in the order of ``request_ids``."""
        return self.slots.open(self.slots.owner(owner), request_ids)

    def step(self, owner: int, batch: StepBatch, quota_pages: int | None = None) -> StepResult:
        """One scheduler step: releases, then truncates, then allocs.

        The whole batch is validated before anything changes; bad input raises
        :class:`KVMemError` naming the column, the item and the value. An alloc that
        cannot be served is a per-item status and changes nothing; with ``atomic`` no
        alloc is applied unless all are OK. ``quota_pages`` caps the pages the owner
        may hold after the step (None: no cap).

        Cost: O(n + T + P) numpy work, vectorised across the items; a Python loop over
        items only when the pool or the quota runs short (never over tokens).
        """
        state = self.slots.owner(owner)
        batch.check_lengths(self.config.max_requests)
        rel, tr, al = batch.release_slots, batch.truncate_slots, batch.alloc_slots
        if al.size and not rel.size and not tr.size:
            fast = self._allocator.decode(state, al, batch.alloc_needs, batch.expectations(), quota_pages)
            if fast is not None:
                self._maybe_audit()
                return fast
        cur = steps.validate(self.slots, state, batch)
        dropped = 0
        if rel.size:
            dropped += steps.release(self.slots, self.table, state, rel)
        if tr.size:
            dropped += steps.truncate(self.slots, self.table, state, tr, batch.truncate_lens)
        if cur is None:
            result = no_allocs(dropped)
        else:
            result = self._allocator.alloc(state, al, batch.alloc_needs, cur, batch.atomic, quota_pages)
            result.num_pages_released = dropped
        self._maybe_audit()
        return result

    # ------------------------------------------------------------- inspection

    def alloced_len(self, owner: int, slot: int) -> int:
        state = self.slots.owner(owner)
        if not (1 <= slot <= self.config.max_requests) or self.slots.owner_of[slot] != state.index:
            raise KVMemError(Reason.SLOT_NOT_FOUND, f"request slot {slot} is not open in this session", slot=slot)
        return int(self.slots.alloced[slot])

    def stats(self) -> PoolStats:
        """Pool counters and per-owner usage. O(owners)."""
        num_free = self.pool.num_free
        num_quarantined = self.pool.num_quarantined
        total = self.config.num_pages - 1
        slots = self.slots
        return PoolStats(
            num_pages_total=total,
            num_free_pages=num_free,
            num_cached_pages=0,
            num_used_pages=total - num_free - num_quarantined,
            num_quarantined_pages=num_quarantined,
            num_free_request_slots=slots.num_free,
            num_open_requests=self.config.max_requests - slots.num_free,
            owners=tuple(OwnerUsage(o.index, o.num_requests, o.num_pages_held) for o in slots.owners.values()),
        )

    def audit(self) -> AuditReport:
        """Check every invariant (O(pool): see :func:`kvmem.server.core.audit.audit`)."""
        return audit(self.config, self.pool, self.table, self.slots, self._quarantine)

    def _maybe_audit(self) -> None:
        if self.audit_every_step:
            report = self.audit()
            if not report.ok:
                raise CorruptionError("audit failed: " + "; ".join(report.problems))
