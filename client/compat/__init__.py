"""A drop-in for schedulers written against the reference allocator
(``shared/reference/seed_kv_allocator.py``): the same class name and methods, with the
reference's meaning, over a kvmem session. A scheduler switches by changing its import
and constructor::

    from kvmem.client.compat import KVAllocator
    allocator = KVAllocator("/tmp/kvmem.sock", max_batch_size=256, name="scheduler-0")

    with allocator.iteration():                 # the one added line: calls go out as ONE Step
        locs = [allocator.alloc(r.req_pool_index, r.extend_len, r.alloced_len) for r in batch]
    out_cache_loc = torch.cat(locs)             # resolved at the end of the block
    ...
    allocator.free_req_cache(req.req_pool_index, req.alloced_len)
    allocator.free_group_end()                  # queued frees: one Step

Outside a block every call is its own Step (correct, and one round trip each: slow for a
batch). Request indices map to kvmem request slots inside the class (opened on first
use: one Open per block at most). ``docs/COMPAT.md`` lists every difference from the
reference; the bookkeeping is :mod:`kvmem.client.compat.book`, the lazily resolved
results :mod:`kvmem.client.compat.results`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvmem.client.step import AllocStatus, TokensLike

from .book import ALLOC, CACHE, FREE, MATCH, Batch, Free
from .machinery import AllocatorCore, _count, _tokens
from .results import Iteration, KVLocResult, PendingInt, ReqToPage

__all__ = ["Iteration", "KVAllocator", "KVLocResult", "PendingInt", "ReqToPage"]


class KVAllocator(AllocatorCore):
    """The reference allocator's interface over a kvmem session (see the module doc).

    ``target_or_client``: a socket path / ``HOST:PORT`` (the allocator attaches, and
    ``close()`` detaches) or an attached :class:`~kvmem.client.sync.KVMemClient` (left
    open). Request indices are ``[0, max_batch_size)``. ``page_size``, ``size`` (token
    slots, page 0 included) and ``max_context_len`` are the server's; when given they
    must agree with it (ValueError otherwise). ``device``: where ``kv_loc`` tensors go
    (default: the host). ``name``, ``cache_namespace``, ``timeout``, ``auth_token`` are
    the session's (only with a target).
    """

    # ------------------------------------------------------------ the reference's

    def alloc(self, req_pool_index: int, need_size: int, alloced_len: int) -> Any:
        """``need_size`` more token slots for request index ``req_pool_index``, which
        holds ``alloced_len`` tokens: fill its last page's tail, then new pages. Outside
        a block: one Step; the int32 ``kv_loc`` or None (``last_failure`` says why).
        Inside: a :class:`KVLocResult` resolved at the block's end. ``alloced_len`` below
        what the request holds trims it first (the reference's way to drop rejected
        draft tokens); 0 on an index that still holds pages starts a new request there
        (see ``docs/COMPAT.md``: the old one's pages stay held). After ``match_prefix``
        of the same request in the same block, pass the whole length and 0: the result
        holds the tokens from the match's end."""
        block = self._block
        if block is not None and type(req_pool_index) is int and type(need_size) is int and type(alloced_len) is int:
            result = self._alloc_in_block(block, req_pool_index, need_size, alloced_len)
            if result is not None:
                return result
        index = self._index(req_pool_index)
        need, have = _count(need_size, "need_size"), _count(alloced_len, "alloced_len")
        batch = self._batch()
        r = self._request_for(batch, index, fresh=have == 0, what="alloc")
        batch.touch(r)
        batch.check_phase(r, ALLOC, index)
        cur: int | None
        if batch.phase.get(r) == MATCH:
            if have:
                raise ValueError(
                    f"alloc of request index {index} after its match_prefix in this block: the matched length is "
                    f"not known yet, so pass the whole length as need_size and 0 as alloced_len (got {have})"
                )
            cur, pages = None, self._book.pages_for(need)
        else:
            planned = batch.planned_len(r)
            assert planned is not None  # _request_for binds a new request in place of a released one
            if have > planned:
                raise ValueError(
                    f"alloc: alloced_len {have} of request index {index} is beyond the {planned} tokens it holds "
                    "(the reference would read a stale block-table row)"
                )
            if have < planned:
                if batch.phase.get(r, FREE) > FREE:
                    raise ValueError(
                        f"alloc of request index {index}: a trim to {have} after cache_request in one block"
                    )
                batch.add_free(r, Free(have))
            cur, pages = have, self._book.pages_for(have + need) - self._book.pages_for(have)
        result = batch.add_alloc(r, need, cur, pages)
        if self._block is not None:
            self._block.results.append(result)
            return result
        self._send_single(batch)
        return result.value

    def _alloc_in_block(self, block: Iteration, index: int, need: int, have: int) -> KVLocResult | None:
        """``alloc``'s common case in a block, in a few dictionary operations: a request
        the block has not touched, at the length the server has. None: not that case
        (``alloc`` then checks and decides)."""
        batch = self._pending
        if not (0 <= index < self.max_batch_size and need >= 0) or index in batch.bound:
            return None
        r = self._book.reqs[index]
        if r is None or r.length != have or r in batch.phase:
            return None
        ps = self.page_size
        result = batch.add_alloc(r, need, have, (have + need + ps - 1) // ps - (have + ps - 1) // ps)
        block.results.append(result)
        return result

    def free_req_cache(self, req_pool_index: int, alloced_len: int) -> None:
        """Free every page of the request (the reference: pages ``[0, ceil(alloced_len /
        page_size))``); its index keeps its kvmem slot for the next request. Applied at
        ``free_group_end()`` or the block's end."""
        index, have = self._index(req_pool_index), _count(alloced_len, "alloced_len")
        if have:
            r = self._held(index, have, 0, "free_req_cache")
            self._pending.add_free(r, Free(0))

    def free_extra_pages_not_cached(self, req_pool_index: int, real_seq_len: int, alloced_len: int) -> None:
        """Free the pages from ``real_seq_len // page_size`` on: the partial tail and
        any over-allocation (a truncate to ``(real_seq_len // page_size) * page_size``
        tokens). The full pages stay with the request (the reference's scheduler put
        them in its own prefix cache). Applied at ``free_group_end()`` or the block's end."""
        index = self._index(req_pool_index)
        real, have = _count(real_seq_len, "real_seq_len"), _count(alloced_len, "alloced_len")
        full = real // self.page_size
        if self._book.pages_for(have) <= full:
            return
        r = self._held(index, have, full, "free_extra_pages_not_cached")
        self._pending.add_free(r, Free(self._book.cut(r, full * self.page_size, self._pending.marks_of(r))))

    def free_with_diff(self, new_prefix_page_ids: Any, old_page_ids: Any) -> torch.Tensor:
        """The reference's: ``old_page_ids[i]`` where ``new_prefix_page_ids[i]`` differs
        is the request's duplicate of a page its own prefix cache holds: given back
        (see ``docs/COMPAT.md``: returned once the pages after it in its row are freed
        too). Returns the mask. With kvmem's cache, ``finish(req, token_ids)`` does this
        on the server instead."""
        new, old = torch.as_tensor(new_prefix_page_ids), torch.as_tensor(old_page_ids)
        if len(new) != len(old):
            raise ValueError(f"free_with_diff: {len(new)} new prefix page ids but {len(old)} old page ids")
        diff = new != old
        pages = old[diff].tolist()
        if pages:
            self._give_back(pages, "free_with_diff")
        return diff

    def append_to_later_free(self, page_ids: Any) -> None:
        """Pages the scheduler's own prefix cache evicted: they go back to the pool at
        ``free_group_end()`` (or the block's end) once the pages after them in their
        request's row go too. Pages this allocator does not hold for such a cache raise
        ValueError (a double free), and nothing changes."""
        pages = torch.as_tensor(page_ids).flatten().tolist()
        if pages:
            self._give_back(pages, "append_to_later_free")

    def free_group_begin(self) -> None:
        """Start a free group (the reference never had one). Frees wait for
        ``free_group_end()`` in any case, as the reference's do."""

    def free_group_end(self) -> None:
        """Send the queued frees as one Step (inside a block: they go with its Step)."""
        if self._block is None and self._pending:
            due = self._send(self._pending)
            self._pending = due

    def available_size(self) -> int:
        """Pages an alloc could take now (the reference's unit: pages, not tokens): free
        pages and cached pages kvmem evicts on demand, as of the latest answer, minus
        what the open block's allocs may take. After a Step that changed the prefix
        cache, the cached count is refreshed with one Stats call."""
        book = self._book
        if book.evictable_stale:
            self._refresh()
        pending = self._pending.num_pending_pages if self._block is not None else 0
        return max(book.num_free_pages + book.num_evictable_pages - pending, 0)

    def clear(self) -> None:
        """Release every request this allocator holds (its own only: the pool is shared)
        and drop the queued frees. One Step."""
        if self._block is not None:
            raise RuntimeError("clear() inside an iteration block")
        batch = Batch()
        held = {r for r in self._book.reqs if r is not None} | {r for r, _ in self._book.parked.values()}
        for r in held:
            if r.slot:
                batch.add_free(r, Free(0, True))
        self._send(batch)
        self._pending = Batch()

    # ------------------------------------------------------------ kvmem's

    @property
    def last_failure(self) -> AllocStatus | None:
        """Why the latest failed alloc failed (OUT_OF_PAGES, CONTEXT_TOO_LONG,
        QUOTA_EXCEEDED); None after a call or block whose allocs all succeeded."""
        code = self._book.last_failure
        return None if code is None else AllocStatus(code)

    def alloced_len(self, req_pool_index: int) -> int:
        """The tokens the request index holds, as the server last said."""
        r = self._book.reqs[self._index(req_pool_index)]
        return 0 if r is None else r.length

    def match_prefix(self, req_pool_index: int, token_ids: TokensLike, max_tokens: int | None = None) -> Any:
        """Start a request at ``req_pool_index`` on the longest run of cached full pages
        of ``token_ids`` (at most ``max_tokens`` tokens; pass ``len - 1`` to compute at
        least one), written into its row. Returns the tokens matched: an int outside a
        block (one Step; then ``alloc(req, len - matched, matched)``), a
        :class:`PendingInt` inside (then ``alloc(req, len, 0)`` in the same block)."""
        index, tokens = self._index(req_pool_index), _tokens(token_ids)
        batch = self._batch()
        r = self._request_for(batch, index, fresh=True, what="match_prefix")
        batch.touch(r)
        batch.check_phase(r, MATCH, index)
        pending = PendingInt(f"match_prefix of request index {index}")
        batch.matches.append((r, tokens, None if max_tokens is None else int(max_tokens), pending))
        batch.phase[r] = MATCH
        if self._block is not None:
            return pending
        self._send_single(batch)
        return pending.value

    def cache_request(self, req_pool_index: int, token_ids: TokensLike) -> Any:
        """Insert the request's full pages of ``token_ids`` (its tokens so far, computed)
        into the prefix cache now (chunked prefill). Returns the pages of its row
        switched to equal cached pages (int; :class:`PendingInt` inside a block)."""
        index, tokens = self._index(req_pool_index), _tokens(token_ids)
        batch = self._batch()
        r = self._bound(batch, index)
        planned = None if r is None else batch.planned_len(r)
        if r is None or planned is None or len(tokens) > planned:
            raise ValueError(f"cache_request: {len(tokens)} token ids for request index {index}, which holds {planned}")
        batch.touch(r)
        batch.check_phase(r, CACHE, index)
        pending = PendingInt(f"cache_request of request index {index}")
        batch.caches.append((r, tokens, pending))
        batch.phase[r] = CACHE
        if self._block is not None:
            return pending
        self._send_single(batch)
        return pending.value

    def finish(self, req_pool_index: int, token_ids: TokensLike | None = None) -> None:
        """End the request: with ``token_ids`` its full pages enter kvmem's prefix cache
        (where the cache holds an equal page, the duplicate is freed), then its pages
        and slot go. Replaces the reference's tree insert, ``free_with_diff``,
        ``free_extra_pages_not_cached`` and slot free. Applied at ``free_group_end()``
        or the block's end; the index is free for a new request at once."""
        index = self._index(req_pool_index)
        tokens = None if token_ids is None else _tokens(token_ids)
        r = self._bound(self._pending, index)
        if r is None or self._pending.planned_len(r) is None:
            raise ValueError(f"finish: request index {index} holds no request (finished twice, or never started)")
        self._pending.check_phase(r, FREE, index)
        self._pending.add_free(r, Free(0, True, tokens))
        self._pending.bound[index] = None

    def truncate(self, req_pool_index: int, new_len: int) -> None:
        """Shrink the request to ``new_len`` tokens (rejected draft tokens): the pages
        past ``ceil(new_len / page_size)`` go. Applied at ``free_group_end()`` or the
        block's end."""
        index, n = self._index(req_pool_index), _count(new_len, "new_len")
        r = self._held(index, n, 0, "truncate")
        self._pending.add_free(r, Free(n))

    def iteration(self) -> contextlib.AbstractContextManager[Iteration]:
        """A block for one scheduler iteration: the calls inside go out at its end as
        one Step (after one Open if it saw new requests). If the block raises, nothing
        of it is sent."""
        return self._iteration()

    def collect(self) -> torch.Tensor:
        """The latest block's ``kv_loc`` of every successful alloc, in call order."""
        return self._last.collect()
