"""The drop-in's bookkeeping, without I/O: what :class:`~kvmem.client.compat.KVAllocator`
knows of its kvmem requests (:class:`Request`, :class:`Book`) and the calls it has
collected for its next Step (:class:`Batch`).

A Step applies releases, truncates, caches, matches, then allocs; a Batch keeps the
calls of each request in that order (its *phase*: a free, then cache_request, then
match_prefix, then alloc), so the Step does what the calls said in the order they
were made. Nothing in a Batch touches the Book until its Step is answered
(:meth:`Book.commit`): a Step that fails, or a block that raises, changes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from kvmem.client.step import StepResult, TokensLike

from .results import Iteration, KVLocResult, PendingInt, StepView, Ticket

FREE, CACHE, MATCH, ALLOC = 0, 1, 2, 3
PHASES = ("a free", "cache_request", "match_prefix", "alloc")


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One kvmem request: what request index ``index`` stands for now, or a *parked*
    one (``pages`` set): a request whose index was reused while it still held pages,
    which stay held for the scheduler's own prefix cache until named by
    ``append_to_later_free`` / ``free_with_diff``. Only :meth:`Book.commit` changes a
    Request. ``slot``: 0 until opened; ``length``: the server's alloced_len as of the
    latest answer; ``given_back``: columns the scheduler freed by page id, returned once
    every later column is (a Step frees a request's pages from the end)."""

    request_id: str
    index: int
    slot: int = 0
    length: int = 0
    given_back: frozenset[int] = frozenset()
    pages: list[int] | None = None  # a parked request's row, by column
    closed: bool = False


class Free(NamedTuple):
    """A request's frees in one Step: a truncate to ``target`` tokens, or a release
    (with the token ids for the prefix cache, or None)."""

    target: int
    release: bool = False
    tokens: TokensLike | None = None


MISSING: Any = object()  # "no planned binding": the Book's binding holds


class Batch:
    """The calls collected for one Step, per request and in Step order, plus the
    planned bindings of request indices (``bound``: a finish unbinds an index, a new
    request binds it) and the columns given back by page id (``marks``). ``base``: the
    queued frees a single call outside a block draws its request's entries from (see
    :meth:`touch`). Every method validates before it changes anything."""

    __slots__ = (
        "allocs", "base", "bound", "caches", "frees", "marks", "matches", "num_pending_pages", "parks", "phase",
        "ticket",
    )  # fmt: skip

    def __init__(self, base: Batch | None = None) -> None:
        self.base = base
        self.phase: dict[Request, int] = {}  # every request the batch touches, with its latest phase
        self.frees: dict[Request, Free] = {}
        self.marks: dict[Request, frozenset[int]] = {}
        self.caches: list[tuple[Request, TokensLike, PendingInt]] = []
        self.matches: list[tuple[Request, TokensLike, int | None, PendingInt]] = []
        # (request, need, length before the alloc or None when matched in this Step, result)
        self.allocs: list[tuple[Request, int, int | None, KVLocResult]] = []
        self.bound: dict[int, Request | None] = {}
        self.parks: list[Request] = []
        self.num_pending_pages = 0  # pages the allocs may take (for available_size)
        self.ticket = Ticket()  # what the allocs' results wait for

    def copy(self) -> Batch:
        other = Batch(self.base)
        other.phase, other.frees, other.marks = dict(self.phase), dict(self.frees), dict(self.marks)
        other.caches, other.matches, other.allocs = list(self.caches), list(self.matches), list(self.allocs)
        other.bound, other.parks, other.num_pending_pages = dict(self.bound), list(self.parks), self.num_pending_pages
        other.ticket = self.ticket
        return other

    def __bool__(self) -> bool:
        return bool(self.phase or self.parks or self.bound)

    # ---------------------------------------------------------------- planning

    def binding(self, index: int) -> Request | None:
        """The request ``index`` stands for as planned (MISSING: as the Book says)."""
        got = self.bound.get(index, MISSING)
        if got is MISSING and self.base is not None:
            got = self.base.bound.get(index, MISSING)
        return got

    def touch(self, r: Request) -> None:
        """Take ``r``'s queued frees and marks from ``base`` into this batch (a single
        call applies its own request's queued frees with it, and only those)."""
        base = self.base
        if base is not None and r not in self.phase and r in base.phase:
            self.phase[r] = FREE
            if r in base.frees:
                self.frees[r] = base.frees[r]
            if r in base.marks:
                self.marks[r] = base.marks[r]

    def planned_len(self, r: Request) -> int | None:
        """``r``'s length once the queued frees apply (this batch's, or ``base``'s for a
        request this batch has not touched); None if it is released."""
        f = self.frees.get(r)
        if f is None and self.base is not None and r not in self.phase:
            f = self.base.frees.get(r)
        if f is None:
            return r.length
        return None if f.release else min(f.target, r.length)

    def marks_of(self, r: Request) -> frozenset[int]:
        marks = self.marks.get(r)
        if marks is None and self.base is not None and r not in self.phase:
            marks = self.base.marks.get(r)
        return r.given_back if marks is None else marks

    def check_phase(self, r: Request, phase: int, index: int) -> None:
        have = self.phase.get(r, -1)
        if have > phase or (have == phase and phase >= MATCH):
            raise ValueError(
                f"request index {index}: {PHASES[phase]} after {PHASES[have]} of the same request in one iteration "
                "block; a block's calls go out as one Step, which applies frees, cache_request, match_prefix, then "
                "alloc: make them in that order (or in the next block)"
            )

    def add_free(self, r: Request, free: Free) -> None:
        """Queue ``free`` for ``r``: truncates merge to the shortest; a release supersedes."""
        old = self.frees.get(r)
        if old is not None and not free.release:
            free = old if old.release else Free(min(old.target, free.target))
        self.frees[r] = free
        self.phase.setdefault(r, FREE)

    def add_alloc(self, r: Request, need: int, cur: int | None, num_pages: int) -> KVLocResult:
        result = KVLocResult(r.index, self.ticket, len(self.allocs))
        self.allocs.append((r, need, cur, result))
        self.phase[r] = ALLOC
        self.num_pending_pages += num_pages
        return result

    def forget(self, done: Batch) -> None:
        """Drop what ``done`` (a single call drawn from this batch) took and applied."""
        for r in done.phase:
            self.phase.pop(r, None)
            self.frees.pop(r, None)
            self.marks.pop(r, None)
        for index in done.bound:
            self.bound.pop(index, None)

    # ---------------------------------------------------------------- the Step

    def new_requests(self) -> list[Request]:
        """Requests that need an Open before the Step (a new one that is only freed needs none)."""
        return [r for r, phase in self.phase.items() if r.slot == 0 and phase > FREE]

    def step_args(self) -> dict[str, Any]:
        """The keyword arguments of ``client.step`` for this batch (empty: nothing to send)."""
        args: dict[str, Any] = {}
        releases = [(r.slot, f.tokens) for r, f in self.frees.items() if f.release and r.slot]
        truncates = [(r.slot, f.target) for r, f in self.frees.items() if not f.release and f.target < r.length]
        if releases:
            args["release_slots"] = [s for s, _ in releases]
            if any(t is not None for _, t in releases):
                args["release_token_ids"] = [t for _, t in releases]
        if truncates:
            args["truncate_slots"] = [s for s, _ in truncates]
            args["truncate_lens"] = [n for _, n in truncates]
        if self.caches:
            args["cache"] = [(r.slot, tokens) for r, tokens, _ in self.caches]
        if self.matches:
            args["match"] = [(r.slot, tokens, limit) for r, tokens, limit, _ in self.matches]
        if self.allocs:
            allocs = self.allocs
            args["alloc_slots"] = [a[0].slot for a in allocs]
            args["alloc_needs"] = [a[1] for a in allocs]
            args["alloc_expected_lens"] = [-1 if a[2] is None else a[2] for a in allocs]
        return args

    def fail(self, error: BaseException) -> None:
        """The Step failed: every pending result raises ``error``."""
        self.ticket.error = error
        for *_, pending in self.matches:
            pending._fail(error)
        for *_, pending in self.caches:
            pending._fail(error)


class Book:
    """What the allocator knows as of the latest answer: the request each index stands
    for (``reqs``; ``slot_of`` the same as a tensor for the block table), the parked
    requests' pages (``parked``: page id -> (request, column)), and the pool counters.
    Only :meth:`commit` changes it after construction."""

    def __init__(self, max_batch_size: int, page_size: int, device: torch.device | None) -> None:
        self.page_size = page_size
        self.device = device
        self.reqs: list[Request | None] = [None] * max_batch_size
        self.generation = [0] * max_batch_size
        self.slot_of = torch.zeros(max_batch_size, dtype=torch.int64)
        self.parked: dict[int, tuple[Request, int]] = {}
        self.num_free_pages = 0
        self.num_evictable_pages = 0
        self.evictable_stale = False
        self.last_failure: Any = None

    def new_request(self, index: int, prefix: str) -> Request:
        """A new kvmem request for ``index``. Its id counts the index's committed
        requests, so a Step that failed and is retried reopens the same slot (Open is
        idempotent per id) instead of leaking the one its Open took."""
        return Request(f"{prefix}{index}.{self.generation[index] + 1}", index)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def cut(self, r: Request, target: int, marks: frozenset[int]) -> int:
        """A truncate of ``r`` to ``target`` tokens, extended down over columns given
        back by page id that it leaves at the row's end."""
        kept = self.pages_for(target)
        cols = kept
        while cols and (cols - 1) in marks:
            cols -= 1
        return target if cols == kept else cols * self.page_size

    def commit(
        self,
        batch: Batch,
        opened: Iterable[tuple[Request, int]],
        result: StepResult | None,
        read_row: Callable[[int, int], list[int]],
        iteration: Iteration | None,
    ) -> Batch:
        """Apply ``batch``, whose Open gave ``opened`` and whose Step answered ``result``.
        Returns the frees that parking made due (queued for the next group end)."""
        for r, slot in opened:
            r.slot = slot
        touched: set[int] = set()
        for r, f in batch.frees.items():
            if f.release:
                self._drop_parked(r, 0)
                r.closed, r.length = True, 0
                if 0 <= r.index < len(self.reqs) and self.reqs[r.index] is r:
                    self.reqs[r.index] = None
                    touched.add(r.index)
            elif f.target < r.length:
                r.length = f.target
                self._drop_parked(r, self.pages_for(f.target))
        for r, marks in batch.marks.items():
            r.given_back = frozenset(c for c in marks if c < self.pages_for(r.length))
        for index, bound in batch.bound.items():
            self.reqs[index] = bound
            touched.add(index)
            if bound is not None:
                self.generation[index] += 1
        for index in touched:
            bound = self.reqs[index]
            self.slot_of[index] = bound.slot if bound is not None else 0
        if result is not None:
            self._answered(batch, result, iteration)
        due = Batch()
        for r in batch.parks:
            self._park(r, read_row)
        for r in (*batch.parks, *batch.marks):  # a parked request's tail given back goes at the next group end
            target = self.cut(r, r.length, r.given_back)
            if r.pages is not None and not r.closed and target < r.length:
                due.add_free(r, Free(0, True) if target == 0 else Free(target))
        return due

    def _answered(self, batch: Batch, result: StepResult, iteration: Iteration | None) -> None:
        if batch.matches:
            lens = result.match_lens.tolist()
            for (r, _, _, pending), n in zip(batch.matches, lens, strict=True):
                r.length = n
                pending._resolve(n)
            self.evictable_stale = True
        if batch.caches:
            for (_, _, pending), n in zip(batch.caches, result.cache_switched.tolist(), strict=True):
                pending._resolve(n)
            self.evictable_stale = True
        if any(f.release and f.tokens is not None for f in batch.frees.values()):
            self.evictable_stale = True
        self.num_free_pages = result.num_free_pages
        self.num_evictable_pages = max(self.num_evictable_pages - result.num_pages_evicted, 0)
        if not batch.allocs:
            return
        kv = result.kv_loc.clone() if self.device is None else result.kv_loc.to(self.device, copy=True)
        status = bytes(result.status.numpy().tobytes())
        view = StepView(kv, result.kv_loc_offsets.tolist(), status)
        batch.ticket.view = view  # every result of the batch resolves
        failure = None
        if status.count(0) == len(status) and not batch.matches:  # all OK (decode): lengths only
            for r, need, cur, _ in batch.allocs:
                r.length = cur + need  # type: ignore[operator]  # no match in the batch: cur is set
        else:
            for (r, need, cur, _), code in zip(batch.allocs, status, strict=True):
                if code == 0:
                    r.length = max(need, r.length) if cur is None else cur + need
                else:
                    failure = code
        self.last_failure = failure
        if iteration is not None:
            iteration._view = view

    def _park(self, r: Request, read_row: Callable[[int, int], list[int]]) -> None:
        """``r``'s index was reused while it held pages: keep them for the scheduler's
        prefix cache, findable by page id (``parked``)."""
        if r.closed or not r.length:
            return
        r.pages = read_row(r.slot, self.pages_for(r.length))
        r.index = -1
        for col, page in enumerate(r.pages):
            self.parked[page] = (r, col)

    def _drop_parked(self, r: Request, kept_cols: int) -> None:
        if r.pages is None:
            return
        for page in r.pages[kept_cols:]:
            self.parked.pop(page, None)
        del r.pages[kept_cols:]
