"""Hand-off tickets in the core (``kvmem.server.core.handoff``): a running request moves
from one owner to another with its slot, row, pages and length as they are (no page
copied, no reference count changed); tickets are single-use and checked whole with the
Step; the giver's end, the window's end and a restart release what is not adopted; a
numbered Step that hands off or adopts is undone whole by a crash.

Geometry: page_size 4, pages 1..23, request slots 1..6, 32 tokens (8 pages) a request.
Every core audits itself after each mutating call (``audit_every_step``)."""

from __future__ import annotations

import numpy as np
import pytest
from core_state import cut_everywhere, snapshot

from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.core.handoff import MAX_STATE_BYTES, ticket_slot
from kvmem.server.core.image import CoreImage
from kvmem.server.core.pool import PagePool
from kvmem.server.core.restore import layout_for, restore
from kvmem.server.core.slots import RequestTable
from kvmem.server.errors import KVMemError, Reason

CFG = CoreConfig(num_pages=24, page_size=4, max_requests=6, max_context_len=32)
PROMPT = np.arange(500, 512, dtype=np.int32)  # 3 full pages


def core_with(prefix: bool = True) -> KVCore:
    return KVCore(CFG, audit_every_step=True, prefix_cache=prefix)


def running(core: KVCore, owner: int, rid: str, tokens: int) -> int:
    (slot,) = core.open(owner, [rid]).tolist()
    core.step(owner, StepBatch.of(alloc_slots=[slot], alloc_needs=[tokens]))
    return slot


def everything(core: KVCore) -> tuple[object, ...]:
    """All the state a refused Step must leave as it was."""
    return (_plain(snapshot(core)), sorted(core.tickets.by_ticket))


def _plain(state: dict) -> dict:
    """A snapshot with its arrays as bytes, so two compare with ``==``."""
    return {k: v.tobytes() if isinstance(v, np.ndarray) else v for k, v in state.items()}


def test_a_request_moves_with_its_row_pages_and_length_and_nothing_copied() -> None:
    core = core_with()
    a, b = core.add_owner(), core.add_owner()
    slot = running(core, a, "req", 10)
    row, refs = core.block_table[slot].copy(), core.pool.ref_cnt.copy()
    out = core.step(a, StepBatch.of(handoff=[slot], handoff_states=[b"tokens-so-far"]))
    (ticket,) = out.tickets
    assert ticket_slot(ticket) == slot and len(ticket.split(".")[1]) == 32
    assert core.pages_held(a) == 0 and core.slots_of(a).size == 0
    s = core.stats()
    assert (s.num_handoff_tickets, s.num_handoff_pages, s.num_used_pages) == (1, 3, 3)
    assert [o.owner for o in s.owners] == [a, b]  # the holder is no owner of the stats
    with pytest.raises(KVMemError) as err:  # the giver can no longer name it
        core.step(a, StepBatch.of(alloc_slots=[slot], alloc_needs=[1]))
    assert err.value.reason is Reason.SLOT_NOT_FOUND
    # adopt and decode on in the same Step
    got = core.step(b, StepBatch.of(adopt=[(ticket, "mine")], alloc_slots=[slot], alloc_needs=[1],
                                    alloc_expected_lens=[10]))  # fmt: skip
    assert got.adopt_slots.tolist() == [slot] and got.adopt_lens.tolist() == [10]
    assert got.adopt_states == (b"tokens-so-far",) and got.kv_loc.tolist() == [int(row[2]) * 4 + 2]
    np.testing.assert_array_equal(core.block_table[slot], row)  # the same pages, in place
    np.testing.assert_array_equal(core.pool.ref_cnt, refs)
    assert core.alloced_len(b, slot) == 11 and core.pages_held(b) == 3
    assert core.open(b, ["mine"]).tolist() == [slot]  # under b's request id
    assert core.stats().num_handoff_tickets == 0 and core.tickets.num_adopted == 1


def test_a_ticket_is_single_use_and_a_wrong_one_changes_nothing() -> None:
    core = core_with()
    a, b = core.add_owner(), core.add_owner()
    slot = running(core, a, "req", 6)
    (ticket,) = core.step(a, StepBatch.of(handoff=[slot])).tickets
    forged = f"{slot}." + "0" * 32
    other = running(core, b, "open", 2)
    cases = [
        (StepBatch.of(adopt=[(forged, "x")]), Reason.TICKET_NOT_FOUND, "no open hand-off ticket"),
        (StepBatch.of(adopt=[("junk", "x")]), Reason.TICKET_NOT_FOUND, "'junk'"),
        (StepBatch.of(adopt=[(ticket, "x"), (ticket, "y")]), Reason.BAD_VALUE, "repeats adopt_tickets[0]"),
        (StepBatch.of(adopt=[(ticket, "open")]), Reason.BAD_VALUE, f"already open in this session (slot {other})"),
        (StepBatch.of(adopt=[(ticket, "")]), Reason.BAD_VALUE, "non-empty"),
        (StepBatch.of(adopt=[(ticket, "x" * 300)]), Reason.BAD_VALUE, "300 bytes"),
        (StepBatch(adopt_tickets=(ticket,)), Reason.LENGTH_MISMATCH, "adopt_request_ids has 0"),
        (StepBatch.of(adopt=[(ticket, "x")], release_slots=[other], alloc_slots=[other], alloc_needs=[1]),
         Reason.SLOT_NOT_FOUND, "released earlier"),
        (StepBatch.of(adopt=[(ticket, "x")], alloc_slots=[slot, slot], alloc_needs=[1, 1]),
         Reason.DUPLICATE_SLOT, "appears twice"),
        (StepBatch.of(adopt=[(ticket, "x")], alloc_slots=[5], alloc_needs=[1]), Reason.SLOT_NOT_FOUND, "slot 5"),
    ]  # fmt: skip
    for batch, reason, words in cases:
        before = everything(core)
        with pytest.raises(KVMemError) as err:
            core.step(b, batch)
        assert err.value.reason is reason and words in str(err.value), (reason, str(err.value))
        assert ticket not in str(err.value)  # a ticket is never echoed whole
        assert everything(core) == before
    core.step(b, StepBatch.of(adopt=[(ticket, "x")]))
    with pytest.raises(KVMemError) as err:  # adopted twice
        core.step(b, StepBatch.of(adopt=[(ticket, "again")]))
    assert err.value.reason is Reason.TICKET_NOT_FOUND


def test_hand_off_items_are_checked_whole() -> None:
    core = core_with()
    a = core.add_owner()
    s1, s2 = running(core, a, "r1", 5), running(core, a, "r2", 5)
    cases = [
        (StepBatch.of(handoff=[s1, s1]), Reason.DUPLICATE_SLOT),
        (StepBatch.of(handoff=[9]), Reason.SLOT_NOT_FOUND),
        (StepBatch.of(handoff=[s1], release_slots=[s1]), Reason.SLOT_NOT_FOUND),
        (StepBatch.of(handoff=[s1], alloc_slots=[s1], alloc_needs=[1]), Reason.BAD_VALUE),
        (StepBatch.of(handoff=[s1], handoff_states=[b"a", b"b"]), Reason.LENGTH_MISMATCH),
        (StepBatch.of(handoff_states=[b"a"]), Reason.LENGTH_MISMATCH),
        (StepBatch.of(handoff=[s1], handoff_states=[b"x" * (MAX_STATE_BYTES + 1)]), Reason.BAD_VALUE),
    ]
    for batch, reason in cases:
        before = everything(core)
        with pytest.raises(KVMemError) as err:
            core.step(a, batch)
        assert err.value.reason is reason, (reason, err.value)
        assert everything(core) == before
    # a truncate first, then the hand-off of the shortened request
    out = core.step(a, StepBatch.of(truncate_slots=[s2], truncate_lens=[3], handoff=[s2]))
    assert out.num_pages_released == 1 and core.stats().num_handoff_pages == 1


def test_another_namespace_is_refused_naming_both_and_the_quota_counts_adopted_pages() -> None:
    core = core_with()
    a, b, c = core.add_owner("llama"), core.add_owner("qwen"), core.add_owner("llama")
    slot = running(core, a, "req", 9)  # 3 pages
    (ticket,) = core.step(a, StepBatch.of(handoff=[slot])).tickets
    before = everything(core)
    with pytest.raises(KVMemError) as err:
        core.step(b, StepBatch.of(adopt=[(ticket, "x")]))
    assert err.value.reason is Reason.NAMESPACE_MISMATCH
    assert "'llama'" in str(err.value) and "'qwen'" in str(err.value)
    own = running(core, c, "own", 8)  # 2 pages
    with pytest.raises(KVMemError) as err:
        core.step(c, StepBatch.of(adopt=[(ticket, "x")]), quota_pages=4)
    assert err.value.reason is Reason.QUOTA_EXCEEDED and "holding 5 pages, over its quota of 4" in str(err.value)
    assert core.has_ticket(ticket) and before[1] == sorted(core.tickets.by_ticket)
    # counted after the Step's releases: releasing its own request makes room
    core.step(c, StepBatch.of(release_slots=[own], adopt=[(ticket, "x")]), quota_pages=4)
    assert core.pages_held(c) == 3


def test_the_givers_end_and_the_window_release_tickets_as_a_release_would() -> None:
    core = core_with()
    a, b = core.add_owner(), core.add_owner()
    t_plain = core.step(a, StepBatch.of(handoff=[running(core, a, "p", 8)])).tickets[0]
    core.remove_owner(a)  # detached: its ticket is released, its pages free
    assert not core.has_ticket(t_plain) and core.stats().num_free_pages == 23 and core.tickets.num_given_up == 1
    c = core.add_owner()
    t_lapsed = core.step(c, StepBatch.of(handoff=[running(core, c, "q", 8)])).tickets[0]
    core.remove_owner(c, quarantine=True)  # lease lapsed: quarantined with its other pages
    assert not core.has_ticket(t_lapsed) and core.quarantined_pages(c) == 2
    assert core.stats().num_quarantined_pages == 2 and core.stats().num_handoff_tickets == 0
    t_late = core.step(b, StepBatch.of(handoff=[running(core, b, "r", 8)])).tickets[0]
    assert core.release_tickets([t_late, "nope"]) == 1 and core.release_tickets([t_late]) == 0
    assert core.tickets.num_expired == 1 and core.stats().num_used_pages == 0
    with pytest.raises(KVMemError) as err:
        core.step(b, StepBatch.of(adopt=[(t_late, "x")]))
    assert err.value.reason is Reason.TICKET_NOT_FOUND


def test_a_ticket_whose_pages_the_prefix_cache_shares_keeps_refcounts_and_cache_right() -> None:
    core = core_with()
    a, b = core.add_owner(), core.add_owner()
    first = running(core, a, "first", 12)
    core.step(a, StepBatch.of(release_slots=[first], release_tokens=[PROMPT]))  # 3 cached pages
    (s1, s2) = core.open(a, ["x", "y"]).tolist()
    tokens = np.concatenate([PROMPT, [1, 2, 3]])
    core.step(a, StepBatch.of(match=[(s1, tokens), (s2, tokens)], alloc_slots=[s1, s2], alloc_needs=[15, 15]))
    shared = core.block_table[s1, :3].copy()
    assert core.pool.ref_cnt[shared].tolist() == [2, 2, 2]
    (ticket,) = core.step(a, StepBatch.of(handoff=[s1])).tickets
    assert core.pool.ref_cnt[shared].tolist() == [2, 2, 2] and core.stats().num_cached_pages == 0
    core.step(b, StepBatch.of(adopt=[(ticket, "z")], alloc_slots=[s1], alloc_needs=[2]))
    core.step(a, StepBatch.of(release_slots=[s2]))
    assert core.pool.ref_cnt[shared].tolist() == [1, 1, 1]
    # the adopter releases it with its tokens: the cached pages stay cached, one copy each
    core.step(b, StepBatch.of(release_slots=[s1], release_tokens=[np.concatenate([tokens, [4, 5]])]))
    assert core.stats().num_used_pages == 0 and core.stats().num_cached_pages == 4
    (s3,) = core.open(b, ["w"]).tolist()
    got = core.step(b, StepBatch.of(match=[(s3, tokens)]))
    assert got.match_lens.tolist() == [12]


def test_a_restart_releases_tickets_not_adopted_and_keeps_everything_else() -> None:
    layout = layout_for(CFG)
    buf = bytearray(layout.size)
    core = KVCore(CFG, image=CoreImage.create(buf, layout), audit_every_step=True)
    a, b = core.add_owner(), core.add_owner()
    keep = running(core, a, "keep", 6)
    (t1,) = core.step(a, StepBatch.of(handoff=[running(core, a, "dup", 8)])).tickets
    core.step(b, StepBatch.of(handoff=[running(core, b, "dup", 8)]))  # the same request id twice in the holder
    new, report = restore(CFG, core.block_table.copy(), buf, audit_every_step=True)
    assert report.repaired == ("2 hand-off ticket(s) not adopted released (not kept)",), report
    assert sorted(s.owner for s in report.sessions) == [a, b] and report.requests == 1
    assert new.slots_of(a).tolist() == [keep] and new.stats().num_used_pages == 2
    with pytest.raises(KVMemError) as err:
        new.step(b, StepBatch.of(adopt=[(t1, "x")]))
    assert err.value.reason is Reason.TICKET_NOT_FOUND and "not kept across a restart" in str(err.value)


def test_a_numbered_step_that_hands_off_or_adopts_is_undone_whole_by_a_crash() -> None:
    """Numbered Steps that hand off (with a truncate) and adopt (with a decode) are cut
    between any two of the owners' changes and at each crash point: each cut restores to
    exactly what the image before the Step restores to."""

    layout = layout_for(CFG)
    buf = bytearray(layout.size)
    core = KVCore(CFG, image=CoreImage.create(buf, layout), audit_every_step=True)
    cuts: list[tuple[str, int, bytes, np.ndarray]] = []
    at = 0

    def cut(where: str) -> None:
        cuts.append((where, at, bytes(buf), core.block_table.copy()))

    a, b = core.add_owner(), core.add_owner()
    core.set_session(a, "sid-a", "prefill", None)
    core.set_session(b, "sid-b", "decode", None)
    s1, s2 = core.open(a, ["r1", "r2"]).tolist()
    core.step(a, StepBatch.of(alloc_slots=[s1, s2], alloc_needs=[9, 7]))
    (d,) = core.open(b, ["own"]).tolist()
    core.step(b, StepBatch.of(alloc_slots=[d], alloc_needs=[3]))
    starts: dict[int, tuple[bytes, np.ndarray]] = {}

    def step(owner: int, n: int, batch: StepBatch) -> tuple[str, ...]:
        nonlocal at
        at += 1
        starts[at] = (bytes(buf), core.block_table.copy())
        out = core.step(owner, batch, seq=n)
        core.commit(n)
        return out.tickets

    with cut_everywhere({RequestTable: ("truncate", "grow", "move"), PagePool: ("take", "unref")}, cut):
        t1, t2 = step(a, 1, StepBatch.of(truncate_slots=[s2], truncate_lens=[4], handoff=[s1, s2],
                                         handoff_states=[b"1", b"2"]))  # fmt: skip
        step(b, 1, StepBatch.of(adopt=[(t1, "a1"), (t2, "a2")], alloc_slots=[s1, d, s2], alloc_needs=[8, 1, 1]))
    points = {where for where, *_ in cuts}
    assert {"mid-allocs", "after-releases", "after-prefix", "before RequestTable.move"} <= points, points
    undone = 0
    cuts = [c for c in cuts if c[1]]  # the set-up's (unnumbered) changes are no Step's
    for where, n, image, rows in cuts:
        new, report = restore(CFG, rows.copy(), bytearray(image), audit_every_step=True)
        base, _ = restore(CFG, starts[n][1].copy(), bytearray(starts[n][0]), audit_every_step=True)
        undone += bool(report.undone)
        assert new.audit().ok, (where, n, report)
        assert _plain(snapshot(new)) == _plain(snapshot(base)), (where, n, report)
    assert undone >= len(cuts) - 6, (undone, len(cuts))  # cuts before a Step's first change undo nothing
    new, report = restore(CFG, core.block_table.copy(), bytearray(buf), audit_every_step=True)
    assert report.undone == "" and sorted(new.slots_of(b).tolist()) == sorted([s1, s2, d])
    assert new.alloced_len(b, s1) == 17 and new.alloced_len(b, s2) == 5
