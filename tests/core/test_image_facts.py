"""The state image's per-page facts of the prefix cache (``kvmem.server.core.image``), as the
cache writes them at the end of each call (``PrefixCache.flush_image``): whichever way a
page was cached in the call (cache items whose pages are all new, some new, items
without a full page and items whose tokens do not start on a page boundary, release
items whose pages an alloc of the same Step evicts), the image holds exactly the cached
pages with their key, parent, depth, namespace and tokens, and a restore gets them back."""

from __future__ import annotations

import numpy as np

from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.core.image import CoreImage
from kvmem.server.core.restore import layout_for, restore

CFG = CoreConfig(num_pages=48, page_size=4, max_requests=8, max_context_len=192)


def check_image(core: KVCore) -> None:
    """Every page the cache holds is flagged in the image with the cache's facts, and no other."""
    cache, image = core.cache, core.image
    assert image is not None
    np.testing.assert_array_equal(image.page_cached, cache.cached)
    for p in np.flatnonzero(cache.cached).tolist():
        assert image.page_key[p].tobytes() == cache.key[p], p
        assert image.page_parent[p].tobytes() == cache.parent[p], p
        assert image.page_tokens[p].tolist() == cache.tokens[p].tolist(), p
        assert image.namespace_name(int(image.page_ns[p])) == cache.namespace[p], p
        assert int(image.page_depth[p]) == int(cache.depth[p]), p


def test_the_image_holds_each_cached_pages_facts_however_it_was_cached() -> None:
    buf = bytearray(layout_for(CFG).size)
    core = KVCore(CFG, image=CoreImage.create(buf, layout_for(CFG)), audit_every_step=True)
    seq = [0]

    def step(owner: int, batch: StepBatch) -> None:
        seq[0] += 1
        core.step(owner, batch, seq=seq[0])
        core.commit(seq[0])
        check_image(core)

    rng = np.random.default_rng(7)
    o, other = core.add_owner("ns"), core.add_owner("other")
    a, b, c, d = core.open(o, ["a", "b", "c", "d"]).tolist()
    toks = {s: rng.integers(0, 1000, 40).astype(np.int32) for s in (a, b, c, d)}
    step(o, StepBatch.of(alloc_slots=[a, b, c, d], alloc_needs=[22, 9, 3, 16]))
    # all new: a's 5 full pages (22 tokens: b's start off a page boundary), b's 2, none of c's, d's 4
    step(o, StepBatch.of(cache=[(a, toks[a][:22]), (b, toks[b][:9]), (c, toks[c][:3]), (d, toks[d][:16])]))
    # some new: b's first 2 pages are cached, 2 more; a's and d's are all cached; c's first
    step(o, StepBatch.of(alloc_slots=[b, c], alloc_needs=[8, 2]))
    step(o, StepBatch.of(cache=[(a, toks[a][:22]), (b, toks[b][:17]), (c, toks[c][:5]), (d, toks[d][:16])]))
    # a page whose key is cached elsewhere is switched, not cached: e's first 4 pages are d's
    (e,) = core.open(o, ["e"]).tolist()
    step(o, StepBatch.of(alloc_slots=[e], alloc_needs=[24]))
    mixed = np.concatenate([toks[d][:16], rng.integers(0, 1000, 8).astype(np.int32)])
    step(o, StepBatch.of(cache=[(e, mixed)]))
    # another namespace in its own call
    (f,) = core.open(other, ["f"]).tolist()
    step(other, StepBatch.of(alloc_slots=[f], alloc_needs=[8]))
    step(other, StepBatch.of(cache=[(f, toks[a][:8])]))
    # released with tokens (3 new pages cached), then an alloc of the same Step that takes
    # every free page and those 3 (evicted in the call that cached them)
    (h,) = core.open(o, ["h"]).tolist()
    step(o, StepBatch.of(alloc_slots=[h], alloc_needs=[12]))
    evictions = core.cache.num_evictions
    need = (core.pool.num_free + 3) * CFG.page_size
    released = rng.integers(0, 1000, 12).astype(np.int32)
    step(o, StepBatch.of(release_slots=[h], release_tokens=[released], alloc_slots=[e], alloc_needs=[need]))
    assert core.cache.num_evictions == evictions + 3
    # a Step that caches again, after one that evicted
    step(o, StepBatch.of(release_slots=[e], release_tokens=[mixed]))
    new, report = restore(CFG, core.block_table.copy(), bytearray(buf), audit_every_step=True)
    assert report.repaired == (), report
    assert new.cache.index == core.cache.index
    check_image(new)
