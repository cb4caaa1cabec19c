"""The drop-in's bookkeeping, without I/O: what :class:`~kvmem.client.compat.KVAllocator`
knows of its kvmem requests as of the latest answer (:class:`Request`, :class:`Book`),
and how an answered Step changes it (:meth:`Book.commit`, given the
:class:`~kvmem.client.compat.calls.Batch` that was sent and what the server said). Only
the Book's methods change a Request or the Book; what the server sends is read by
:mod:`kvmem.client.compat.calls`, which passes it in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvmem.client.step import StepResult

from .calls import Batch, Free
from .results import StepView


@dataclasses.dataclass(eq=False, slots=True)
class Request:
    """One kvmem request: what request index ``index`` stands for now, or a *parked*
    one (``pages`` set): a request whose index was reused while it still held pages,
    which stay held for the scheduler's own prefix cache until named by
    ``append_to_later_free`` / ``free_with_diff``. Only the :class:`Book` changes a
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


class Book:
    """What the allocator knows as of the latest answer: the request each index stands
    for (``reqs``; ``slot_of`` the same as a tensor for the block table), the parked
    requests' pages (``parked``: page id -> (request, column)), and the pool counters.
    Only :meth:`commit` (an answered Step), :meth:`opened` (an answered Open) and
    :meth:`counted` (an answered Stats) change it after construction."""

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

    def opened(self, requests: list[Request], slots: list[int]) -> None:
        """The Open of ``requests`` gave them ``slots`` (before their Step: the Step names them)."""
        for r, slot in zip(requests, slots, strict=True):
            r.slot = slot

    def handed_off(self, indices: list[int]) -> None:
        """The requests of ``indices`` were handed off (to a ticket): their indices are free."""
        for index in indices:
            r = self.reqs[index]
            if r is not None:
                r.closed, r.length = True, 0
            self.reqs[index] = None
            self.slot_of[index] = 0

    def adopted(self, indices: list[int], request_ids: list[str], slots: list[int], lens: list[int]) -> None:
        """Tickets were adopted: each index stands for its adopted request now."""
        for index, rid, slot, length in zip(indices, request_ids, slots, lens, strict=True):
            self.reqs[index] = Request(rid, index, slot, length)
            self.generation[index] += 1
            self.slot_of[index] = slot

    def counted(self, num_free_pages: int, num_cached_pages: int) -> None:
        """The pool's counters as a Stats call said."""
        self.num_free_pages, self.num_evictable_pages = num_free_pages, num_cached_pages
        self.evictable_stale = False

    def commit(self, batch: Batch, result: StepResult | None, read_row: Callable[[int, int], list[int]]) -> Batch:
        """Apply ``batch``, whose new requests are opened and whose Step answered
        ``result`` (None: it had nothing to send). ``read_row(slot, num_pages)``: a row
        of the block table. Returns the frees that parking made due (queued for the next
        group end)."""
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
            self._answered(batch, result)
        due = Batch()
        for r in batch.parks:
            self._park(r, read_row)
        for r in (*batch.parks, *batch.marks):  # a parked request's tail given back goes at the next group end
            target = self.cut(r, r.length, r.given_back)
            if r.pages is not None and not r.closed and target < r.length:
                due.add_free(r, Free(0, True) if target == 0 else Free(target))
        return due

    def _answered(self, batch: Batch, result: StepResult) -> None:
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
        batch.ticket.view = view  # every result of the batch (and its block's collect()) resolves
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
