"""The drop-in for the reference allocator's users (``kvmem.client.compat.KVAllocator``),
against real ``kvmem serve`` processes on unix sockets (no mocks).

The trace tests replay the per-step scheduler flow of ``shared/reference/README.md``
(new requests, prefill allocs, decode allocs with speculative reserves and their trims,
preemption when pages run out, finishes with ``free_extra_pages_not_cached`` into the
scheduler's own prefix cache or ``free_req_cache``, evictions from that cache with
``append_to_later_free``, one ``free_group_end`` per step), seeded, through the drop-in
and through the reference allocator in-process, in lockstep, and compare every alloc's
outcome and ``kv_loc``, every live block-table row and the free count after each step.

Page ids: a fresh server hands out pages 1, 2, 3, ... as the reference's free list does,
and the test checks the ids are *equal* until the first page is freed. After that the
orders differ by design: kvmem pushes freed pages on a stack (the next alloc gets the
latest freed), the reference appends them at the end of its list (the next alloc gets
the oldest). So ids are compared up to a renaming built as the trace goes: the pages
held at each step (live rows and the scheduler's cache) must pair one to one between the
two allocators, every row must map onto the reference's row, every ``kv_loc`` onto the
reference's ``kv_loc``, and a request's kept pages never change between steps.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import pathlib
import random
import sys
from typing import Any

import pytest
import torch
from conftest import ServerProcess, start_server

from kvmem.client import AllocStatus, KVMemClient
from kvmem.client.compat import KVAllocator

ROOT = pathlib.Path(__file__).resolve().parents[2]
PS = 4
NUM_PAGES = 97  # pages 1..96 usable (384 tokens)
MAX_CTX = 96  # 24 pages per request
MAX_BATCH = 12  # request indices 0..11
TRACE_ARGS = ("--num-pages", str(NUM_PAGES), "--page-size", str(PS), "--max-requests", "128", "--max-context", "96")
SMALL_ARGS = ("--num-pages", "17", "--page-size", "4", "--max-requests", "32", "--max-context", "32")  # pages 1..16


def _load_reference() -> Any:
    """bench/_reference.py's loader (patches ``pin_memory`` out on a CPU); None-safe."""
    spec = importlib.util.spec_from_file_location("_kvmem_test_reference_loader", ROOT / "bench" / "_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.load_reference(ROOT.parent / "shared" / "reference" / "seed_kv_allocator.py")


REFERENCE = _load_reference()
needs_reference = pytest.mark.skipif(
    not REFERENCE.available,
    reason=f"comparison with the reference allocator skipped: {REFERENCE.note} (it lives in ../shared/reference/)",
)


def pages_for(num_tokens: int) -> int:
    return -(-num_tokens // PS)


@pytest.fixture
def trace_server(tmpdir_short: str) -> Any:
    srv = start_server(tmpdir_short, *TRACE_ARGS)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def small(tmpdir_short: str) -> Any:
    srv = start_server(tmpdir_short, *SMALL_ARGS)
    yield srv
    assert srv.stop() == 0, srv.log()


# --------------------------------------------------------------------- the trace


@dataclasses.dataclass
class Req:
    rid: int
    prompt: int
    output: int
    spec: int  # 0: one token per decode; k: a speculative reserve of k tokens
    index: int = -1
    alloced: int = 0  # the scheduler's alloced_len
    real: int = 0  # tokens with K/V
    rows: dict[str, list[int]] = dataclasses.field(default_factory=dict)


class Side:
    """One allocator under the trace, with the scheduler's own prefix cache: per
    finished request, the page ids of the full pages it still holds."""

    def __init__(self, name: str, allocator: Any, row: Any) -> None:
        self.name, self.a, self.row = name, allocator, row
        self.tree: list[list[int]] = []


class Renaming:
    """kvmem page id -> reference page id, for the pages held now."""

    def __init__(self) -> None:
        self.kv2ref: dict[int, int] = {}

    def update(self, pairs: list[tuple[int, int]], identity: bool, where: str) -> None:
        new: dict[int, int] = {}
        back: dict[int, int] = {}
        for kv, ref in pairs:
            assert new.setdefault(kv, ref) == ref, f"{where}: kvmem page {kv} stands for two reference pages"
            assert back.setdefault(ref, kv) == kv, f"{where}: reference page {ref} stands for two kvmem pages"
            assert not identity or kv == ref, f"{where}: before any free, page ids must be equal ({kv} vs {ref})"
        self.kv2ref = new

    def slots(self, kv_loc: list[int]) -> list[int]:
        return [self.kv2ref[t // PS] * PS + t % PS for t in kv_loc]


class Trace:
    """The scheduler: seeded arrivals, admission, prefill, decode, speculative trims,
    preemption, finishes and its own prefix cache, driving every side in lockstep.
    ``mode``: "block" (a block around the allocs; frees by free_group_end), "folded"
    (one block per iteration: last iteration's frees, then the allocs), "single" (no
    block: one Step per call)."""

    def __init__(self, mode: str, seed: int, dropin: KVAllocator, reference: Any | None) -> None:
        self.mode, self.rng = mode, random.Random(seed)
        self.d = Side("kvmem", dropin, lambda i, n: dropin.req_to_page[i][:n].tolist())
        self.sides = [self.d]
        if reference is not None:
            self.sides.append(Side("reference", reference, lambda i, n: reference.req_to_page_cpu[i, :n].tolist()))
        self.decider = self.sides[-1]  # decisions read the reference's counts when it is there
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: dict[int, Req] = {}
        self.post: list[tuple[Any, ...]] = []
        self.next_rid, self.freed_any, self.t = 0, False, 0
        self.renaming = Renaming()
        self.seen: collections.Counter[str] = collections.Counter()

    def arrivals(self) -> None:
        for _ in range(self.rng.choice((0, 0, 1, 1, 2, 3))):
            long_prompt = self.rng.random() < 0.05
            prompt = self.rng.randint(97, 120) if long_prompt else self.rng.randint(1, 40)
            output = self.rng.randint(50, 70) if self.rng.random() < 0.1 else self.rng.randint(1, 30)
            spec = 3 if self.rng.random() < 0.3 else 0
            self.waiting.append(Req(self.next_rid, prompt, output, spec))
            self.next_rid += 1

    def post_process(self) -> None:
        """Last iteration's frees, evictions from the scheduler's cache, free_group_end."""
        short = self.decider.a.available_size() < len(self.running) + 4
        evict = None
        if short and self.d.tree:
            evict = self.rng.randint(1, len(self.d.tree[0]))
            self.seen["evictions"] += 1
        for side in self.sides:
            for op, index, *args in self.post:
                if op == "free":
                    side.a.free_req_cache(index, *args)
                elif op == "trim":
                    side.a.free_extra_pages_not_cached(index, *args)
                else:  # finished into the scheduler's own prefix cache
                    real, alloced = args
                    pages = side.row(index, real // PS)
                    if pages:
                        side.tree.append(pages)
                        mask = side.a.free_with_diff(torch.tensor(pages), torch.tensor(pages))
                        assert not mask.any()
                    side.a.free_extra_pages_not_cached(index, real, alloced)
            if evict is not None:
                side.a.append_to_later_free(torch.tensor(side.tree[0][-evict:], dtype=torch.int32))
                del side.tree[0][-evict:]
                if not side.tree[0]:
                    side.tree.pop(0)
            if side is self.d:
                side.a.free_group_begin()  # the reference has none (its defect 2)
            side.a.free_group_end()
        self.freed_any = self.freed_any or bool(self.post) or evict is not None
        self.post = []

    def admit(self) -> list[Req]:
        free = sorted(set(range(MAX_BATCH)) - set(self.running))
        admitted: list[Req] = []
        budget = self.decider.a.available_size()
        while self.waiting and len(admitted) < len(free):
            req = self.waiting[0]
            if budget < pages_for(req.prompt) + len(self.running) + 2 and self.rng.random() > 0.05:
                break
            self.waiting.popleft()
            req.index = free[len(admitted)]
            budget -= pages_for(req.prompt)
            admitted.append(req)
        return admitted

    def step(self) -> None:
        self.t += 1
        where = f"step {self.t} ({self.mode})"
        dropin = self.d.a
        before = dropin.num_steps, dropin.num_opens
        if self.mode == "folded":
            dropin.begin_iteration()
        self.post_process()
        if self.mode != "folded":
            self.check_counts(f"{where}, after the frees")
        self.arrivals()
        admitted = self.admit()
        items = [(r, r.prompt, 0, "prefill") for r in admitted]
        for index in sorted(self.running):
            r = self.running[index]
            items.append((r, 1 if not r.spec else r.real + r.spec - r.alloced, r.alloced, "decode"))
        if self.mode == "block":
            dropin.begin_iteration()
        outs: dict[str, list[Any]] = {side.name: [] for side in self.sides}
        statuses: list[Any] = []  # the drop-in's: why each alloc failed (None: it did not)
        for side in self.sides:
            for r, need, have, _ in items:
                outs[side.name].append(side.a.alloc(r.index, need, have))
                if side is self.d and self.mode == "single":
                    statuses.append(dropin.last_failure)
        if self.mode != "single":
            it = dropin.end_iteration()
            assert it.num_round_trips <= 2, f"{where}: the block took {it.num_round_trips} round trips"
            statuses = [None if res.ok else res.status for res in outs["kvmem"]]
            assert torch.equal(it.collect(), torch.cat([res for res in outs["kvmem"] if res.ok] or [it.collect()]))
            outs["kvmem"] = [res.value for res in outs["kvmem"]]
        steps, opens = dropin.num_steps - before[0], dropin.num_opens - before[1]
        if self.mode == "block":
            assert steps <= 2 and opens <= 1, f"{where}: {steps} Steps, {opens} Opens in one iteration"
        elif self.mode == "folded":
            assert steps <= 1 and opens <= 1, f"{where}: {steps} Steps, {opens} Opens in one iteration"
        self.check_allocs(items, outs, where)
        self.advance(items, outs["kvmem"], statuses)
        self.check_counts(f"{where}, after the allocs")

    def check_allocs(self, items: list[Any], outs: dict[str, list[Any]], where: str) -> None:
        # Outcomes: the same on both sides, and the drop-in says why a failure failed.
        for n, (r, _, _, kind) in enumerate(items):
            got = [outs[s.name][n] is None for s in self.sides]
            assert len(set(got)) == 1, f"{where}: {kind} alloc of request {r.rid} failed on one side only: {got}"
        # Rows after this step's allocs (pages the scheduler's cache holds too) pair one to one.
        ok = [(r, need, have) for (r, need, have, _), out in zip(items, outs["kvmem"], strict=True) if out is not None]
        grown = {r.index: pages_for(have + need) for r, need, have in ok}
        pairs: list[tuple[int, int]] = []
        for index, r in list(self.running.items()) + [(r.index, r) for r, _, _ in ok]:
            n = grown.get(index, pages_for(r.alloced))
            rows = {s.name: s.row(index, n) for s in self.sides}
            for name, row in rows.items():
                old = r.rows.get(name, [])
                k = min(len(old), len(row))
                assert row[:k] == old[:k], f"{where}: {name} changed kept pages of request {r.rid}: {old} -> {row}"
                assert 0 not in row, f"{where}: {name} row of request {r.rid} has a hole: {row}"
            if len(self.sides) == 2:
                pairs += list(zip(rows["kvmem"], rows["reference"], strict=True))
        if len(self.sides) == 2:
            for kv_tree, ref_tree in zip(self.d.tree, self.sides[1].tree, strict=True):
                pairs += list(zip(kv_tree, ref_tree, strict=True))
            self.renaming.update(pairs, identity=not self.freed_any, where=where)
        # Every kv_loc: its own row's slots, and the reference's up to the renaming.
        for n, (r, need, have, _) in enumerate(items):
            out = outs["kvmem"][n]
            if out is None:
                continue
            row = self.d.row(r.index, pages_for(have + need))
            kv = out.tolist()
            assert kv == [row[p // PS] * PS + p % PS for p in range(have, have + need)], f"{where}: request {r.rid}"
            if len(self.sides) == 2:
                ref = outs["reference"][n].tolist()
                assert self.renaming.slots(kv) == ref, f"{where}: kv_loc of request {r.rid}: {kv} vs reference {ref}"

    def advance(self, items: list[Any], outs: list[Any], statuses: list[Any]) -> None:
        for (r, need, have, kind), out, status in zip(items, outs, statuses, strict=True):
            too_long = have + need > MAX_CTX
            want = None if out is not None else AllocStatus.CONTEXT_TOO_LONG if too_long else AllocStatus.OUT_OF_PAGES
            assert status == want, f"request {r.rid}: the drop-in says {status!r}, expected {want!r}"
            if out is None:
                if kind == "decode":
                    del self.running[r.index]
                    self.post.append(("free", r.index, r.alloced))
                    self.seen["preempted" if not too_long else "too long (decode)"] += 1
                else:
                    self.seen["prefill refused" if not too_long else "too long (prefill)"] += 1
                if not too_long:  # requeue from the start
                    r.alloced = r.real = 0
                    r.rows = {}
                    self.waiting.appendleft(r)
                continue
            if kind == "prefill":
                r.alloced = r.real = r.prompt
                self.running[r.index] = r
            elif not r.spec:
                r.alloced += need
                r.real += 1
            else:
                r.alloced += need
                r.real += self.rng.randint(1, r.spec)  # accepted draft tokens (and the bonus one)
                if pages_for(r.alloced) > pages_for(r.real):
                    self.post.append(("trim", r.index, pages_for(r.real) * PS, r.alloced))
                    self.seen["trims"] += 1
                r.alloced = r.real  # the rejected tail: the next alloc starts here
            r.rows = {s.name: s.row(r.index, pages_for(r.alloced)) for s in self.sides}
            if r.real >= r.prompt + r.output:
                del self.running[r.index]
                if self.rng.random() < 0.5:
                    self.post.append(("free", r.index, r.alloced))
                    self.seen["finished (free_req_cache)"] += 1
                else:
                    self.post.append(("tree", r.index, r.real, r.alloced))
                    self.seen["finished (own cache)"] += 1

    def check_counts(self, where: str) -> None:
        mine = self.d.a.available_size()
        if len(self.sides) == 2:
            theirs = self.sides[1].a.available_size()
            assert mine == theirs, f"{where}: kvmem has {mine} free pages, the reference {theirs}"
        if self.t % 10 == 0:
            stats = self.d.a.client.stats()
            assert stats.num_free_pages == mine and stats.num_cached_pages == 0, (where, stats)
            self.seen["parked (max)"] = max(self.seen["parked (max)"], len(self.d.a._book.parked))


def run_trace(server: ServerProcess, mode: str, steps: int, seed: int, with_reference: bool) -> Trace:
    with KVAllocator(server.target, max_batch_size=MAX_BATCH, page_size=PS, size=NUM_PAGES * PS) as dropin:
        reference = None
        if with_reference:
            reference = REFERENCE.allocator(
                num_pages=NUM_PAGES, page_size=PS, max_batch_size=MAX_BATCH, max_context_len=MAX_CTX
            )
        trace = Trace(mode, seed, dropin, reference)
        for _ in range(steps):
            trace.step()
        stats = dropin.client.stats(audit=True)
        assert stats.audit.ok, stats.audit.problems
        assert stats.num_steps == dropin.num_steps  # the only session: every Step is the drop-in's
    return trace


@needs_reference
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("mode", "steps"), [("block", 400), ("folded", 400), ("single", 120)])
def test_trace_matches_the_reference(trace_server: ServerProcess, mode: str, steps: int) -> None:
    trace = run_trace(trace_server, mode, steps, seed=13, with_reference=True)
    if mode != "single":  # the long runs must have been through every path
        for what in (
            "preempted",
            "prefill refused",
            "trims",
            "evictions",
            "finished (own cache)",
            "too long (prefill)",
        ):
            assert trace.seen[what] > 0, (what, dict(trace.seen))
        assert trace.seen["parked (max)"] > 0, dict(trace.seen)


@pytest.mark.timeout(120)
def test_trace_without_the_reference(trace_server: ServerProcess) -> None:
    """The drop-in alone (where ``../shared/reference`` is absent this is what runs):
    kv_loc against its own rows, kept pages kept, counts against the server's."""
    trace = run_trace(trace_server, "block", 120, seed=7, with_reference=False)
    assert trace.seen["preempted"] > 0, dict(trace.seen)


# ------------------------------------------------------------- the block, and calls


def attach(server: ServerProcess, name: str = "compat", max_batch_size: int = 8) -> KVAllocator:
    return KVAllocator(server.target, max_batch_size=max_batch_size, name=name)


def server_steps(a: KVAllocator) -> int:
    return a.client.stats().num_steps


@pytest.mark.timeout(60)
def test_a_block_is_one_step_whatever_the_batch_size(trace_server: ServerProcess) -> None:
    with attach(trace_server, max_batch_size=64) as a:
        for n in (1, 8, 24):
            steps = server_steps(a)
            with a.iteration() as it:  # prefill: n requests seen for the first time
                results = [a.alloc(i, 5, 0) for i in range(n)]
                with pytest.raises(RuntimeError, match="end of the iteration block"):
                    torch.cat(results)
                assert not results[0].resolved
                assert a.available_size() == 96 - 2 * n  # minus what the block asked for
            assert (it.num_round_trips, server_steps(a) - steps) == (2, 1)  # one Open, one Step
            out_cache_loc = torch.cat(results)  # the scheduler's usual line, unchanged
            assert torch.equal(out_cache_loc, it.collect()) and out_cache_loc.dtype == torch.int32
            # One block's results in call order concatenate as one copy; any other list
            # (reversed, a subset, mixed with tensors) item by item: the same values.
            per_item = [res.value for res in results]
            assert torch.equal(out_cache_loc, torch.cat(per_item))
            assert torch.equal(torch.cat(results[::-1]), torch.cat(per_item[::-1]))
            assert torch.equal(torch.cat(results[n // 2 :]), torch.cat(per_item[n // 2 :]))
            assert torch.equal(
                torch.cat([*results, torch.zeros(1, dtype=torch.int32)], 0),
                torch.cat([*per_item, torch.zeros(1, dtype=torch.int32)]),
            )
            out_cache_loc[:1] = -1  # a copy: the results keep their values
            assert torch.equal(torch.cat(results), torch.cat(per_item))
            for i, res in enumerate(results):
                row = a.req_to_page[i][:2].tolist()
                assert res.ok and res.value.tolist() == [row[p // PS] * PS + p % PS for p in range(5)]
            with a.iteration() as it:  # decode: no new request, no Open
                results = [a.alloc(i, 1, 5) for i in range(n)]
            assert (it.num_round_trips, server_steps(a) - steps) == (1, 2)
            assert [int(x) for x in torch.cat(results)] == [int(a.req_to_page[i][1]) * PS + 1 for i in range(n)]
            for i in range(n):
                a.free_req_cache(i, 6)
            a.free_group_end()  # one Step for all the frees
            assert server_steps(a) - steps == 3 and a.available_size() == 96
        assert a.num_steps == server_steps(a)


@pytest.mark.timeout(60)
def test_outside_a_block_each_call_is_one_step(small: ServerProcess) -> None:
    with attach(small) as a:
        assert torch.equal(a.alloc(0, 5, 0), torch.arange(4, 9, dtype=torch.int32))  # pages 1, 2
        assert a.alloc(0, 3, 5).tolist() == [9, 10, 11]  # the tail of page 2: no new page
        assert a.alloc(1, 33, 0) is None and a.last_failure == AllocStatus.CONTEXT_TOO_LONG
        assert a.alloc(1, 32, 0) is not None and a.last_failure is None  # pages 3..10
        assert a.alloc(2, 32, 0) is None and a.last_failure == AllocStatus.OUT_OF_PAGES  # 6 pages left
        assert a.alloced_len(2) == 0 and a.req_to_page[2].count_nonzero() == 0  # a failure changed nothing
        assert (a.num_steps, a.num_opens) == (5, 3) and server_steps(a) == 5
        assert a.available_size() == 6


@pytest.mark.timeout(60)
def test_a_failed_alloc_in_a_block_resolves_to_none_and_changes_nothing(small: ServerProcess) -> None:
    with attach(small) as a:
        with a.iteration() as it:
            ok1 = a.alloc(0, 32, 0)  # 8 pages
            long = a.alloc(1, 40, 0)  # beyond max_context 32
            ok2 = a.alloc(2, 32, 0)  # 8 pages: the pool is full
            short = a.alloc(3, 4, 0)
        assert ok1 and ok2 and ok1.ok and ok1.status == AllocStatus.OK
        assert not long and long.value is None and long.status == AllocStatus.CONTEXT_TOO_LONG
        assert not short and short.value is None and short.status == AllocStatus.OUT_OF_PAGES
        assert it.failed == [long, short] and a.last_failure == AllocStatus.OUT_OF_PAGES
        with pytest.raises(ValueError, match=r"request index 1 failed \(CONTEXT_TOO_LONG\)"):
            torch.cat([ok1, long])
        assert torch.equal(torch.cat([ok1, ok2]), it.collect()) and it.collect().numel() == 64
        for index in (1, 3):
            assert a.alloced_len(index) == 0 and a.req_to_page[index].count_nonzero() == 0
        assert a.available_size() == 0


@pytest.mark.timeout(60)
def test_frees_apply_at_group_end_or_block_end(small: ServerProcess) -> None:
    with attach(small) as a:
        a.alloc(0, 16, 0)  # pages 1..4
        a.alloc(1, 16, 0)  # pages 5..8
        a.free_req_cache(0, 16)
        assert a.available_size() == 8 and a.alloced_len(0) == 16  # queued, as the reference's
        steps = a.num_steps
        a.free_group_end()
        assert a.available_size() == 12 and a.alloced_len(0) == 0 and a.num_steps == steps + 1
        a.free_group_end()  # nothing queued: no Step
        assert a.num_steps == steps + 1
        with a.iteration() as it:
            a.free_req_cache(1, 16)
            a.free_group_end()  # inside a block: the frees go with its Step
            big = [a.alloc(2, 32, 0), a.alloc(3, 32, 0)]  # 16 pages: only with request 1's 4
            assert a.available_size() == 0  # 12 free, minus the block's 16
        assert it.num_round_trips == 2 and all(big)  # frees run before allocs in the block's Step
        assert {5, 6, 7, 8} <= set(a.req_to_page[[2, 3]].flatten().tolist()) and a.alloced_len(1) == 0


@pytest.mark.timeout(60)
def test_finish_with_tokens_then_another_session_matches_the_prompt(trace_server: ServerProcess) -> None:
    prompt = list(range(100, 110))  # pages [100..103] [104..107] and a partial one
    with attach(trace_server, "a") as a, attach(trace_server, "b") as b:
        a.alloc(0, len(prompt), 0)
        pages = a.req_to_page[0][:3].tolist()
        a.finish(0, prompt)  # the full pages enter kvmem's cache, the partial one is freed
        assert a.alloced_len(0) == 10  # applied at the group's end
        a.free_group_end()
        assert a.alloced_len(0) == 0 and a.req_to_page[0].count_nonzero() == 0
        stats = a.client.stats()
        assert stats.num_cached_pages == 2 and a.available_size() == stats.num_free_pages + 2 == 96

        with b.iteration():  # another session: match and alloc in one Step
            matched = b.match_prefix(2, prompt, len(prompt) - 1)
            rest = b.alloc(2, len(prompt), 0)  # the whole length: it gets the remainder
        assert int(matched) == 8 and b.alloced_len(2) == 10
        row = b.req_to_page[2][:3].tolist()
        assert row[:2] == pages[:2]  # the same pages: nothing to compute for them
        assert rest.value.tolist() == [row[2] * PS, row[2] * PS + 1]

        assert b.match_prefix(3, prompt) == 8  # outside a block: one Step, an int
        assert b.alloc(3, 2, 8).tolist()[0] // PS not in pages[:2]
        assert b.req_to_page[3][:2].tolist() == pages[:2]

        # Chunked prefill: cache a running request's pages, another session shares them at once.
        chunk = list(range(500, 508))
        b.alloc(1, 8, 0)
        assert b.cache_request(1, chunk) == 0
        assert a.match_prefix(1, [*chunk, 1, 2]) == 8 and a.req_to_page[1][:2].equal(b.req_to_page[1][:2])


@pytest.mark.timeout(60)
def test_bad_input_raises_clearly_and_changes_nothing(small: ServerProcess) -> None:
    with attach(small) as a:
        a.alloc(0, 8, 0)
        a.alloc(1, 6, 0)

        def snapshot() -> tuple[Any, ...]:
            return (
                a.available_size(), [a.alloced_len(i) for i in range(8)], a.req_to_page[torch.arange(8)].tolist(),
                a.num_steps, a.client.stats().num_free_pages,
            )  # fmt: skip

        before = snapshot()
        with pytest.raises(IndexError, match="request index 8 out of range"):
            a.alloc(8, 1, 0)
        with pytest.raises(IndexError):
            a.free_req_cache(-1, 4)
        with pytest.raises(ValueError, match="need_size must be >= 0"):
            a.alloc(2, -1, 0)
        with pytest.raises(ValueError, match="beyond the 6 tokens"):
            a.alloc(1, 1, 9)
        with pytest.raises(ValueError, match="double free"):
            a.free_req_cache(3, 4)  # never allocated
        with pytest.raises(ValueError, match="not held by this allocator"):
            a.append_to_later_free([16])
        with pytest.raises(ValueError, match="appears twice"):
            a.append_to_later_free([1, 1])
        with pytest.raises(ValueError, match="finished twice, or never started"):
            a.finish(5)
        with pytest.raises(ValueError, match="2 new prefix page ids but 1 old"):
            a.free_with_diff(torch.tensor([1, 2]), torch.tensor([1]))
        assert snapshot() == before

        a.free_req_cache(0, 8)
        with pytest.raises(ValueError, match="double free"):
            a.free_req_cache(0, 8)  # queued already
        a.free_group_end()
        with pytest.raises(ValueError, match="double free"):
            a.free_req_cache(0, 8)  # freed already
        with pytest.raises(ValueError, match="double free"):
            a.free_extra_pages_not_cached(0, 0, 8)
        with pytest.raises(ValueError, match="not held by this allocator"):
            a.append_to_later_free([1])  # request 0's page, freed
        before = snapshot()

        with a.iteration():  # calls on one request out of Step order
            a.alloc(1, 1, 6)
            with pytest.raises(ValueError, match="after alloc of the same request"):
                a.free_req_cache(1, 6)
            with pytest.raises(ValueError, match="after alloc of the same request"):
                a.alloc(1, 1, 7)
        assert a.alloced_len(1) == 7

        with pytest.raises(ZeroDivisionError), a.iteration():  # a block that raises sends nothing
            pending = a.alloc(2, 4, 0)
            a.free_req_cache(1, 7)
            _ = 1 / 0
        with pytest.raises(RuntimeError, match="nothing of it was sent"):
            _ = pending.ok
        with a.iteration():
            later = a.alloc(2, 4, 0)
            assert not later.resolved
        assert later.ok and a.alloced_len(2) == 4
        a.free_req_cache(2, 4)  # (and back: the checks below count from before this block)
        a.free_group_end()
        assert a.alloced_len(1) == 7 and a.alloced_len(2) == 0 and a.num_steps == before[3] + 3
        stats = a.client.stats(audit=True)
        assert stats.audit.ok, stats.audit.problems


@pytest.mark.timeout(60)
def test_a_step_refused_at_block_end_applies_nothing(small: ServerProcess) -> None:
    from kvmem.client import FailedPrecondition

    with attach(small) as a:
        a.alloc(0, 8, 0)
        assert a.cache_request(0, list(range(8))) == 0  # both pages cached: immutable now
        free, steps = a.available_size(), a.num_steps
        with pytest.raises(FailedPrecondition, match="PAGE_SHARED"), a.iteration() as it:
            trimmed = a.alloc(0, 1, 6)  # a trim into the middle of a cached page: the server refuses
            other = a.alloc(1, 4, 0)
        assert it.ended and a.num_steps == steps
        for res in (trimmed, other):
            with pytest.raises(FailedPrecondition):
                _ = res.ok
        assert a.alloced_len(0) == 8 and a.alloced_len(1) == 0 and a.available_size() == free
        with a.iteration():  # the next block is fine (index 1 reopens the slot its Open took)
            again = a.alloc(1, 4, 0)
            assert not again.resolved
        assert again.ok and a.alloced_len(1) == 4 and a.client.stats().num_open_requests == 2


@pytest.mark.timeout(60)
def test_req_to_page_maps_request_indices_to_rows(small: ServerProcess) -> None:
    with attach(small) as a, KVMemClient(small.target, name="other") as other:
        other.alloc(other.open(["x"]), [4])  # another session's request: slot 1
        a.alloc(2, 5, 0)
        a.alloc(0, 9, 0)
        table, slot2 = a.client.block_table, a._book.slot_of[2]
        rp = a.req_to_page
        assert rp[2].equal(table[slot2]) and rp[2][:2].tolist() == [2, 3]
        assert rp[0][:3].tolist() == [4, 5, 6] and rp[1].count_nonzero() == 0  # no request: the padding row
        assert rp[torch.tensor([2, 0])][:, :2].tolist() == [[2, 3], [4, 5]]
        assert rp[[0, 2], 0].tolist() == [4, 2] and rp[2, 0:2].tolist() == [2, 3]
        assert a.req_to_page_cpu[0].device.type == "cpu" and a.req_to_page_cpu[0].equal(rp[0])
        assert tuple(rp.shape) == (8, table.shape[1])


@pytest.mark.timeout(60)
def test_pages_of_the_schedulers_own_cache(small: ServerProcess) -> None:
    """free_with_diff and append_to_later_free free by page id; kvmem frees a request's
    pages from the end, so a given-back page goes once every later page of its row has."""
    with attach(small) as a:
        a.alloc(0, 12, 0)  # pages 1, 2, 3
        mask = a.free_with_diff(torch.tensor([9, 10, 3]), torch.tensor([1, 2, 3]))  # 1, 2: duplicates
        assert mask.tolist() == [True, True, False]
        a.free_extra_pages_not_cached(0, 12, 12)  # nothing past the full pages
        a.free_group_end()
        assert a.available_size() == 13  # 1 and 2 wait for 3
        with pytest.raises(ValueError, match="page 1 is not held"):
            a.append_to_later_free([1])  # given back already
        a.append_to_later_free(torch.tensor([3], dtype=torch.int32))  # the cache evicts 3
        a.free_group_end()
        assert a.available_size() == 16 and a.alloced_len(0) == 0

        a.alloc(1, 8, 0)  # pages (a stack: the latest freed first)
        held = a.req_to_page[1][:2].tolist()
        a.free_extra_pages_not_cached(1, 8, 8)  # finished: its 2 full pages go to the scheduler's cache
        a.free_group_end()
        a.alloc(1, 4, 0)  # index 1 reused: the old request's pages stay held (parked)
        # open: index 0's (empty: an index keeps its slot), index 1's, the parked one
        assert a.available_size() == 13 and a.client.stats().num_open_requests == 3
        a.append_to_later_free([held[1]])
        a.free_group_end()
        assert a.available_size() == 14
        a.append_to_later_free([held[0]])
        a.free_group_end()  # the last one: the parked request ends, its slot returns
        assert a.available_size() == 15 and a.client.stats().num_open_requests == 2

        a.clear()  # everything this allocator holds, in one Step
        assert a.available_size() == 16 and a.client.stats().num_open_requests == 0
        assert a.req_to_page[torch.arange(8)].count_nonzero() == 0


@pytest.mark.timeout(60)
def test_finish_and_reuse_the_index_in_one_block(small: ServerProcess) -> None:
    with attach(small) as a:
        a.alloc(0, 10, 0)
        with a.iteration() as it:  # last iteration's finish, then a new request at the same index
            a.finish(0, list(range(10)))
            new = a.alloc(0, 4, 0)
        assert it.num_round_trips == 2 and new.ok and a.alloced_len(0) == 4  # an Open for the new request
        stats = a.client.stats()
        assert stats.num_cached_pages == 2 and stats.num_open_requests == 1
        with pytest.raises(ValueError, match="finished twice"), a.iteration():
            a.finish(0)
            a.finish(0)


def test_a_request_index_handed_off_is_adopted_under_a_new_index(small: ServerProcess) -> None:
    """The drop-in hands a request off by index and another allocator (another session)
    adopts it under one of its own free indices: the same pages through ``req_to_page``,
    the length, and ``alloc`` goes on from there; the giver's index is free again."""
    with attach(small) as a, attach(small) as b:
        a.alloc(3, 6, 0)  # pages 1, 2
        row = a.req_to_page[3][:2].tolist()
        with pytest.raises(RuntimeError, match="inside an iteration block"), a.iteration():
            a.handoff([3])
        (ticket,) = a.handoff([3], [b"state"])
        assert a.req_to_page[3].count_nonzero() == 0 and a.alloced_len(3) == 0
        with pytest.raises(ValueError, match="holds no request"):
            a.handoff([3])
        b.alloc(0, 1, 0)
        with pytest.raises(ValueError, match="index 0 holds a request"):
            b.adopt([ticket], [0])
        assert b.adopt([ticket], [5]) == [6]
        assert b.req_to_page[5][:2].tolist() == row and b.alloced_len(5) == 6
        assert b.alloc(5, 1, 6).tolist() == [row[1] * PS + 2]
        assert a.alloc(3, 4, 0) is not None  # the giver's index takes a new request
        b.finish(5)
        b.free_group_end()
        assert b.client.stats(audit=True).audit.ok
