"""Unit tests of the allocation core (``kvmem.server.core``): pages, request slots, the
block table and batched steps.

Geometry of most tests (``make_core()`` defaults): page_size 4, num_pages 9 (pages 1..8
usable, page 0 is padding), request slots 1..4, max_context_len 16 tokens = 4 pages per
request, so the block table is int32 [5, 4]. A token slot is ``page * 4 + offset``.
States are drawn in comments as block-table rows, e.g. ``# row 1: [1, 2, 0, 0]  len 6``.

Owners are the small integers ``core.add_owner()`` returns (``a``, ``b``, ... in the
tests); a step takes a :class:`StepBatch` (built here by the helpers ``step`` and
``alloc``) and the owner's page quota, which the sessions layer keeps.

Every core a test builds is audited when the test ends (fixture ``make_core``), and is
built with ``audit_every_step=True``, so it audits itself after every mutating call as
well.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

from kvmem.server.core import AllocStatus, CoreConfig, KVCore, OwnerUsage, PagePool, PoolStats, StepBatch, StepOutcome
from kvmem.server.errors import CorruptionError, ErrorKind, KVMemError, Reason
from kvmem.server.sessions import Sessions
from core_state import snapshot

OK = AllocStatus.OK
OUT_OF_PAGES = AllocStatus.OUT_OF_PAGES
CONTEXT_TOO_LONG = AllocStatus.CONTEXT_TOO_LONG
QUOTA_EXCEEDED = AllocStatus.QUOTA_EXCEEDED
ABORTED = AllocStatus.ABORTED

PS = 4  # page size of the default geometry


# ---------------------------------------------------------------------------- helpers


@pytest.fixture
def make_core():
    """Factory of cores; each one made is audited when the test ends."""
    made: list[KVCore] = []

    def make(
        num_pages: int = 9,
        page_size: int = PS,
        max_requests: int = 4,
        max_context_len: int = 16,
        block_table: np.ndarray | None = None,
    ) -> KVCore:
        config = CoreConfig(num_pages, page_size, max_requests, max_context_len)
        core = KVCore(config, block_table, audit_every_step=True)  # audits after every mutating call
        made.append(core)
        return core

    yield make
    for core in made:
        report = core.audit()
        assert report.ok, report.problems


def assert_audit(core: KVCore) -> None:
    report = core.audit()
    assert report.ok, report.problems
    assert (
        report.num_free_pages + report.num_cached_pages + report.num_used_pages + report.num_quarantined_pages
        == core.config.num_pages - 1
    )


def step(core: KVCore, owner: int, quota_pages: int | None = None, **columns) -> StepOutcome:
    """One step of ``owner``: ``columns`` (and ``atomic``) as :meth:`StepBatch.of` takes
    them, so a bad column raises BAD_VALUE from here exactly as the core's step would."""
    return core.step(owner, StepBatch.of(**columns), quota_pages)


def alloc(core: KVCore, owner: int, slots, needs, quota_pages: int | None = None, **kw) -> StepOutcome:
    return step(core, owner, quota_pages, alloc_slots=slots, alloc_needs=needs, **kw)


def statuses(res: StepOutcome) -> list[AllocStatus]:
    return [AllocStatus(int(s)) for s in res.alloc_status]


def kv_of(res: StepOutcome, i: int) -> list[int]:
    return res.kv_loc[res.kv_loc_offsets[i] : res.kv_loc_offsets[i + 1]].tolist()


def pages_of(res: StepOutcome, i: int) -> list[int]:
    return res.new_pages[res.new_page_offsets[i] : res.new_page_offsets[i + 1]].tolist()


def row(core: KVCore, slot: int) -> list[int]:
    return core.block_table[slot].tolist()


def check_result_types(res: StepOutcome, n: int) -> None:
    assert res.alloc_status.dtype == np.int8 and res.alloc_status.shape == (n,)
    assert res.kv_loc.dtype == np.int32
    assert res.kv_loc_offsets.dtype == np.int32 and res.kv_loc_offsets.shape == (n + 1,)
    assert res.new_pages.dtype == np.int32
    assert res.new_page_offsets.dtype == np.int32 and res.new_page_offsets.shape == (n + 1,)
    assert res.kv_loc_offsets[0] == 0 and res.kv_loc_offsets[-1] == res.kv_loc.size
    assert res.new_page_offsets[0] == 0 and res.new_page_offsets[-1] == res.new_pages.size


def assert_unchanged(before: dict, core: KVCore) -> None:
    after = snapshot(core)
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
        else:
            assert after[key] == value, key
    assert_audit(core)


def raises(reason: Reason, fn, *args, **kwargs) -> KVMemError:
    with pytest.raises(KVMemError) as info:
        fn(*args, **kwargs)
    err = info.value
    assert err.reason is reason, (err.reason, str(err))
    assert err.kind is reason.kind
    return err


def two_requests(make_core, **kw) -> tuple[KVCore, int]:
    core = make_core(**kw)
    a = core.add_owner()
    slots = core.open(a, ["r1", "r2"])
    assert slots.tolist() == [1, 2]
    return core, a


# --------------------------------------------------------------- config and setup


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(num_pages=1, page_size=4, max_requests=4, max_context_len=16),  # page 0 only
        dict(num_pages=0, page_size=4, max_requests=4, max_context_len=16),
        dict(num_pages=9, page_size=0, max_requests=4, max_context_len=16),
        dict(num_pages=9, page_size=4, max_requests=0, max_context_len=16),
        dict(num_pages=9, page_size=4, max_requests=4, max_context_len=0),
        dict(num_pages=9, page_size=4, max_requests=4, max_context_len=-3),
        dict(num_pages=9.0, page_size=4, max_requests=4, max_context_len=16),
        dict(num_pages=9, page_size=True, max_requests=4, max_context_len=16),
        dict(num_pages=2**30, page_size=4, max_requests=4, max_context_len=16),  # token slots beyond int32
    ],
)
def test_config_rejects_bad_geometry(kwargs) -> None:
    with pytest.raises(ValueError):
        CoreConfig(**kwargs)


def test_config_geometry() -> None:
    cfg = CoreConfig(num_pages=9, page_size=4, max_requests=4, max_context_len=17)
    assert cfg.max_pages_per_request == 5  # ceil(17 / 4)
    assert cfg.block_table_shape == (5, 5)
    assert CoreConfig(9, 4, 4, 16).block_table_shape == (5, 4)


def test_given_block_table_is_zeroed_and_written_in_place(make_core) -> None:
    bt = np.full((5, 4), 7, dtype=np.int32)
    core = make_core(block_table=bt)
    assert core.block_table is bt
    assert not bt.any()
    a = core.add_owner()
    core.open(a, ["r"])
    alloc(core, a, [1], [5])
    # row 1: [1, 2, 0, 0]  len 5
    assert bt[1].tolist() == [1, 2, 0, 0]


@pytest.mark.parametrize(
    "bt",
    [
        np.zeros((5, 4), dtype=np.int64),
        np.zeros((4, 4), dtype=np.int32),
        np.zeros((5, 5), dtype=np.int32),
        np.zeros((5, 8), dtype=np.int32)[:, ::2],  # right shape, not contiguous
    ],
)
def test_block_table_of_wrong_shape_or_dtype_is_refused(bt) -> None:
    with pytest.raises(ValueError, match="block_table"):
        KVCore(CoreConfig(9, 4, 4, 16), bt)


def test_fresh_core(make_core) -> None:
    core = make_core()
    assert core.pool.num_free == 8
    assert not core.block_table.any()
    assert not core.pool.ref_cnt.any()
    assert core.stats() == PoolStats(
        num_pages_total=8,
        num_free_pages=8,
        num_cached_pages=0,
        num_used_pages=0,
        num_quarantined_pages=0,
        num_free_request_slots=4,
        num_open_requests=0,
        owners=(),
    )
    assert_audit(core)


def test_reasons_map_to_the_kinds_of_the_design() -> None:
    assert Reason.BAD_VALUE.kind is ErrorKind.INVALID_ARGUMENT
    assert Reason.LENGTH_MISMATCH.kind is ErrorKind.INVALID_ARGUMENT
    assert Reason.DUPLICATE_SLOT.kind is ErrorKind.INVALID_ARGUMENT
    assert Reason.SLOT_NOT_FOUND.kind is ErrorKind.NOT_FOUND
    assert Reason.UNKNOWN_SESSION.kind is ErrorKind.FAILED_PRECONDITION
    assert Reason.ALLOCED_LEN_MISMATCH.kind is ErrorKind.FAILED_PRECONDITION
    assert Reason.TRUNCATE_BEYOND_ALLOCED.kind is ErrorKind.FAILED_PRECONDITION
    assert Reason.NO_FREE_REQUEST_SLOT.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert Reason.CORRUPTION.kind is ErrorKind.INTERNAL
    err = CorruptionError("boom", pages=[3])
    assert err.reason is Reason.CORRUPTION and err.kind is ErrorKind.INTERNAL
    assert err.metadata == {"pages": "[3]"}


# ------------------------------------------------------------------------- alloc


def test_alloc_from_alloced_len_zero(make_core) -> None:
    core, a = two_requests(make_core)
    res = alloc(core, a, [1], [3])
    check_result_types(res, 1)
    # row 1: [1, 0, 0, 0]  len 3   tokens 0..2 at page 1, offsets 0..2
    assert statuses(res) == [OK]
    assert res.kv_loc.tolist() == [4, 5, 6]
    assert res.new_pages.tolist() == [1]  # the first page handed out is 1, never 0
    assert res.kv_loc_offsets.tolist() == [0, 3]
    assert res.new_page_offsets.tolist() == [0, 1]
    assert res.num_pages_released == 0
    assert row(core, 1) == [1, 0, 0, 0]
    assert core.alloced_len(a, 1) == 3
    assert core.pool.ref_cnt.tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert core.pool.num_free == 7
    assert_audit(core)


def test_alloc_fills_the_tail_of_the_last_page_first(make_core) -> None:
    core, a = two_requests(make_core)
    alloc(core, a, [1], [3])
    res = alloc(core, a, [1], [3])
    # row 1: [1, 2, 0, 0]  len 6   token 3 at page 1 offset 3, tokens 4, 5 on page 2
    assert statuses(res) == [OK]
    assert res.kv_loc.tolist() == [7, 8, 9]
    assert res.new_pages.tolist() == [2]
    assert row(core, 1) == [1, 2, 0, 0]
    assert core.alloced_len(a, 1) == 6
    assert_audit(core)


def test_need_that_exactly_fills_the_last_page(make_core) -> None:
    core, a = two_requests(make_core)
    alloc(core, a, [1], [3])
    res = alloc(core, a, [1], [1])
    # row 1: [1, 0, 0, 0]  len 4   page 1 full, no new page
    assert statuses(res) == [OK]
    assert res.kv_loc.tolist() == [7]
    assert res.new_pages.tolist() == []
    assert res.new_page_offsets.tolist() == [0, 0]
    assert row(core, 1) == [1, 0, 0, 0]
    assert core.alloced_len(a, 1) == 4
    assert core.pool.num_free == 7
    # The next token needs a new page, at offset 0.
    res = alloc(core, a, [1], [1])
    # row 1: [1, 2, 0, 0]  len 5
    assert res.kv_loc.tolist() == [8]
    assert res.new_pages.tolist() == [2]
    assert row(core, 1) == [1, 2, 0, 0]
    # A prefill that ends exactly on a page boundary takes no extra page.
    res = alloc(core, a, [2], [8])
    # row 2: [3, 4, 0, 0]  len 8
    assert res.new_pages.tolist() == [3, 4]
    assert res.kv_loc.tolist() == list(range(12, 20))
    assert row(core, 2) == [3, 4, 0, 0]
    assert_audit(core)


def test_need_zero(make_core) -> None:
    core, a = two_requests(make_core)
    before = snapshot(core)
    res = alloc(core, a, [1], [0])
    # row 1: [0, 0, 0, 0]  len 0   (no page for zero tokens)
    assert statuses(res) == [OK]
    assert res.kv_loc.tolist() == [] and res.new_pages.tolist() == []
    assert res.kv_loc_offsets.tolist() == [0, 0] and res.new_page_offsets.tolist() == [0, 0]
    assert_unchanged(before, core)
    alloc(core, a, [1], [4])
    before = snapshot(core)
    res = alloc(core, a, [1], [0])  # on a full page: still nothing
    assert statuses(res) == [OK] and res.kv_loc.size == 0 and res.new_pages.size == 0
    assert_unchanged(before, core)


def test_multi_page_prefill(make_core) -> None:
    core, a = two_requests(make_core)
    res = alloc(core, a, [1], [10])
    # row 1: [1, 2, 3, 0]  len 10   pages 1, 2 full, page 3 offsets 0, 1
    assert statuses(res) == [OK]
    assert res.kv_loc.tolist() == list(range(4, 14))
    assert res.new_pages.tolist() == [1, 2, 3]
    assert row(core, 1) == [1, 2, 3, 0]
    assert core.alloced_len(a, 1) == 10
    # Continue mid-page, across two more pages up to the context limit.
    res = alloc(core, a, [1], [6])
    # row 1: [1, 2, 3, 4]  len 16
    assert res.kv_loc.tolist() == [14, 15, 16, 17, 18, 19]
    assert res.new_pages.tolist() == [4]
    assert row(core, 1) == [1, 2, 3, 4]
    assert_audit(core)


def test_batch_of_allocs_in_item_order(make_core) -> None:
    core = make_core()
    a = core.add_owner()
    core.open(a, ["r1", "r2", "r3", "r4"])
    res = alloc(core, a, [1, 2, 3, 4], [5, 1, 0, 4])
    check_result_types(res, 4)
    # row 1: [1, 2, 0, 0]  len 5
    # row 2: [3, 0, 0, 0]  len 1
    # row 3: [0, 0, 0, 0]  len 0
    # row 4: [4, 0, 0, 0]  len 4
    assert statuses(res) == [OK] * 4
    assert [kv_of(res, i) for i in range(4)] == [[4, 5, 6, 7, 8], [12], [], [16, 17, 18, 19]]
    assert [pages_of(res, i) for i in range(4)] == [[1, 2], [3], [], [4]]
    assert res.kv_loc_offsets.tolist() == [0, 5, 6, 6, 10]
    assert res.new_page_offsets.tolist() == [0, 2, 3, 3, 4]
    assert [row(core, s) for s in (1, 2, 3, 4)] == [[1, 2, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0], [4, 0, 0, 0]]
    # A decode step (one token each): slots 3 and 4 need a new page, 1 and 2 do not.
    res = alloc(core, a, [4, 3, 2, 1], [1, 1, 1, 1])
    # row 1: [1, 2, 0, 0]  len 6
    # row 2: [3, 0, 0, 0]  len 2
    # row 3: [6, 0, 0, 0]  len 1
    # row 4: [4, 5, 0, 0]  len 5
    assert res.new_pages.tolist() == [5, 6]
    assert res.new_page_offsets.tolist() == [0, 1, 2, 2, 2]
    assert res.kv_loc.tolist() == [20, 24, 13, 9]
    assert res.kv_loc_offsets.tolist() == [0, 1, 2, 3, 4]
    assert [row(core, s) for s in (1, 2, 3, 4)] == [[1, 2, 0, 0], [3, 0, 0, 0], [6, 0, 0, 0], [4, 5, 0, 0]]
    # A mixed step: nothing, one token, a chunk across a page boundary.
    res = alloc(core, a, [1, 2, 3], [0, 1, 6])
    # row 2: [3, 0, 0, 0]  len 3
    # row 3: [6, 7, 0, 0]  len 7
    assert [kv_of(res, i) for i in range(3)] == [[], [14], [25, 26, 27, 28, 29, 30]]
    assert [pages_of(res, i) for i in range(3)] == [[], [], [7]]
    assert [core.alloced_len(a, s) for s in (1, 2, 3, 4)] == [6, 3, 7, 5]
    assert_audit(core)


def test_step_without_items(make_core) -> None:
    core, a = two_requests(make_core)
    before = snapshot(core)
    res = core.step(a, StepBatch())
    check_result_types(res, 0)
    assert res.kv_loc_offsets.tolist() == [0] and res.new_page_offsets.tolist() == [0]
    assert res.num_pages_released == 0
    assert_unchanged(before, core)


def test_accepts_lists_tuples_and_integer_arrays(make_core) -> None:
    core = make_core()
    a = core.add_owner()
    core.open(a, ["r1", "r2", "r3", "r4"])
    slots = np.array([1, 2], dtype=np.int64)
    needs = np.array([2, 3], dtype=np.int64)
    res = alloc(core, a, slots, needs, alloc_expected_lens=np.array([0, -1], dtype=np.int64))
    assert statuses(res) == [OK, OK]
    assert slots.tolist() == [1, 2] and needs.tolist() == [2, 3]  # inputs are not modified
    res = alloc(core, a, np.array([3], dtype=np.int32), np.array([1], dtype=np.uint8))
    assert statuses(res) == [OK]
    res = alloc(core, a, (4,), (1,), alloc_expected_lens=(0,))
    assert statuses(res) == [OK]
    res = step(core, a, truncate_slots=np.array([1], dtype=np.int16), truncate_lens=[1])
    assert core.alloced_len(a, 1) == 1
    assert [core.alloced_len(a, s) for s in (1, 2, 3, 4)] == [1, 3, 1, 1]
    # A StepBatch built directly from int64 arrays (what the service passes).
    one = np.array([1], dtype=np.int64)
    res = core.step(a, StepBatch(alloc_slots=one, alloc_needs=one, alloc_expected_lens=one))
    # row 1: [1, 0, 0, 0]  len 2   token 1 at page 1 offset 1
    assert statuses(res) == [OK] and res.kv_loc.tolist() == [1 * PS + 1]
    assert [core.alloced_len(a, s) for s in (1, 2, 3, 4)] == [2, 3, 1, 1]


# ------------------------------------------------------------ capacity results


def test_context_limit(make_core) -> None:
    core, a = two_requests(make_core)
    before = snapshot(core)
    res = alloc(core, a, [1], [17])
    assert statuses(res) == [CONTEXT_TOO_LONG]
    assert res.kv_loc.size == 0 and res.new_pages.size == 0
    assert res.kv_loc_offsets.tolist() == [0, 0] and res.new_page_offsets.tolist() == [0, 0]
    assert_unchanged(before, core)
    # A huge need is a per-item result too, not an error.
    res = alloc(core, a, [1], [2**31 - 1])
    assert statuses(res) == [CONTEXT_TOO_LONG]
    assert_unchanged(before, core)

    alloc(core, a, [1], [14])
    # row 1: [1, 2, 3, 4]  len 14
    before = snapshot(core)
    res = alloc(core, a, [1], [3])  # 17 > 16
    assert statuses(res) == [CONTEXT_TOO_LONG]
    assert_unchanged(before, core)
    # Other items of the step are served; the too-long one changes nothing.
    res = alloc(core, a, [1, 2], [3, 2])
    # row 2: [5, 0, 0, 0]  len 2
    assert statuses(res) == [CONTEXT_TOO_LONG, OK]
    assert [kv_of(res, 0), kv_of(res, 1)] == [[], [20, 21]]
    assert core.alloced_len(a, 1) == 14
    res = alloc(core, a, [1], [2])  # exactly max_context_len
    # row 1: [1, 2, 3, 4]  len 16
    assert statuses(res) == [OK]
    assert res.kv_loc.tolist() == [18, 19]
    assert core.alloced_len(a, 1) == 16
    before = snapshot(core)
    res = alloc(core, a, [1, 2], [1, 0])
    assert statuses(res) == [CONTEXT_TOO_LONG, OK]
    res = alloc(core, a, [1], [0])  # at the limit, zero tokens still fit
    assert statuses(res) == [OK]
    assert_unchanged(before, core)


def fill_for_out_of_pages(make_core) -> tuple[KVCore, int]:
    core = make_core()
    a = core.add_owner()
    assert core.open(a, ["r1", "r2", "r3", "r4"]).tolist() == [1, 2, 3, 4]
    alloc(core, a, [1, 2], [16, 11])
    # row 1: [1, 2, 3, 4]  len 16
    # row 2: [5, 6, 7, 0]  len 11
    # free: [8]
    assert [row(core, 1), row(core, 2)] == [[1, 2, 3, 4], [5, 6, 7, 0]]
    assert core.pool.num_free == 1
    return core, a


def test_out_of_pages_changes_nothing(make_core) -> None:
    core, a = fill_for_out_of_pages(make_core)
    before = snapshot(core)
    lens = [core.alloced_len(a, s) for s in (1, 2, 3, 4)]
    res = alloc(core, a, [3], [5])  # two pages, one free
    assert statuses(res) == [OUT_OF_PAGES]
    assert res.kv_loc.size == 0 and res.new_pages.size == 0
    assert res.kv_loc_offsets.tolist() == [0, 0] and res.new_page_offsets.tolist() == [0, 0]
    assert_unchanged(before, core)
    np.testing.assert_array_equal(core.block_table, before["block_table"])
    np.testing.assert_array_equal(core.pool.ref_cnt, before["ref_cnt"])
    assert core.pool.num_free == 1
    assert [core.alloced_len(a, s) for s in (1, 2, 3, 4)] == lens == [16, 11, 0, 0]


def test_out_of_pages_admits_later_items_greedily(make_core) -> None:
    core, a = fill_for_out_of_pages(make_core)
    res = alloc(core, a, [3, 2], [5, 2])
    # item 0 (two pages) fails; item 1 fills page 7's tail and takes the last page:
    # row 2: [5, 6, 7, 8]  len 13
    # row 3: [0, 0, 0, 0]  len 0
    assert statuses(res) == [OUT_OF_PAGES, OK]
    assert [kv_of(res, 0), kv_of(res, 1)] == [[], [31, 32]]
    assert [pages_of(res, 0), pages_of(res, 1)] == [[], [8]]
    assert row(core, 2) == [5, 6, 7, 8] and row(core, 3) == [0, 0, 0, 0]
    assert core.pool.num_free == 0
    # Pool empty: a token in a page's tail is still served, a new page is not.
    res = alloc(core, a, [3, 2, 4], [1, 1, 0])
    # row 2: [5, 6, 7, 8]  len 14
    assert statuses(res) == [OUT_OF_PAGES, OK, OK]
    assert res.kv_loc.tolist() == [33]
    assert [core.alloced_len(a, s) for s in (1, 2, 3, 4)] == [16, 14, 0, 0]


def test_out_of_pages_first_come_first_served(make_core) -> None:
    core, a = fill_for_out_of_pages(make_core)
    before = snapshot(core)
    res = alloc(core, a, [4, 3], [1, 1])
    # row 4: [8, 0, 0, 0]  len 1   (slot 3 asked second and gets nothing)
    assert statuses(res) == [OK, OUT_OF_PAGES]
    assert res.kv_loc.tolist() == [32]
    assert row(core, 4) == [8, 0, 0, 0] and row(core, 3) == [0, 0, 0, 0]
    step(core, a, truncate_slots=[4], truncate_lens=[0])
    assert_unchanged(before, core)


def test_page_zero_is_never_handed_out(make_core) -> None:
    core = make_core(num_pages=6, page_size=1, max_requests=5, max_context_len=5)
    a = core.add_owner()
    core.open(a, ["a", "b", "c", "d", "e"])
    taken = []
    for i in range(5):
        res = alloc(core, a, [i + 1], [1])
        assert statuses(res) == [OK]
        taken += res.new_pages.tolist()
        assert res.kv_loc.tolist() == res.new_pages.tolist()  # page_size 1: token slot = page
    assert sorted(taken) == [1, 2, 3, 4, 5]
    assert core.pool.ref_cnt[0] == 0 and core.pool.num_free == 0
    assert core.stats().num_used_pages == 5
    res = alloc(core, a, [1, 2, 3, 4, 5], [1, 1, 1, 1, 1])
    assert statuses(res) == [OUT_OF_PAGES] * 5
    assert not core.block_table[0].any()
    # The whole default pool, then nothing more: 0 never appears.
    core = make_core()
    a = core.add_owner()
    core.open(a, ["r1", "r2", "r3"])
    res = alloc(core, a, [1, 2, 3], [16, 16, 1])
    assert statuses(res) == [OK, OK, OUT_OF_PAGES]
    assert res.new_pages.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert 0 not in core.block_table[1:3]
    assert core.pool.ref_cnt[0] == 0
    assert core.audit().num_used_pages == 8 and core.audit().num_free_pages == 0


def test_atomic_rollback(make_core) -> None:
    core, a = fill_for_out_of_pages(make_core)
    # row 1: [1, 2, 3, 4]  len 16
    # row 2: [5, 6, 7, 0]  len 11
    # free: [8]
    before = snapshot(core)
    res = alloc(core, a, [2, 3, 4], [1, 1, 1], atomic=True)
    # 2 fits in page 7's tail, 3 would take page 8, 4 finds none: nothing is applied.
    check_result_types(res, 3)
    assert statuses(res) == [ABORTED, ABORTED, OUT_OF_PAGES]
    assert res.kv_loc.size == 0 and res.new_pages.size == 0
    assert res.kv_loc_offsets.tolist() == [0, 0, 0, 0] and res.new_page_offsets.tolist() == [0, 0, 0, 0]
    assert_unchanged(before, core)
    res = alloc(core, a, [2, 1, 3], [1, 1, 0], atomic=True)
    assert statuses(res) == [ABORTED, CONTEXT_TOO_LONG, ABORTED]
    assert_unchanged(before, core)
    # The same items without atomic: the ones that fit are served.
    res = alloc(core, a, [2, 3, 4], [1, 1, 1])
    assert statuses(res) == [OK, OK, OUT_OF_PAGES]
    assert res.kv_loc.tolist() == [31, 32]
    # row 2: [5, 6, 7, 0]  len 12   row 3: [8, 0, 0, 0]  len 1   free: []
    assert [row(core, 2), row(core, 3)] == [[5, 6, 7, 0], [8, 0, 0, 0]]
    res = alloc(core, a, [2, 3], [1, 1], atomic=True)  # 2 needs a page, 3 fits its tail
    assert statuses(res) == [OUT_OF_PAGES, ABORTED]
    assert core.alloced_len(a, 3) == 1
    # An atomic step whose items all fit is applied whole.
    res = alloc(core, a, [3, 4], [2, 0], atomic=True)
    # row 3: [8, 0, 0, 0]  len 3
    assert statuses(res) == [OK, OK]
    assert res.kv_loc.tolist() == [33, 34]
    assert row(core, 3) == [8, 0, 0, 0]


def test_atomic_covers_allocs_only(make_core) -> None:
    """``atomic``: if any alloc item fails none is applied; the step's releases and
    truncates (validated, never capacity-limited) still are."""
    core, a = fill_for_out_of_pages(make_core)
    res = step(
        core,
        a,
        release_slots=[1],
        truncate_slots=[2],
        truncate_lens=[4],
        alloc_slots=[3, 4],
        alloc_needs=[1, 17],
        atomic=True,
    )
    # row 1: released      row 2: [5, 0, 0, 0]  len 4
    assert statuses(res) == [ABORTED, CONTEXT_TOO_LONG]
    assert res.num_pages_released == 6
    assert row(core, 1) == [0, 0, 0, 0] and row(core, 2) == [5, 0, 0, 0] and row(core, 3) == [0, 0, 0, 0]
    assert core.pool.num_free == 7
    assert [core.alloced_len(a, s) for s in (2, 3, 4)] == [4, 0, 0]


# ------------------------------------------------------------------------ quota


def test_quota(make_core) -> None:
    """The quota is the caller's (the sessions layer keeps it) and comes with each step:
    q's steps all pass ``quota_pages=Q``."""
    Q = 3
    core = make_core()
    q = core.add_owner()
    free = core.add_owner()
    qa, qb = core.open(q, ["a", "b"]).tolist()
    (fa,) = core.open(free, ["f"]).tolist()
    res = alloc(core, q, [qa], [10], quota_pages=Q)
    # q: row qa: [1, 2, 3, 0]  len 10   3 of 3 pages
    assert statuses(res) == [OK]
    res = alloc(core, q, [qa], [2], quota_pages=Q)  # the tail of page 3, no new page
    assert statuses(res) == [OK] and res.new_pages.size == 0
    usage = {o.owner: o for o in core.stats().owners}
    assert usage[q] == OwnerUsage(owner=q, num_requests=2, num_pages_held=3)
    assert usage[free] == OwnerUsage(owner=free, num_requests=1, num_pages_held=0)
    before = snapshot(core)
    res = alloc(core, q, [qa, qb], [1, 1], quota_pages=Q)  # pages are free (5), the quota is not
    assert statuses(res) == [QUOTA_EXCEEDED, QUOTA_EXCEEDED]
    assert res.kv_loc.size == 0
    assert_unchanged(before, core)
    # Others are not limited by q's quota.
    res = alloc(core, free, [fa], [16])
    assert statuses(res) == [OK]
    assert core.pool.num_free == 1
    # Short of both: the quota is reported.
    res = alloc(core, q, [qb], [8], quota_pages=Q)
    assert statuses(res) == [QUOTA_EXCEEDED]
    # A truncate in the same step gives quota back before the allocs.
    res = step(core, q, Q, truncate_slots=[qa], truncate_lens=[4], alloc_slots=[qb], alloc_needs=[1])
    # q: row qa: [1, 0, 0, 0]  len 4;  row qb: [p, 0, 0, 0]  len 1
    assert statuses(res) == [OK]
    assert res.num_pages_released == 2
    usage = {o.owner: o for o in core.stats().owners}
    assert usage[q].num_pages_held == 2 and usage[free].num_pages_held == 4
    assert core.stats().num_used_pages == 6
    assert_audit(core)
    # The core keeps no quota of its own: the same step without one is served.
    before = snapshot(core)
    assert statuses(alloc(core, q, [qb], [8], quota_pages=Q)) == [QUOTA_EXCEEDED]  # 2 + 2 pages > 3
    assert_unchanged(before, core)
    assert statuses(alloc(core, q, [qb], [8])) == [OK]
    assert core.pages_held(q) == 4 and core.pool.num_free == 0


def test_quota_is_admitted_greedily_and_exactly(make_core) -> None:
    Q = 3
    core = make_core()
    q = core.add_owner()
    core.open(q, ["x", "y", "z"])
    res = alloc(core, q, [1, 2, 3], [8, 8, 4], quota_pages=Q)
    # row 1: [1, 2, 0, 0]  len 8   row 2: refused   row 3: [3, 0, 0, 0]  len 4
    assert statuses(res) == [OK, QUOTA_EXCEEDED, OK]
    assert [pages_of(res, i) for i in range(3)] == [[1, 2], [], [3]]
    assert core.stats().owners[0].num_pages_held == 3
    res = alloc(core, q, [1, 2, 3], [1, 1, 1], quota_pages=Q, atomic=True)
    assert statuses(res) == [QUOTA_EXCEEDED, QUOTA_EXCEEDED, QUOTA_EXCEEDED]
    step(core, q, Q, release_slots=[3])
    res = alloc(core, q, [2, 1], [1, 1], quota_pages=Q, atomic=True)
    assert statuses(res) == [ABORTED, QUOTA_EXCEEDED]
    assert core.stats().owners[0].num_pages_held == 2
    zero = core.add_owner()  # its steps pass quota_pages=0
    (z,) = core.open(zero, ["z"]).tolist()
    assert statuses(alloc(core, zero, [z], [0], quota_pages=0)) == [OK]
    assert statuses(alloc(core, zero, [z], [1], quota_pages=0)) == [QUOTA_EXCEEDED]
    assert core.alloced_len(zero, z) == 0


# --------------------------------------------------------------------- truncate


def ten_tokens(make_core) -> tuple[KVCore, int]:
    core, a = two_requests(make_core)
    alloc(core, a, [1, 2], [10, 2])
    # row 1: [1, 2, 3, 0]  len 10
    # row 2: [4, 0, 0, 0]  len 2
    assert [row(core, 1), row(core, 2)] == [[1, 2, 3, 0], [4, 0, 0, 0]]
    return core, a


def test_truncate_to_zero(make_core) -> None:
    core, a = ten_tokens(make_core)
    res = step(core, a, truncate_slots=[1], truncate_lens=[0])
    # row 1: [0, 0, 0, 0]  len 0   (still open)
    assert res.num_pages_released == 3 and res.alloc_status.size == 0
    assert row(core, 1) == [0, 0, 0, 0]
    assert core.alloced_len(a, 1) == 0
    assert core.pool.ref_cnt[1:4].tolist() == [0, 0, 0]
    assert core.pool.num_free == 7
    assert core.stats().num_open_requests == 2
    res = alloc(core, a, [1], [1])
    assert res.new_pages.size == 1 and res.new_pages[0] in (1, 2, 3)
    assert res.kv_loc.tolist() == [res.new_pages[0] * PS]
    assert_audit(core)


def test_truncate_to_a_page_boundary(make_core) -> None:
    core, a = ten_tokens(make_core)
    res = step(core, a, truncate_slots=[1], truncate_lens=[8])
    # row 1: [1, 2, 0, 0]  len 8   page 3 dropped
    assert res.num_pages_released == 1
    assert row(core, 1) == [1, 2, 0, 0]
    assert core.alloced_len(a, 1) == 8
    assert core.pool.ref_cnt[3] == 0 and core.pool.num_free == 5
    res = alloc(core, a, [1], [1])  # token 8 starts a new page at offset 0
    (page,) = res.new_pages.tolist()
    assert row(core, 1) == [1, 2, page, 0]
    assert res.kv_loc.tolist() == [page * PS]
    assert_audit(core)


def test_truncate_to_mid_page(make_core) -> None:
    core, a = ten_tokens(make_core)
    res = step(core, a, truncate_slots=[1], truncate_lens=[5])
    # row 1: [1, 2, 0, 0]  len 5   page 2 keeps offset 0 only
    assert res.num_pages_released == 1
    assert row(core, 1) == [1, 2, 0, 0]
    assert core.alloced_len(a, 1) == 5
    res = alloc(core, a, [1], [2])  # reuses page 2 offsets 1, 2
    # row 1: [1, 2, 0, 0]  len 7
    assert res.kv_loc.tolist() == [9, 10] and res.new_pages.size == 0
    assert_audit(core)


def test_truncate_to_the_same_length_and_several_slots(make_core) -> None:
    core, a = ten_tokens(make_core)
    before = snapshot(core)
    res = step(core, a, truncate_slots=[1, 2], truncate_lens=[10, 2])
    assert res.num_pages_released == 0
    assert_unchanged(before, core)
    res = step(core, a, truncate_slots=[2, 1], truncate_lens=[0, 1])
    # row 1: [1, 0, 0, 0]  len 1   row 2: [0, 0, 0, 0]  len 0
    assert res.num_pages_released == 3
    assert [row(core, 1), row(core, 2)] == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert core.pool.num_free == 7


def test_truncate_and_alloc_the_same_slot_in_one_step(make_core) -> None:
    core, a = ten_tokens(make_core)
    res = step(core, a, truncate_slots=[1], truncate_lens=[6], alloc_slots=[1], alloc_needs=[3])
    # after the truncate: row 1: [1, 2, 0, 0]  len 6
    # after the alloc:    row 1: [1, 2, p, 0]  len 9   tokens 6, 7 on page 2, 8 on p
    assert statuses(res) == [OK]
    assert res.num_pages_released == 1
    (page,) = res.new_pages.tolist()
    assert row(core, 1) == [1, 2, page, 0]
    assert res.kv_loc.tolist() == [10, 11, page * PS]
    assert core.alloced_len(a, 1) == 9
    # alloc_expected_lens is the length the alloc starts from: after the truncate.
    res = step(
        core, a, truncate_slots=[1], truncate_lens=[2], alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[2]
    )
    # row 1: [1, 0, 0, 0]  len 3
    assert statuses(res) == [OK] and res.kv_loc.tolist() == [6]
    before = snapshot(core)
    err = raises(
        Reason.ALLOCED_LEN_MISMATCH,
        step,
        core,
        a,
        truncate_slots=[1],
        truncate_lens=[1],
        alloc_slots=[1],
        alloc_needs=[1],
        alloc_expected_lens=[3],
    )
    assert "alloc_expected_lens[0] = 3" in str(err) and "alloced_len 1" in str(err)
    assert_unchanged(before, core)


# ---------------------------------------------------------------------- release


def test_release_and_reuse_of_a_slot(make_core) -> None:
    core, a = ten_tokens(make_core)
    res = step(core, a, release_slots=[1])
    # row 1: [0, 0, 0, 0]  closed   row 2: [4, 0, 0, 0]  len 2
    assert res.num_pages_released == 3 and res.alloc_status.size == 0
    assert row(core, 1) == [0, 0, 0, 0] and row(core, 2) == [4, 0, 0, 0]
    assert core.pool.ref_cnt.tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]
    assert core.pool.num_free == 7
    stats = core.stats()
    assert (stats.num_open_requests, stats.num_free_request_slots) == (1, 3)
    assert stats.owners[0].num_requests == 1 and stats.owners[0].num_pages_held == 1
    raises(Reason.SLOT_NOT_FOUND, core.alloced_len, a, 1)
    before = snapshot(core)
    raises(Reason.SLOT_NOT_FOUND, step, core, a, release_slots=[1])  # released twice
    assert_unchanged(before, core)
    # The slot comes back for a new request (even one reusing the old id), empty.
    (slot,) = core.open(a, ["r1"]).tolist()
    assert slot == 1
    assert core.alloced_len(a, slot) == 0 and row(core, slot) == [0, 0, 0, 0]
    res = alloc(core, a, [slot], [5])
    assert res.new_pages.size == 2 and set(res.new_pages.tolist()) <= {1, 2, 3, 5, 6, 7, 8}
    assert row(core, slot) == res.new_pages.tolist() + [0, 0]
    assert_audit(core)


def test_release_frees_pages_for_the_allocs_of_the_same_step(make_core) -> None:
    core, a = fill_for_out_of_pages(make_core)
    res = step(core, a, release_slots=[1], alloc_slots=[3, 4], alloc_needs=[16, 4])
    # row 1: closed   row 3: four pages among 1..4 and 8   row 4: the fifth
    assert statuses(res) == [OK, OK]
    assert res.num_pages_released == 4
    assert sorted(res.new_pages.tolist()) == [1, 2, 3, 4, 8]
    assert row(core, 3) == pages_of(res, 0) and row(core, 4)[0] == pages_of(res, 1)[0]
    assert core.pool.num_free == 0


def test_release_several_and_count(make_core) -> None:
    core, a = ten_tokens(make_core)
    res = step(core, a, release_slots=[2, 1])
    assert res.num_pages_released == 4
    assert not core.block_table.any()
    assert core.pool.num_free == 8 and not core.pool.ref_cnt.any()
    assert core.stats().num_open_requests == 0 and core.stats().owners[0].num_pages_held == 0
    # A released request id is a new request when opened again.
    assert core.open(a, ["r2", "r1"]).tolist() == [1, 2]


# ------------------------------------------------------------------------- open


def test_open_is_idempotent_per_request_id(make_core) -> None:
    core = make_core()
    a = core.add_owner()
    b = core.add_owner()
    slots = core.open(a, ["r1", "r2"])
    assert slots.dtype == np.int32 and slots.tolist() == [1, 2]
    assert core.open(a, ["r2", "r1"]).tolist() == [2, 1]
    assert core.open(a, ["r3", "r3", "r1"]).tolist() == [3, 3, 1]
    assert core.open(b, ["r1"]).tolist() == [4]  # the same id of another owner is another request
    assert core.open(a, []).tolist() == []
    stats = core.stats()
    assert (stats.num_open_requests, stats.num_free_request_slots) == (4, 0)
    assert {o.owner: o.num_requests for o in stats.owners} == {a: 3, b: 1}
    # Reopening existing ids needs no free slot.
    assert core.open(a, ["r1", "r2", "r3"]).tolist() == [1, 2, 3]


def test_open_without_a_free_slot_opens_nothing(make_core) -> None:
    core = make_core()
    a = core.add_owner()
    core.open(a, ["r1", "r2", "r3"])
    before = snapshot(core)
    err = raises(Reason.NO_FREE_REQUEST_SLOT, core.open, a, ["r1", "n1", "n2"])
    assert err.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "request slot" in str(err) and "2 new request(s)" in str(err) and "1 of 4" in str(err)
    assert err.metadata == {"requested": "2", "free": "1"}
    assert_unchanged(before, core)
    assert core.open(a, ["r1", "n1", "n1"]).tolist() == [1, 4, 4]
    raises(Reason.NO_FREE_REQUEST_SLOT, core.open, a, ["n2"])


@pytest.mark.parametrize("bad", ["", 5, None, b"x"])
def test_open_rejects_bad_request_ids(make_core, bad) -> None:
    core = make_core()
    a = core.add_owner()
    before = snapshot(core)
    err = raises(Reason.BAD_VALUE, core.open, a, ["ok", bad])
    assert "#1" in str(err) and repr(bad) in str(err)
    assert_unchanged(before, core)


# ------------------------------------------------------------- pool double free


def test_pool_unref_detects_double_free() -> None:
    pool = PagePool(6)
    pages = pool.take(3)
    assert pages.tolist() == [1, 2, 3]
    assert pool.num_free == 2 and pool.ref_cnt.tolist() == [0, 1, 1, 1, 0, 0]
    assert pool.unref(np.array([2], dtype=np.int32)) == 1
    assert pool.unref(np.zeros(0, dtype=np.int32)) == 0

    def frozen() -> tuple:
        return pool.ref_cnt.tolist(), pool.num_free, pool.free_pages().tolist()

    before = frozen()
    for bad, named in [
        ([2], "2"),  # already free
        ([1, 2], "2"),  # one good, one free: nothing changes, not even page 1
        ([3, 3], "3"),  # count 1, dropped twice in one call
        ([1, 3, 1], "1"),
        ([0], "0"),  # the padding page
        ([6], "6"),  # out of range
        ([-1], "-1"),
        ([1, 2**32 + 1], str(2**32 + 1)),  # int64 ids: never wrapped into int32
    ]:
        with pytest.raises(CorruptionError) as info:
            pool.unref(np.array(bad, dtype=np.int32 if max(bad) < 2**31 else np.int64))
        assert info.value.reason is Reason.CORRUPTION and info.value.kind is ErrorKind.INTERNAL
        assert named in str(info.value)
        assert frozen() == before, bad
    # A page referenced twice may be dropped twice in one call.
    pool.ref_cnt[3] = 2
    assert pool.unref(np.array([3, 1, 3], dtype=np.int32)) == 2
    assert pool.num_free == 5 and not pool.ref_cnt.any()
    assert sorted(pool.free_pages().tolist()) == [1, 2, 3, 4, 5]
    with pytest.raises(CorruptionError):
        pool.take(6)


def test_double_free_through_the_core_changes_nothing(make_core) -> None:
    core, a = ten_tokens(make_core)
    step(core, a, release_slots=[1])
    # pages 1, 2, 3 are free; page 4 is row 2's
    before = snapshot(core)
    for bad in ([1], [4, 2], [4, 4]):
        with pytest.raises(CorruptionError) as info:
            core.pool.unref(np.array(bad, dtype=np.int32))
        assert "double free" in str(info.value)
        assert_unchanged(before, core)


# ------------------------------------------------------------------- owners


def test_add_owner_mints_distinct_small_integers(make_core) -> None:
    core = make_core()
    owners = [core.add_owner() for _ in range(3)]
    assert all(isinstance(o, int) and o >= 1 for o in owners)
    assert len(set(owners)) == 3 and all(core.has_owner(o) for o in owners)
    assert {o.owner for o in core.stats().owners} == set(owners)


def test_attach_validates_the_quota() -> None:
    """Quotas are the sessions layer's: a bad one is refused there, nothing registered."""
    sessions = Sessions(KVCore(CoreConfig(9, PS, 4, 16), audit_every_step=True), lease_s=10.0)
    core = sessions.core
    zero = sessions.attach("a", 0)
    assert zero.quota_pages == 0 and core.has_owner(zero.owner)
    before = snapshot(core)
    sessions_before = dict(sessions.by_id)
    err = raises(Reason.BAD_VALUE, sessions.attach, "b", -1)
    assert "-1" in str(err)
    raises(Reason.BAD_VALUE, sessions.attach, "b", 1.5)
    assert_unchanged(before, core)
    assert sessions.by_id == sessions_before
    assert set(core.slots.owners) == {zero.owner}
    # A good quota (or none) after the refusals registers exactly one owner each.
    b = sessions.attach("b", 2)
    unlimited = sessions.attach("c", None)
    assert (b.quota_pages, unlimited.quota_pages) == (2, None)
    assert set(core.slots.owners) == {zero.owner, b.owner, unlimited.owner}
    assert set(sessions.by_id) == {zero.session_id, b.session_id, unlimited.session_id}


def test_remove_owner_releases_everything(make_core) -> None:
    core = make_core()
    a = core.add_owner()
    b = core.add_owner()  # with a quota of 4 pages
    core.open(a, ["r1", "r2"])
    core.open(b, ["r1"])
    alloc(core, a, [1, 2], [5, 9])
    alloc(core, b, [3], [3], quota_pages=4)
    # a: row 1: [1, 2, 0, 0]  len 5;  row 2: [3, 4, 5, 0]  len 9
    # b: row 3: [6, 0, 0, 0]  len 3
    assert core.remove_owner(a) == 2
    assert not core.has_owner(a)
    assert not core.block_table[[1, 2]].any()
    assert row(core, 3) == [6, 0, 0, 0] and core.alloced_len(b, 3) == 3
    assert core.pool.ref_cnt.tolist() == [0, 0, 0, 0, 0, 0, 1, 0, 0]
    stats = core.stats()
    assert stats.num_free_pages == 7 and stats.num_open_requests == 1 and stats.num_free_request_slots == 3
    assert [(o.owner, o.num_requests, o.num_pages_held) for o in stats.owners] == [(b, 1, 1)]
    assert_audit(core)
    before = snapshot(core)
    err = raises(Reason.UNKNOWN_SESSION, step, core, a, release_slots=[1])
    assert str(err) == f"unknown owner {a}"
    raises(Reason.UNKNOWN_SESSION, core.alloced_len, a, 1)
    raises(Reason.UNKNOWN_SESSION, core.open, a, ["r1"])
    raises(Reason.UNKNOWN_SESSION, core.remove_owner, a)
    raises(Reason.UNKNOWN_SESSION, core.pages_held, a)
    raises(Reason.UNKNOWN_SESSION, core.slots_of, a)
    assert_unchanged(before, core)
    # A new owner gets a new index (never a removed one's) and starts with nothing.
    c = core.add_owner()
    assert c not in (a, b) and not core.has_owner(a)
    (slot,) = core.open(c, ["r1"]).tolist()
    assert core.alloced_len(c, slot) == 0 and row(core, slot) == [0, 0, 0, 0]
    assert core.pages_held(c) == 0 and core.slots_of(c).tolist() == [slot]
    assert core.remove_owner(b) == 1
    assert core.remove_owner(c) == 1
    assert not core.block_table.any() and core.pool.num_free == 8
    assert core.stats().num_free_request_slots == 4


# -------------------------------------------------------------- isolation


def test_another_owners_slot_is_not_found_exactly_like_a_closed_one(make_core) -> None:
    core = make_core()
    a = core.add_owner()
    b = core.add_owner()
    (slot,) = core.open(a, ["secret"]).tolist()
    alloc(core, a, [slot], [6])
    core.open(b, ["mine"])
    calls = [
        lambda: step(core, b, release_slots=[slot]),
        lambda: step(core, b, truncate_slots=[slot], truncate_lens=[0]),
        lambda: step(core, b, alloc_slots=[slot], alloc_needs=[1]),
        lambda: step(core, b, alloc_slots=[slot], alloc_needs=[1], alloc_expected_lens=[6]),
        lambda: core.alloced_len(b, slot),
    ]
    before = snapshot(core)
    foreign = []
    for call in calls:
        err = raises(Reason.SLOT_NOT_FOUND, call)
        assert f"slot {slot}" in str(err)
        foreign.append((str(err), err.metadata))
    assert_unchanged(before, core)
    step(core, a, release_slots=[slot])
    closed = [(str(err), err.metadata) for err in (raises(Reason.SLOT_NOT_FOUND, call) for call in calls)]
    assert closed == foreign


# ---------------------------------------------------------------- validation


def validation_state(make_core) -> tuple[KVCore, int, int]:
    core = make_core()
    a = core.add_owner()
    b = core.add_owner()
    assert core.open(a, ["r1", "r2"]).tolist() == [1, 2]
    assert core.open(b, ["r3"]).tolist() == [3]
    alloc(core, a, [1], [6])
    alloc(core, b, [3], [1])
    # a: row 1: [1, 2, 0, 0]  len 6;  row 2: [0, 0, 0, 0]  len 0
    # b: row 3: [3, 0, 0, 0]  len 1
    # slot 4 closed
    assert [row(core, s) for s in (1, 2, 3, 4)] == [[1, 2, 0, 0], [0, 0, 0, 0], [3, 0, 0, 0], [0, 0, 0, 0]]
    return core, a, b


BIG = 2**40
NOBODY = 1000  # an owner index the core never handed out
INVALID_STEPS = [
    # (id, owner ("a", or "nobody": NOBODY), step kwargs, reason, fragments the message must contain)
    (
        "unknown-owner",
        "nobody",
        dict(alloc_slots=[1], alloc_needs=[1]),
        Reason.UNKNOWN_SESSION,
        [f"unknown owner {NOBODY}"],
    ),
    ("release-closed", "a", dict(release_slots=[4]), Reason.SLOT_NOT_FOUND, ["release_slots[0]", "slot 4"]),
    (
        "truncate-closed",
        "a",
        dict(truncate_slots=[4], truncate_lens=[0]),
        Reason.SLOT_NOT_FOUND,
        ["truncate_slots[0]", "slot 4"],
    ),
    (
        "alloc-closed",
        "a",
        dict(alloc_slots=[2, 4], alloc_needs=[1, 1]),
        Reason.SLOT_NOT_FOUND,
        ["alloc_slots[1]", "slot 4"],
    ),
    ("release-other-owner", "a", dict(release_slots=[3]), Reason.SLOT_NOT_FOUND, ["slot 3"]),
    ("truncate-other-owner", "a", dict(truncate_slots=[3], truncate_lens=[0]), Reason.SLOT_NOT_FOUND, ["slot 3"]),
    (
        "alloc-other-owner",
        "a",
        dict(alloc_slots=[1, 3], alloc_needs=[1, 1]),
        Reason.SLOT_NOT_FOUND,
        ["alloc_slots[1]", "slot 3"],
    ),
    ("slot-0", "a", dict(alloc_slots=[0], alloc_needs=[1]), Reason.SLOT_NOT_FOUND, ["slot 0"]),
    ("slot-past-max", "a", dict(alloc_slots=[5], alloc_needs=[1]), Reason.SLOT_NOT_FOUND, ["slot 5"]),
    ("slot-sentinel+1", "a", dict(release_slots=[6]), Reason.SLOT_NOT_FOUND, ["slot 6"]),
    ("slot-huge", "a", dict(truncate_slots=[BIG], truncate_lens=[0]), Reason.SLOT_NOT_FOUND, [f"slot {BIG}"]),
    ("slot-negative", "a", dict(release_slots=[1, -1]), Reason.SLOT_NOT_FOUND, ["release_slots[1]", "slot -1"]),
    ("slot-very-negative", "a", dict(alloc_slots=[-BIG], alloc_needs=[1]), Reason.SLOT_NOT_FOUND, [f"slot {-BIG}"]),
    # -5 and -4 index slots 1 and 2 (a's own) from the end of the 6-entry slot arrays
    (
        "decode-negative-wraps-to-own",
        "a",
        dict(alloc_slots=[-5], alloc_needs=[1]),
        Reason.SLOT_NOT_FOUND,
        ["alloc_slots[0]", "slot -5"],
    ),
    (
        "decode-negative-wraps-to-listed",
        "a",
        dict(alloc_slots=[2, -4], alloc_needs=[1, 1]),
        Reason.SLOT_NOT_FOUND,
        ["alloc_slots[1]", "slot -4"],
    ),
    (
        "release-negative-wraps-to-own",
        "a",
        dict(release_slots=[-4]),
        Reason.SLOT_NOT_FOUND,
        ["release_slots[0]", "slot -4"],
    ),
    ("release-duplicate", "a", dict(release_slots=[1, 2, 1]), Reason.DUPLICATE_SLOT, ["slot 1", "twice"]),
    (
        "truncate-duplicate",
        "a",
        dict(truncate_slots=[2, 2], truncate_lens=[0, 0]),
        Reason.DUPLICATE_SLOT,
        ["truncate_slots", "slot 2", "twice"],
    ),
    (
        "alloc-duplicate",
        "a",
        dict(alloc_slots=[2, 1, 2], alloc_needs=[1, 1, 1]),
        Reason.DUPLICATE_SLOT,
        ["alloc_slots", "slot 2", "twice"],
    ),
    (
        "alloc-duplicate-as-long-as-slots",
        "a",
        dict(alloc_slots=[1] * 4, alloc_needs=[0] * 4),
        Reason.DUPLICATE_SLOT,
        ["alloc_slots", "slot 1", "twice"],
    ),
    # A column longer than max_requests (4 here) is refused by its length, before anything else.
    (
        "alloc-longer-than-slots",
        "a",
        dict(alloc_slots=[1] * 10, alloc_needs=[0] * 10),
        Reason.BAD_VALUE,
        ["alloc_slots has 10 items", "max_requests = 4"],
    ),
    (
        "release-longer-than-slots",
        "a",
        dict(release_slots=[2] * 7),
        Reason.BAD_VALUE,
        ["release_slots has 7 items", "max_requests = 4"],
    ),
    (
        "truncate-lens-longer-than-slots",
        "a",
        dict(truncate_slots=[1], truncate_lens=[0] * 5),
        Reason.BAD_VALUE,
        ["truncate_lens has 5 items", "max_requests = 4"],
    ),
    (
        "expected-longer-than-slots",
        "a",
        dict(alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[6] * 5),
        Reason.BAD_VALUE,
        ["alloc_expected_lens has 5 items", "max_requests = 4"],
    ),
    (
        "unknown-slots-longer-than-slots",
        "a",
        dict(truncate_slots=[BIG] * 5, truncate_lens=[0] * 5),
        Reason.BAD_VALUE,
        ["truncate_slots has 5 items", "max_requests = 4"],
    ),
    (
        "alloc-released",
        "a",
        dict(release_slots=[2], alloc_slots=[1, 2], alloc_needs=[1, 1]),
        Reason.SLOT_NOT_FOUND,
        ["alloc_slots[1]", "slot 2", "released"],
    ),
    (
        "truncate-released",
        "a",
        dict(release_slots=[1], truncate_slots=[1], truncate_lens=[0]),
        Reason.SLOT_NOT_FOUND,
        ["truncate_slots[0]", "slot 1", "released"],
    ),
    ("negative-need", "a", dict(alloc_slots=[1, 2], alloc_needs=[1, -1]), Reason.BAD_VALUE, ["alloc_needs[1]", "-1"]),
    ("need-2^31", "a", dict(alloc_slots=[2], alloc_needs=[2**31]), Reason.BAD_VALUE, ["alloc_needs[0]", "2147483648"]),
    (
        "negative-truncate-len",
        "a",
        dict(truncate_slots=[1], truncate_lens=[-2]),
        Reason.BAD_VALUE,
        ["truncate_lens[0]", "-2"],
    ),
    (
        "truncate-beyond",
        "a",
        dict(truncate_slots=[2, 1], truncate_lens=[0, 7]),
        Reason.TRUNCATE_BEYOND_ALLOCED,
        ["truncate_lens[1] = 7", "alloced_len 6", "slot 1"],
    ),
    (
        "truncate-beyond-empty",
        "a",
        dict(truncate_slots=[2], truncate_lens=[1]),
        Reason.TRUNCATE_BEYOND_ALLOCED,
        ["= 1", "alloced_len 0", "slot 2"],
    ),
    (
        "expected-mismatch",
        "a",
        dict(alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[5]),
        Reason.ALLOCED_LEN_MISMATCH,
        ["alloc_expected_lens[0] = 5", "slot 1", "alloced_len 6"],
    ),
    (
        "expected-mismatch-second",
        "a",
        dict(alloc_slots=[2, 1], alloc_needs=[1, 1], alloc_expected_lens=[0, 7]),
        Reason.ALLOCED_LEN_MISMATCH,
        ["alloc_expected_lens[1] = 7", "alloced_len 6"],
    ),
    (
        "expected-below-minus-1",
        "a",
        dict(alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[-2]),
        Reason.BAD_VALUE,
        ["alloc_expected_lens[0]", "-2"],
    ),
    (
        "float-needs",
        "a",
        dict(alloc_slots=[1], alloc_needs=np.array([1.0])),
        Reason.BAD_VALUE,
        ["alloc_needs", "float64"],
    ),
    ("float-slots-list", "a", dict(alloc_slots=[1.5], alloc_needs=[1]), Reason.BAD_VALUE, ["alloc_slots", "float64"]),
    (
        "float-release",
        "a",
        dict(release_slots=np.array([1.0], dtype=np.float32)),
        Reason.BAD_VALUE,
        ["release_slots", "float32"],
    ),
    (
        "float-truncate-lens",
        "a",
        dict(truncate_slots=[1], truncate_lens=[0.5]),
        Reason.BAD_VALUE,
        ["truncate_lens", "float64"],
    ),
    (
        "float-expected",
        "a",
        dict(alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[6.0]),
        Reason.BAD_VALUE,
        ["alloc_expected_lens", "float64"],
    ),
    ("bool-needs", "a", dict(alloc_slots=[1], alloc_needs=[True]), Reason.BAD_VALUE, ["alloc_needs", "bool"]),
    ("string-slots", "a", dict(release_slots=["1"]), Reason.BAD_VALUE, ["release_slots", "<U1"]),
    (
        "2d-alloc-slots",
        "a",
        dict(alloc_slots=np.array([[1, 2]]), alloc_needs=[1, 1]),
        Reason.BAD_VALUE,
        ["alloc_slots", "one-dimensional", "(1, 2)"],
    ),
    ("2d-needs", "a", dict(alloc_slots=[1, 2], alloc_needs=[[1], [1]]), Reason.BAD_VALUE, ["alloc_needs", "(2, 1)"]),
    (
        "2d-release",
        "a",
        dict(release_slots=np.array([[1], [2]], dtype=np.int64)),
        Reason.BAD_VALUE,
        ["release_slots", "(2, 1)"],
    ),
    ("ragged", "a", dict(release_slots=[[1], [1, 2]]), Reason.BAD_VALUE, ["release_slots", "list of integers"]),
    ("scalar", "a", dict(release_slots=1), Reason.BAD_VALUE, ["release_slots", "shape ()"]),
    ("none", "a", dict(truncate_slots=None, truncate_lens=None), Reason.BAD_VALUE, ["truncate_slots"]),
    (
        "uint64-beyond-int64",
        "a",
        dict(alloc_slots=[1], alloc_needs=np.array([2**63], dtype=np.uint64)),
        Reason.BAD_VALUE,
        ["alloc_needs", "beyond int64"],
    ),
    ("int-beyond-int64", "a", dict(alloc_slots=[1], alloc_needs=[2**64]), Reason.BAD_VALUE, ["alloc_needs", "object"]),
    (
        "alloc-length-mismatch",
        "a",
        dict(alloc_slots=[1, 2], alloc_needs=[1]),
        Reason.LENGTH_MISMATCH,
        ["alloc_slots has 2", "alloc_needs has 1"],
    ),
    ("needs-without-slots", "a", dict(alloc_needs=[1]), Reason.LENGTH_MISMATCH, ["alloc_slots has 0", "has 1"]),
    (
        "truncate-length-mismatch",
        "a",
        dict(truncate_slots=[1], truncate_lens=[0, 0]),
        Reason.LENGTH_MISMATCH,
        ["truncate_slots has 1", "truncate_lens has 2"],
    ),
    (
        "expected-length-mismatch",
        "a",
        dict(alloc_slots=[1, 2], alloc_needs=[1, 1], alloc_expected_lens=[6]),
        Reason.LENGTH_MISMATCH,
        ["alloc_expected_lens has 1", "alloc_slots has 2"],
    ),
    (
        "expected-without-allocs",
        "a",
        dict(alloc_expected_lens=[0]),
        Reason.LENGTH_MISMATCH,
        ["alloc_slots has 0", "alloc_expected_lens has 1"],
    ),
    # Valid parts before the bad one are not applied either.
    (
        "valid-release-then-bad-need",
        "a",
        dict(release_slots=[2], alloc_slots=[1], alloc_needs=[-5]),
        Reason.BAD_VALUE,
        ["-5"],
    ),
    (
        "valid-truncate-then-mismatch",
        "a",
        dict(truncate_slots=[1], truncate_lens=[0], alloc_slots=[1], alloc_needs=[16], alloc_expected_lens=[6]),
        Reason.ALLOCED_LEN_MISMATCH,
        ["= 6", "alloced_len 0"],
    ),
    (
        "valid-alloc-then-bad-slot",
        "a",
        dict(release_slots=[1], truncate_slots=[2], truncate_lens=[0], alloc_slots=[2, 3], alloc_needs=[16, 1]),
        Reason.SLOT_NOT_FOUND,
        ["alloc_slots[1]", "slot 3"],
    ),
]


@pytest.mark.parametrize(
    ("owner", "kwargs", "reason", "fragments"), [case[1:] for case in INVALID_STEPS], ids=[c[0] for c in INVALID_STEPS]
)
@pytest.mark.parametrize("atomic", [False, True])
def test_invalid_step_raises_and_changes_nothing(make_core, owner, kwargs, reason, fragments, atomic) -> None:
    core, a, b = validation_state(make_core)
    before = snapshot(core)
    lens = [core.alloced_len(a, 1), core.alloced_len(a, 2), core.alloced_len(b, 3)]
    err = raises(reason, step, core, {"a": a, "nobody": NOBODY}[owner], atomic=atomic, **kwargs)
    message = str(err)
    assert message == err.message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert_unchanged(before, core)
    assert [core.alloced_len(a, 1), core.alloced_len(a, 2), core.alloced_len(b, 3)] == lens == [6, 0, 1]


def test_error_metadata_names_the_item(make_core) -> None:
    core, a, _ = validation_state(make_core)
    err = raises(Reason.SLOT_NOT_FOUND, step, core, a, alloc_slots=[2, 4], alloc_needs=[1, 1])
    assert err.metadata == {"index": "1", "slot": "4"}
    err = raises(Reason.TRUNCATE_BEYOND_ALLOCED, step, core, a, truncate_slots=[1], truncate_lens=[9])
    assert err.metadata == {"index": "0", "slot": "1", "alloced_len": "6"}
    err = raises(Reason.ALLOCED_LEN_MISMATCH, step, core, a, alloc_slots=[1], alloc_needs=[0], alloc_expected_lens=[0])
    assert err.metadata == {"index": "0", "slot": "1", "alloced_len": "6"}
    err = raises(Reason.UNKNOWN_SESSION, core.step, NOBODY, StepBatch())
    assert err.metadata == {"owner": str(NOBODY)}
    assert repr(err) == f"KVMemError(UNKNOWN_SESSION, 'unknown owner {NOBODY}')"


def test_expected_lens_that_match_or_are_absent(make_core) -> None:
    core, a, _ = validation_state(make_core)
    res = alloc(core, a, [1, 2], [1, 1], alloc_expected_lens=[6, 0])
    assert statuses(res) == [OK, OK]
    res = alloc(core, a, [1, 2], [1, 1], alloc_expected_lens=[-1, 1])  # -1: no expectation
    assert statuses(res) == [OK, OK]
    res = alloc(core, a, [1, 2], [1, 1], alloc_expected_lens=[])  # empty: none at all
    assert statuses(res) == [OK, OK]
    assert [core.alloced_len(a, 1), core.alloced_len(a, 2)] == [9, 3]
    # A failed item with a right expectation is still a result, not an error.
    res = alloc(core, a, [1], [8], alloc_expected_lens=[9])
    assert statuses(res) == [CONTEXT_TOO_LONG]


@pytest.mark.parametrize("slot", [0, 4, 3, 5, -1, BIG])
def test_alloced_len_of_a_slot_not_open_here(make_core, slot) -> None:
    core, a, b = validation_state(make_core)
    assert core.alloced_len(a, 1) == 6 and core.alloced_len(a, 2) == 0 and core.alloced_len(b, 3) == 1
    err = raises(Reason.SLOT_NOT_FOUND, core.alloced_len, a, slot)
    assert f"slot {slot}" in str(err)
    assert str(err) == f"request slot {slot} is not open in this session"


# --------------------------------------------------------------------- audit


def _corrupt_free_stack_twice(core: KVCore) -> None:
    free = core.pool._free
    free[core.pool.num_free - 1] = free[core.pool.num_free - 2]


def _corrupt_ref_cnt(core: KVCore) -> None:
    core.pool.ref_cnt[int(core.block_table[1, 0])] = 2


def _corrupt_row_tail(core: KVCore) -> None:
    core.block_table[1, 3] = int(core.pool._free[0])


def _corrupt_slot_stack_repeat(core: KVCore) -> None:
    free = core.slots.free_slots()  # a view
    free[1] = free[0]


def _corrupt_slot_stack_open(core: KVCore) -> None:
    core.slots.free_slots()[0] = 1  # slot 1 is open


def _corrupt_slot_stack_range(core: KVCore) -> None:
    core.slots.free_slots()[0] = 0


def _corrupt_owner_count(core: KVCore) -> None:
    (owner,) = core.slots.owners.values()
    owner.num_pages_held += 1


@pytest.mark.parametrize(
    ("corrupt", "problem"),
    [
        (_corrupt_free_stack_twice, "pages twice in the free stack and quarantines"),
        (_corrupt_ref_cnt, "ref_cnt differs from block-table references"),
        (_corrupt_row_tail, "non-zero block-table entries past a request's pages in rows [1]"),
        (_corrupt_slot_stack_repeat, "free request slot stack holds open or repeated slots"),
        (_corrupt_slot_stack_open, "free request slot stack holds open or repeated slots"),
        (_corrupt_slot_stack_range, "free request slot stack holds slots outside [1, max_requests]"),
        (_corrupt_owner_count, "owner {a} holds 4 pages by its count, 3 by its rows"),
    ],
)
def test_audit_names_each_broken_invariant(corrupt, problem) -> None:
    # No audit after each step: the corruption is made by hand; the audit is what is under test.
    core = KVCore(CoreConfig(9, PS, 4, 16), audit_every_step=False)
    a = core.add_owner()
    slots = core.open(a, ["r1", "r2"])
    assert statuses(alloc(core, a, slots, [9, 2])) == [OK, OK]  # 3 + 1 pages
    step(core, a, release_slots=[2])  # slot 2 back on the free stack
    assert core.audit().ok, core.audit().problems
    corrupt(core)
    report = core.audit()
    assert not report.ok
    problem = problem.format(a=a)
    assert any(problem in p for p in report.problems), report.problems


@pytest.mark.parametrize("audit_every_step", [False, True])
def test_audit_every_step_is_the_constructors_switch(monkeypatch: pytest.MonkeyPatch, audit_every_step) -> None:
    """With ``audit_every_step`` every mutating call audits the pool and raises
    CorruptionError on a broken invariant (after applying the call); without it none
    does. The core reads no environment: ``KVMEM_DEBUG=1`` changes nothing."""
    monkeypatch.setenv("KVMEM_DEBUG", "1")
    core = KVCore(CoreConfig(9, PS, 4, 16), audit_every_step=audit_every_step)
    assert core.audit_every_step is audit_every_step
    a = core.add_owner()
    assert core.open(a, ["r1", "r2"]).tolist() == [1, 2]
    assert statuses(alloc(core, a, [1], [9])) == [OK]
    # row 1: [1, 2, 3, 0]  len 9   free stack [8, 7, 6, 5, 4]: now [8, 7, 6, 5, 5]
    _corrupt_free_stack_twice(core)
    calls = [
        lambda: core.step(a, StepBatch()),  # no items
        lambda: alloc(core, a, [2], [0]),  # the general path
        lambda: alloc(core, a, [1], [1]),  # the decode fast path (page 3's tail: no page taken)
        lambda: step(core, a, release_slots=[2]),
        lambda: core.remove_owner(a),
    ]
    for call in calls:
        if audit_every_step:
            with pytest.raises(CorruptionError, match=r"audit failed: .*pages twice in the free stack and quarantines"):
                call()
        else:
            call()
    # The calls were applied either way; only the audit differs.
    assert not core.has_owner(a) and not core.block_table.any()
    report = core.audit()
    assert not report.ok
    assert any("pages twice in the free stack and quarantines" in p for p in report.problems), report.problems


# ------------------------------------------------------- one owner per invariant

# Each invariant's state and the core modules whose code may change it (a source scan:
# an owner's rule stated in its docstring, kept by every other module).
_POOL, _REQUESTS = {"pool.py"}, {"slots.py"}
OWNED = {
    # PagePool: reference counts (and, private, the free stack and the words)
    "ref_cnt": _POOL,
    "num_quarantined": _POOL,
    # RequestTable: the block-table rows, lengths, slot owners and ids, the free slots,
    # the owners and every Owner's accounting
    "array": _REQUESTS,
    "flat": _REQUESTS,
    "block_table": _REQUESTS,
    "alloced": _REQUESTS,
    "owner_of": _REQUESTS,
    "request_id": _REQUESTS,
    "num_free": _REQUESTS,
    "owners": _REQUESTS,
    "num_pages_held": _REQUESTS,
    "num_requests": _REQUESTS,
    "request_slots": _REQUESTS,
    "prefix_query_tokens": _REQUESTS,
    "prefix_hit_tokens": _REQUESTS,
    "num_evictions": _REQUESTS | {"prefix.py"},  # an Owner's (RequestTable) and the cache's own
}
_VIEWS = {"reshape", "view", "ravel", "transpose", "swapaxes", "squeeze"}  # results share the memory
_ROW_VIEWS = {"_row_heads"}  # RequestTable's methods that return views of the rows (``array``)
_MUTATORS = {
    *("put", "fill", "itemset", "sort", "partition", "resize", "setfield", "byteswap"),  # numpy arrays
    *("update", "pop", "popitem", "clear", "setdefault", "__setitem__", "__delitem__"),  # dicts
}
_WRITE_FUNCS = {"copyto", "put", "place", "putmask", "at"}  # np.copyto(dst, ...), np.add.at(dst, ...)


def _writes(source: str) -> list[tuple[str, int]]:
    """``(what, line)`` for every write in ``source`` to an attribute of :data:`OWNED`
    (``what`` is its name) or to a private attribute of another object (``what`` is
    ``"_name via x"``): an assignment, augmented assignment or ``del`` of the attribute
    or into it (a subscript), through a name bound to it or to a view of it in the same
    function, a mutating method (called or passed on), ``out=``, and ``np.copyto`` /
    ``put`` / ``place`` / ``putmask`` / ``ufunc.at`` of it. A constructor binding its
    own attributes (``self.x = ...`` in ``__init__``) is construction, not a write."""
    found: list[tuple[str, int]] = []

    def owned(node: ast.expr, aliases: dict[str, str]) -> str | None:
        """The owned attribute whose memory ``node`` is, or None."""
        if isinstance(node, ast.Attribute):
            return node.attr if node.attr in OWNED else None
        if isinstance(node, ast.Subscript):
            return owned(node.value, aliases)
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _ROW_VIEWS:
                return "array"
            if node.func.attr in _VIEWS:
                return owned(node.func.value, aliases)
        return None

    def private(node: ast.expr) -> str | None:
        """``_name via x`` when ``node`` is, or lies in, a private attribute of an object other than ``self``."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            by_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            if isinstance(node, ast.Attribute) and node.attr[:1] == "_" and node.attr[:2] != "__" and not by_self:
                return f"{node.attr} via {ast.unparse(node.value)}"
            node = node.value
        return None

    def target(node: ast.expr, aliases: dict[str, str], constructing: bool) -> None:
        if isinstance(node, (ast.Tuple, ast.List)):
            for elt in node.elts:
                target(elt, aliases, constructing)
            return
        what = None
        if isinstance(node, ast.Attribute):
            own = isinstance(node.value, ast.Name) and node.value.id == "self"
            what = None if constructing and own else owned(node, aliases)
        elif isinstance(node, ast.Subscript):
            what = owned(node.value, aliases)
        elif isinstance(node, ast.Starred):
            return target(node.value, aliases, constructing)
        what = what or private(node)
        if what:
            found.append((what, node.lineno))

    def function(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        aliases: dict[str, str] = {}
        constructing = fn.name == "__init__"
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                for tgt in node.targets:
                    target(tgt, aliases, constructing)
                    if isinstance(tgt, ast.Tuple):  # a, b = x, y: pairwise; a, b = f(): each name
                        values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value] * len(tgt.elts)
                        pairs = list(zip(tgt.elts, values, strict=False))
                    else:
                        pairs = [(tgt, node.value)]
                    for name, value in pairs:
                        if isinstance(name, ast.Name) and (what := owned(value, aliases)):
                            aliases[name.id] = what
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                target(node.target, aliases, constructing and isinstance(node, ast.AnnAssign))
            elif isinstance(node, ast.Delete):
                for tgt in node.targets:
                    target(tgt, aliases, False)
            elif isinstance(node, ast.Attribute) and node.attr in _MUTATORS:
                if what := owned(node.value, aliases) or private(node.value):
                    found.append((what, node.lineno))
            elif isinstance(node, ast.Call):
                func = node.func
                writes_first = isinstance(func, ast.Attribute) and func.attr in _WRITE_FUNCS and node.args
                if writes_first and (what := owned(node.args[0], aliases)):  # np.copyto(dst, ...), np.add.at(dst, ...)
                    found.append((what, node.lineno))
                for kw in node.keywords:
                    if kw.arg == "out" and (what := owned(kw.value, aliases)):
                        found.append((what, node.lineno))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function(node)
    return sorted(set(found), key=lambda w: w[1])


def _core_sources() -> dict[str, str]:
    import kvmem.server.core

    folder = pathlib.Path(kvmem.server.core.__file__).parent
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.py"))}


def test_each_invariant_is_changed_by_its_owner_alone() -> None:
    """PagePool alone changes the reference counts; RequestTable (``slots.py``) alone
    the block-table rows, ``alloced``, the slot owners and ids, and the owners'
    accounting (``num_pages_held`` and the rest); nobody changes another object's
    private state. The step, alloc and prefix modules and ``KVCore`` plan and call."""
    outside = [
        f"{module}:{line}: writes {what}"
        for module, source in _core_sources().items()
        for what, line in _writes(source)
        if module not in OWNED.get(what, set())
    ]
    assert not outside, outside


def test_the_owners_writes_are_found() -> None:
    """The scan sees the owners' own writes (so it is not blind): the pool's counts
    through an alias and ``np.add.at``, the rows through aliases and subscripts, the
    lengths and the pages-held counts."""
    sources = _core_sources()
    in_pool = {what for what, _ in _writes(sources["pool.py"])}
    in_requests = {what for what, _ in _writes(sources["slots.py"])}
    assert {"ref_cnt", "num_quarantined"} <= in_pool, in_pool
    assert {"array", "flat", "alloced", "owner_of", "request_id", "num_free", "owners"} <= in_requests, in_requests
    assert {"num_pages_held", "num_requests", "request_slots", "prefix_query_tokens", "num_evictions"} <= in_requests


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("core.slots.alloced[slots] = 0", "alloced"),
        ("state.num_pages_held += 1", "num_pages_held"),
        ("state.num_pages_held = 0", "num_pages_held"),
        ("row = core.block_table[3, :2]\n    row[0] = 7", "block_table"),
        ("flat, width = table.flat, table.width\n    flat[0] = 7", "flat"),
        ("heads = table.array.reshape(-1)\n    heads[1] = 0", "array"),
        ("heads, zero = self._row_heads(4)\n    heads[slots] = zero", "array"),
        ("table.flat.put([1], 2)", "flat"),
        ("np.add.at(core.pool.ref_cnt, [1], 1)", "ref_cnt"),
        ("np.cumsum(x, out=core.slots.alloced[1:])", "alloced"),
        ("del core.slots.owners[1]", "owners"),
        ("deque(map(state.request_slots.pop, ids))", "request_slots"),
        ("core.pool._free[0] = 3", "_free via core.pool"),
        ("pool._words.word[pages] = 1", "_words via pool"),
    ],
)
def test_the_owner_scan_finds_each_kind_of_write(line: str, what: str) -> None:
    assert [w for w, _ in _writes(f"def f():\n    {line}\n")] == [what]


def test_the_owner_scan_lets_reads_copies_and_construction_be() -> None:
    source = """
class C:
    def __init__(self, table):
        self.alloced = np.zeros(4)
        self.flat = table.reshape(-1)

    def f(self, core, slots):
        cur = core.slots.alloced[slots] + 1
        page = core.table.flat.take(slots)
        page[0] = 3
        lengths = core.slots.alloced.copy()
        lengths[slots] = 0
        self._words.word[slots] = 0
        n = core.slots.owners.get(1)
"""
    assert _writes(source) == []
