"""The drop-in's public class, :class:`KVAllocator`: the reference allocator's methods
(``shared/reference/seed_kv_allocator.py``) with their meaning, and kvmem's additions
(``match_prefix``, ``cache_request``, ``finish``, ``truncate``, the iteration block,
``handoff`` and ``adopt``),
over a kvmem session. Each method checks its call against what is planned and hands it
to the :class:`~kvmem.client.compat.calls.Outbox`, which sends.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any, Self

import numpy as np
import torch

from kvmem.client.resume import Resumed
from kvmem.client.step import AllocStatus, TokensLike
from kvmem.client.sync import KVMemClient

from .book import Book
from .calls import ALLOC, CACHE, FREE, MATCH, MISSING, Batch, Free, Outbox
from .results import Iteration, PendingInt, ReqToPage


class KVAllocator:
    """The reference allocator's interface over a kvmem session. A scheduler switches
    by changing its import and constructor, and batches its calls with one added line::

        from kvmem.client.compat import KVAllocator
        allocator = KVAllocator("/tmp/kvmem.sock", max_batch_size=256, name="scheduler-0")

        with allocator.iteration():                 # the one added line: calls go out as ONE Step
            locs = [allocator.alloc(r.req_pool_index, r.extend_len, r.alloced_len) for r in batch]
        out_cache_loc = torch.cat(locs)             # resolved at the end of the block
        ...
        allocator.free_req_cache(req.req_pool_index, req.alloced_len)
        allocator.free_group_end()                  # queued frees: one Step

    Outside a block every call is its own Step (correct, and one round trip each: slow
    for a batch). Request indices map to kvmem request slots inside the class (opened on
    first use: one Open per block at most). ``docs/COMPAT.md`` lists every difference
    from the reference.

    ``target_or_client``: a socket path / ``HOST:PORT`` (the allocator attaches, and
    ``close()`` detaches) or an attached :class:`~kvmem.client.sync.KVMemClient` (left
    open). Request indices are ``[0, max_batch_size)``. ``page_size``, ``size`` (token
    slots, page 0 included) and ``max_context_len`` are the server's; when given they
    must agree with it (ValueError otherwise). ``device``: where ``kv_loc`` tensors go
    (default: the host). ``name``, ``cache_namespace``, ``timeout``, ``auth_token`` are
    the session's (only with a target), and ``on_resumed``: called when the client
    resumed the session after its server restarted (``kvmem serve --keep-state``), with
    a :class:`kvmem.client.Resumed`; the allocator's requests go on as they were (the
    same slots, rows and K/V), its calls block through the restart, and nothing is
    raised. ``request_id_prefix`` starts the ids of the kvmem requests it opens.
    ``model_id``: the model with its weights' revision, for a server with a store
    (``kvmem serve --store``); the drop-in's matches take what the store gave the server
    so far (a prefix still being fetched is computed: nothing in the reference's
    interface could hold the request for it).
    """

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
        on_resumed: Callable[[Resumed], None] | None = None,
        model_id: str = "",
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._owns_client = not isinstance(target_or_client, KVMemClient)
        if isinstance(target_or_client, KVMemClient):
            if name or cache_namespace or on_resumed or model_id:
                raise ValueError(
                    "name, cache_namespace, model_id and on_resumed are the given client's: set them on it"
                )
            self.client = target_or_client
        else:
            self.client = KVMemClient(
                target_or_client,
                name=name or "kvmem-compat",
                cache_namespace=cache_namespace,
                timeout=timeout,
                auth_token=auth_token,
                on_resumed=on_resumed,
                model_id=model_id,
            )
        try:
            g = self.client.geometry
            _agree("page_size", page_size, g.page_size)
            pages = None if size is None else size // g.page_size
            _agree("size // page_size (pages, page 0 included)", pages, g.num_pages)
            _agree("max_context_len", max_context_len, g.max_context_len)
            self.page_size: int = g.page_size
            self.max_batch_size = max_batch_size
            self.max_context_len: int = g.max_context_len
            self._book = Book(max_batch_size, g.page_size, None if device is None else torch.device(device))
            self._reqs = self._book.reqs  # the request each index stands for (alloc's common case reads it)
            self._out = Outbox(self.client, self._book, request_id_prefix)
            self.req_to_page = ReqToPage(lambda: self.client.block_table, self._book.slot_of)
            self.req_to_page_cpu = ReqToPage(lambda: self.client.block_table, self._book.slot_of, cpu=True)
            self.client.block_table  # noqa: B018 - mapped now: a server without KV memory fails here, not mid-step
            self._out.refresh()
        except BaseException:
            self.close()
            raise

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
        out = self._out
        block = out.block
        if block is not None and type(req_pool_index) is int and type(need_size) is int and type(alloced_len) is int:
            # The common case in a block, in a few dictionary operations: a request the
            # block has not touched, at the length the server has.
            batch = out.pending
            if 0 <= req_pool_index < self.max_batch_size and need_size >= 0 and req_pool_index not in batch.bound:
                r = self._reqs[req_pool_index]
                if r is not None and r.length == alloced_len and r not in batch.phase:
                    ps = self.page_size
                    pages = (alloced_len + need_size + ps - 1) // ps - (alloced_len + ps - 1) // ps
                    result = batch.add_alloc(r, need_size, alloced_len, pages)
                    block.results.append(result)
                    return result
        return self._alloc(req_pool_index, need_size, alloced_len)

    def _alloc(self, req_pool_index: int, need_size: int, alloced_len: int) -> Any:
        """``alloc`` in general: every case, checked."""
        out = self._out
        index = self._index(req_pool_index)
        need, have = _count(need_size, "need_size"), _count(alloced_len, "alloced_len")
        batch = out.batch()
        r = out.request_for(batch, index, fresh=have == 0, what="alloc")
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
            assert planned is not None  # request_for binds a new request in place of a released one
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
        if out.block is not None:
            out.block.results.append(result)
            return result
        out.send_single(batch)
        return result.value

    def free_req_cache(self, req_pool_index: int, alloced_len: int) -> None:
        """Free every page of the request (the reference: pages ``[0, ceil(alloced_len /
        page_size))``); its index keeps its kvmem slot for the next request. Applied at
        ``free_group_end()`` or the block's end."""
        index, have = self._index(req_pool_index), _count(alloced_len, "alloced_len")
        if have:
            r = self._out.held(index, have, 0, "free_req_cache")
            self._out.pending.add_free(r, Free(0))

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
        r = self._out.held(index, have, full, "free_extra_pages_not_cached")
        pending = self._out.pending
        pending.add_free(r, Free(self._book.cut(r, full * self.page_size, pending.marks_of(r))))

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
            self._out.give_back(pages, "free_with_diff")
        return diff

    def append_to_later_free(self, page_ids: Any) -> None:
        """Pages the scheduler's own prefix cache evicted: they go back to the pool at
        ``free_group_end()`` (or the block's end) once the pages after them in their
        request's row go too. Pages this allocator does not hold for such a cache raise
        ValueError (a double free), and nothing changes."""
        pages = torch.as_tensor(page_ids).flatten().tolist()
        if pages:
            self._out.give_back(pages, "append_to_later_free")

    def free_group_begin(self) -> None:
        """Start a free group (the reference never had one). Frees wait for
        ``free_group_end()`` in any case, as the reference's do."""

    def free_group_end(self) -> None:
        """Send the queued frees as one Step (inside a block: they go with its Step)."""
        self._out.group_end()

    def available_size(self) -> int:
        """Pages an alloc could take now (the reference's unit: pages, not tokens): free
        pages and cached pages kvmem evicts on demand, as of the latest answer, minus
        what the open block's allocs may take. After a Step that changed the prefix
        cache, the cached count is refreshed with one Stats call."""
        book = self._book
        if book.evictable_stale:
            self._out.refresh()
        out = self._out
        pending = out.pending.num_pending_pages if out.block is not None else 0
        return max(book.num_free_pages + book.num_evictable_pages - pending, 0)

    def clear(self) -> None:
        """Release every request this allocator holds (its own only: the pool is shared)
        and drop the queued frees. One Step."""
        if self._out.block is not None:
            raise RuntimeError("clear() inside an iteration block")
        batch = Batch()
        held = {r for r in self._book.reqs if r is not None} | {r for r, _ in self._book.parked.values()}
        for r in held:
            if r.slot:
                batch.add_free(r, Free(0, True))
        self._out.send_instead(batch)

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
        index, tokens, out = self._index(req_pool_index), _tokens(token_ids), self._out
        batch = out.batch()
        r = out.request_for(batch, index, fresh=True, what="match_prefix")
        batch.touch(r)
        batch.check_phase(r, MATCH, index)
        pending = PendingInt(f"match_prefix of request index {index}")
        batch.add_match(r, tokens, None if max_tokens is None else int(max_tokens), pending)
        if out.block is not None:
            return pending
        out.send_single(batch)
        return pending.value

    def cache_request(self, req_pool_index: int, token_ids: TokensLike) -> Any:
        """Insert the request's full pages of ``token_ids`` (its tokens so far, computed)
        into the prefix cache now (chunked prefill). Returns the pages of its row
        switched to equal cached pages (int; :class:`PendingInt` inside a block)."""
        index, tokens, out = self._index(req_pool_index), _tokens(token_ids), self._out
        batch = out.batch()
        r = out.bound(batch, index)
        planned = None if r is None else batch.planned_len(r)
        if r is None or planned is None or len(tokens) > planned:
            raise ValueError(f"cache_request: {len(tokens)} token ids for request index {index}, which holds {planned}")
        batch.touch(r)
        batch.check_phase(r, CACHE, index)
        pending = PendingInt(f"cache_request of request index {index}")
        batch.add_cache(r, tokens, pending)
        if out.block is not None:
            return pending
        out.send_single(batch)
        return pending.value

    def finish(self, req_pool_index: int, token_ids: TokensLike | None = None) -> None:
        """End the request: with ``token_ids`` its full pages enter kvmem's prefix cache
        (where the cache holds an equal page, the duplicate is freed), then its pages
        and slot go. Replaces the reference's tree insert, ``free_with_diff``,
        ``free_extra_pages_not_cached`` and slot free. Applied at ``free_group_end()``
        or the block's end; the index is free for a new request at once."""
        index = self._index(req_pool_index)
        tokens = None if token_ids is None else _tokens(token_ids)
        pending = self._out.pending
        r = self._out.bound(pending, index)
        if r is None or pending.planned_len(r) is None:
            raise ValueError(f"finish: request index {index} holds no request (finished twice, or never started)")
        pending.check_phase(r, FREE, index)
        pending.add_free(r, Free(0, True, tokens))
        pending.bind(index, None)

    def truncate(self, req_pool_index: int, new_len: int) -> None:
        """Shrink the request to ``new_len`` tokens (rejected draft tokens): the pages
        past ``ceil(new_len / page_size)`` go. Applied at ``free_group_end()`` or the
        block's end."""
        index, n = self._index(req_pool_index), _count(new_len, "new_len")
        r = self._out.held(index, n, 0, "truncate")
        self._out.pending.add_free(r, Free(n))

    def handoff(self, req_pool_indices: Sequence[int], states: list[bytes] | None = None) -> list[str]:
        """Hand the requests of ``req_pool_indices`` to another scheduler of this server,
        copying nothing (:meth:`kvmem.client.KVMemClient.handoff`): one Step, outside a
        block; returns a ticket per index, for the adopting process. The indices are
        free afterwards (their ``req_to_page`` rows read zeros) and this process must not
        write the requests' pages any more. An index with calls queued (a block not
        ended, frees not sent) is refused first."""
        indices = [self._index(i) for i in req_pool_indices]
        self._idle("handoff", indices)
        reqs = [self._reqs[i] for i in indices]
        missing = [i for i, r in zip(indices, reqs, strict=True) if r is None or not r.slot]
        if missing:
            raise ValueError(f"request index {missing[0]} holds no request to hand off")
        tickets = self.client.handoff([r.slot for r in reqs if r is not None], states)
        self._book.handed_off(indices)
        return tickets

    def adopt(self, tickets: Sequence[str], req_pool_indices: Sequence[int]) -> list[int]:
        """Take over requests another scheduler handed off (:meth:`handoff`, or a
        :class:`~kvmem.client.KVMemClient`'s), each under a free request index of this
        allocator, with their K/V in place: one Step, outside a block. Returns each
        one's alloced_len (its tokens); ``req_to_page`` reads its pages at once, and
        ``alloc`` goes on from that length."""
        indices = [self._index(i) for i in req_pool_indices]
        if len(indices) != len(tickets) or len(set(indices)) != len(indices):
            raise ValueError(f"{len(tickets)} tickets need as many distinct request indices, got {indices}")
        self._idle("adopt", indices)
        taken = [i for i in indices if self._reqs[i] is not None]
        if taken:
            raise ValueError(f"request index {taken[0]} holds a request: adopt into a free index")
        rids = [self._book.new_request(i, self._out.prefix).request_id for i in indices]
        res = self.client.adopt(list(tickets), rids)
        self._book.adopted(indices, rids, res.adopt_slots.tolist(), res.adopt_lens.tolist())
        return res.adopt_lens.tolist()

    def _idle(self, what: str, indices: list[int]) -> None:
        """No block open and no call queued for ``indices``: a hand-off or an adoption goes alone."""
        out = self._out
        if out.block is not None:
            raise RuntimeError(f"{what}() inside an iteration block: call it between blocks")
        queued = [i for i in indices if out.pending.binding(i) is not MISSING or self._queued(i)]
        if queued:
            raise RuntimeError(f"request index {queued[0]} has frees queued: free_group_end() first")

    def _queued(self, index: int) -> bool:
        r = self._reqs[index]
        return r is not None and r in self._out.pending.phase

    def iteration(self) -> contextlib.AbstractContextManager[Iteration]:
        """A block for one scheduler iteration: the calls inside go out at its end as
        one Step (after one Open if it saw new requests). If the block raises, nothing
        of it is sent."""
        return self._out.iteration()

    def begin_iteration(self) -> Iteration:
        """Open an iteration block (what ``with iteration():`` does); :meth:`end_iteration`
        sends it. Blocks do not nest."""
        return self._out.begin()

    def end_iteration(self) -> Iteration:
        """Send the block's calls; its results resolve. Raises what the Step raised (then
        nothing of the block applied, and its results raise it too)."""
        return self._out.end()

    def collect(self) -> torch.Tensor:
        """The latest block's ``kv_loc`` of every successful alloc, in call order."""
        return self._out.last.collect()

    @property
    def num_steps(self) -> int:
        """The Steps this allocator sent."""
        return self._out.num_steps

    @property
    def num_opens(self) -> int:
        """The Opens this allocator sent."""
        return self._out.num_opens

    def _index(self, req_pool_index: Any) -> int:
        index = operator.index(req_pool_index)
        if not 0 <= index < self.max_batch_size:
            raise IndexError(f"request index {index} out of range [0, {self.max_batch_size})")
        return index

    def close(self) -> None:
        """Detach, if this allocator attached (its requests are released with the session)."""
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
