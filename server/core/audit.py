"""The audit: every invariant of the pool, checked from scratch.

O(num_pages + max_requests * max_pages_per_request): a debug check, run after every
mutating call when the core's ``audit_every_step`` is on (tests, ``KVMEM_DEBUG=1``),
and on demand by Stats. It reads, never changes, and names what it finds.
"""

from __future__ import annotations

import numpy as np

from kvmem.server.core.config import AuditReport, CoreConfig
from kvmem.server.core.pool import PagePool
from kvmem.server.core.prefix import PrefixCache
from kvmem.server.core.slots import RequestTable
from kvmem.server.core.table import BlockTable


def audit(
    config: CoreConfig,
    pool: PagePool,
    table: BlockTable,
    slots: RequestTable,
    quarantine: dict[int, list[np.ndarray]],
    cache: PrefixCache,
    loading: np.ndarray | None = None,
) -> AuditReport:
    """``loading``: the device pages of the host tier's loads in copy (one reference
    each, the load's, besides the rows')."""
    problems: list[str] = []
    held = [a for arrays in quarantine.values() for a in arrays]
    in_quarantine = np.concatenate(held) if held else np.zeros(0, dtype=np.int32)
    queued = cache.queued()
    num_used = _audit_pages(config, pool, np.concatenate((in_quarantine, queued)), problems)
    num_cached = int(queued.size)
    _audit_cache(config, pool, cache, queued, in_quarantine, problems)
    num_q = pool.num_quarantined
    if in_quarantine.size != num_q:
        problems.append(f"the quarantines hold {in_quarantine.size} pages but the pool counts {num_q}")
    if pool.num_free + num_cached + num_used + num_q != config.num_pages - 1:
        problems.append(
            f"free {pool.num_free} + cached {num_cached} + used {num_used} + quarantined {num_q} "
            f"!= {config.num_pages - 1} pages"
        )
    have = table.num_pages_for(slots.alloced[: config.max_requests + 1])
    _audit_table(config, pool, table, slots, have, loading, problems)
    _audit_owners(slots, have, problems)
    _audit_free_slots(config, slots, problems)
    return AuditReport(not problems, tuple(problems), pool.num_free, num_cached, num_used, num_q)


def _audit_cache(
    config: CoreConfig,
    pool: PagePool,
    cache: PrefixCache,
    queued: np.ndarray,
    in_quarantine: np.ndarray,
    problems: list[str],
) -> None:
    """The prefix cache: the index and the per-page keys agree; every cached page's
    parent is a root or cached (no chain is broken); the evictable queue holds exactly
    the cached pages no one references; no free or quarantined page is cached."""
    if not cache.enabled:
        if cache.num_entries or queued.size:
            problems.append("the prefix cache is off but holds pages")
        return
    keyed = np.flatnonzero(cache.cached)
    if keyed.size and keyed[0] == 0:
        problems.append("page 0 is marked cached")
    if len(cache.index) != keyed.size:
        problems.append(f"the key index has {len(cache.index)} entries for {keyed.size} cached pages")
    wrong = [p for p in keyed.tolist() if cache.index.get(cache.key[p]) != p]
    if wrong:
        problems.append(f"cached pages whose key does not map back to them: {wrong[:16]}")
    roots = set(cache.roots.values())
    broken = [p for p in keyed.tolist() if cache.parent[p] not in roots and cache.parent[p] not in cache.index]
    if broken:
        problems.append(f"cached pages whose parent key is neither a root nor cached: {broken[:16]}")
    idle = keyed[pool.ref_cnt[keyed] == 0]
    if not np.array_equal(np.sort(queued), idle):
        problems.append(f"the evictable queue holds {queued.size} pages, {idle.size} cached pages have no reference")
    if queued.size != cache.num_evictable:
        problems.append(f"the evictable queue holds {queued.size} pages, its count says {cache.num_evictable}")
    loose = np.concatenate((pool.free_pages(), in_quarantine)).astype(np.intp)
    if loose.size and np.count_nonzero(cache.cached[loose]):
        problems.append(f"free or quarantined pages that are cached: {loose[cache.cached[loose]].tolist()[:16]}")


def _audit_pages(config: CoreConfig, pool: PagePool, in_quarantine: np.ndarray, problems: list[str]) -> int:
    """Reference counts against the free stack, the quarantines and the cache's
    evictable queue (``in_quarantine`` holds both): a page with no reference is in
    exactly one of them. Returns the number of used pages."""
    ref = pool.ref_cnt
    free = np.concatenate((pool.free_pages(), in_quarantine))
    if ref[0] != 0:
        problems.append(f"page 0 has ref_cnt {int(ref[0])}")
    if np.count_nonzero(ref < 0):
        problems.append(f"negative ref_cnt on pages {np.flatnonzero(ref < 0).tolist()[:16]}")
    if free.size and (np.count_nonzero(free <= 0) or np.count_nonzero(free >= config.num_pages)):
        problems.append("free stack or quarantine holds ids outside [1, num_pages)")
    else:
        in_free = np.bincount(free, minlength=config.num_pages)
        if np.count_nonzero(in_free > 1):
            twice = np.flatnonzero(in_free > 1).tolist()[:16]
            problems.append(f"pages twice in the free stack and quarantines: {twice}")
        both = (in_free > 0) & (ref > 0)
        if np.count_nonzero(both):
            problems.append(f"free or quarantined pages with references: {np.flatnonzero(both).tolist()[:16]}")
        lost = (in_free == 0) & (ref == 0)
        lost[0] = False
        if np.count_nonzero(lost):
            problems.append(f"pages neither referenced, free nor quarantined: {np.flatnonzero(lost).tolist()[:16]}")
    return int(np.count_nonzero(ref[1:] > 0))


def _audit_table(
    config: CoreConfig,
    pool: PagePool,
    table: BlockTable,
    slots: RequestTable,
    have: np.ndarray,
    loading: np.ndarray | None,
    problems: list[str],
) -> None:
    """Rows against lengths, and the pages they hold (and loads in copy) against the
    reference counts."""
    bt = table.array
    open_ = slots.owner_of[: config.max_requests + 1] != 0
    if np.count_nonzero(have[~open_]):
        problems.append("closed request slots with alloced_len > 0")
    valid = np.arange(bt.shape[1])[None, :] < np.where(open_, have, 0)[:, None]
    if np.count_nonzero(bt[~valid]):
        rows = np.flatnonzero((bt * ~valid).any(axis=1))
        problems.append(f"non-zero block-table entries past a request's pages in rows {rows.tolist()[:16]}")
    held = bt[valid]
    if np.count_nonzero(held <= 0) or np.count_nonzero(held >= config.num_pages):
        problems.append("block table holds page ids outside [1, num_pages) within a request's pages")
        return
    if loading is not None and loading.size:
        held = np.concatenate((held, loading))
    refs = np.bincount(held, minlength=config.num_pages)
    if not np.array_equal(refs, pool.ref_cnt):
        diff = np.flatnonzero(refs != pool.ref_cnt)
        problems.append(f"ref_cnt differs from block-table references on pages {diff.tolist()[:16]}")


def _audit_owners(slots: RequestTable, have: np.ndarray, problems: list[str]) -> None:
    """Per-owner totals against the slots and rows they own."""
    for o in slots.owners.values():
        mine = slots.slots_of(o)
        if mine.size != o.num_requests:
            problems.append(f"owner {o.index} counts {o.num_requests} requests but owns {mine.size} slots")
        lost = [int(x) for x in mine.tolist() if slots.live_slot(o, slots.request_id[x] or "") != x]
        if lost:
            problems.append(f"owner {o.index} has open slots its request ids do not map to: {lost[:16]}")
        if len(o.request_slots) != o.num_requests:
            problems.append(f"owner {o.index} maps {len(o.request_slots)} request ids for {o.num_requests} requests")
        if int(have[mine].sum()) != o.num_pages_held:
            problems.append(
                f"owner {o.index} holds {o.num_pages_held} pages by its count, {int(have[mine].sum())} by its rows"
            )
    owned = slots.owner_of[1 : slots.max_requests + 1]
    unknown = set(np.unique(owned[owned != 0]).tolist()) - set(slots.owners)
    if unknown:
        problems.append(f"slots owned by unknown owner indices {sorted(unknown)}")
    kept = np.flatnonzero((owned == 0) & slots.request_id[1 : slots.max_requests + 1].astype(bool)) + 1
    if kept.size:
        problems.append(f"closed request slots keep a request id: {kept.tolist()[:16]}")


def _audit_free_slots(config: CoreConfig, slots: RequestTable, problems: list[str]) -> None:
    """The free slot stack holds only closed, distinct slots in range."""
    owned = slots.owner_of[1 : config.max_requests + 1]
    if slots.num_free + int(np.count_nonzero(owned)) != config.max_requests:
        problems.append("free request slots + open request slots != max_requests")
    free = slots.free_slots()
    if free.size and (int(free.min()) < 1 or int(free.max()) > config.max_requests):
        problems.append("free request slot stack holds slots outside [1, max_requests]")
    elif np.count_nonzero(slots.owner_of[free]) or np.unique(free).size != free.size:
        problems.append("free request slot stack holds open or repeated slots")
