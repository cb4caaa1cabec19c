"""Restoring a core from its state image (``kvmem.server.core.restore``): a state cut between
any two of the owners' changes inside a Step comes back consistent (the audit clean, no
page lost or held twice); torn states are repaired and the repairs named; an image of
another geometry, not an image at all, or truncated is refused in one line and
changes nothing (a state a running server holds: ``tests/server/test_keep_state.py``). (The state machine of
``test_prefix_properties.py`` restarts its core through :func:`restore` at random points
and checks that nothing the model sees changes.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
from core_state import cut_everywhere

from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.core.image import CoreImage, ImageMismatch
from kvmem.server.core.pool import PagePool
from kvmem.server.core.prefix import PrefixCache
from kvmem.server.core.restore import layout_for, restore
from kvmem.server.core.slots import RequestTable

CFG = CoreConfig(num_pages=40, page_size=4, max_requests=8, max_context_len=64)
SYSTEM = np.arange(100, 124, dtype=np.int32)  # 6 pages of tokens


def fresh(cfg: CoreConfig = CFG) -> tuple[KVCore, bytearray]:
    buf = bytearray(layout_for(cfg).size)
    core = KVCore(cfg, image=CoreImage.create(buf, layout_for(cfg)), audit_every_step=True)
    return core, buf


def busy(core: KVCore) -> tuple[int, list[int]]:
    """Two owners, requests with rows, a cached system prompt, a quarantine."""
    o = core.add_owner("ns")
    gone = core.add_owner("ns")
    a, b, c = core.open(o, ["a", "b", "c"]).tolist()
    core.step(o, StepBatch.of(alloc_slots=[a, b], alloc_needs=[24, 10]))
    core.step(o, StepBatch.of(release_slots=[a], release_tokens=[SYSTEM]))  # 6 cached pages
    core.step(o, StepBatch.of(match=[(c, np.concatenate([SYSTEM, [7, 8]]))], alloc_slots=[c], alloc_needs=[26]))
    (g,) = core.open(gone, ["g"]).tolist()
    core.step(gone, StepBatch.of(alloc_slots=[g], alloc_needs=[8]))
    core.remove_owner(gone, quarantine=True)
    return o, [b, c]


def test_a_clean_state_comes_back_whole() -> None:
    core, buf = fresh()
    o, (b, c) = busy(core)
    before = (core.block_table.copy(), core.slots.alloced.copy(), core.pool.ref_cnt.copy(), core.stats())
    new, report = restore(CFG, core.block_table, buf, audit_every_step=True)
    assert report.repaired == () and (report.owners, report.requests, report.quarantined_pages) == (1, 2, 2), report
    assert report.cached_pages == 6 and "nothing to repair" in report.describe()
    np.testing.assert_array_equal(new.block_table, before[0])
    np.testing.assert_array_equal(new.slots.alloced, before[1])
    np.testing.assert_array_equal(new.pool.ref_cnt, before[2])
    assert new.stats().num_free_pages == before[3].num_free_pages
    assert new.slots_of(o).tolist() == [b, c] and new.quarantined_pages(2) == 2
    # it goes on: the same ids keep their slots, a match finds the cached pages, releases free them
    assert new.open(o, ["b", "c"]).tolist() == [b, c]
    (d,) = new.open(o, ["d"]).tolist()
    res = new.step(o, StepBatch.of(match=[(d, np.concatenate([SYSTEM, [9]]))], alloc_slots=[d], alloc_needs=[25]))
    assert res.match_lens.tolist() == [24]
    new.step(o, StepBatch.of(release_slots=[b, c, d]))
    assert new.release_quarantine(2) == 2 and new.audit().ok


def test_a_state_cut_between_any_two_changes_of_a_step_comes_back_consistent() -> None:
    """Every change the owners make in these Steps (a release with tokens, a match and
    an alloc, a cache item, an alloc that evicts, a truncate) is cut off in turn: the
    image and rows as they were at that instant are restored, and the audit is clean."""
    core, buf = fresh(CoreConfig(num_pages=16, page_size=4, max_requests=8, max_context_len=64))
    cuts: list[tuple[str, bytes, np.ndarray]] = []

    def cutting(cls: type, name: str) -> None:
        method = getattr(cls, name)

        def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            cuts.append((f"before {cls.__name__}.{name}", bytes(buf), core.block_table.copy()))
            out = method(self, *args, **kwargs)
            cuts.append((f"after {cls.__name__}.{name}", bytes(buf), core.block_table.copy()))
            return out

        setattr(cls, name, wrapper)
        undo.append((cls, name, method))

    undo: list[tuple[type, str, object]] = []
    for cls, names in ((RequestTable, ("release", "truncate", "grow", "attach", "switch", "open")),
                       (PagePool, ("take", "unref", "share")), (PrefixCache, ("insert", "evict", "push_evictable"))):  # fmt: skip
        for name in names:
            cutting(cls, name)
    try:
        o = core.add_owner("ns")
        a, b = core.open(o, ["a", "b"]).tolist()
        core.step(o, StepBatch.of(alloc_slots=[a, b], alloc_needs=[24, 9]))
        core.step(o, StepBatch.of(release_slots=[a], release_tokens=[SYSTEM], alloc_slots=[b], alloc_needs=[1]))
        (c,) = core.open(o, ["c"]).tolist()
        core.step(o, StepBatch.of(match=[(c, SYSTEM)], alloc_slots=[c], alloc_needs=[28]))
        core.step(o, StepBatch.of(cache=[(b, np.arange(8, dtype=np.int32))], truncate_slots=[c], truncate_lens=[25]))
        (d,) = core.open(o, ["d"]).tolist()
        core.step(o, StepBatch.of(alloc_slots=[d], alloc_needs=[16]))  # takes the evictable pages
    finally:
        for cls, name, method in undo:
            setattr(cls, name, method)
    assert len(cuts) > 30, len(cuts)
    for where, image, rows in cuts:
        back = bytearray(image)
        table = rows.copy()
        new, report = restore(core.config, table, back, audit_every_step=True)
        assert new.audit().ok, (where, report)
        stats = new.stats()
        assert stats.num_free_pages + stats.num_cached_pages + stats.num_used_pages + stats.num_quarantined_pages == 15


def test_a_torn_state_is_repaired_and_each_repair_named() -> None:
    core, buf = fresh()
    o, (b, c) = busy(core)
    table, image = core.block_table, CoreImage.open(buf, layout_for(CFG))
    image.set("writer_pid", 0)
    table[b, 5] = 9  # an entry past b's 3 pages
    image.alloced[c] = 40  # longer than its 7 pages
    other = int(table[b, 0])
    (x,) = np.flatnonzero(image.rid_len == 0)[1:2].tolist()  # a closed slot: give it an owner it never had
    image.slot_word[x] = 77
    table[x, 0] = other
    cached = np.flatnonzero(image.page_cached).tolist()
    image.page_parent[cached[2]] = 0  # a chain broken in its middle: pages 2.. of it go
    new, report = restore(CFG, table, buf, audit_every_step=True)
    text = report.describe()
    for words in ("of broken chains uncached", "closed", "cut to the pages their rows hold", "past their requests"):
        assert words in text, text
    assert new.audit().ok and new.slots.alloced[c] == 28 and int(new.block_table[b, 5]) == 0
    assert report.cached_pages == 2 and new.slots.alloced[x] == 0


def test_a_page_in_two_rows_stays_in_the_first_only() -> None:
    core, buf = fresh()
    o = core.add_owner()
    a, b = core.open(o, ["a", "b"]).tolist()
    core.step(o, StepBatch.of(alloc_slots=[a, b], alloc_needs=[8, 8]))
    core.block_table[b, 1] = core.block_table[a, 0]  # torn: b's second page is a's first
    new, report = restore(CFG, core.block_table, buf, audit_every_step=True)
    assert "cut before a page another row holds" in report.describe() and new.slots.alloced[b] == 4
    assert new.audit().ok


@pytest.mark.parametrize(
    ("spoil", "words"),
    [
        (lambda buf: b"garbage!" + buf[8:], "not a kvmem state image"),
        (lambda buf: os.urandom(len(buf)), "not a kvmem state image"),
        (lambda buf: buf[: len(buf) // 2], "bytes, its layout needs"),
    ],
    ids=["no-magic", "random-bytes", "truncated"],
)
def test_what_is_not_an_image_is_refused_and_left_alone(spoil, words: str) -> None:  # type: ignore[no-untyped-def]
    core, buf = fresh()
    busy(core)
    spoilt = bytearray(spoil(bytes(buf)))
    kept, rows = bytes(spoilt), core.block_table.copy()
    with pytest.raises(ImageMismatch, match=words):
        restore(CFG, core.block_table, spoilt)
    assert bytes(spoilt) == kept and np.array_equal(core.block_table, rows)


def test_an_image_of_another_geometry_is_refused_naming_the_difference() -> None:
    core, buf = fresh()
    busy(core)
    kept = bytes(buf)
    bigger = CoreConfig(num_pages=48, page_size=4, max_requests=8, max_context_len=64)
    with pytest.raises(ImageMismatch, match=r"num_pages 40 \(this server's 48\)"):
        restore(bigger, np.zeros(bigger.block_table_shape, np.int32), buf)
    other = CoreConfig(num_pages=40, page_size=8, max_requests=8, max_context_len=64)
    with pytest.raises(ImageMismatch, match=r"page_size 4 \(this server's 8\), width 16 \(this server's 8\)"):
        restore(other, np.zeros(other.block_table_shape, np.int32), buf)
    assert bytes(buf) == kept


def _state(core: KVCore) -> tuple[object, ...]:
    """What a Step changes, as a client and the cache see it."""
    s = core.stats()
    n = core.config.max_requests + 1
    return (
        core.block_table.tobytes(), core.slots.alloced[:n].tolist(), core.slots.owner_of[:n].tolist(),
        core.slots.request_id[:n].tolist(), sorted(core.cache.index.items()),
        (s.num_free_pages, s.num_cached_pages, s.num_used_pages, s.num_quarantined_pages),
    )  # fmt: skip


def test_a_numbered_step_cut_anywhere_is_undone_whole_and_a_committed_one_kept() -> None:
    """Numbered Steps (as the server sends them) of every kind are cut between any two
    of the owners' changes and at each named crash point: the restored state is exactly
    the one before the Step (rows, lengths, owners, ids, cache keys, page counts), the
    undo is named, and the owner's applied number is the previous Step's. A state taken
    after a commit is the Step's whole."""
    cfg = CoreConfig(num_pages=16, page_size=4, max_requests=8, max_context_len=64)
    core, buf = fresh(cfg)
    cuts: list[tuple[str, int, bytes, np.ndarray]] = []
    seq = 0

    def cut(where: str) -> None:
        cuts.append((where, seq, bytes(buf), core.block_table.copy()))

    before: dict[int, tuple[object, ...]] = {}
    after: dict[int, tuple[object, ...]] = {}
    o = core.add_owner("ns")
    core.set_session(o, "sid-1", "worker", 12)

    def step(batch: StepBatch) -> None:
        nonlocal seq
        seq += 1
        before[seq] = _state(core)
        core.step(o, batch, seq=seq)
        core.commit(seq)
        after[seq] = _state(core)

    methods = {RequestTable: ("release", "truncate", "grow", "attach", "switch"), PagePool: ("take", "unref", "share"),
               PrefixCache: ("insert", "evict", "push_evictable")}  # fmt: skip
    with cut_everywhere(methods, cut):
        a, b = core.open(o, ["a", "b"]).tolist()
        step(StepBatch.of(alloc_slots=[a, b], alloc_needs=[24, 9]))
        step(StepBatch.of(release_slots=[a], release_tokens=[SYSTEM], alloc_slots=[b], alloc_needs=[1]))
        (c,) = core.open(o, ["c"]).tolist()
        step(StepBatch.of(match=[(c, SYSTEM)], alloc_slots=[c], alloc_needs=[28]))
        step(StepBatch.of(cache=[(b, np.arange(8, dtype=np.int32))], truncate_slots=[c], truncate_lens=[25]))
        (d,) = core.open(o, ["d"]).tolist()
        step(StepBatch.of(alloc_slots=[d], alloc_needs=[16]))  # takes the evictable pages
        step(StepBatch.of(alloc_slots=[b, d], alloc_needs=[1, 1]))  # decode
        step(StepBatch.of(release_slots=[b, c, d]))
    points = {where for where, *_ in cuts}
    assert {"mid-allocs", "after-releases", "after-prefix"} <= points, points
    assert len(cuts) > 50, len(cuts)
    undone = 0
    for where, at, image, rows in cuts:
        new, report = restore(cfg, rows.copy(), bytearray(image), audit_every_step=True)
        undone += bool(report.undone)
        assert new.audit().ok, (where, at, report)
        assert _state(new) == before[at], (where, at, report)
        assert report.repaired == (), (where, at, report.repaired)
        assert f"number {at}" in report.undone or _state(new) == after.get(at - 1), (where, at)
        (session,) = report.sessions
        assert (session.session_id, session.name, session.quota_pages) == ("sid-1", "worker", 12)
        assert session.applied_seq == at - 1, (where, at)
    assert undone > 40, undone  # the cuts before a Step's first change have nothing to undo
    # committed: the whole Step, nothing undone
    new, report = restore(cfg, core.block_table.copy(), bytearray(buf), audit_every_step=True)
    assert _state(new) == after[seq] and report.undone == "" and report.sessions[0].applied_seq == seq
