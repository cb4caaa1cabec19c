"""The drop-in's calls on their way to the server: :class:`Batch`, the calls collected
for one Step, and :class:`Outbox`, which holds them between calls (the queued frees;
inside an iteration block, the whole block), finds the kvmem request a call addresses
as planned, opens and ends the block, and is the one place that sends (an Open of new
requests, then the Step) and hands the answer to
:meth:`~kvmem.client.compat.book.Book.commit`.

A Step applies releases, truncates, caches, matches, then allocs; a Batch keeps the
calls of each request in that order (its *phase*: a free, then cache_request, then
match_prefix, then alloc), so the Step does what the calls said in the order they
were made. Nothing in a Batch touches the Book until its Step is answered: a Step that
fails, or a block that raises, changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from kvmem.client.step import StepResult, TokensLike

from .results import Iteration, KVLocResult, PendingInt, Ticket

if TYPE_CHECKING:
    from kvmem.client.sync import KVMemClient

    from .book import Book, Request

FREE, CACHE, MATCH, ALLOC = 0, 1, 2, 3
PHASES = ("a free", "cache_request", "match_prefix", "alloc")


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
    :meth:`touch`). Only its methods change it; each validates before it changes anything."""

    __slots__ = (
        "allocs",
        "base",
        "bound",
        "caches",
        "frees",
        "marks",
        "matches",
        "num_pending_pages",
        "parks",
        "phase",
        "ticket",
    )

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

    def bind(self, index: int, r: Request | None) -> None:
        """Plan ``index`` to stand for ``r`` (None: for no request, after a finish)."""
        self.bound[index] = r

    def park(self, r: Request) -> None:
        """Plan ``r`` parked: its index is reused while it holds pages."""
        self.parks.append(r)

    def add_free(self, r: Request, free: Free) -> None:
        """Queue ``free`` for ``r``: truncates merge to the shortest; a release supersedes."""
        old = self.frees.get(r)
        if old is not None and not free.release:
            free = old if old.release else Free(min(old.target, free.target))
        self.frees[r] = free
        self.phase.setdefault(r, FREE)

    def mark(self, r: Request, marks: frozenset[int]) -> None:
        """``marks``: the columns of ``r`` given back by page id, these included."""
        self.marks[r] = marks
        self.phase.setdefault(r, FREE)

    def add_cache(self, r: Request, tokens: TokensLike, pending: PendingInt) -> None:
        self.caches.append((r, tokens, pending))
        self.phase[r] = CACHE

    def add_match(self, r: Request, tokens: TokensLike, limit: int | None, pending: PendingInt) -> None:
        self.matches.append((r, tokens, limit, pending))
        self.phase[r] = MATCH

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


class Outbox:
    """The calls of one :class:`~kvmem.client.compat.KVAllocator` not sent yet, and the
    one place that sends them over its ``client``. ``pending``: the queued frees; while
    a block is open (``block``), the whole block, which its end sends as one Step.
    ``last``: the latest block that ended. ``num_steps`` / ``num_opens``: the Steps and
    Opens sent. ``book``: what the answers committed (changed only by its methods)."""

    load_wait_s = 0.0  # seconds blocks waited for matched pages loading from the host tier

    def __init__(self, client: KVMemClient, book: Book, request_id_prefix: str) -> None:
        self.client = client
        self.book = book
        self.prefix = request_id_prefix
        self.pending = Batch()
        self.block: Iteration | None = None
        self.last = Iteration()
        self.num_steps = 0
        self.num_opens = 0
        self._saved: Batch | None = None  # the queued frees as the open block found them

    # ---------------------------------------------------------------- the block

    @contextlib.contextmanager
    def iteration(self) -> Iterator[Iteration]:
        it = self.begin()
        try:
            yield it
        except BaseException:
            self._abort(it)
            raise
        self.end()

    def begin(self) -> Iteration:
        if self.block is not None:
            raise RuntimeError("an iteration block is already open (blocks do not nest)")
        ticket = Ticket()  # the block's results: not the restored copy's if the block fails
        self._saved, self.block = self.pending.copy(), Iteration(ticket)
        self.pending.ticket = ticket
        return self.block

    def end(self) -> Iteration:
        it, batch = self.block, self.pending
        if it is None:
            raise RuntimeError("end_iteration() without begin_iteration()")
        self.block = None
        steps = self.num_steps + self.num_opens
        try:
            due = self.send(batch)
        except BaseException as err:
            self.pending, it.ended = self._saved or Batch(), True
            batch.fail(err)
            raise
        finally:
            self._saved = None
        it.num_round_trips, it.ended = self.num_steps + self.num_opens - steps, True
        self.pending, self.last = due, it
        return it

    def _abort(self, it: Iteration) -> None:
        self.pending.fail(RuntimeError("the iteration block raised: nothing of it was sent"))
        self.pending, self._saved, self.block, it.ended = self._saved or Batch(), None, None, True

    def batch(self) -> Batch:
        """Where a call goes: the open block, or (outside one) a batch of its own that
        draws its request's queued frees from ``pending``."""
        return self.pending if self.block is not None else Batch(self.pending)

    # ---------------------------------------------------------------- requests as planned

    def bound(self, batch: Batch, index: int) -> Request | None:
        """The request ``index`` stands for once ``batch`` applies."""
        r = batch.binding(index)
        return self.book.reqs[index] if r is MISSING else r

    def request_for(self, batch: Batch, index: int, fresh: bool, what: str) -> Request:
        """The request a call on ``index`` addresses; a fresh call (nothing held by the
        caller's account) on an index that still holds pages parks those and binds a
        new request."""
        r = self.bound(batch, index)
        planned = None if r is None else batch.planned_len(r)
        if r is not None and planned is not None and (planned == 0 or not fresh):
            return r
        if not fresh:
            raise ValueError(f"{what}: request index {index} holds no tokens (finished, freed or never started)")
        if r is not None and planned:
            if batch.phase.get(r, FREE) > FREE:
                raise ValueError(f"{what} of request index {index} at length 0 after other calls on it in this block")
            batch.park(r)
        new = self.book.new_request(index, self.prefix)
        batch.bind(index, new)
        return new

    def held(self, index: int, have: int, from_col: int, what: str) -> Request:
        """The request at ``index`` whose pages from column ``from_col`` up to ``have``
        tokens a free names: all held and none queued for freeing, else a ValueError."""
        r = self.bound(self.pending, index)
        planned = None if r is None else self.pending.planned_len(r)
        if r is None or planned is None or have > planned:
            raise ValueError(
                f"{what}: request index {index} holds {planned or 0} tokens, the call names {have}: a double free "
                "(or pages never allocated)"
            )
        self.pending.check_phase(r, FREE, index)
        given = [c for c in self.pending.marks_of(r) if from_col <= c < self.book.pages_for(have)]
        if given:
            raise ValueError(f"{what}: request index {index}'s pages at columns {sorted(given)} were freed by page id")
        return r

    def give_back(self, pages: list[int], what: str) -> None:
        """Mark ``pages`` as given back by the scheduler's prefix cache; where given-back
        pages end a request's row they are queued for freeing (a truncate; a parked
        request with none left is released). Validated whole before anything changes."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"{what}: a page id appears twice in {pages}")
        batch, book = self.pending, self.book
        found: dict[Request, set[int]] = {}
        live: dict[int, tuple[Request, int]] | None = None
        for page in pages:
            hit = book.parked.get(page)
            if hit is None:
                live = self._live_pages() if live is None else live
                hit = live.get(page)
            planned = None if hit is None else batch.planned_len(hit[0])
            if (
                hit is None
                or planned is None
                or hit[1] >= book.pages_for(planned)
                or hit[1] in (batch.marks_of(hit[0]) | found.get(hit[0], set()))
            ):
                raise ValueError(f"{what}: page {page} is not held by this allocator (a double free?); nothing changed")
            found.setdefault(hit[0], set()).add(hit[1])
        plan = []
        for r, cols in found.items():
            marks, planned = batch.marks_of(r) | cols, batch.planned_len(r) or 0
            target = book.cut(r, planned, marks)
            if target < planned and r.pages is None:
                batch.check_phase(r, FREE, r.index)
            plan.append((r, marks, Free(0, True) if target == 0 and r.pages is not None else Free(target), planned))
        for r, marks, free, planned in plan:
            batch.mark(r, marks)
            if free.release or free.target < planned:
                batch.add_free(r, free)

    def _live_pages(self) -> dict[int, tuple[Request, int]]:
        """Page id -> (request, column) of the requests bound to indices: one gather of
        their rows. O(pages they hold); only for the lookups of pages given back."""
        reqs = [r for r in self.book.reqs if r is not None and r.length]
        if not reqs:
            return {}
        rows = self.client.block_table[torch.tensor([r.slot for r in reqs])].cpu().tolist()
        return {
            page: (r, col)
            for r, row in zip(reqs, rows, strict=True)
            for col, page in enumerate(row[: self.book.pages_for(r.length)])
        }

    # ---------------------------------------------------------------- sending

    def group_end(self) -> None:
        """Outside a block: send the queued frees as one Step."""
        if self.block is None and self.pending:
            self.pending = self.send(self.pending)

    def send_single(self, batch: Batch) -> None:
        """One call outside a block: its Step (with its request's queued frees)."""
        try:
            due = self.send(batch)
        except BaseException as err:
            batch.fail(err)
            raise
        self.pending.forget(batch)
        for r, f in due.frees.items():
            self.pending.add_free(r, f)

    def send_instead(self, batch: Batch) -> None:
        """Send ``batch`` and drop the queued frees (``clear()``: it releases them all)."""
        self.send(batch)
        self.pending = Batch()

    def send(self, batch: Batch) -> Batch:
        """Open the batch's new requests, send its Step, commit. Returns the frees that
        became due (parked pages given back earlier)."""
        new = batch.new_requests()
        if new:
            slots = self.client.open([r.request_id for r in new])
            self.num_opens += 1
            self.book.opened(new, slots.tolist())  # the server holds them now; a retried Step reopens the same ids
        args = batch.step_args()
        result = None
        if args:
            result = self.client.step(**args)
            self.num_steps += 1
        due = self.book.commit(batch, result, self._read_row)
        if result is not None and batch.matches:
            self._wait_loads(batch, result)
        return due

    def _wait_loads(self, batch: Batch, result: StepResult) -> None:
        """Matched pages still loading from the server's host tier: the block returns
        once they are in (every layer), so what the scheduler reads after it is there.
        In this process's memory, no round trip."""
        loading = result.array("match_loading")
        if not loading.any():
            return
        lens = result.array("match_lens")
        for (r, _, _, _), m, n in zip(batch.matches, lens.tolist(), loading.tolist(), strict=True):
            if n:
                self.load_wait_s += self.client.wait_loads(r.slot, m, n)

    def _read_row(self, slot: int, num_pages: int) -> list[int]:
        row: list[int] = self.client.block_table[slot, :num_pages].tolist()
        return row

    def refresh(self) -> None:
        """The pool's counters from one Stats call."""
        stats = self.client.stats()
        self.book.counted(stats.num_free_pages, stats.num_cached_pages)
