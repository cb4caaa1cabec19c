"""The prefix cache in the core: match, cache, release with tokens, eviction, namespaces.

Every core here audits after every call (``audit_every_step``): free + cached + used =
total, counts equal references, the index and the chains are consistent.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvmem.server.core import AllocStatus, CoreConfig, KVCore, StepBatch
from kvmem.server.core.events import AllCleared, PagesRemoved, PagesStored
from kvmem.server.core.hashing import XXH3Keys
from kvmem.server.errors import KVMemError, Reason

PS = 4


def make(num_pages: int = 17, *, prefix_cache: bool = True, max_context_len: int = 32) -> tuple[KVCore, list]:
    events: list = []
    core = KVCore(
        CoreConfig(num_pages=num_pages, page_size=PS, max_requests=8, max_context_len=max_context_len),
        audit_every_step=True,
        prefix_cache=prefix_cache,
        event_sink=events.extend,
    )
    return core, events


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def run(core: KVCore, owner: int, rid: str, toks: list[int], *, release: bool = True) -> int:
    """A request that computes ``toks`` (alloc) and, with ``release``, ends with them."""
    (slot,) = core.open(owner, [rid]).tolist()
    result = core.step(owner, StepBatch.of(alloc_slots=[slot], alloc_needs=[len(toks)]))
    assert result.alloc_status.tolist() == [AllocStatus.OK]
    if release:
        core.step(owner, StepBatch.of(release_slots=[slot], release_tokens=[toks]))
    return slot


def row(core: KVCore, slot: int) -> list[int]:
    r = core.block_table[slot]
    return r[r != 0].tolist()


def test_match_after_release_attaches_the_full_pages() -> None:
    core, _ = make()
    a = core.add_owner()
    prompt = tokens(14)  # 3 full pages and 2 tokens
    first = run(core, a, "r1", prompt, release=False)
    pages = row(core, first)
    core.step(a, StepBatch.of(release_slots=[first], release_tokens=[prompt]))
    stats = core.stats()
    assert (stats.num_cached_pages, stats.num_cache_entries) == (3, 3)  # the partial page is free
    (slot,) = core.open(a, ["r2"]).tolist()
    result = core.step(a, StepBatch.of(match=[(slot, prompt)]))
    assert result.match_lens.tolist() == [12]
    assert row(core, slot) == pages[:3]
    assert core.alloced_len(a, slot) == 12
    assert core.stats().num_cached_pages == 0  # held again: used


def test_match_after_cache_item_shares_a_running_request() -> None:
    core, _ = make()
    a = core.add_owner()
    prompt = tokens(8)
    running = run(core, a, "r1", prompt, release=False)
    result = core.step(a, StepBatch.of(cache=[(running, prompt)]))
    assert result.cache_switched.tolist() == [0] and result.num_pages_cached == 2
    (slot,) = core.open(a, ["r2"]).tolist()
    result = core.step(a, StepBatch.of(match=[(slot, prompt)]))
    assert result.match_lens.tolist() == [8]
    assert row(core, slot) == row(core, running)
    assert core.pool.ref_cnt[row(core, slot)].tolist() == [2, 2]


def test_partial_page_is_never_cached() -> None:
    core, events = make()
    a = core.add_owner()
    run(core, a, "r1", tokens(3))  # less than a page
    assert core.stats().num_cache_entries == 0
    assert not [e for e in events if isinstance(e, PagesStored)]


def test_max_tokens_caps_the_match() -> None:
    core, _ = make()
    a = core.add_owner()
    prompt = tokens(16)
    run(core, a, "r1", prompt)
    (slot,) = core.open(a, ["r2"]).tolist()
    # A scheduler that must compute at least one token passes len - 1: 15 tokens, 3 pages.
    result = core.step(a, StepBatch.of(match=[(slot, prompt, len(prompt) - 1)]))
    assert result.match_lens.tolist() == [12]
    stats = core.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (15, 12)


def test_namespaces_never_share() -> None:
    core, _ = make()
    a, b, c = core.add_owner("llama"), core.add_owner("qwen"), core.add_owner("llama")
    prompt = tokens(8)
    run(core, a, "r1", prompt)
    (sb,) = core.open(b, ["x"]).tolist()
    (sc,) = core.open(c, ["x"]).tolist()
    result = core.step(b, StepBatch.of(match=[(sb, prompt)]))
    assert result.match_lens.tolist() == [0]
    result = core.step(c, StepBatch.of(match=[(sc, prompt)]))
    assert result.match_lens.tolist() == [8]
    usage = {o.owner: o for o in core.stats().owners}
    assert (usage[b].prefix_query_tokens, usage[b].prefix_hit_tokens) == (8, 0)
    assert (usage[c].prefix_query_tokens, usage[c].prefix_hit_tokens) == (8, 8)


def test_two_sessions_share_pages_and_both_hold_them() -> None:
    core, _ = make()
    a, b = core.add_owner(), core.add_owner()
    prompt = tokens(8)
    sa = run(core, a, "r", prompt, release=False)
    core.step(a, StepBatch.of(cache=[(sa, prompt)]))
    (sb,) = core.open(b, ["r"]).tolist()
    core.step(b, StepBatch.of(match=[(sb, prompt)], alloc_slots=[sb], alloc_needs=[1]))
    shared = row(core, sa)
    assert row(core, sb)[:2] == shared
    core.step(a, StepBatch.of(release_slots=[sa]))  # a lets go: b still holds them
    assert core.pool.ref_cnt[shared].tolist() == [1, 1]
    assert core.stats().num_cached_pages == 0
    core.step(b, StepBatch.of(release_slots=[sb]))
    assert core.stats().num_cached_pages == 2


def test_eviction_is_lru_chain_end_first() -> None:
    core, events = make(num_pages=9)  # 8 pages
    a = core.add_owner()
    old, new = tokens(8, 100), tokens(8, 500)
    run(core, a, "old", old)
    run(core, a, "new", new)
    events.clear()
    assert core.stats().num_cached_pages == 4
    old_keys = list(XXH3Keys().keys("", XXH3Keys().root(""), np.array(old, dtype=np.int32), 2, PS))
    # Allocs that need 5 pages: 4 free, so one eviction: the oldest chain's end.
    (slot,) = core.open(a, ["big"]).tolist()
    result = core.step(a, StepBatch.of(alloc_slots=[slot], alloc_needs=[5 * PS]))
    assert result.num_pages_evicted == 1
    assert [e.keys for e in events if isinstance(e, PagesRemoved)] == [[old_keys[1]]]
    core.step(a, StepBatch.of(alloc_slots=[slot], alloc_needs=[PS]))  # one more: the old chain's first page
    assert [e.keys for e in events if isinstance(e, PagesRemoved)][-1] == [old_keys[0]]
    (probe,) = core.open(a, ["probe"]).tolist()
    assert core.step(a, StepBatch.of(match=[(probe, new)])).match_lens.tolist() == [8]
    assert core.step(a, StepBatch.of(release_slots=[probe], match=[])).match_lens.size == 0


def test_a_match_refreshes_recency() -> None:
    core, events = make(num_pages=9)
    a = core.add_owner()
    first, second = tokens(8, 100), tokens(8, 500)
    run(core, a, "first", first)
    run(core, a, "second", second)
    (slot,) = core.open(a, ["again"]).tolist()
    core.step(a, StepBatch.of(match=[(slot, first)]))
    core.step(a, StepBatch.of(release_slots=[slot]))  # first is now the most recent
    events.clear()
    (big,) = core.open(a, ["big"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[big], alloc_needs=[6 * PS]))
    (probe,) = core.open(a, ["probe"]).tolist()
    assert core.step(a, StepBatch.of(match=[(probe, first)])).match_lens.tolist() == [8]


def test_eviction_under_pressure_serves_allocs_and_refuses_beyond() -> None:
    core, _ = make(num_pages=9)
    a = core.add_owner()
    run(core, a, "r", tokens(16))  # 4 pages cached
    (slot,) = core.open(a, ["big"]).tolist()
    result = core.step(a, StepBatch.of(alloc_slots=[slot], alloc_needs=[8 * PS]))
    assert result.alloc_status.tolist() == [AllocStatus.OK] and result.num_pages_evicted == 4
    stats = core.stats()
    assert (stats.num_free_pages, stats.num_cached_pages, stats.num_evictions) == (0, 0, 4)
    (other,) = core.open(a, ["more"]).tolist()
    result = core.step(a, StepBatch.of(alloc_slots=[other], alloc_needs=[1]))
    assert result.alloc_status.tolist() == [AllocStatus.OUT_OF_PAGES]


def test_duplicate_insert_frees_the_request_page_and_keeps_the_cached_one() -> None:
    core, _ = make()
    a, b = core.add_owner(), core.add_owner()
    prompt = tokens(8)
    sa = run(core, a, "r", prompt, release=False)
    sb = run(core, b, "r", prompt, release=False)  # computed the same prompt itself
    core.step(a, StepBatch.of(cache=[(sa, prompt)]))
    cached, own = row(core, sa), row(core, sb)
    free_before = core.stats().num_free_pages
    # Release with tokens: b's duplicates are freed, the cache's pages kept.
    core.step(b, StepBatch.of(release_slots=[sb], release_tokens=[prompt]))
    assert core.stats().num_free_pages == free_before + 2
    assert set(core.pool.free_pages().tolist()) >= set(own)
    assert core.pool.ref_cnt[cached].tolist() == [1, 1]
    # A cache item instead switches the row to the cached pages.
    sc = run(core, b, "r2", [*prompt, 7], release=False)
    own = row(core, sc)
    result = core.step(b, StepBatch.of(cache=[(sc, prompt)]))
    assert result.cache_switched.tolist() == [2]
    assert row(core, sc) == cached + own[2:]
    assert set(own[:2]) <= set(core.pool.free_pages().tolist())
    assert result.changed_rows.tolist() == [sc]


def test_parents_outlive_their_children_and_a_chain_regrows() -> None:
    """A parent is never evicted while a child is cached (chain ends go first), so no
    cached page has a missing parent; once a chain is evicted from its end up to its
    first page, the same tokens insert it again from the root."""
    core, events = make(num_pages=9)
    a = core.add_owner()
    prompt = tokens(12)
    run(core, a, "r", prompt)
    keys = next(e for e in events if isinstance(e, PagesStored)).keys
    (slot,) = core.open(a, ["short"]).tolist()
    core.step(a, StepBatch.of(match=[(slot, prompt, PS)]))  # holds the first page only
    (big,) = core.open(a, ["big"]).tolist()
    events.clear()
    core.step(a, StepBatch.of(alloc_slots=[big], alloc_needs=[7 * PS]))  # 5 free + 2 evicted
    removed = [k for e in events if isinstance(e, PagesRemoved) for k in e.keys]
    assert removed == [keys[2], keys[1]]
    core.step(a, StepBatch.of(release_slots=[slot, big]))
    (again,) = core.open(a, ["again"]).tolist()
    result = core.step(a, StepBatch.of(match=[(again, prompt)], alloc_slots=[again], alloc_needs=[12]))
    assert result.match_lens.tolist() == [4]
    result = core.step(a, StepBatch.of(release_slots=[again], release_tokens=[prompt]))
    assert result.num_pages_cached == 2
    (probe,) = core.open(a, ["probe"]).tolist()
    assert core.step(a, StepBatch.of(match=[(probe, prompt)])).match_lens.tolist() == [12]


def test_the_whole_step_order_in_one_call() -> None:
    """Release with tokens, then match of the same prompt, then alloc of the rest: the
    new request matches what the release just cached, and its alloc extends from there."""
    core, _ = make()
    a = core.add_owner()
    prompt = tokens(10)
    done = run(core, a, "done", prompt, release=False)
    cached = row(core, done)[:2]
    (fresh,) = core.open(a, ["fresh"]).tolist()
    result = core.step(
        a,
        StepBatch.of(
            release_slots=[done],
            release_tokens=[prompt],
            match=[(fresh, [*prompt, 1, 2, 3], len(prompt) + 2)],
            alloc_slots=[fresh],
            alloc_needs=[13],  # the whole length: the remainder after the match is allocated
            alloc_expected_lens=[-1],
        ),
    )
    assert result.match_lens.tolist() == [8]
    assert result.alloc_status.tolist() == [AllocStatus.OK]
    assert core.alloced_len(a, fresh) == 13
    assert row(core, fresh)[:2] == cached
    ps_base = [p * PS for p in row(core, fresh)[2:]]
    assert result.kv_loc.tolist() == [ps_base[0] + i for i in range(4)] + [ps_base[1]]


def test_truncate_into_a_cached_page_is_refused() -> None:
    core, _ = make()
    a = core.add_owner()
    prompt = tokens(8)
    slot = run(core, a, "r", prompt, release=False)
    core.step(a, StepBatch.of(cache=[(slot, prompt)]))
    before = core.block_table.copy()
    with pytest.raises(KVMemError) as err:
        core.step(a, StepBatch.of(truncate_slots=[slot], truncate_lens=[6]))
    assert err.value.reason is Reason.PAGE_SHARED
    assert "truncate to a page boundary (4)" in err.value.message
    assert np.array_equal(core.block_table, before) and core.alloced_len(a, slot) == 8
    core.step(a, StepBatch.of(truncate_slots=[slot], truncate_lens=[4]))  # a boundary is fine
    assert core.stats().num_cached_pages == 1


@pytest.mark.parametrize(
    ("batch", "reason", "words"),
    [
        (lambda s: StepBatch.of(cache=[(s, tokens(12))]), Reason.ALLOCED_LEN_MISMATCH, "beyond alloced_len 8"),
        (lambda s: StepBatch.of(cache=[(s, tokens(8)), (s, tokens(8))]), Reason.DUPLICATE_SLOT, "appears twice"),
        (lambda s: StepBatch.of(match=[(s, tokens(8))]), Reason.ALLOCED_LEN_MISMATCH, "a fresh request"),
        (lambda s: StepBatch.of(release_slots=[s], release_tokens=[tokens(8, 7)]), Reason.BAD_VALUE, "differ"),
        (lambda s: StepBatch.of(match=[(99, tokens(8))]), Reason.SLOT_NOT_FOUND, "not open"),
        (lambda s: StepBatch.of(truncate_slots=[s], truncate_lens=[0], match=[(s, tokens(8), -2)]), Reason.BAD_VALUE,
         "match_max_tokens[0] must be >= 0"),
        (lambda s: StepBatch.of(release_slots=[s], match=[(s, tokens(8))]), Reason.SLOT_NOT_FOUND, "released earlier"),
    ],
)  # fmt: skip
def test_bad_prefix_items_change_nothing(batch, reason, words) -> None:
    core, events = make()
    a = core.add_owner()
    prompt = tokens(8)
    slot = run(core, a, "r", prompt, release=False)
    core.step(a, StepBatch.of(cache=[(slot, prompt)]))
    table, stats, keys, n_events = core.block_table.copy(), core.stats(), dict(core.cache.index), len(events)
    with pytest.raises(KVMemError) as err:
        core.step(a, batch(slot))
    assert err.value.reason is reason, err.value
    assert words in err.value.message
    assert np.array_equal(core.block_table, table) and core.stats() == stats
    assert core.cache.index == keys and len(events) == n_events


def test_expected_length_on_a_matched_alloc_is_refused() -> None:
    core, _ = make()
    a = core.add_owner()
    (slot,) = core.open(a, ["r"]).tolist()
    with pytest.raises(KVMemError, match="matched in this step"):
        core.step(
            a, StepBatch.of(match=[(slot, tokens(8))], alloc_slots=[slot], alloc_needs=[1], alloc_expected_lens=[0])
        )
    assert core.alloced_len(a, slot) == 0


def test_no_prefix_cache_matches_nothing_and_caches_nothing() -> None:
    core, events = make(prefix_cache=False)
    a = core.add_owner()
    prompt = tokens(8)
    slot = run(core, a, "r", prompt, release=False)
    assert core.step(a, StepBatch.of(cache=[(slot, prompt)])).cache_switched.tolist() == [0]
    core.step(a, StepBatch.of(release_slots=[slot], release_tokens=[prompt]))
    (fresh,) = core.open(a, ["x"]).tolist()
    assert core.step(a, StepBatch.of(match=[(fresh, prompt)])).match_lens.tolist() == [0]
    stats = core.stats()
    assert (stats.num_cached_pages, stats.num_cache_entries, stats.num_free_pages) == (0, 0, 16)
    assert events == []


def test_quota_caps_a_match_and_quarantine_keeps_cached_pages_matchable() -> None:
    core, _ = make()
    a, b = core.add_owner(), core.add_owner()
    prompt = tokens(16)
    sa = run(core, a, "r", prompt, release=False)
    core.step(a, StepBatch.of(cache=[(sa, prompt)], alloc_slots=[sa], alloc_needs=[2]))
    (sb,) = core.open(b, ["r"]).tolist()
    assert core.step(b, StepBatch.of(match=[(sb, prompt)]), quota_pages=2).match_lens.tolist() == [8]
    # a's lease lapses: its uncached tail page is quarantined; its cached pages stay in the cache.
    core.remove_owner(a, quarantine=True)
    assert core.quarantined_pages(a) == 1
    (probe,) = core.open(b, ["probe"]).tolist()
    assert core.step(b, StepBatch.of(match=[(probe, prompt)])).match_lens.tolist() == [16]


def test_snapshot_lists_every_cached_page_parents_first() -> None:
    core, _ = make()
    a = core.add_owner("ns")
    run(core, a, "r1", tokens(12))
    run(core, a, "r2", tokens(8, 900))
    snap = core.snapshot_events()
    assert isinstance(snap[0], AllCleared)
    stored = snap[1:]
    assert len(stored) == 5 and all(len(e.keys) == 1 and e.namespace == "ns" for e in stored)
    seen: set[bytes] = set()
    for e in stored:
        assert e.parent_key is None or e.parent_key in seen
        seen.add(e.keys[0])
    assert seen == set(core.cache.index)


@pytest.mark.parametrize("how", ["release", "truncate", "remove_owner"])
def test_rows_that_share_a_descending_chain_let_go_together(how: str) -> None:
    """Two requests holding the same cached chain let go in one call (the pages are
    listed twice): the queue still holds the chain end first, even where the chain's
    first page has the higher id, so eviction takes the end, never the parent.
    (Found by the wire fuzzer: pages sorted by id put the parent first.)"""
    core = KVCore(CoreConfig(num_pages=4, page_size=4, max_requests=8, max_context_len=32), audit_every_step=True)
    a = core.add_owner()
    x, y = core.open(a, ["x", "y"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[x], alloc_needs=[8]))  # x: [1, 2]
    core.step(a, StepBatch.of(release_slots=[x]))  # the free stack's top: 2, then 1
    core.step(a, StepBatch.of(alloc_slots=[y], alloc_needs=[8]))  # y: [2, 1]: the parent has the higher id
    toks = list(range(8))
    core.step(a, StepBatch.of(release_slots=[y], release_tokens=[toks]))  # cached chain 2 -> 1
    holder = core.add_owner() if how == "remove_owner" else a
    r1, r2 = core.open(holder, ["r1", "r2"]).tolist()
    core.step(holder, StepBatch.of(match=[(r1, toks), (r2, toks)]))
    if how == "release":
        core.step(a, StepBatch.of(release_slots=[r1, r2]))
    elif how == "truncate":
        core.step(a, StepBatch.of(truncate_slots=[r1, r2], truncate_lens=[0, 0]))
    else:
        core.remove_owner(holder)
    assert core.cache.queued().tolist() == [1, 2]  # the end (page 1) first
    (z,) = core.open(a, ["z"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[z], alloc_needs=[8]))  # page 3 and one eviction: the chain's end
    (probe,) = core.open(a, ["probe"]).tolist()
    assert core.step(a, StepBatch.of(match=[(probe, toks)])).match_lens.tolist() == [4]


def test_a_duplicate_found_by_a_release_is_queued_in_its_chain_place() -> None:
    """A release with tokens whose first page is already cached elsewhere (Q): the row
    switches to Q before the release, so Q is queued with the chain, after its new
    child, and an eviction of one page takes the child, never Q. (Found by reading the
    server for the wire fuzzer: Q left where it was in the queue was older than the
    child, so evicted first, leaving a cached page without its parent.)"""
    core, _ = make(num_pages=9)
    a = core.add_owner()
    t = tokens(8)
    s1, s2 = core.open(a, ["x", "y"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[s1, s2], alloc_needs=[4, 8]))
    core.step(a, StepBatch.of(release_slots=[s1], release_tokens=[t[:4]]))  # Q cached, evictable
    q = core.cache.queued().tolist()
    core.step(a, StepBatch.of(release_slots=[s2], release_tokens=[t]))  # page 0 duplicates Q
    queued = core.cache.queued().tolist()
    assert queued[-1] == q[0] and len(queued) == 2  # the child, then Q (newest)
    (z,) = core.open(a, ["z"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[z], alloc_needs=[4 * (core.pool.num_free + 1)]))  # evicts one page
    (probe,) = core.open(a, ["probe"]).tolist()
    assert core.step(a, StepBatch.of(match=[(probe, t)])).match_lens.tolist() == [4]


def test_a_duplicate_held_by_a_row_released_in_the_same_step() -> None:
    core, _ = make(num_pages=9)
    a = core.add_owner()
    t = tokens(8)
    s1, s2 = core.open(a, ["x", "y"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[s1, s2], alloc_needs=[4, 8]))
    core.step(a, StepBatch.of(cache=[(s1, t[:4])]))
    core.step(a, StepBatch.of(release_slots=[s2, s1], release_tokens=[t, None]))
    (z,) = core.open(a, ["z"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[z], alloc_needs=[4 * (core.pool.num_free + 1)]))
    (probe,) = core.open(a, ["probe"]).tolist()
    assert core.step(a, StepBatch.of(match=[(probe, t)])).match_lens.tolist() == [4]


def test_bad_slots_beside_a_match_are_not_found_never_a_crash() -> None:
    core, _ = make()
    a = core.add_owner()
    (s,) = core.open(a, ["r"]).tolist()
    for batch in (
        StepBatch.of(match=[(s, tokens(8))], alloc_slots=[1_000_000], alloc_needs=[1], alloc_expected_lens=[-1]),
        StepBatch.of(match=[(1_000_000, tokens(8))], alloc_slots=[s], alloc_needs=[1], alloc_expected_lens=[-1]),
        StepBatch.of(match=[(9, tokens(8))], alloc_slots=[-1], alloc_needs=[1], alloc_expected_lens=[3]),
    ):
        with pytest.raises(KVMemError) as err:
            core.step(a, batch)
        assert err.value.reason is Reason.SLOT_NOT_FOUND, err.value


def test_match_max_tokens_without_match_items_is_a_length_mismatch() -> None:
    core, _ = make()
    a = core.add_owner()
    with pytest.raises(KVMemError) as err:
        core.step(a, StepBatch(match_max_tokens=np.array([3, 4], dtype=np.int64)))
    assert err.value.reason is Reason.LENGTH_MISMATCH
