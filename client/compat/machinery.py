"""The machinery under :class:`~kvmem.client.compat.KVAllocator`: the session and its
geometry, the iteration block, how a call finds its kvmem request, and the one place
that sends (an Open of new requests, then the Step) and commits the answer
(:meth:`kvmem.client.compat.book.Book.commit`)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any, Self

import numpy as np
import torch

from kvmem.client.step import TokensLike
from kvmem.client.sync import KVMemClient

from .book import FREE, MISSING, Batch, Book, Free, Request
from .results import Iteration, ReqToPage, Ticket


class AllocatorCore:
    """The state and the sending of :class:`~kvmem.client.compat.KVAllocator` (which
    documents the constructor)."""

    def __init__(
        self,
        target_or_client: str | KVMemClient,
        *,
        max_batch_size: int,
        page_size: int | None = None,
        name: str = "",
        cache_namespace: str = "",
        size: int | None = None,
        max_context_len: int | None = None,
        device: str | torch.device | None = None,
        timeout: float = 10.0,
        auth_token: str | None = None,
        request_id_prefix: str = "compat-",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._owns_client = not isinstance(target_or_client, KVMemClient)
        if isinstance(target_or_client, KVMemClient):
            if name or cache_namespace:
                raise ValueError("name and cache_namespace are the given client's: set them on it")
            self.client = target_or_client
        else:
            self.client = KVMemClient(
                target_or_client, name=name or "kvmem-compat", cache_namespace=cache_namespace, timeout=timeout,
                auth_token=auth_token,
            )  # fmt: skip
        try:
            g = self.client.geometry
            _agree("page_size", page_size, g.page_size)
            _agree("size // page_size (pages, page 0 included)", None if size is None else size // g.page_size,
                   g.num_pages)  # fmt: skip
            _agree("max_context_len", max_context_len, g.max_context_len)
            self.page_size: int = g.page_size
            self.max_batch_size = max_batch_size
            self.max_context_len: int = g.max_context_len
            self._prefix = request_id_prefix
            self._book = Book(max_batch_size, g.page_size, None if device is None else torch.device(device))
            self._pending = Batch()  # queued frees; inside a block, the whole block
            self._saved: Batch | None = None
            self._block: Iteration | None = None
            self._last = Iteration()
            self.num_steps = 0  # Steps this allocator sent
            self.num_opens = 0  # Opens this allocator sent
            self.req_to_page = ReqToPage(lambda: self.client.block_table, self._book.slot_of)
            self.req_to_page_cpu = ReqToPage(lambda: self.client.block_table, self._book.slot_of, cpu=True)
            self.client.block_table  # noqa: B018 - mapped now: a server without KV memory fails here, not mid-step
            self._refresh()
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def _iteration(self) -> Iterator[Iteration]:
        it = self.begin_iteration()
        try:
            yield it
        except BaseException:
            self._abort_iteration(it)
            raise
        self.end_iteration()

    def begin_iteration(self) -> Iteration:
        """Open an iteration block (what ``with iteration():`` does); :meth:`end_iteration`
        sends it. Blocks do not nest."""
        if self._block is not None:
            raise RuntimeError("an iteration block is already open (blocks do not nest)")
        self._saved, self._block = self._pending.copy(), Iteration()
        self._pending.ticket = Ticket()  # the block's results: not the restored copy's if the block fails
        return self._block

    def end_iteration(self) -> Iteration:
        """Send the block's calls; its results resolve. Raises what the Step raised (then
        nothing of the block applied, and its results raise it too)."""
        it, batch = self._block, self._pending
        if it is None:
            raise RuntimeError("end_iteration() without begin_iteration()")
        self._block = None
        steps = self.num_steps + self.num_opens
        try:
            due = self._send(batch, it)
        except BaseException as err:
            self._pending, it.ended = self._saved or Batch(), True
            batch.fail(err)
            raise
        finally:
            self._saved = None
        it.num_round_trips, it.ended = self.num_steps + self.num_opens - steps, True
        self._pending, self._last = due, it
        return it

    def _abort_iteration(self, it: Iteration) -> None:
        self._pending.fail(RuntimeError("the iteration block raised: nothing of it was sent"))
        self._pending, self._saved, self._block, it.ended = self._saved or Batch(), None, None, True

    def close(self) -> None:
        """Detach, if this allocator attached (its requests are released with the session)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _index(self, req_pool_index: Any) -> int:
        index = operator.index(req_pool_index)
        if not 0 <= index < self.max_batch_size:
            raise IndexError(f"request index {index} out of range [0, {self.max_batch_size})")
        return index

    def _batch(self) -> Batch:
        return self._pending if self._block is not None else Batch(self._pending)

    def _bound(self, batch: Batch, index: int) -> Request | None:
        r = batch.binding(index)
        return self._book.reqs[index] if r is MISSING else r

    def _request_for(self, batch: Batch, index: int, fresh: bool, what: str) -> Request:
        """The request a call on ``index`` addresses; a fresh call (nothing held by the
        caller's account) on an index that still holds pages parks those and binds a
        new request."""
        r = self._bound(batch, index)
        planned = None if r is None else batch.planned_len(r)
        if r is not None and planned is not None and (planned == 0 or not fresh):
            return r
        if not fresh:
            raise ValueError(f"{what}: request index {index} holds no tokens (finished, freed or never started)")
        if r is not None and planned:
            if batch.phase.get(r, FREE) > FREE:
                raise ValueError(f"{what} of request index {index} at length 0 after other calls on it in this block")
            batch.parks.append(r)
        new = self._book.new_request(index, self._prefix)
        batch.bound[index] = new
        return new

    def _held(self, index: int, have: int, from_col: int, what: str) -> Request:
        """The request at ``index`` whose pages from column ``from_col`` up to ``have``
        tokens a free names: all held and none queued for freeing, else a ValueError."""
        r = self._bound(self._pending, index)
        planned = None if r is None else self._pending.planned_len(r)
        if r is None or planned is None or have > planned:
            raise ValueError(
                f"{what}: request index {index} holds {planned or 0} tokens, the call names {have}: a double free "
                "(or pages never allocated)"
            )
        self._pending.check_phase(r, FREE, index)
        given = [c for c in self._pending.marks_of(r) if from_col <= c < self._book.pages_for(have)]
        if given:
            raise ValueError(f"{what}: request index {index}'s pages at columns {sorted(given)} were freed by page id")
        return r

    def _give_back(self, pages: list[int], what: str) -> None:
        """Mark ``pages`` as given back by the scheduler's prefix cache; where given-back
        pages end a request's row they are queued for freeing (a truncate; a parked
        request with none left is released). Validated whole before anything changes."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"{what}: a page id appears twice in {pages}")
        batch, found = self._pending, dict[Request, set[int]]()
        live: dict[int, tuple[Request, int]] | None = None
        for page in pages:
            hit = self._book.parked.get(page)
            if hit is None:
                live = self._live_pages() if live is None else live
                hit = live.get(page)
            planned = None if hit is None else batch.planned_len(hit[0])
            if (
                hit is None
                or planned is None
                or hit[1] >= self._book.pages_for(planned)
                or hit[1] in (batch.marks_of(hit[0]) | found.get(hit[0], set()))
            ):
                raise ValueError(f"{what}: page {page} is not held by this allocator (a double free?); nothing changed")
            found.setdefault(hit[0], set()).add(hit[1])
        plan = []
        for r, cols in found.items():
            marks, planned = batch.marks_of(r) | cols, batch.planned_len(r) or 0
            target = self._book.cut(r, planned, marks)
            if target < planned and r.pages is None:
                batch.check_phase(r, FREE, r.index)
            plan.append((r, marks, Free(0, True) if target == 0 and r.pages is not None else Free(target), planned))
        for r, marks, free, planned in plan:
            batch.marks[r] = marks
            batch.phase.setdefault(r, FREE)
            if free.release or free.target < planned:
                batch.add_free(r, free)

    def _live_pages(self) -> dict[int, tuple[Request, int]]:
        """Page id -> (request, column) of the requests bound to indices: one gather of
        their rows. O(pages they hold); only for free_with_diff's lookups."""
        reqs = [r for r in self._book.reqs if r is not None and r.length]
        if not reqs:
            return {}
        rows = self.client.block_table[torch.tensor([r.slot for r in reqs])].cpu().tolist()
        return {
            page: (r, col)
            for r, row in zip(reqs, rows, strict=True)
            for col, page in enumerate(row[: self._book.pages_for(r.length)])
        }

    def _send_single(self, batch: Batch) -> None:
        """One call outside a block: its Step (with its request's queued frees)."""
        try:
            due = self._send(batch)
        except BaseException as err:
            batch.fail(err)
            raise
        self._pending.forget(batch)
        for r, f in due.frees.items():
            self._pending.add_free(r, f)

    def _send(self, batch: Batch, iteration: Iteration | None = None) -> Batch:
        """Open the batch's new requests, send its Step, commit. Returns the frees that
        became due (parked pages given back earlier)."""
        new = batch.new_requests()
        opened: list[tuple[Request, int]] = []
        if new:
            slots = self.client.open([r.request_id for r in new])
            self.num_opens += 1
            opened = list(zip(new, slots.tolist(), strict=True))
            for r, slot in opened:
                r.slot = slot  # the server holds it now; a retried Step reopens the same id
        args = batch.step_args()
        result = None
        if args:
            result = self.client.step(**args)
            self.num_steps += 1
        return self._book.commit(batch, opened, result, self._read_row, iteration)

    def _read_row(self, slot: int, num_pages: int) -> list[int]:
        row: list[int] = self.client.block_table[slot, :num_pages].tolist()
        return row

    def _refresh(self) -> None:
        stats = self.client.stats()
        book = self._book
        book.num_free_pages, book.num_evictable_pages = stats.num_free_pages, stats.num_cached_pages
        book.evictable_stale = False


def _agree(what: str, given: int | None, server: int) -> None:
    if given is not None and given != server:
        raise ValueError(f"{what} {given} disagrees with the server's {server}: the server's pool decides")


def _count(value: Any, what: str) -> int:
    n = operator.index(value)
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    return n


def _tokens(token_ids: TokensLike) -> np.ndarray:
    a = np.asarray(token_ids.cpu() if isinstance(token_ids, torch.Tensor) else token_ids)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"token ids must be a 1-D list of integers, got shape {a.shape} dtype {a.dtype}")
    return a
