"""The core's front door: :class:`KVCore`, what the sessions layer calls."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from kvmem.server.core import crash, prefix_step
from kvmem.server.core import step as steps
from kvmem.server.core.alloc import NO_ALLOCS, Allocator
from kvmem.server.core.audit import audit
from kvmem.server.core.batch import NO_INT32, StepBatch, StepOutcome
from kvmem.server.core.config import AuditReport, CoreConfig, HostTierStats, OwnerId, OwnerUsage, PoolStats
from kvmem.server.core.events import AllCleared, CacheEvent
from kvmem.server.core.handoff import Tickets
from kvmem.server.core.hashing import PageKeys, XXH3Keys
from kvmem.server.core.image import CoreImage
from kvmem.server.core.pool import PagePool
from kvmem.server.core.prefix import PrefixCache
from kvmem.server.core.slots import Owner, RequestTable
from kvmem.server.core.table import BlockTable
from kvmem.server.core.tier import HostTier
from kvmem.server.core.undo import UndoLog
from kvmem.server.errors import CorruptionError, KVMemError, Reason


class KVCore:
    """Request slots, block table and per-owner accounting over a :class:`PagePool`.

    Each invariant has one owner that alone changes its state: the :class:`PagePool`
    (``pool``) the reference counts and the free stack, the
    :class:`~kvmem.server.core.slots.RequestTable` (``slots``) the rows, lengths, slot
    owners and per-owner accounting, the :class:`PrefixCache` (``cache``) its keys and
    evictable queue. The step, alloc and prefix modules plan; they call the owners to
    change anything.

    Owners are small integers (:meth:`add_owner`); who they are (sessions, names,
    leases, quotas) is the sessions layer's business. Not thread-safe: the server calls
    it from one event loop, so each call is one critical section.

    ``audit_every_step`` runs :meth:`audit` after every mutating call (O(pool): a debug
    switch that the tests and ``KVMEM_DEBUG=1`` turn on).

    The prefix cache (``prefix_cache``, on by default) keys full pages with
    ``page_keys`` (default :class:`~kvmem.server.core.hashing.XXH3Keys`); owners share
    cached pages within a namespace (:meth:`add_owner`). ``event_sink`` receives the
    cache events of each mutating call that made any, as one list (see
    :mod:`kvmem.server.core.events`).

    ``image`` (:class:`~kvmem.server.core.image.CoreImage`): the state image the
    owners write their facts into, in place, so that a later process can take the core
    over (:func:`kvmem.server.core.restore.restore`); None (the default) keeps no image.

    Costs are stated per method: ``n`` items in a call, ``T`` tokens it allocates, ``P``
    pages it takes or drops. Nothing is proportional to ``num_pages`` except
    :meth:`audit` and construction.
    """

    def __init__(
        self,
        config: CoreConfig,
        block_table: np.ndarray | None = None,
        *,
        audit_every_step: bool = False,
        prefix_cache: bool = True,
        page_keys: PageKeys | None = None,
        event_sink: Callable[[list[CacheEvent]], None] | None = None,
        image: CoreImage | None = None,
        host_tier: HostTier | None = None,
        page_bytes: int = 0,
    ) -> None:
        if host_tier is not None and not prefix_cache:
            raise ValueError("a host tier cannot be used with the prefix cache off")
        if host_tier is not None and image is not None:
            host_tier.attach_image(image)  # its facts kept beside the pool's
        self.config = config
        self.image = image
        # A numbered Step's changes, before it makes them, so that a crash undoes it (see .undo).
        self.undo = None if image is None else UndoLog(image)
        self.pool = PagePool(config.num_pages, image)
        self.cache = PrefixCache(
            config.num_pages, config.page_size, page_keys or XXH3Keys(), enabled=prefix_cache, image=image
        )
        self.cache.undo = self.undo
        self.cache.tier = self.host_tier = host_tier
        self._page_bytes = page_bytes  # bytes of one page over all ranks (the host tier's stats)
        if prefix_cache:
            self.pool.cache = self.cache
        self.event_sink = event_sink
        self.table = BlockTable(config, block_table)
        self.block_table = self.table.array
        self.slots = RequestTable(config.max_requests, self.table, self.pool, image, self.undo)
        self._allocator = Allocator(config, self.pool, self.table, self.slots, self.undo)
        self.tickets = Tickets(self.slots, image)  # requests handed off, until adopted (see .handoff)
        self.audit_every_step = audit_every_step
        # Pages of removed owners that no one may take yet, by owner (see remove_owner).
        self._quarantine: dict[int, list[np.ndarray]] = {}

    # ----------------------------------------------------------------- owners

    @property
    def prefix_enabled(self) -> bool:
        return self.cache.enabled

    @property
    def page_keys(self) -> PageKeys:
        return self.cache.page_keys

    def add_owner(self, namespace: str = "") -> OwnerId:
        """A new owner (a session) in prefix-cache ``namespace``; its index, never
        reused. O(max_requests), once."""
        return self.slots.add_owner(namespace)

    def remove_owner(self, owner: int, *, quarantine: bool = False) -> int:
        """Release every request of ``owner`` (exactly as a release step would) and
        forget it. With ``quarantine`` the pages this leaves unreferenced are not free:
        they are held for ``owner`` (its process may still write into them) until
        :meth:`release_quarantine`. O(its requests + their pages). Returns the number of
        requests."""
        hold: list[np.ndarray] | None = [] if quarantine else None
        state = self.slots.owner(owner)
        given = self.tickets.of_giver(owner)
        if given:  # its tickets end with it, as its requests do
            self.tickets.release(given, hold, expired=False)
        released = self.slots.remove_owner(state, hold)
        if hold:
            self._quarantine[owner] = hold
            self.pool.mark_held(owner, hold)
        self._finish()
        return released

    def quarantined_pages(self, owner: int) -> int:
        """Pages held in ``owner``'s quarantine (0 if none). O(its arrays)."""
        return sum(int(a.size) for a in self._quarantine.get(owner, ()))

    def release_quarantine(self, owner: int) -> int:
        """Free the pages held in ``owner``'s quarantine; returns how many (0 if none).
        O(those pages)."""
        hold = self._quarantine.pop(owner, None)
        freed = 0 if hold is None else self.pool.release_held(hold)
        self._finish()
        return freed

    def install_quarantine(self, quarantine: dict[int, list[np.ndarray]]) -> None:
        """A restored state's quarantines, by owner (:mod:`.restore`; the pool already
        counts their pages)."""
        self._quarantine = quarantine
        for owner, hold in quarantine.items():
            self.pool.mark_held(owner, hold)

    def owner_ids(self) -> list[int]:
        """Every owner's index (a restored core's are the last run's), the tickets' holder's not."""
        return [o for o in self.slots.owners if o != self.tickets.holder_index]

    # --------------------------------------------------------------- hand-offs

    def release_tickets(self, tickets: Sequence[str]) -> int:
        """Release the open ones of hand-off ``tickets`` (their window passed) as a
        release would release their requests; returns how many were open. O(n + their pages)."""
        released = self.tickets.release(tickets)
        self._finish()
        return released

    def has_ticket(self, ticket: str) -> bool:
        return ticket in self.tickets.by_ticket

    def quarantine_owners(self) -> list[int]:
        """The owners whose quarantines hold pages."""
        return list(self._quarantine)

    def set_session(self, owner: int, session_id: str, name: str, quota_pages: int | None) -> None:
        """Keep who ``owner`` is (a session: its id, name and quota) in the state image,
        for a later process to resume it by. O(1); nothing without an image."""
        if self.image is not None:
            self.image.write_session(self.slots.owner(owner).record, session_id, name, quota_pages)

    def applied_seq(self, owner: int) -> int:
        """The number of ``owner``'s last Step applied whole (:meth:`commit`; 0: none
        kept, or no image)."""
        record = self.slots.owner(owner).record
        return 0 if self.image is None or record < 0 else int(self.image.owner_seq[record])

    def install_seq(self, owner: int, seq: int) -> None:
        """A restored owner's last applied Step number (:mod:`.restore`)."""
        if self.image is not None:
            self.image.owner_seq[self.slots.owner(owner).record] = seq

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

    def step(self, owner: int, batch: StepBatch, quota_pages: int | None = None, seq: int = 0) -> StepOutcome:
        """One scheduler step: releases, then truncates, then cache items, then match
        items, then allocs (see :mod:`kvmem.server.core.prefix_step` for the prefix
        cache's part; an alloc that needs pages evicts cached ones when the free stack
        is short).

        The whole batch is validated before anything changes; bad input raises
        :class:`KVMemError` naming the column, the item and the value. An alloc that
        cannot be served is a per-item status and changes nothing; with ``atomic`` no
        alloc is applied unless all are OK. ``quota_pages`` caps the pages the owner
        may hold after the step (None: no cap).

        Validate, then apply each kind of item in order (its module plans it from the
        state the earlier ones left, the owners change it), then build the result, once.

        ``seq`` (> 0, with a state image): the Step's number. What it changes is recorded
        first (:mod:`.undo`), and it is applied whole only at :meth:`commit` (``seq``):
        a crash before that undoes it. A refused Step leaves no record.

        Cost: O(n + T + P) numpy work, vectorised across the items; a Python loop over
        items only when the pool or the quota runs short (never over tokens).
        """
        tier = self.host_tier
        if tier is not None and (tier.mover.finished or (tier.link is not None and tier.link.results)):
            self.finish_loads()
        requests = self.slots
        state = requests.owner(owner)
        prefix = batch.check_lengths(self.config.max_requests)  # and whether it carries prefix work
        rel, tr, al = batch.release_slots, batch.truncate_slots, batch.alloc_slots
        cache = self.cache
        evictions = cache.num_evictions
        moves = batch.handoff_slots.size or batch.handoff_states or batch.adopt_tickets or batch.adopt_request_ids
        if al.size and not rel.size and not tr.size and not prefix and not moves:
            # The decode fast path validates, plans and applies in one pass (its undo
            # record begun there), or changes nothing and leaves the step to the general path.
            fast = self._allocator.decode(state, al, batch.alloc_needs, batch.expectations(), quota_pages, seq)
            if fast is not None:
                evicted = cache.num_evictions - evictions
                if evicted:
                    requests.count_evictions(state, evicted)
                status, kv_loc, kv_off, pages, page_off, _ = fast
                # nothing released or refused; no match, cache switch, insert or row change
                result = StepOutcome(
                    status, kv_loc, kv_off, pages, page_off, 0, 0, NO_INT32, NO_INT32, 0, evicted, NO_INT32
                )
                self._finish()
                return result
        undo = self.undo
        if not seq or undo is None:
            return self._general(state, batch, quota_pages, prefix)
        closing = rel
        if moves:  # the slots it hands off and adopts change owners: their words go into the record
            closing = np.concatenate([rel, batch.handoff_slots, self.tickets.slots_of(batch.adopt_tickets)])
            if closing.size > self.config.max_requests:  # slots named twice: refused below, before any change
                closing = rel
        undo.begin(state.record, seq, [rel, tr, batch.match_slots, al], closing)
        try:
            return self._general(state, batch, quota_pages, prefix)
        except BaseException:
            undo.abort()  # refused before any change (a bug past that: the audit says)
            raise

    def finish_loads(self) -> int:
        """Take the host tier's loads whose copy has ended: their host pages back in its
        LRU order, their device pages' load references dropped (a page no request holds
        any more is then evictable, or free). The server calls it when the copy thread
        says so; :meth:`step` first too. Returns the pages. O(those pages)."""
        tier = self.host_tier
        if tier is None:
            return 0
        done = tier.finished()
        stored = tier.link is not None and tier.store_results(self.cache.index)
        if not done and not stored:
            return 0
        pages = np.zeros(0, dtype=np.int32) if not done else np.concatenate(done) if len(done) > 1 else done[0]
        if pages.size:
            self.pool.unref(pages)
        self.cache.events += tier.take_events()  # the store's pages installed, host pages evicted for them
        self._finish()
        return int(pages.size)

    def commit(self, seq: int) -> None:
        """The Step :meth:`step` was given ``seq`` for is applied whole (the commit
        point: see :mod:`.undo`). O(1)."""
        if self.undo is not None:
            self.undo.commit(seq)

    def _general(self, state: Owner, batch: StepBatch, quota_pages: int | None, prefix: bool) -> StepOutcome:
        """The general path of :meth:`step`: validate every item, then apply."""
        requests = self.slots
        rel, tr, al = batch.release_slots, batch.truncate_slots, batch.alloc_slots
        cache = self.cache
        evictions, inserted = cache.num_evictions, cache.num_inserted
        # validate: every item, before anything changes
        ms, hs, tickets = batch.match_slots, batch.handoff_slots, self.tickets
        adopted, found = None, None
        if batch.adopt_tickets or batch.adopt_request_ids:
            adopted, found = tickets.check_adopts(state, batch, self.config.max_requests)
        cur = steps.validate(requests, state, batch, adopted)
        plan = None
        if prefix or (tr.size and cache.enabled and cache.num_entries):
            plan = prefix_step.validate(cache, requests, state, batch)
        if hs.size or batch.handoff_states:
            tickets.check_handoffs(state, batch)
        if adopted is not None:
            tickets.check_quota(state, batch, adopted, quota_pages)
        # apply, in the step's order
        released = 0
        if rel.size:
            if plan is not None and plan.release_keys:
                prefix_step.insert_released(cache, requests, batch, plan, state.namespace)
            released += requests.release(state, rel)
        if tr.size:
            released += requests.truncate(state, tr, batch.truncate_lens)
        handed = tickets.hand_off(state, batch) if hs.size else ()
        if crash.armed:
            crash.at("after-releases")
        switched, changed = NO_INT32, list[int]()
        if plan is not None and batch.cache_slots.size:
            switched, changed = prefix_step.cache_rows(cache, requests, batch, plan, state.namespace)
        lens, loading, fetching, needs = NO_INT32, NO_INT32, NO_INT32, batch.alloc_needs
        if ms.size:
            lens, loading, fetching = prefix_step.match(
                cache, requests, state, batch, quota_pages, self.config.max_context_len
            )
            if cur is not None:
                cur = requests.alloced[al]  # matched slots start where their match ended
                needs = prefix_step.remainders(requests, batch, lens)
        adoption = None if found is None or adopted is None else tickets.adopt(state, batch, adopted, found)
        if crash.armed:
            crash.at("after-prefix")
        allocs = NO_ALLOCS if cur is None else self._allocator.alloc(state, al, needs, cur, batch.atomic, quota_pages)
        evicted = cache.num_evictions - evictions
        if evicted:
            requests.count_evictions(state, evicted)
        changed_rows = NO_INT32
        if changed or lens.size:
            changed_rows = np.concatenate([np.array(changed, dtype=np.int64), ms[lens > 0]])
        status, kv_loc, kv_off, pages, page_off, refused = allocs
        result = StepOutcome(
            status,
            kv_loc,
            kv_off,
            pages,
            page_off,
            released,
            refused,
            lens,
            switched,
            cache.num_inserted - inserted,
            evicted,
            changed_rows,
            handed,
        )
        if adoption is not None:
            result.adopt_slots, result.adopt_lens, result.adopt_states = adoption
        result.match_loading = loading
        result.match_fetching = fetching
        self._finish()
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
        cache = self.cache
        num_cached = cache.num_evictable
        total = self.config.num_pages - 1
        slots = self.slots
        return PoolStats(
            num_pages_total=total,
            num_free_pages=num_free,
            num_cached_pages=num_cached,
            num_used_pages=total - num_free - num_cached - num_quarantined,
            num_quarantined_pages=num_quarantined,
            num_free_request_slots=slots.num_free,
            num_open_requests=self.config.max_requests - slots.num_free,
            num_handoff_tickets=len(self.tickets.by_ticket),
            num_handoff_pages=0 if self.tickets.holder is None else self.tickets.holder.num_pages_held,
            owners=tuple(
                OwnerUsage(
                    o.index,
                    o.num_requests,
                    o.num_pages_held,
                    o.namespace,
                    o.prefix_query_tokens,
                    o.prefix_hit_tokens,
                    o.num_evictions,
                )
                for o in slots.owners.values()
                if o is not self.tickets.holder
            ),
            num_cache_entries=cache.num_entries,
            num_evictions=cache.num_evictions,
            prefix_query_tokens=cache.query_tokens,
            prefix_hit_tokens=cache.hit_tokens,
            host=self._host_stats(),
            store=None if self.host_tier is None or self.host_tier.link is None else self.host_tier.link.snapshot(),
        )

    def _host_stats(self) -> HostTierStats | None:
        tier = self.host_tier
        if tier is None:
            return None
        p50, p99, bandwidth = tier.mover.load_stats()
        return HostTierStats(
            num_pages=tier.num_pages,
            num_free_pages=tier.num_free,
            num_cached_pages=tier.num_cached,
            page_bytes=self._page_bytes,
            num_demoted=tier.num_demoted,
            num_loaded=tier.num_loaded,
            num_evicted=tier.num_evicted,
            num_dropped=tier.num_dropped,
            hit_tokens=tier.hit_tokens,
            num_loading_pages=tier.num_loading_pages,
            load_ms_p50=p50,
            load_ms_p99=p99,
            load_gib_per_s=bandwidth,
        )

    def snapshot_events(self) -> list[CacheEvent]:
        """``AllCleared`` then a ``PagesStored`` per cached page, parents first: the
        pool's (medium "GPU"), then the host tier's ("CPU"; a page on both tiers is
        listed on each): what a watcher that lost track resyncs from. O(cache size
        log); never on a step."""
        host = [] if self.host_tier is None else self.host_tier.snapshot()
        return [AllCleared(), *self.cache.snapshot(), *host]

    def audit(self) -> AuditReport:
        """Check every invariant (O(pool): see :func:`kvmem.server.core.audit.audit`)."""
        tier = self.host_tier
        loading = None if tier is None else tier.loading_device_pages()
        report = audit(self.config, self.pool, self.table, self.slots, self._quarantine, self.cache, loading)
        problems = self.tickets.problems()
        if tier is not None:
            namespaces = {tier.namespace[p] for p in tier.index.values()}
            problems += tier.audit(self.cache.index, {self.cache.root(ns) for ns in namespaces})
        return dataclasses.replace(report, ok=False, problems=report.problems + tuple(problems)) if problems else report

    def _finish(self) -> None:
        """End of a mutating call: the cache's new pages into the state image; hand its
        cache events to the sink; audit if asked."""
        self.cache.flush_image()
        events = self.cache.events
        if events:
            self.cache.events = []
            if self.event_sink is not None:
                self.event_sink(events)
        tier = self.host_tier
        if tier is not None and tier.link is not None:  # the store's thread: the events, then what the call asked
            tier.link.flush(events)
        if self.audit_every_step:
            report = self.audit()
            if not report.ok:
                raise CorruptionError("audit failed: " + "; ".join(report.problems))
