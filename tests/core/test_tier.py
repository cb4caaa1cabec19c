"""The host-memory tier in the core: pages the pool evicts go to host memory with their
K/V (write-back), a match that reaches them loads them back into device pages in the
same call, the host evicts least recently used without breaking a chain, and every page
of both tiers is accounted for (every core here audits after every call).

The K/V bytes are real: the pool is a numpy array in the pool's layout, the host tier's
pages are :class:`kvmem.server.memory.host.HostPages` over it, and each test writes a
pattern into the token slots it allocates and reads it back through the row a match
gives."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvmem.client.loads import PageLoads
from kvmem.server.core import AllocStatus, CoreConfig, KVCore, StepBatch
from kvmem.server.core.events import PagesRemoved, PagesStored
from kvmem.server.core.tier import HostTier
from kvmem.server.memory.geometry import KVGeometry, PoolSpec
from kvmem.server.memory.host import HostPages, planes_of

PS = 4
GEOMETRY = KVGeometry("mha", num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32", page_size=PS)


class Pool:
    """A core with a host tier over a numpy KV pool, and the pool's bytes."""

    def __init__(
        self,
        num_pages: int = 9,
        host_pages: int = 16,
        max_context_len: int = 32,
        min_load_pages: int = 1,
        write_through: bool = False,
    ) -> None:
        spec = PoolSpec(GEOMETRY, num_pages, 8, max_context_len)
        self.raw = np.zeros(spec.kv_bytes, dtype=np.uint8)
        self.events: list = []
        self.mover = HostPages([self.raw], GEOMETRY, num_pages, host_pages)
        self.tier = HostTier(host_pages, PS, self.mover, min_load_pages, write_through)
        self.core = KVCore(
            CoreConfig(num_pages=num_pages, page_size=PS, max_requests=8, max_context_len=max_context_len),
            audit_every_step=True,
            event_sink=self.events.extend,
            host_tier=self.tier,
            page_bytes=GEOMETRY.page_bytes,
        )
        self.owner = self.core.add_owner()
        self.loads = PageLoads(self.mover.counters, GEOMETRY.num_layers, PS)
        # [planes, tokens, bytes per token per plane]: every plane of every token slot
        self.slots = self.raw.reshape(planes_of(GEOMETRY), num_pages * PS, -1)

    def write(self, kv_loc: np.ndarray, token_ids: list[int], start: int) -> None:
        """What a model would write: per plane, bytes made of the token, its position, the plane."""
        for i, (loc, tok) in enumerate(zip(kv_loc.tolist(), token_ids, strict=True)):
            for plane in range(self.slots.shape[0]):
                self.slots[plane, loc] = _pattern(tok, start + i, plane, self.slots.shape[2])

    def check(self, slot: int, token_ids: list[int]) -> None:
        """The row's first ``len(token_ids)`` token slots hold what was written for them."""
        row = self.core.block_table[slot]
        # as a reader does: wait for the pages still loading (the copy thread's)
        self.loads.wait(row[: -(-len(token_ids) // PS)].astype(np.int64), timeout=10)
        for pos, tok in enumerate(token_ids):
            loc = int(row[pos // PS]) * PS + pos % PS
            for plane in range(self.slots.shape[0]):
                want = _pattern(tok, pos, plane, self.slots.shape[2])
                assert np.array_equal(self.slots[plane, loc], want), f"position {pos}, plane {plane}"

    def run(self, rid: str, toks: list[int], *, release: bool = True) -> int:
        """A request that computes ``toks`` (writing their K/V) and, with ``release``,
        ends with them (their full pages cached)."""
        core = self.core
        (slot,) = core.open(self.owner, [rid]).tolist()
        result = core.step(self.owner, StepBatch.of(alloc_slots=[slot], alloc_needs=[len(toks)]))
        assert result.alloc_status.tolist() == [AllocStatus.OK]
        self.write(result.kv_loc, toks, 0)
        if release:
            core.step(self.owner, StepBatch.of(release_slots=[slot], release_tokens=[toks]))
        return slot

    def match(self, rid: str, toks: list[int]) -> tuple[int, int]:
        (slot,) = self.core.open(self.owner, [rid]).tolist()
        result = self.core.step(self.owner, StepBatch.of(match=[(slot, toks)]))
        return slot, int(result.match_lens[0])


def _pattern(token: int, position: int, plane: int, width: int) -> np.ndarray:
    return ((np.arange(width) * 7 + token * 31 + position * 13 + plane * 101) % 251).astype(np.uint8)


def tokens(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def test_tier_an_evicted_prefix_comes_back_from_the_host_with_its_kv() -> None:
    p = Pool()
    prompt = tokens(14, 100)  # 3 full pages + 2 tokens
    p.run("a", prompt)
    assert p.core.stats().num_cached_pages == 3
    big = p.run("b", tokens(32, 500), release=False)  # all 8 pages: the 3 cached ones evicted, to the host
    st = p.core.stats()
    assert (st.num_cached_pages, st.host.num_cached_pages, st.host.num_demoted) == (0, 3, 3)
    stored = [e for e in p.events if isinstance(e, PagesStored) and e.medium == "CPU"]
    removed = [e for e in p.events if isinstance(e, PagesRemoved)]
    assert sum(len(e.keys) for e in stored) == 3 and all(e.medium == "GPU" for e in removed)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))  # b ends without caching: its pages are free
    slot, matched = p.match("c", prompt)
    assert matched == 12  # all 3 pages, from the host
    p.check(slot, prompt[:12])
    st = p.core.stats()
    assert (st.host.num_loaded, st.host.hit_tokens, st.prefix_hit_tokens) == (3, 12, 12)
    assert st.host.num_cached_pages == 3  # both tiers hold them now
    loads = [e for e in p.events if isinstance(e, PagesStored) and e.medium == "GPU"]
    assert loads[-1].parent_key is None and len(loads[-1].keys) == 3  # the load: stored on the device again


def test_tier_a_match_continues_from_the_device_onto_the_host() -> None:
    p = Pool(num_pages=9)
    prompt = tokens(16, 100)  # 4 full pages
    p.run("a", prompt)
    holder = p.run("b", prompt[:8], release=False)  # shares pages 0-1 (a match would) by caching them
    p.core.step(p.owner, StepBatch.of(release_slots=[holder], release_tokens=[prompt[:8]]))
    # Evict pages 2-3 of the chain (its end goes first), keep 0-1 on the device.
    _, matched = p.match("m", prompt[:8])
    assert matched == 8
    filler = p.run("f", tokens(24, 900), release=False)  # 6 pages: 7 usable left, 2 held by m
    st = p.core.stats()
    assert st.host.num_demoted >= 2
    p.core.step(p.owner, StepBatch.of(release_slots=[filler]))
    slot2, matched2 = p.match("again", prompt)
    assert matched2 == 16
    p.check(slot2, prompt)
    assert p.core.stats().host.num_loaded == 2


def test_tier_a_load_that_does_not_fit_is_shortened_not_failed() -> None:
    p = Pool(num_pages=9)
    prompt = tokens(16, 100)
    p.run("a", prompt)
    big = p.run("b", tokens(32, 500), release=False)  # every page: the prompt's 4 go to the host
    assert p.core.stats().host.num_cached_pages == 4
    (extra,) = p.core.open(p.owner, ["x"]).tolist()
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    p.core.step(p.owner, StepBatch.of(alloc_slots=[extra], alloc_needs=[24]))  # 6 of 8 pages held
    slot, matched = p.match("c", prompt)
    assert matched == 8  # 2 pages were left: the match takes what fits
    p.check(slot, prompt[:8])
    assert p.core.stats().num_free_pages == 0


def test_tier_the_host_evicts_least_recently_used_and_never_breaks_a_chain() -> None:
    p = Pool(num_pages=9, host_pages=4)
    first, second = tokens(16, 100), tokens(16, 300)
    p.run("a", first)
    big = p.run("b", tokens(32, 500), release=False)  # first's 4 pages -> host (full)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    p.run("c", second)
    big = p.run("d", tokens(32, 700), release=False)  # second's 4 -> host, first's evicted from it
    st = p.core.stats()
    assert (st.host.num_cached_pages, st.host.num_evicted) == (4, 4)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    assert p.match("e", first)[1] == 0
    slot, matched = p.match("f", second)
    assert matched == 16
    p.check(slot, second)
    assert any(isinstance(e, PagesRemoved) and e.medium == "CPU" for e in p.events)


def test_tier_more_evicted_at_once_than_the_host_holds_keeps_the_parents() -> None:
    p = Pool(num_pages=9, host_pages=2)
    prompt = tokens(16, 100)
    p.run("a", prompt)
    big = p.run("b", tokens(32, 500), release=False)  # 4 evicted at once, 2 fit: the chain's first two
    st = p.core.stats()
    assert (st.host.num_cached_pages, st.host.num_dropped) == (2, 2)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    slot, matched = p.match("c", prompt)
    assert matched == 8
    p.check(slot, prompt[:8])


def test_tier_two_matches_of_one_step_load_a_page_once() -> None:
    p = Pool(num_pages=9)
    prompt = tokens(12, 100)
    p.run("a", prompt)
    big = p.run("b", tokens(32, 500), release=False)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    s1, s2 = p.core.open(p.owner, ["x", "y"]).tolist()
    result = p.core.step(p.owner, StepBatch.of(match=[(s1, prompt), (s2, prompt)]))
    assert result.match_lens.tolist() == [12, 12]
    assert p.core.block_table[s1][:3].tolist() == p.core.block_table[s2][:3].tolist()
    p.check(s2, prompt)
    st = p.core.stats()
    assert (st.host.num_loaded, st.num_used_pages) == (3, 3)


def test_tier_a_load_shorter_than_the_minimum_is_computed_instead() -> None:
    p = Pool(num_pages=9, min_load_pages=4)  # --host-min-load-tokens 13-16 with pages of 4
    prompt = tokens(12, 100)  # 3 pages: shorter than the minimum
    p.run("a", prompt)
    big = p.run("b", tokens(32, 500), release=False)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    assert p.core.stats().host.num_cached_pages == 3
    assert p.match("c", prompt)[1] == 0  # not loaded: the request computes them
    assert p.core.stats().host.num_loaded == 0
    longer = tokens(16, 300)  # 4 pages: loaded
    p.run("d", longer)
    big = p.run("e", tokens(32, 700), release=False)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    slot, matched = p.match("f", longer)
    assert matched == 16
    p.check(slot, longer)


def test_tier_write_through_copies_pages_as_they_are_cached_and_evicting_copies_nothing() -> None:
    p = Pool(write_through=True)
    prompt = tokens(14, 100)
    p.run("a", prompt)  # released with its tokens: its 3 full pages cached, and on the host at once
    st = p.core.stats()
    assert (st.num_cached_pages, st.host.num_cached_pages, st.host.num_demoted) == (3, 3, 3)
    assert sum(len(e.keys) for e in p.events if isinstance(e, PagesStored) and e.medium == "CPU") == 3
    big = p.run("b", tokens(32, 500), release=False)  # evicts them: nothing more to copy
    assert p.core.stats().host.num_demoted == 3
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    slot, matched = p.match("c", prompt)
    assert matched == 12
    p.check(slot, prompt[:12])


def test_tier_cannot_be_used_with_a_kept_image_or_without_the_prefix_cache() -> None:
    p = Pool()
    cfg = CoreConfig(num_pages=9, page_size=PS, max_requests=8, max_context_len=32)
    with pytest.raises(ValueError, match="prefix cache off"):
        KVCore(cfg, prefix_cache=False, host_tier=p.tier)


def _mover(kind: str, pools: list[np.ndarray], geometry: KVGeometry, num_pages: int, host_pages: int) -> Any:
    """The numpy mover (the CPU pool's) or the torch one (a CUDA pool's, here over CPU
    tensors; a staging run of one page, so every copy is made in several runs)."""
    if kind == "numpy":
        return HostPages(pools, geometry, num_pages, host_pages)
    import torch

    from kvmem.server.memory.host_torch import TorchHostPages

    tensors = [torch.from_numpy(p) for p in pools]  # the same bytes: the test reads the numpy arrays
    return TorchHostPages(tensors, geometry, num_pages, host_pages, staging_bytes=geometry.page_bytes)


GEOMETRIES = [
    KVGeometry("mha", num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=PS),
    KVGeometry("mla", num_layers=3, kv_lora_rank=8, rope_dim=4, dtype="float16", page_size=PS),
]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["mha", "mla"])
def test_tier_pages_go_to_the_host_and_back_whole_in_either_format(geometry: KVGeometry, kind: str) -> None:
    """A page is every layer's slice of the pool (K and V for mha, the latent for mla):
    what goes to the host comes back byte for byte into another page, and nothing else
    of the pool changes. The copy back is the copy thread's, a layer at a time: layer
    i's counter passes i only once layer i's bytes are in, and no later layer is. The
    same for the torch mover (a CUDA pool's, its code run here on CPU tensors)."""
    num_pages = 6
    spec = PoolSpec(geometry, num_pages, 4, 8)
    pool = np.random.default_rng(3).integers(0, 255, spec.kv_bytes, dtype=np.uint8)
    mover = _mover(kind, [pool], geometry, num_pages, 3)
    before = pool.copy()
    mover.to_host(np.array([2, 4]), np.array([1, 0]))
    view = pool.reshape(planes_of(geometry), num_pages, -1)
    was = before.reshape(planes_of(geometry), num_pages, -1)
    per_layer = planes_of(geometry) // geometry.num_layers
    loads = PageLoads(mover.counters, geometry.num_layers, PS)
    target = np.array([5, 3])
    mover.hold()  # the copy thread stops before each layer: a layer at a time
    try:
        mover.start_load(np.array([1, 0]), target, "t")  # page 2's bytes into page 5, page 4's into 3
        assert mover.counters.tolist() == [3, 3, 3, 0, 3, 0] and not loads.ready(target, layer=0)
        for layer in range(geometry.num_layers):
            mover.allow(1)
            loads.wait(target, layer=layer, timeout=10)
            assert mover.counters[target].tolist() == [layer + 1] * 2
            done = (layer + 1) * per_layer  # these planes are in, the others not yet
            assert np.array_equal(view[:done, 5], was[:done, 2]) and np.array_equal(view[:done, 3], was[:done, 4])
            assert np.array_equal(view[done:, [5, 3]], was[done:, [5, 3]])
    finally:
        mover.resume()
    mover.wait_idle()
    assert list(mover.finished) == ["t"] and loads.ready(target)
    assert np.array_equal(view[:, 5], was[:, 2]) and np.array_equal(view[:, 3], was[:, 4])
    untouched = [0, 1, 2, 4]
    assert np.array_equal(view[:, untouched], was[:, untouched])
    mover.close()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=["mha", "mla"])
def test_tier_pages_of_every_rank_move_together(geometry: KVGeometry, kind: str) -> None:
    """Two tensor-parallel ranks (``--devices``: a tier per rank, one page id space):
    a demotion and a load move the page on every rank, each into its own rank, and both
    movers leave the same bytes."""
    num_pages, spec = 5, PoolSpec(geometry, 5, 4, 8)
    rng = np.random.default_rng(11)
    pools = [rng.integers(0, 255, spec.kv_bytes, dtype=np.uint8) for _ in range(2)]
    was = [p.copy().reshape(planes_of(geometry), num_pages, -1) for p in pools]
    mover = _mover(kind, pools, geometry, num_pages, 4)
    mover.to_host(np.array([0, 3, 1]), np.array([2, 0, 3]))
    for rank in range(2):
        assert np.array_equal(mover.page(2, rank), was[rank][:, 0]) and np.array_equal(mover.page(3, rank), was[rank][:, 1])
    mover.start_load(np.array([2, 0, 3]), np.array([4, 2, 0]), "t")
    mover.wait_idle()
    for rank in range(2):
        view = pools[rank].reshape(planes_of(geometry), num_pages, -1)
        assert np.array_equal(view[:, [4, 2, 0]], was[rank][:, [0, 3, 1]])
        assert np.array_equal(view[:, [1, 3]], was[rank][:, [1, 3]])
    assert mover.counters.tolist() == [geometry.num_layers] * num_pages and list(mover.finished) == ["t"]
    mover.close()


# --------------------------------------------------------------- loads off the Step's path
# The copy thread is held (HostPages.hold) so that a load is in copy for as long as a
# test needs: every interleaving below is made, not hoped for.


def _evicted_prefix(p: Pool, prompt: list[int]) -> None:
    """``prompt``'s full pages cached, then evicted to the host by a request taking the whole pool."""
    p.run("a", prompt)
    big = p.run("b", tokens(32, 500), release=False)
    p.core.step(p.owner, StepBatch.of(release_slots=[big]))
    assert p.core.stats().host.num_cached_pages == len(prompt) // PS


def test_tier_a_match_answers_before_its_copy_and_says_what_is_still_loading() -> None:
    p = Pool()
    prompt = tokens(12, 100)
    _evicted_prefix(p, prompt)
    p.mover.hold()
    try:
        (slot,) = p.core.open(p.owner, ["c"]).tolist()
        r = p.core.step(p.owner, StepBatch.of(match=[(slot, prompt)]))
        assert r.match_lens.tolist() == [12] and r.match_loading.tolist() == [12]
        pages = p.loads.pages_of(p.core.block_table[slot], 12, 12)
        assert not p.loads.ready(pages, layer=0)  # nothing of it is readable yet
        st = p.core.stats()
        assert st.host.num_loading_pages == 3 and st.num_used_pages == 3
        # Another session matching the same prefix meanwhile shares the pages in copy: it waits too.
        other = p.core.add_owner()
        (slot2,) = p.core.open(other, ["d"]).tolist()
        r2 = p.core.step(other, StepBatch.of(match=[(slot2, prompt[:8])]))
        assert r2.match_lens.tolist() == [8] and r2.match_loading.tolist() == [8]
        assert p.core.stats().host.num_loaded == 3  # loaded once
        p.mover.allow(1)  # layer 0 of every page in: layer 0 readable, layer 1 not
        p.loads.wait(pages, layer=0, timeout=10)
        assert not p.loads.ready(pages, layer=1)
    finally:
        p.mover.resume()
    p.check(slot, prompt)
    p.check(slot2, prompt[:8])
    assert p.core.finish_loads() == 3
    (slot3,) = p.core.open(p.owner, ["e"]).tolist()
    r3 = p.core.step(p.owner, StepBatch.of(match=[(slot3, prompt)]))
    assert r3.match_lens.tolist() == [12] and r3.match_loading.tolist() == [0]  # on the device, loaded


def test_tier_a_request_released_while_loading_frees_its_pages_when_the_copy_ends() -> None:
    p = Pool()
    prompt = tokens(12, 100)
    _evicted_prefix(p, prompt)
    p.mover.hold()
    try:
        slot, _ = p.match("c", prompt)
        pages = p.core.block_table[slot, :3].copy()
        p.core.step(p.owner, StepBatch.of(release_slots=[slot]))  # released with its load in copy
        st = p.core.stats()
        assert (st.num_used_pages, st.num_cached_pages) == (3, 0)  # the load holds them: no one can take them
        assert p.core.pool.ref_cnt[pages].tolist() == [1, 1, 1]
        # An alloc wanting every page cannot have them: they are neither free nor evictable.
        (big,) = p.core.open(p.owner, ["big"]).tolist()
        r = p.core.step(p.owner, StepBatch.of(alloc_slots=[big], alloc_needs=[32]))
        assert r.alloc_status.tolist() == [AllocStatus.OUT_OF_PAGES]
    finally:
        p.mover.resume()
    p.mover.wait_idle()
    # The Step takes the finished load first: its pages are evictable, then taken.
    r = p.core.step(p.owner, StepBatch.of(alloc_slots=[big], alloc_needs=[32]))
    assert r.alloc_status.tolist() == [AllocStatus.OK]
    assert p.core.stats().host.num_loading_pages == 0


def test_tier_a_session_killed_mid_load_loses_nothing() -> None:
    p = Pool()
    prompt = tokens(12, 100)
    _evicted_prefix(p, prompt)
    victim = p.core.add_owner()
    p.mover.hold()
    try:
        (slot,) = p.core.open(victim, ["v"]).tolist()
        r = p.core.step(victim, StepBatch.of(match=[(slot, prompt)], alloc_slots=[slot], alloc_needs=[14]))
        assert r.match_loading.tolist() == [12] and r.alloc_status.tolist() == [AllocStatus.OK]
        p.core.remove_owner(victim, quarantine=True)  # its lease lapsed: its own page is quarantined
        st = p.core.stats()
        assert (st.num_quarantined_pages, st.num_used_pages, st.host.num_loading_pages) == (1, 3, 3)
    finally:
        p.mover.resume()
    p.mover.wait_idle()
    assert p.core.finish_loads() == 3
    st = p.core.stats()
    assert (st.num_cached_pages, st.num_used_pages, st.num_quarantined_pages) == (3, 0, 1)
    assert p.core.audit().ok
    slot2, matched = p.match("w", prompt)  # the K/V a dead session's load brought in serve the next one
    assert matched == 12
    p.check(slot2, prompt)


def test_tier_a_host_tier_whose_pages_are_all_in_copy_drops_evictions_and_never_waits() -> None:
    p = Pool(num_pages=9, host_pages=3)
    prompt = tokens(12, 100)
    _evicted_prefix(p, prompt)  # the host's 3 pages: the prompt's
    p.mover.hold()
    try:
        slot, matched = p.match("c", prompt)
        assert matched == 12 and p.core.stats().host.num_loading_pages == 3  # every host page pinned
        dropped = p.core.stats().host.num_dropped
        p.run("x", tokens(8, 700))  # 2 pages cached
        filler = p.run("f", tokens(20, 900), release=False)  # 5 pages: evicts x's 2, the host has no room
        st = p.core.stats()
        assert st.host.num_dropped == dropped + 2 and st.host.num_cached_pages == 3
        removed = [k for e in p.events if isinstance(e, PagesRemoved) and e.medium == "GPU" for k in e.keys]
        assert len(removed) >= 2  # reported gone, not lost silently
        p.core.step(p.owner, StepBatch.of(release_slots=[filler]))
    finally:
        p.mover.resume()
    p.check(slot, prompt)


# --------------------------------------------------------------- a kept state (--keep-state)


class KeptPool(Pool):
    """A :class:`Pool` whose core keeps a state image, its host pages in memory of the
    test's (what the kept files are to a server), so that :meth:`restart` can build
    another core over the same image, table, counters and host pages, as a restarted
    server does (:func:`kvmem.server.core.restore.restore`)."""

    def __init__(self, num_pages: int = 9, host_pages: int = 16) -> None:
        from kvmem.server.core.image import CoreImage
        from kvmem.server.core.restore import layout_for

        spec = PoolSpec(GEOMETRY, num_pages, 8, 32)
        self.raw = np.zeros(spec.kv_bytes, dtype=np.uint8)
        self.host_raw = np.zeros(host_pages * GEOMETRY.page_bytes, dtype=np.uint8)
        self.counters = np.zeros(num_pages, dtype=np.int32)
        self.table = np.zeros((9, 8), dtype=np.int32)
        self.cfg = CoreConfig(num_pages=num_pages, page_size=PS, max_requests=8, max_context_len=32)
        self.layout = layout_for(self.cfg, host_pages=host_pages)
        self.buf = bytearray(self.layout.size)
        self.events: list = []
        self.num_pages, self.host_pages = num_pages, host_pages
        self.mover = HostPages([self.raw], GEOMETRY, num_pages, host_pages, self.counters, [self.host_raw])
        self.tier = HostTier(host_pages, PS, self.mover)
        self.core = KVCore(
            self.cfg,
            self.table,
            audit_every_step=True,
            event_sink=self.events.extend,
            image=CoreImage.create(self.buf, self.layout),
            host_tier=self.tier,
            page_bytes=GEOMETRY.page_bytes,
        )
        self.owner = self.core.add_owner()
        self.loads = PageLoads(self.mover.counters, GEOMETRY.num_layers, PS)
        self.slots = self.raw.reshape(planes_of(GEOMETRY), num_pages * PS, -1)

    def restart(self) -> Any:
        """A new process's core over the kept state (the old one is gone, its copy thread
        with it: held ones never run again). Returns the restoration."""
        from kvmem.server.core.restore import restore

        self.mover.abandon()  # the old process's copy thread: its loads in copy never finish
        self.mover = HostPages(
            [self.raw], GEOMETRY, self.num_pages, self.host_pages, self.counters, [self.host_raw], reopened=True
        )
        self.tier = HostTier(self.host_pages, PS, self.mover)
        self.core, restoration = restore(
            self.cfg, self.table, self.buf, audit_every_step=True, host_tier=self.tier, page_bytes=GEOMETRY.page_bytes
        )
        self.owner = max(self.core.owner_ids())
        self.loads = PageLoads(self.mover.counters, GEOMETRY.num_layers, PS)
        return restoration


def test_tier_a_restart_with_the_state_kept_keeps_the_host_tier_and_its_index() -> None:
    p = KeptPool()
    prompt = tokens(12, 100)
    _evicted_prefix(p, prompt)
    r = p.restart()
    assert r.repaired == (), r.repaired
    st = p.core.stats()
    assert (st.host.num_cached_pages, st.host.num_free_pages, st.num_cached_pages) == (3, 13, 0)
    slot, matched = p.match("again", prompt)  # from the host tier the last process filled
    assert matched == 12
    p.check(slot, prompt)
    assert p.core.audit().ok


def _load_the_crash_cuts(p: KeptPool, prompt: list[int]) -> int:
    """``prompt``'s pages evicted to the host, then matched back in a committed Step
    whose load never finishes (the copy thread held: the process dies with it in
    copy). Returns the matching request's slot."""
    _evicted_prefix(p, prompt)
    p.mover.hold()
    (slot,) = p.core.open(p.owner, ["c"]).tolist()
    res = p.core.step(p.owner, StepBatch.of(match=[(slot, prompt)]), seq=1)
    p.core.commit(1)
    assert res.match_loading.tolist() == [12]
    return slot


def test_tier_a_restart_during_loads_copies_them_again_and_nothing_is_read_early() -> None:
    p = KeptPool()
    prompt = tokens(12, 100)
    slot = _load_the_crash_cuts(p, prompt)
    pages = p.core.block_table[slot, :3].copy()
    assert p.counters[pages].tolist() == [0, 0, 0]  # what a reader sees: not one layer in
    r = p.restart()
    assert any("copied in again from the host tier" in line for line in r.repaired), r.repaired
    assert p.loads.ready(pages.astype(np.int64))  # copied before the server serves
    assert p.core.block_table[slot, :3].tolist() == pages.tolist() and p.core.alloced_len(p.owner, slot) == 12
    p.check(slot, prompt)
    assert p.core.audit().ok


def test_tier_a_restart_during_a_load_whose_host_page_is_gone_cuts_the_rows_before_it() -> None:
    p = KeptPool()
    prompt = tokens(12, 100)
    slot = _load_the_crash_cuts(p, prompt)
    p.core.image.host_cached[:] = False  # a torn image: the host tier's facts lost
    r = p.restart()
    assert any("not on the host tier, uncached" in line for line in r.repaired), r.repaired
    assert p.core.alloced_len(p.owner, slot) == 0  # its row ends before the half-copied pages
    st = p.core.stats()
    assert (st.num_cached_pages, st.host.num_cached_pages) == (0, 0) and p.core.audit().ok
