"""The host-memory tier in the core: pages the pool evicts go to host memory with their
K/V (write-back), a match that reaches them loads them back into device pages in the
same call, the host evicts least recently used without breaking a chain, and every page
of both tiers is accounted for (every core here audits after every call).

The K/V bytes are real: the pool is a numpy array in the pool's layout, the host tier's
pages are :class:`kvmem.server.memory.host.HostPages` over it, and each test writes a
pattern into the token slots it allocates and reads it back through the row a match
gives."""

from __future__ import annotations

import numpy as np
import pytest

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


@pytest.mark.parametrize(
    "geometry",
    [
        KVGeometry("mha", num_layers=3, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=PS),
        KVGeometry("mla", num_layers=3, kv_lora_rank=8, rope_dim=4, dtype="float16", page_size=PS),
    ],
    ids=["mha", "mla"],
)
def test_tier_pages_go_to_the_host_and_back_whole_in_either_format(geometry: KVGeometry) -> None:
    """A page is every layer's slice of the pool (K and V for mha, the latent for mla):
    what goes to the host comes back byte for byte into another page, and nothing else
    of the pool changes."""
    num_pages = 6
    spec = PoolSpec(geometry, num_pages, 4, 8)
    pool = np.random.default_rng(3).integers(0, 255, spec.kv_bytes, dtype=np.uint8)
    mover = HostPages([pool], geometry, num_pages, 3)
    before = pool.copy()
    mover.to_host(np.array([2, 4]), np.array([1, 0]))
    mover.to_device(np.array([1, 0]), np.array([5, 3]))  # page 2's bytes into page 5, page 4's into 3
    view = pool.reshape(planes_of(geometry), num_pages, -1)
    was = before.reshape(planes_of(geometry), num_pages, -1)
    assert np.array_equal(view[:, 5], was[:, 2]) and np.array_equal(view[:, 3], was[:, 4])
    untouched = [0, 1, 2, 4]
    assert np.array_equal(view[:, untouched], was[:, untouched])
