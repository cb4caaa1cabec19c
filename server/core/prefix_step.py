"""The prefix cache's part of a step: release items' tokens, cache items, match items.

:func:`validate` checks them (and computes every key the step inserts) before anything
changes; :func:`insert_released`, :func:`cache_rows` and :func:`match` apply them in the
step's order (releases, truncates, caches, matches, allocs). Each works out what the
rows get and leaves the change to :class:`~kvmem.server.core.slots.RequestTable`
(``switch``, ``attach``); the cache's own entries it changes through
:class:`PrefixCache`. Costs O(items + pages involved): a Python loop over items and
their pages (a page key is a chain), never over tokens, and nothing proportional to
the cache's size.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import numpy as np

from kvmem.server.core.batch import NO_EXPECTATION, NO_INT32, StepBatch, TokenLists, raise_first
from kvmem.server.core.image import row_items
from kvmem.server.core.prefix import PrefixCache
from kvmem.server.core.slots import Owner, RequestTable
from kvmem.server.core.table import BlockTable
from kvmem.server.core.tier import HostTier
from kvmem.server.errors import KVMemError, Reason


@dataclasses.dataclass(slots=True)
class PrefixPlan:
    """What :func:`validate` worked out: per release and cache item, the keys of its
    full pages (None: nothing to insert)."""

    release_keys: list[list[bytes] | None]
    cache_keys: list[list[bytes] | None]


def lengths_after_truncates(requests: RequestTable, batch: StepBatch, which: np.ndarray) -> np.ndarray:
    """``alloced_len`` of the slots ``which`` once this step's truncates applied. O(n)."""
    tr = batch.truncate_slots
    if not tr.size:
        return requests.alloced[which].astype(np.int64)
    scratch = requests.scratch
    scratch[which] = requests.alloced[which]
    scratch[tr] = batch.truncate_lens
    return scratch[which].copy()


def validate(cache: PrefixCache, requests: RequestTable, state: Owner, batch: StepBatch) -> PrefixPlan:
    """Check the prefix items of ``batch`` (its slot columns and lengths are checked
    already); change nothing. O(items + pages to insert)."""
    rel, cs, ms = batch.release_slots, batch.cache_slots, batch.match_slots
    table = requests.table
    if cs.size:
        requests.check(state, cs, "cache_slots", rel)
    if ms.size:  # its slots are checked (steps.validate)
        _check_match(requests, batch)
    if cache.enabled and cache.num_entries:
        _check_truncates(cache, table, requests, batch)
    plan = PrefixPlan([], [])
    if batch.release_tokens is not None and rel.size:
        have = requests.alloced[rel].astype(np.int64)
        plan.release_keys = _keys(cache, table, state, rel, batch.release_tokens, have, "release_token_ids")
    if cs.size and batch.cache_tokens is not None:
        have = lengths_after_truncates(requests, batch, cs)
        plan.cache_keys = _keys(cache, table, state, cs, batch.cache_tokens, have, "cache_token_ids")
    return plan


def _check_match(requests: RequestTable, batch: StepBatch) -> None:
    ms = batch.match_slots
    cur = lengths_after_truncates(requests, batch, ms)
    raise_first(
        cur != 0,
        lambda i: KVMemError(
            Reason.ALLOCED_LEN_MISMATCH,
            f"match_slots[{i}]: request slot {int(ms[i])} has alloced_len {int(cur[i])}; a match needs a fresh "
            "request (alloced_len 0)",
            index=i,
            slot=int(ms[i]),
            alloced_len=int(cur[i]),
        ),
    )
    limits = batch.match_max_tokens
    if limits is not None and limits.size:
        raise_first(
            limits < NO_EXPECTATION,
            lambda i: KVMemError(
                Reason.BAD_VALUE, f"match_max_tokens[{i}] must be >= 0 (or -1 for none), got {int(limits[i])}", index=i
            ),
        )


def _check_truncates(cache: PrefixCache, table: BlockTable, requests: RequestTable, batch: StepBatch) -> None:
    """PAGE_SHARED: a truncate to the middle of a cached page (the request would write
    into a page the cache shares)."""
    tr, lens = batch.truncate_slots, batch.truncate_lens
    if not tr.size:
        return
    ps = table.page_size
    cur = requests.alloced[tr]
    partial = (lens % ps != 0) & (lens < cur)
    if not np.count_nonzero(partial):
        return
    pages = np.zeros(tr.size, dtype=np.int32)
    pages[partial] = table.flat[tr[partial] * table.width + lens[partial] // ps]
    bad = partial & cache.cached[pages]

    def error(i: int) -> KVMemError:
        n, page = int(lens[i]), int(pages[i])
        return KVMemError(
            Reason.PAGE_SHARED,
            f"truncate_lens[{i}] = {n} would leave request slot {int(tr[i])} writing into page {page}, a page of the "
            f"prefix cache that other requests may share; truncate to a page boundary ({n // ps * ps}) instead",
            index=i,
            slot=int(tr[i]),
            page=page,
        )

    raise_first(bad, error)


def _keys(
    cache: PrefixCache,
    table: BlockTable,
    state: Owner,
    which: np.ndarray,
    tokens: TokenLists,
    have: np.ndarray,
    column: str,
) -> list[list[bytes] | None]:
    """Per item: the keys of its full pages, checked against the keys its row's pages
    are already cached under. O(items + pages)."""
    lengths = tokens.lengths()
    raise_first(
        lengths > have,
        lambda i: KVMemError(
            Reason.ALLOCED_LEN_MISMATCH,
            f"{column}[{i}] has {int(lengths[i])} tokens, beyond alloced_len {int(have[i])} of request slot "
            f"{int(which[i])}",
            index=i,
            slot=int(which[i]),
        ),
    )
    if not cache.enabled:
        return [None] * int(which.size)
    ps, ns = table.page_size, state.namespace
    root = cache.root(ns)
    out: list[list[bytes] | None] = []
    for i, (slot, n) in enumerate(zip(which.tolist(), (lengths // ps).tolist(), strict=True)):
        if not n:
            out.append(None)
            continue
        keys = list(cache.page_keys.keys(ns, root, tokens.item(i), n, ps))
        row = table.array[slot, :n]
        flags, known = cache.cached[row].tolist(), cache.key[row].tolist()
        for col, (is_cached, was, key) in enumerate(zip(flags, known, keys, strict=True)):
            if is_cached and was != key:
                raise KVMemError(
                    Reason.BAD_VALUE,
                    f"{column}[{i}]: the tokens of page {col} of request slot {slot} differ from those it is cached "
                    "with (it was matched or cached with other tokens)",
                    index=i,
                    slot=slot,
                    page_index=col,
                )
        out.append(keys)
    return out


def insert_released(cache: PrefixCache, requests: RequestTable, batch: StepBatch, plan: PrefixPlan, ns: str) -> None:
    """Release items' full pages enter the cache (before the release drops them, so
    those left unreferenced wait in the evictable queue). Where the cache has a key on
    another page, the row is first switched to the cache's page and the request's copy
    freed (the cache's is kept): the release then lets go of the cache's page in its
    chain's place, so the evictable queue keeps every chain's end before its beginning
    (a cache's page left where it was, older than the children just queued, would be
    evicted before them)."""
    if batch.release_tokens is None:
        return
    _insert_rows(cache, requests, batch.release_slots, batch.release_tokens, plan.release_keys, ns)


def _insert_rows(
    cache: PrefixCache,
    requests: RequestTable,
    which: np.ndarray,
    tokens: TokenLists,
    plan_keys: list[list[bytes] | None],
    ns: str,
) -> tuple[np.ndarray, list[int]]:
    """Insert each item's full pages; switch its row to the cache's page wherever the
    key is cached on another page (sharing it, freeing the row's own), all rows in one
    :meth:`RequestTable.switch` once every item is inserted (a switch changes no key
    and no later item's row). Returns pages switched per item and the slots whose rows
    changed."""
    switched = np.zeros(int(which.size), dtype=np.int32)
    changed: list[int] = []
    where: list[np.ndarray] = []
    kept_pages: list[np.ndarray] = []
    table = requests.table
    width = table.width
    root = cache.root(ns)
    # With a state image the new pages' facts go to it once, for all items (_pend_image);
    # each item's keys joined as it is inserted, while they are at hand.
    joined: list[bytes] | None = [] if cache.keeps_image else None
    inserted = cache.num_inserted
    for i, (slot, keys) in enumerate(zip(which.tolist(), plan_keys, strict=True)):
        if not keys:
            continue
        row = table.array[slot, : len(keys)]
        kept = np.array(cache.insert(row.tolist(), keys, tokens.item(i), ns, root, 0, joined is None), dtype=np.int32)
        if joined is not None:
            joined.append(b"".join(keys))
        moved = kept != row
        count = int(np.count_nonzero(moved))
        if count:
            where.append(slot * width + np.flatnonzero(moved))
            kept_pages.append(kept[moved])
            switched[i] = count
            changed.append(slot)
    if joined is not None and cache.num_inserted != inserted:
        _pend_image(cache, table, which, tokens, joined, cache.num_inserted - inserted, root, ns)
    if where:
        if len(where) == 1:
            requests.switch(where[0], kept_pages[0])
        else:
            requests.switch(np.concatenate(where), np.concatenate(kept_pages))
    return switched, changed


def _pend_image(
    cache: PrefixCache,
    table: BlockTable,
    which: np.ndarray,
    tokens: TokenLists,
    joined: list[bytes],
    inserted: int,
    root: bytes,
    ns: str,
) -> None:
    """The facts of the ``inserted`` pages :func:`_insert_rows` just cached (their
    switches not made yet), all items at once, to the cache's image
    (:meth:`PrefixCache.pend_image`), vectorised: ``joined`` holds each item's keys
    (its full pages', in column order), joined, for the items with any. The new pages
    are every full page of the items when ``inserted`` counts them all (the usual);
    else those cached now and not yet in the image (:attr:`CoreImage.page_cached` is
    set only at the end of the call that caches a page, and a row's pages not cached
    before are its own, in no other row). O(items + pages)."""
    ps = table.page_size
    sizes = tokens.lengths() // ps  # the items' full pages (as many keys)
    total = int(sizes.sum())
    kind = cache.key_item
    all_keys = np.frombuffer(b"".join(joined), kind)
    if all_keys.size != total:
        raise AssertionError(f"{all_keys.size} keys for {total} full pages")
    starts = np.repeat(np.cumsum(sizes) - sizes, sizes)  # per page, where its item's pages start
    at = np.arange(total)  # per page, its index among all the items' pages (and keys)
    cols = at - starts
    pages = table.flat[np.repeat(which * table.width, sizes) + cols]
    item_tokens = np.repeat(tokens.offsets[:-1], sizes)  # per page, where its item's tokens start
    if inserted != total:  # only some are new
        at = np.flatnonzero(cache.cached[pages] & ~cache.image_cached[pages])
        cols, pages, item_tokens = cols[at], pages[at], item_tokens[at]
        keys = all_keys[at]
    else:
        keys = all_keys
    parents = all_keys.take(at - 1)  # the key before it in its chain (a first page's: the root, below)
    parents[cols == 0] = np.frombuffer(root, kind)[0]
    ids = tokens.ids
    first = item_tokens + cols * ps  # a page's first token in ids
    if ids.dtype == np.int32 and ids.flags.c_contiguous and not (first % ps).any():  # whole rows of ids
        rows = row_items(ids[: ids.size // ps * ps].reshape(-1, ps))[first // ps]
    else:
        rows = row_items(np.ascontiguousarray(ids[first[:, None] + np.arange(ps)], dtype=np.int32))
    cache.pend_image(pages.astype(np.intp), keys, parents, rows, ns)


def cache_rows(
    cache: PrefixCache, requests: RequestTable, batch: StepBatch, plan: PrefixPlan, ns: str
) -> tuple[np.ndarray, list[int]]:
    """Cache items: insert each running request's full pages; where the cache has an
    equal page elsewhere, the row is switched to it and the request's duplicate freed.
    Returns pages switched per item (int32) and the slots whose rows changed."""
    tokens = batch.cache_tokens
    if tokens is None or not cache.enabled:
        return np.zeros(int(batch.cache_slots.size), dtype=np.int32), []
    return _insert_rows(cache, requests, batch.cache_slots, tokens, plan.cache_keys, ns)


def match(
    cache: PrefixCache, requests: RequestTable, state: Owner, batch: StepBatch, quota: int | None, max_context_len: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Match items: find each fresh request's longest run of cached pages (at most
    ``min(len, max_tokens)`` tokens, within the context limit and the owner's quota),
    then :meth:`RequestTable.attach` writes them into the rows and sets the lengths.
    Returns tokens matched per item (int32), with a host tier how many of them are
    still loading (int32; else empty), and with a store how many tokens after the match
    are being fetched from it (int32; else empty: :func:`_want`)."""
    ms, tokens = batch.match_slots, batch.match_tokens
    n = int(ms.size)
    if not n or tokens is None:
        return NO_INT32, NO_INT32, NO_INT32
    lens = np.zeros(n, dtype=np.int32)
    limits = tokens.lengths()
    if batch.match_max_tokens is not None and batch.match_max_tokens.size:
        cap = batch.match_max_tokens
        limits = np.where(cap >= 0, np.minimum(limits, cap), limits)
    queried = int(limits.sum())
    requests.count_queries(state, queried)
    cache.query_tokens += queried
    tier = cache.tier
    none_loading = NO_INT32 if tier is None else np.zeros(n, dtype=np.int32)
    link = None if tier is None else tier.link
    fetching = NO_INT32 if link is None else np.zeros(n, dtype=np.int32)
    if not cache.enabled or not (cache.num_entries or (tier is not None and tier.num_cached) or link is not None):
        return lens, none_loading, fetching
    ps, ns, get = requests.table.page_size, state.namespace, cache.index.get
    root = cache.root(ns)
    most = max_context_len // ps
    quota_left = None if quota is None else quota - state.num_pages_held
    hit_slots: list[int] = []
    runs: list[list[int]] = []
    loads: list[_Load] = []  # the runs that continue on the host tier
    for i, (slot, limit) in enumerate(zip(ms.tolist(), limits.tolist(), strict=True)):
        k = min(limit // ps, most)
        if quota_left is not None:
            k = min(k, max(quota_left, 0))
        run: list[int] = []
        keys = cache.page_keys.keys(ns, root, tokens.item(i), k, ps)
        missed: bytes | None = None
        last = root  # the key of the run's last page
        for key in keys:
            page = get(key)
            if page is None:
                missed = key
                break
            run.append(page)
            last = key
        m = len(run)
        if m:
            hit_slots.append(slot)
            runs.append(run)
            lens[i] = m * ps
        held = m  # pages the node holds: the device's run, then the host's
        if missed is not None and tier is not None and missed in tier.index:
            more, host = tier.run(itertools.chain((missed,), keys))
            held += len(more)
            if len(more) >= tier.min_load_pages:  # else computing them beats copying them
                loads.append(_Load(i, slot, m, host, more, last))
                m += len(more)
            last = more[-1] if more else last
        if link is not None and missed is not None and held < k:
            fetching[i] = _want(cache, link, ns, root, last, tokens.item(i), held, k, ps)
        if quota_left is not None:
            quota_left -= m
    if runs:
        requests.attach(state, hit_slots, runs)
        cache.hit_tokens += int(lens.sum())
    if loads:
        assert tier is not None
        _load(cache, tier, requests, state, loads, tokens, lens)
    if tier is None or not tier.num_loading_pages:
        return lens, none_loading, fetching
    return lens, _still_loading(tier, requests.table, ms, lens), fetching


def _want(
    cache: PrefixCache, link: Any, ns: str, root: bytes, last: bytes, ids: np.ndarray, held: int, k: int, ps: int
) -> int:
    """Ask the store's thread for a match's continuation: the full pages from column
    ``held`` (the node holds the ones before, the last under ``last``) to ``k``, their
    local keys computed here (the store's digests on the thread). Returns the tokens
    asked for (0: none). O(pages asked) hashing."""
    rest = ids[held * ps : k * ps]
    keys = list(cache.page_keys.keys(ns, last, rest, k - held, ps))
    return int(link.want(ns, last, root, keys, rest, held))


def _still_loading(tier: HostTier, table: BlockTable, ms: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Per match item, the tokens of its match from its first page still being copied
    in (by this call's loads or an earlier call's) to its end: what its reader must wait
    for. Only while loads are in copy; O(pages matched)."""
    counters, layers, ps = tier.mover.counters, tier.mover.num_layers, table.page_size
    loading = np.zeros(lens.size, dtype=np.int32)
    for i in np.flatnonzero(lens).tolist():
        pages = table.array[int(ms[i]), : int(lens[i]) // ps]
        behind = counters[pages] < layers
        if np.count_nonzero(behind):
            loading[i] = (pages.size - int(np.argmax(behind))) * ps
    return loading


@dataclasses.dataclass(slots=True)
class _Load:
    """A match item whose run continues on the host tier: its ``host`` pages (under
    ``keys``) go into device pages from column ``col`` of ``slot``'s row."""

    item: int
    slot: int
    col: int
    host: list[int]
    keys: list[bytes]
    parent: bytes  # the key before the first one: the root, or the run's last device page's


def _load(
    cache: PrefixCache,
    tier: HostTier,
    requests: RequestTable,
    state: Owner,
    loads: list[_Load],
    tokens: TokenLists,
    lens: np.ndarray,
) -> None:
    """The host-tier part of the matches (their device runs attached already), in item
    order: a load's first pages that an earlier load of this call put on the device are
    shared; the others get device pages, as many as the pool gives (a load that does
    not fit is shortened: a match never fails for want of pages), cached on the device
    and written into the row after the run, and their bytes copied in by the copy
    thread (the load holds a reference of its own on them until the copy ends). The
    host pages are pinned from here to the copy's end: the evictions that taking device
    pages makes demote pages, and the host may evict to hold them, never a page being
    loaded. O(pages loaded)."""
    pool, ps, index = requests.pool, cache.page_size, cache.index
    for load in loads:
        tier.pin(load.host)
    for load in loads:
        shared: list[int] = []
        for key in load.keys:
            page = index.get(key)
            if page is None:
                break
            shared.append(page)
        s = len(shared)
        c = min(len(load.host) - s, pool.num_available)
        tier.unpin(load.host[:s] + load.host[s + c :])
        col = load.col
        if s:
            got = np.array(shared, dtype=np.int32)
            pool.share(got)
            requests.attach_loaded(state, load.slot, col, got)
            col += s
        if c:
            device = pool.take(c)
            ids = tokens.item(load.item)[col * ps :]
            parent = load.keys[s - 1] if s else load.parent
            kept = cache.insert(device.tolist(), load.keys[s : s + c], ids, state.namespace, parent, col)
            assert kept == device.tolist(), "a loaded page's key was cached on the device already"
            requests.attach_loaded(state, load.slot, col, device)
            # The load's own reference, dropped when its copy ends: on its pages and the chain
            # before them (a release meanwhile must not leave them without their parents).
            held = requests.table.array[load.slot, : col + c].copy()
            pool.share(held)
            tier.load(load.host[s : s + c], device, held)
        lens[load.item] += (s + c) * ps
        cache.hit_tokens += (s + c) * ps


def remainders(requests: RequestTable, batch: StepBatch, lens: np.ndarray) -> np.ndarray:
    """Alloc needs once the matches applied: an alloc of a slot matched in this step
    asks for the request's whole length (its sender could not know the match), so it
    gets what the match did not cover, ``max(need - matched, 0)``; others are as sent.
    O(n)."""
    al, ms = batch.alloc_slots, batch.match_slots
    scratch = requests.scratch
    scratch[al] = 0
    scratch[ms] = lens
    return np.maximum(batch.alloc_needs - scratch[al], 0)
