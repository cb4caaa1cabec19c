"""Property test of the host-memory tier: random interleavings of requests that match
(on either tier), compute and write their K/V, cache or release into the prefix cache,
and of allocs that evict (demoting to the host, which evicts in turn), on small pools.

After every call the core audits both tiers (``audit_every_step``: every page of the
pool free, used, cached or quarantined once; every host page free, cached or pinned
once; every cached page's parent a root or cached on a tier), and every running
request's K/V, read through its row, is what was written for its tokens at their
positions: a page matched from either tier is never another's, never stale, never
half-copied. The copy thread is held and resumed at random, so loads stay in copy
across calls (released, evicted around, matched again meanwhile), and a reader reads
only what the load counters say is in. With the state kept, the process dies at random
(loads in copy included) and another takes the state over: every page of both tiers
is still accounted for and every running request's K/V still what was written."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmem.client.loads import PageLoads
from kvmem.server.core import AllocStatus, CoreConfig, KVCore, StepBatch
from kvmem.server.core.image import CoreImage
from kvmem.server.core.restore import layout_for, restore
from kvmem.server.core.tier import HostTier
from kvmem.server.memory.geometry import KVGeometry, PoolSpec
from kvmem.server.memory.host import HostPages, planes_of

PS = 2
GEOMETRY = KVGeometry("mha", num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=PS)
BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 50, 51, 52, 53], [60, 61, 62, 63, 64, 65]]


def patterns(tokens: list[int], start: int, planes: int, width: int) -> np.ndarray:
    """``[planes, len(tokens), width]``: what a model writes for each token at its
    position (``start`` on) in each plane, all at once."""
    tok = np.asarray(tokens, dtype=np.int64)[None, :, None]
    pos = (start + np.arange(len(tokens), dtype=np.int64))[None, :, None]
    plane = np.arange(planes, dtype=np.int64)[:, None, None]
    return ((np.arange(width)[None, None, :] * 3 + tok * 17 + pos * 5 + plane * 29) % 251).astype(np.uint8)


class World:
    """A core with a host tier; ``kept``: its state kept in an image (``--keep-state``),
    its host pages, load counters and block table in memory a restart takes over."""

    def __init__(self, num_pages: int, host_pages: int, write_through: bool = False, kept: bool = False) -> None:
        spec = PoolSpec(GEOMETRY, num_pages, 8, 10)
        self.raw = np.zeros(spec.kv_bytes, dtype=np.uint8)
        self.host_raw = np.zeros(host_pages * GEOMETRY.page_bytes, dtype=np.uint8)
        self.counters = np.zeros(num_pages, dtype=np.int32)
        self.cfg = CoreConfig(num_pages=num_pages, page_size=PS, max_requests=8, max_context_len=10)
        self.table = np.zeros(self.cfg.block_table_shape, dtype=np.int32)
        self.host_pages, self.write_through, self.kept = host_pages, write_through, kept
        self.buf = bytearray(layout_for(self.cfg, host_pages=host_pages).size) if kept else None
        mover = HostPages([self.raw], GEOMETRY, num_pages, host_pages, self.counters, [self.host_raw])
        self.tier = HostTier(host_pages, PS, mover, write_through=write_through)
        self.loads = PageLoads(mover.counters, GEOMETRY.num_layers, PS)
        image = None if self.buf is None else CoreImage.create(self.buf, layout_for(self.cfg, host_pages=host_pages))
        self.core = KVCore(
            self.cfg,
            self.table,
            audit_every_step=True,
            host_tier=self.tier,
            page_bytes=GEOMETRY.page_bytes,
            image=image,
        )
        self.owner = self.core.add_owner()
        self.slots = self.raw.reshape(planes_of(GEOMETRY), num_pages * PS, -1)
        self.running: dict[int, list[int]] = {}  # slot -> tokens computed (K/V written)
        self.mover = mover
        self.held = False  # the copy thread held: loads stay in copy until resumed
        self.n = 0

    def restart(self) -> None:
        """The process dies (its held copy thread with it) and another takes the kept
        state over: the same image, table, counters and host pages."""
        assert self.buf is not None
        self.mover.abandon()  # its loads in copy never finish
        # what both tiers hold, by key: a restart keeps every page of them (in copy or not)
        before = (dict(self.core.cache.index), set(self.tier.index))
        self.mover = HostPages(
            [self.raw], GEOMETRY, self.cfg.num_pages, self.host_pages, self.counters, [self.host_raw], reopened=True
        )
        self.tier = HostTier(self.host_pages, PS, self.mover, write_through=self.write_through)
        self.core, restoration = restore(
            self.cfg, self.table, self.buf, audit_every_step=True, host_tier=self.tier, page_bytes=GEOMETRY.page_bytes
        )
        assert not [r for r in restoration.repaired if "copied in again" not in r], restoration.repaired
        assert (dict(self.core.cache.index), set(self.tier.index)) == before
        self.owner = max(self.core.owner_ids())
        self.loads = PageLoads(self.mover.counters, GEOMETRY.num_layers, PS)
        self.held = False

    def write(self, kv_loc: np.ndarray, toks: list[int], start: int) -> None:
        if len(toks):
            self.slots[:, kv_loc] = patterns(toks, start, self.slots.shape[0], self.slots.shape[2])

    def check(self) -> None:
        for slot, toks in self.running.items():
            row = self.core.block_table[slot]
            pages = row[: -(-len(toks) // PS)].astype(np.int64)
            if self.held:  # loads may stay in copy: read only what the counters say is in
                ready = self.loads.counters[pages] == GEOMETRY.num_layers
                toks = toks[: int(np.argmin(ready)) * PS] if not ready.all() else toks
            else:
                self.loads.wait(pages, timeout=10)
            if not toks:
                continue
            pos = np.arange(len(toks))
            locs = row[pos // PS].astype(np.int64) * PS + pos % PS
            want = patterns(toks, 0, self.slots.shape[0], self.slots.shape[2])
            wrong = np.flatnonzero((self.slots[:, locs] != want).any(axis=(0, 2)))
            assert not wrong.size, (slot, wrong.tolist())

    def start(self, toks: list[int], cache: bool) -> None:
        if len(self.running) >= 6:
            return
        self.n += 1
        (slot,) = self.core.open(self.owner, [f"r{self.n}"]).tolist()
        r = self.core.step(
            self.owner, StepBatch.of(match=[(slot, toks, len(toks) - 1)], alloc_slots=[slot], alloc_needs=[len(toks)])
        )
        matched = int(r.match_lens[0])
        if r.alloc_status.tolist() != [AllocStatus.OK]:  # out of pages: the match stays, nothing computed
            self.running[slot] = toks[:matched]
            self.release(slot, with_tokens=False)
            return
        self.write(r.kv_loc, toks[matched:], matched)
        self.running[slot] = list(toks)
        if cache:
            self.core.step(self.owner, StepBatch.of(cache=[(slot, toks)]))

    def release(self, slot: int, with_tokens: bool) -> None:
        toks = self.running.pop(slot)
        tokens = [toks] if with_tokens else None
        self.core.step(self.owner, StepBatch.of(release_slots=[slot], release_tokens=tokens))

    def fill(self, n: int) -> None:
        """An alloc of ``n`` tokens (evicting), released at once without caching."""
        self.n += 1
        (slot,) = self.core.open(self.owner, [f"f{self.n}"]).tolist()
        self.core.step(self.owner, StepBatch.of(alloc_slots=[slot], alloc_needs=[n], atomic=False))
        self.core.step(self.owner, StepBatch.of(release_slots=[slot]))


ops = st.one_of(
    st.tuples(st.just("start"), st.integers(0, len(BASES) - 1), st.integers(3, 10), st.booleans()),
    st.tuples(st.just("start"), st.integers(0, len(BASES) - 1), st.just(10), st.just(False)),
    st.tuples(st.just("release"), st.integers(0, 7), st.booleans()),
    st.tuples(st.just("release"), st.integers(0, 7), st.just(True)),
    st.tuples(st.just("fill"), st.integers(1, 10)),
    st.tuples(st.just("fill"), st.integers(6, 10)),
    st.tuples(st.just("hold")),
    st.tuples(st.just("resume")),
    st.tuples(st.just("restart")),
)


@settings(deadline=None)
@given(st.integers(6, 14), st.integers(1, 10), st.booleans(), st.booleans(), st.lists(ops, min_size=15, max_size=60))
def test_tier_random_interleavings_keep_every_page_and_every_byte(
    num_pages: int, host_pages: int, write_through: bool, kept: bool, plan: list
) -> None:
    w = World(num_pages, host_pages, write_through, kept)
    for op in plan:
        if op[0] == "start":
            _, base, length, cache = op
            w.start(BASES[base][:length], cache)
        elif op[0] == "release":
            _, pick, with_tokens = op
            if w.running:
                w.release(sorted(w.running)[pick % len(w.running)], with_tokens)
        elif op[0] == "hold":
            if not w.held:
                w.mover.hold()
                w.held = True
        elif op[0] == "resume":
            w.mover.resume()
            w.held = False
        elif op[0] == "restart":
            if w.kept:
                w.restart()
        else:
            w.fill(op[1])
        if not w.held:  # the copy thread done with what it was given: the same run every time
            w.mover.wait_idle()
        w.check()
    w.mover.resume()
    w.held = False
    w.mover.wait_idle()
    w.core.finish_loads()
    w.check()
    w.mover.close()
    assert w.core.audit().ok
    stats = w.core.stats()
    host = stats.host
    assert host is not None and host.num_free_pages + host.num_cached_pages == host_pages
