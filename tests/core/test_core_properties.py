"""Property tests of the allocation core: random steps against a deliberately simple model.

The model keeps, per open request, a plain Python list of its page ids and its length,
a set of free page ids and the owners' quotas; it admits alloc items one by one in
Python and computes every token slot one token at a time (``page * page_size +
offset``). The page ids a step hands out are taken from the step's result, after
checking that they are exactly as many as the model expects and were free.

The model names owners ``o0, o1, o2``; the core knows each as the small integer its
``add_owner()`` returned (``self.ids``; a removed and re-added owner gets a new one).
As the sessions layer does, every step of an owner passes the owner's quota.

The decode fast path (``Allocator.decode``: allocs only, one token each) is checked
against this model too: the ``decode`` rule (one or two tokens per request, every
request of an owner) and allocs-only draws of ``step`` drive it, and ``invalid_decode``
hands it one-token steps with exactly one thing wrong.

After every rule the core must agree with the model: per-request lengths, block-table
rows, reference counts, free counts, per-owner usage, an ``audit()`` that is ok, and
``free + used == num_pages - 1``. Invalid steps (bad slots, duplicates, bad values,
mismatched lengths, ...) must raise ``KVMemError`` with the expected reason and change
nothing at all.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvmem.server.core import AllocStatus, CoreConfig, KVCore, PagePool, StepBatch, StepResult
from kvmem.server.errors import CorruptionError, KVMemError, Reason
from core_state import snapshot

OWNERS = ("o0", "o1", "o2")
REQUEST_IDS = tuple(f"r{i}" for i in range(6))
# The role of each of an owner's open slots in a random step (repeats weigh the draw).
ROLES = ("alloc", "alloc", "alloc", "truncate+alloc", "truncate", "release", "none")
# Strategies built once (building them per draw costs more than the core's work).
ROLE = st.sampled_from(ROLES)
BOOL = st.booleans()
QUOTA = st.one_of(st.none(), st.integers(0, 6))
EXPECT_MODE = st.sampled_from(("none", "empty", "given"))
RIDS = st.lists(st.sampled_from(REQUEST_IDS), min_size=1, max_size=4)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def assert_same_snapshot(before: dict, after: dict) -> None:
    for key, value in before.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(after[key], value, err_msg=key)
        else:
            assert after[key] == value, key


def step(core: KVCore, owner: int, quota_pages: int | None, **columns) -> StepResult:
    """A step with ``columns`` (and ``atomic``) as :meth:`StepBatch.of` takes them: a bad
    column raises BAD_VALUE from here, as the core's step did from its arguments."""
    return core.step(owner, StepBatch.of(**columns), quota_pages)


class Request:
    __slots__ = ("owner", "rid", "pages", "alloced")

    def __init__(self, owner: str, rid: str) -> None:
        self.owner = owner
        self.rid = rid
        self.pages: list[int] = []
        self.alloced = 0


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core: KVCore | None = None

    # ------------------------------------------------------------------ setup

    @initialize(
        page_size=st.integers(1, 4),
        num_pages=st.integers(2, 11),
        max_requests=st.integers(1, 5),
        max_context_len=st.integers(1, 14),
        quotas=st.lists(QUOTA, min_size=1, max_size=len(OWNERS)),
        data=st.data(),
    )
    def setup(self, page_size, num_pages, max_requests, max_context_len, quotas, data) -> None:
        self.cfg = CoreConfig(num_pages, page_size, max_requests, max_context_len)
        self.ps = page_size
        self.core = KVCore(self.cfg, audit_every_step=True)  # it audits itself after every mutating call too
        self.quota: dict[str, int | None] = {}
        self.ids: dict[str, int] = {}  # model owner name -> the core's owner index
        self.gone: list[int] = []  # indices of removed owners
        for name, quota in zip(OWNERS, quotas):
            self.ids[name] = self.core.add_owner()
            self.quota[name] = quota
        self.owner_st = st.sampled_from(sorted(self.quota))
        self.need_st = st.one_of(st.integers(0, 2), st.integers(0, max_context_len + 2))
        self.reqs: dict[int, Request] = {}  # open slot -> request
        self.free_pages: set[int] = set(range(1, num_pages))
        self.quarantined: dict[int, set[int]] = {}  # removed owner's index -> its held pages
        self.next_rid = 0
        # Start with some requests open (swarm testing may switch open_requests off).
        for i in range(data.draw(st.integers(0, max_requests), label="num_initial")):
            owner = data.draw(self.owner_st, label="initial_owner")
            (slot,) = self.core.open(self.ids[owner], [f"init{i}"]).tolist()
            assert slot not in self.reqs
            self.reqs[slot] = Request(owner, f"init{i}")

    # ---------------------------------------------------------------- helpers

    def slots_of(self, owner: str) -> list[int]:
        return sorted(s for s, r in self.reqs.items() if r.owner == owner)

    def held(self, owner: str) -> int:
        return sum(len(r.pages) for r in self.reqs.values() if r.owner == owner)

    def draw_owner(self, data) -> str:
        """Mostly an owner with open requests (when there is one), sometimes any owner."""
        busy = sorted({r.owner for r in self.reqs.values()})
        if busy and data.draw(st.integers(0, 3), label="prefer_busy"):
            return busy[data.draw(st.integers(0, len(busy) - 1), label="busy_owner")]
        return data.draw(self.owner_st, label="owner")

    def draw_valid_step(self, data, owner: str) -> dict:
        """A valid step for ``owner``: each of its slots gets a role (release, truncate,
        alloc, truncate and alloc, or nothing); allocs come in a random order."""
        rel, tr, tr_len, al, need, expected = [], [], [], [], [], None
        for s in self.slots_of(owner):
            role = data.draw(ROLE, label="role")
            if role == "release":
                rel.append(s)
            if "truncate" in role:
                tr.append(s)
                tr_len.append(data.draw(st.integers(0, self.reqs[s].alloced), label="truncate_len"))
            if "alloc" in role:
                al.append(s)
        if al:
            al = data.draw(st.permutations(al), label="alloc_order")
            need = [data.draw(self.need_st, label="need") for _ in al]
            mode = data.draw(EXPECT_MODE, label="expected")
            if mode == "empty":
                expected = []
            elif mode == "given":
                after_tr = dict(zip(tr, tr_len))
                expected = [
                    after_tr.get(s, self.reqs[s].alloced) if data.draw(BOOL, label="expect") else -1
                    for s in al
                ]
        return dict(
            release_slots=rel,
            truncate_slots=tr,
            truncate_lens=tr_len,
            alloc_slots=al,
            alloc_needs=need,
            alloc_expected_lens=expected,
        )

    # ------------------------------------------------------------------ rules

    @rule(data=st.data())
    def open_requests(self, data) -> None:
        owner = data.draw(self.owner_st, label="owner")
        rids = data.draw(RIDS, label="rids")
        self.check_open(owner, rids)

    def check_open(self, owner: str, rids: list[str]) -> None:
        """Open on the core and on the model: existing ids keep their slot, new ones get
        distinct closed slots, or NO_FREE_REQUEST_SLOT opens nothing."""
        core = self.core
        existing = {r.rid: s for s, r in self.reqs.items() if r.owner == owner}
        new = list(dict.fromkeys(r for r in rids if r not in existing))
        num_free_slots = self.cfg.max_requests - len(self.reqs)
        too_long = len(rids) > self.cfg.max_requests  # the per-Open limit, even with repeated ids
        if too_long or len(new) > num_free_slots:
            before = snapshot(core)
            try:
                core.open(self.ids[owner], rids)
            except KVMemError as err:
                assert err.reason is (Reason.BAD_VALUE if too_long else Reason.NO_FREE_REQUEST_SLOT), str(err)
            else:
                raise AssertionError("open beyond the free request slots succeeded")
            assert_same_snapshot(before, snapshot(core))
            return
        slots = core.open(self.ids[owner], rids)
        assert slots.dtype == np.int32 and slots.shape == (len(rids),)
        got = dict(zip(rids, slots.tolist()))
        for rid, slot in got.items():
            if rid in existing:
                assert slot == existing[rid]
            else:
                assert 1 <= slot <= self.cfg.max_requests and slot not in self.reqs
        new_slots = [got[r] for r in new]
        assert len(set(new_slots)) == len(new_slots)
        for rid in new:
            self.reqs[got[rid]] = Request(owner, rid)

    @rule(data=st.data())
    def step(self, data) -> None:
        """A scheduler step: maybe admit new requests (as a scheduler opens them just
        before their prefill), then a random valid step."""
        owner = self.draw_owner(data)
        num_free_slots = self.cfg.max_requests - len(self.reqs)
        if num_free_slots:
            least = 0 if self.slots_of(owner) else 1
            for _ in range(data.draw(st.integers(least, min(2, num_free_slots)), label="num_new")):
                self.next_rid += 1
                self.check_open(owner, [f"new{self.next_rid}"])
        kw = self.draw_valid_step(data, owner)
        atomic = data.draw(BOOL, label="atomic")
        self.check_step(owner, kw, atomic)

    def check_step(self, owner: str, kw: dict, atomic: bool) -> None:
        """Run a valid step on the core and on the model; compare every result."""
        core, ps, cfg = self.core, self.ps, self.cfg
        kw = {
            "release_slots": [], "truncate_slots": [], "truncate_lens": [], "alloc_slots": [], "alloc_needs": [],
            "alloc_expected_lens": None, **kw,
        }
        res = step(core, self.ids[owner], self.quota[owner], atomic=atomic, **kw)

        # The model: releases, then truncates, then allocs admitted one by one.
        dropped = 0
        for s in kw["release_slots"]:
            req = self.reqs.pop(s)
            dropped += len(req.pages)
            self.free_pages.update(req.pages)
        for s, new_len in zip(kw["truncate_slots"], kw["truncate_lens"]):
            req = self.reqs[s]
            keep = ceil_div(new_len, ps)
            dropped += len(req.pages) - keep
            self.free_pages.update(req.pages[keep:])
            del req.pages[keep:]
            req.alloced = new_len
        assert res.num_pages_released == dropped

        quota = self.quota[owner]
        quota_left = None if quota is None else quota - self.held(owner)
        pool_left = len(self.free_pages)
        want: list[AllocStatus] = []
        for s, n in zip(kw["alloc_slots"], kw["alloc_needs"]):
            cur = self.reqs[s].alloced
            c = ceil_div(cur + n, ps) - ceil_div(cur, ps)
            if cur + n > cfg.max_context_len:
                want.append(AllocStatus.CONTEXT_TOO_LONG)
            elif quota_left is not None and c > quota_left:
                want.append(AllocStatus.QUOTA_EXCEEDED)
            elif c > pool_left:
                want.append(AllocStatus.OUT_OF_PAGES)
            else:
                want.append(AllocStatus.OK)
                pool_left -= c
                if quota_left is not None:
                    quota_left -= c
        if atomic and any(w != AllocStatus.OK for w in want):
            want = [AllocStatus.ABORTED if w == AllocStatus.OK else w for w in want]

        n_items = len(kw["alloc_slots"])
        assert res.alloc_status.dtype == np.int8 and res.kv_loc.dtype == np.int32
        assert res.new_pages.dtype == np.int32
        assert res.kv_loc_offsets.shape == (n_items + 1,) and res.new_page_offsets.shape == (n_items + 1,)
        assert res.kv_loc_offsets[-1] == res.kv_loc.size and res.new_page_offsets[-1] == res.new_pages.size
        assert [AllocStatus(int(x)) for x in res.alloc_status] == want
        assert res.num_refused == sum(w is not AllocStatus.OK for w in want)
        for w in set(want):
            event(f"alloc status {w.name}")

        bt = core.block_table
        for i, (s, n) in enumerate(zip(kw["alloc_slots"], kw["alloc_needs"])):
            kv = res.kv_loc[res.kv_loc_offsets[i] : res.kv_loc_offsets[i + 1]].tolist()
            pages = res.new_pages[res.new_page_offsets[i] : res.new_page_offsets[i + 1]].tolist()
            if want[i] != AllocStatus.OK:
                assert kv == [] and pages == []
                continue
            req = self.reqs[s]
            cur, end = req.alloced, req.alloced + n
            assert len(pages) == ceil_div(end, ps) - ceil_div(cur, ps)
            assert len(set(pages)) == len(pages) and set(pages) <= self.free_pages, (pages, self.free_pages)
            self.free_pages.difference_update(pages)
            req.pages.extend(pages)
            req.alloced = end
            model_kv = [req.pages[pos // ps] * ps + pos % ps for pos in range(cur, end)]
            assert kv == model_kv
            assert kv == [int(bt[s, pos // ps]) * ps + pos % ps for pos in range(cur, end)]
        assert len(set(res.kv_loc.tolist())) == res.kv_loc.size

    @rule(data=st.data())
    def decode(self, data) -> None:
        """Every request of one owner asks for the same few tokens (decode, or a
        speculative reserve): the batched one-token path and its page boundaries."""
        owner = self.draw_owner(data)
        mine = data.draw(st.permutations(self.slots_of(owner)), label="decode_order")
        k = data.draw(st.integers(1, 2), label="tokens")
        atomic = data.draw(BOOL, label="atomic")
        kw = dict(alloc_slots=mine, alloc_needs=[k] * len(mine))
        mode = data.draw(EXPECT_MODE, label="expected")
        if mode == "given":  # the right lengths, some left out (-1)
            kw["alloc_expected_lens"] = [
                self.reqs[s].alloced if data.draw(BOOL, label="expect") else -1 for s in mine
            ]
        elif mode == "empty":
            kw["alloc_expected_lens"] = []
        self.check_step(owner, kw, atomic)

    @rule(data=st.data())
    def invalid_decode(self, data) -> None:
        """A one-token-each step with exactly one thing wrong: the decode fast path must
        hand it to the full validation, which raises, and nothing changes."""
        owner = self.draw_owner(data)
        al = data.draw(st.permutations(self.slots_of(owner)), label="decode_order")
        expected = [self.reqs[s].alloced for s in al]
        theirs = [s for s, r in self.reqs.items() if r.owner != owner]
        closed = [s for s in range(1, self.cfg.max_requests + 1) if s not in self.reqs]
        kinds = ["bad_slot"] + (["duplicate", "expected_mismatch", "expected_bad"] if al else [])
        kind = data.draw(st.sampled_from(kinds), label="decode_corruption")
        event(f"invalid decode: {kind}")
        i = data.draw(st.integers(0, len(al)), label="at")
        if kind == "bad_slot":
            # -2 and -(max_requests + 1) wrap around to open slots in a plain numpy index
            wrap = [-2, -(self.cfg.max_requests + 1)]
            bad = theirs + closed + [0, self.cfg.max_requests + 1, -1, 2**40] + wrap
            al.insert(i, data.draw(st.sampled_from(bad), label="bad_slot"))
            expected.insert(i, -1)
            reason = Reason.SLOT_NOT_FOUND
        elif kind == "duplicate":
            j = data.draw(st.integers(0, len(al) - 1), label="dup_of")
            al.insert(i, al[j])
            expected.insert(i, -1)
            reason = Reason.DUPLICATE_SLOT
        else:
            i = min(i, len(al) - 1)
            expected[i] = expected[i] + 1 if kind == "expected_mismatch" else -2
            reason = Reason.ALLOCED_LEN_MISMATCH if kind == "expected_mismatch" else Reason.BAD_VALUE
        with_expected = kind.startswith("expected") or data.draw(BOOL, label="with_expected")
        if len(al) > self.cfg.max_requests:
            reason = Reason.BAD_VALUE  # a column over max_requests is refused by its length, first
        before = snapshot(self.core)
        try:
            step(
                self.core, self.ids[owner], self.quota[owner], alloc_slots=al, alloc_needs=[1] * len(al),
                alloc_expected_lens=expected if with_expected else None,
            )  # fmt: skip
        except KVMemError as err:
            assert err.reason is reason, (kind, err.reason, str(err), al, expected)
        else:
            raise AssertionError(f"invalid decode step ({kind}) was accepted: {al} {expected}")
        assert_same_snapshot(before, snapshot(self.core))

    @rule(data=st.data())
    def invalid_step(self, data) -> None:
        core = self.core
        owner = self.draw_owner(data)
        kw = self.draw_valid_step(data, owner)
        rel, tr, tr_len = kw["release_slots"], kw["truncate_slots"], kw["truncate_lens"]
        al, need = kw["alloc_slots"], kw["alloc_needs"]
        expected = kw["alloc_expected_lens"]
        max_req = self.cfg.max_requests
        theirs = [s for s, r in self.reqs.items() if r.owner != owner]
        closed = [s for s in range(1, max_req + 1) if s not in self.reqs]
        bad_slots = theirs + closed + [0, max_req + 1, max_req + 2, -1, -2, -(max_req + 1), 2**40, -(2**40)]
        after_tr = dict(zip(tr, tr_len))

        kinds = ["unknown_owner", "bad_slot", "length_need", "length_tr", "length_expected"]
        if rel or tr or al:
            kinds += ["duplicate", "float", "two_d"]
        if rel:
            kinds.append("released_reuse")
        if al:
            kinds += ["negative_need", "huge_need", "expected_mismatch", "expected_bad"]
        if tr:
            kinds += ["negative_len", "truncate_beyond"]
        kind = data.draw(st.sampled_from(kinds), label="corruption")
        event(f"invalid step: {kind}")
        k = data.draw(st.integers(1, 3), label="k")

        def insert(lst: list, value) -> int:
            i = data.draw(st.integers(0, len(lst)), label="at")
            lst.insert(i, value)
            return i

        def add_alloc_item(slot: int) -> None:
            i = insert(al, slot)
            need.insert(i, 0)
            if expected:
                expected.insert(i, -1)

        owner_id, quota = self.ids[owner], self.quota[owner]
        if kind == "unknown_owner":
            # never handed out (0, the next index, far beyond) or removed
            ghosts = [0, -1, max(self.ids.values()) + 1, 2**40, *self.gone]
            owner_id, reason = data.draw(st.sampled_from(ghosts), label="ghost"), Reason.UNKNOWN_SESSION
        elif kind == "bad_slot":
            slot = data.draw(st.sampled_from(bad_slots), label="bad_slot")
            where = data.draw(st.sampled_from(["release", "truncate", "alloc"]), label="where")
            if where == "release":
                insert(rel, slot)
            elif where == "truncate":
                tr_len.insert(insert(tr, slot), 0)
            else:
                add_alloc_item(slot)
            reason = Reason.SLOT_NOT_FOUND
        elif kind == "duplicate":
            nonempty = [w for w, lst in (("release", rel), ("truncate", tr), ("alloc", al)) if lst]
            where = data.draw(st.sampled_from(nonempty), label="where")
            if where == "release":
                insert(rel, data.draw(st.sampled_from(rel)))
            elif where == "truncate":
                j = data.draw(st.integers(0, len(tr) - 1))
                tr_len.insert(insert(tr, tr[j]), tr_len[j])
            else:
                j = data.draw(st.integers(0, len(al) - 1))
                i = insert(al, al[j])
                need.insert(i, 0)
                if expected:
                    expected.insert(i, -1)
            reason = Reason.DUPLICATE_SLOT
        elif kind == "released_reuse":
            slot = data.draw(st.sampled_from(rel))
            if data.draw(st.booleans(), label="in_truncate"):
                tr_len.insert(insert(tr, slot), 0)
            else:
                add_alloc_item(slot)
            reason = Reason.SLOT_NOT_FOUND
        elif kind == "negative_need":
            need[data.draw(st.integers(0, len(need) - 1))] = -k
            reason = Reason.BAD_VALUE
        elif kind == "huge_need":
            need[data.draw(st.integers(0, len(need) - 1))] = 2**31 - 1 + k
            reason = Reason.BAD_VALUE
        elif kind == "negative_len":
            tr_len[data.draw(st.integers(0, len(tr) - 1))] = -k
            reason = Reason.BAD_VALUE
        elif kind == "truncate_beyond":
            i = data.draw(st.integers(0, len(tr) - 1))
            tr_len[i] = self.reqs[tr[i]].alloced + k
            reason = Reason.TRUNCATE_BEYOND_ALLOCED
        elif kind in ("expected_mismatch", "expected_bad"):
            if not expected:
                expected = [-1] * len(al)
            i = data.draw(st.integers(0, len(al) - 1))
            if kind == "expected_bad":
                expected[i] = -1 - k
                reason = Reason.BAD_VALUE
            else:
                right = after_tr.get(al[i], self.reqs[al[i]].alloced)
                expected[i] = right + k if right < k or data.draw(st.booleans()) else right - k
                reason = Reason.ALLOCED_LEN_MISMATCH
        elif kind in ("float", "two_d"):
            lists = {"release_slots": rel, "truncate_slots": tr, "truncate_lens": tr_len,
                     "alloc_slots": al, "alloc_needs": need}
            if expected:
                lists["alloc_expected_lens"] = expected
            name = data.draw(st.sampled_from(sorted(n for n, lst in lists.items() if lst)), label="which")
            arr = np.asarray(lists[name])
            bad = arr.astype(np.float64) if kind == "float" else arr.reshape(1, -1)
            if kind == "two_d" and data.draw(st.booleans(), label="as_list"):
                bad = bad.tolist()
            kw[name] = bad
            reason = Reason.BAD_VALUE
        elif kind == "length_need":
            if need and data.draw(st.booleans()):
                need.pop()
            else:
                need.append(1)
            reason = Reason.LENGTH_MISMATCH
        elif kind == "length_tr":
            if tr_len and data.draw(st.booleans()):
                tr_len.pop()
            else:
                tr_len.append(0)
            reason = Reason.LENGTH_MISMATCH
        else:  # length_expected: non-empty (an empty list means "no expectations") and wrong
            size = data.draw(st.integers(1, len(al) + 2).filter(lambda n: n != len(al)))
            expected = [-1] * size
            reason = Reason.LENGTH_MISMATCH
        if kind not in ("float", "two_d"):
            kw["alloc_expected_lens"] = expected
        if kind != "unknown_owner" and max(map(len, (rel, tr, tr_len, al, need, expected or ()))) > max_req:
            reason = Reason.BAD_VALUE  # a column over max_requests is refused by its length, first

        before = snapshot(core)
        atomic = data.draw(BOOL, label="atomic")
        try:
            step(core, owner_id, quota, atomic=atomic, **kw)
        except KVMemError as err:
            assert err.reason is reason, (kind, err.reason, str(err), kw)
            assert err.kind is reason.kind
        else:
            raise AssertionError(f"invalid step ({kind}) was accepted: {kw}")
        assert_same_snapshot(before, snapshot(core))

    @rule(data=st.data())
    def remove_and_readd_owner(self, data) -> None:
        core = self.core
        owner = data.draw(self.owner_st, label="owner")
        mine = self.slots_of(owner)
        old = self.ids[owner]
        quarantine = data.draw(st.booleans(), label="quarantine")
        assert core.remove_owner(old, quarantine=quarantine) == len(mine)
        pages = {p for s in mine for p in self.reqs.pop(s).pages}
        if quarantine and pages:
            self.quarantined[old] = pages  # out of use until released
        else:
            self.free_pages.update(pages)
        assert core.quarantined_pages(old) == (len(pages) if quarantine else 0)
        assert not core.has_owner(old)
        self.gone.append(old)
        quota = data.draw(QUOTA, label="quota")
        new = core.add_owner()
        assert new not in self.gone and new not in self.ids.values(), (new, self.gone, self.ids)
        self.ids[owner] = new
        self.quota[owner] = quota

    @rule(data=st.data())
    def release_quarantine(self, data) -> None:
        """A quarantined owner's pages come back; any other index frees nothing."""
        held = sorted(self.quarantined)
        if held and data.draw(st.booleans(), label="a_held_one"):
            index = data.draw(st.sampled_from(held), label="held_index")
        else:
            index = data.draw(st.sampled_from([0, -1, 10**6, *self.ids.values(), *self.gone]), label="index")
        pages = self.quarantined.pop(index, set())
        assert self.core.release_quarantine(index) == len(pages)
        self.free_pages.update(pages)

    @rule(data=st.data())
    def look_up_alloced_len(self, data) -> None:
        owner = data.draw(self.owner_st, label="owner")
        slot = data.draw(st.integers(-1, self.cfg.max_requests + 2), label="slot")
        req = self.reqs.get(slot)
        if req is not None and req.owner == owner:
            assert self.core.alloced_len(self.ids[owner], slot) == req.alloced
        else:
            try:
                self.core.alloced_len(self.ids[owner], slot)
            except KVMemError as err:
                assert err.reason is Reason.SLOT_NOT_FOUND
            else:
                raise AssertionError("alloced_len of a slot not open in this session")

    # -------------------------------------------------------------- invariant

    @invariant()
    def agrees_with_the_model(self) -> None:
        core = self.core
        if core is None:
            return
        ps, cfg = self.ps, self.cfg
        bt = core.block_table
        ref = core.pool.ref_cnt
        width = cfg.max_pages_per_request
        all_tokens: list[int] = []
        used: set[int] = set()
        assert not bt[0].any()
        for slot in range(1, cfg.max_requests + 1):
            req = self.reqs.get(slot)
            if req is None:
                assert not bt[slot].any(), (slot, bt[slot])
                continue
            assert core.alloced_len(self.ids[req.owner], slot) == req.alloced
            assert len(req.pages) == ceil_div(req.alloced, ps)
            assert bt[slot].tolist() == req.pages + [0] * (width - len(req.pages))
            tokens = [req.pages[pos // ps] * ps + pos % ps for pos in range(req.alloced)]
            assert tokens == [int(bt[slot, pos // ps]) * ps + pos % ps for pos in range(req.alloced)]
            all_tokens += tokens
            used.update(req.pages)
        assert len(set(all_tokens)) == len(all_tokens), "a token slot is held twice"
        assert 0 not in used
        held = set().union(*self.quarantined.values())
        assert used.isdisjoint(self.free_pages) and used.isdisjoint(held) and held.isdisjoint(self.free_pages)
        assert used | self.free_pages | held == set(range(1, cfg.num_pages))
        assert ref.tolist() == [1 if p in used else 0 for p in range(cfg.num_pages)]
        report = core.audit()
        assert report.ok, report.problems
        stats = core.stats()
        assert stats.num_free_pages == len(self.free_pages) == core.pool.num_free
        assert stats.num_quarantined_pages == report.num_quarantined_pages == len(held)
        assert set(core.pool.free_pages().tolist()) == self.free_pages
        assert stats.num_free_pages + stats.num_used_pages + stats.num_quarantined_pages == cfg.num_pages - 1
        assert (
            report.num_free_pages + report.num_cached_pages + report.num_used_pages + report.num_quarantined_pages
            == cfg.num_pages - 1
        )
        assert stats.num_open_requests == len(self.reqs)
        assert stats.num_free_request_slots == cfg.max_requests - len(self.reqs)
        usage = {o.owner: (o.num_requests, o.num_pages_held) for o in stats.owners}
        assert usage == {self.ids[name]: (len(self.slots_of(name)), self.held(name)) for name in self.quota}
        for name, quota in self.quota.items():
            if quota is not None:
                assert self.held(name) <= quota


# Sized for ~20 s on two slow cores. A failure shrinks one bug only (shrinking these
# data()-driven steps takes minutes; two bugs would take twice as long).
CoreMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoreMachine = CoreMachine.TestCase


# ------------------------------------------------------- PagePool.unref against a model

POOL_PAGES = 12


@settings(max_examples=300, deadline=None)
@given(
    counts=st.lists(st.integers(0, 3), min_size=POOL_PAGES - 1, max_size=POOL_PAGES - 1),
    drop=st.lists(st.integers(-1, POOL_PAGES), max_size=20),
)
def test_pool_unref_matches_a_counter_model(counts: list[int], drop: list[int]) -> None:
    """Any reference counts, any list of page ids (repeats, free pages, page 0 and ids
    out of range included): either every count drops by the times its page is listed
    and exactly the pages reaching 0 are pushed once each, or CorruptionError and
    nothing changes (counts, stamps aside, free stack)."""
    pool = PagePool(POOL_PAGES)
    held = pool.take(POOL_PAGES - 1)  # pages 1..11, then give back the ones at count 0
    pool.ref_cnt[held] = counts
    pool._push(held[np.asarray(counts) == 0])

    def state() -> tuple:
        return pool.ref_cnt.tolist(), pool.num_free, sorted(pool.free_pages().tolist())

    before = state()
    model = [0, *counts]
    times = {p: drop.count(p) for p in drop}
    valid = all(1 <= p < POOL_PAGES and model[p] >= t for p, t in times.items())
    if not valid:
        try:
            pool.unref(np.array(drop, dtype=np.int32))
        except CorruptionError:
            assert state() == before
            return
        raise AssertionError(f"unref({drop}) with counts {counts} did not raise")
    freed = pool.unref(np.array(drop, dtype=np.int32))
    for p, t in times.items():
        model[p] -= t
    newly = sorted(p for p, t in times.items() if model[p] == 0)
    assert freed == len(newly)
    ref, num_free, free = state()
    assert ref == model
    assert num_free == before[1] + len(newly)
    assert free == sorted(before[2] + newly)
