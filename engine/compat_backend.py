"""The scheduler on the drop-in (:class:`kvmem.client.compat.KVAllocator`), driven as a
scheduler written against the reference allocator drives it once switched
(``docs/COMPAT.md``): ``kvmem simulate --api compat`` and ``Engine(api="compat")``.

The scheduler (:mod:`.scheduler`) and its model are the same as on the batched client,
with the same decisions; only its allocator calls differ (this module's
:class:`CompatBackend`, a :class:`~.backend.Backend`). Requests
are known by *request index* (``[0, max_batch_size)``, handed out here as a reference
scheduler's request pool does; the drop-in maps them to kvmem slots), and each
iteration is one ``with allocator.iteration():`` block of per-request calls:

* ``finish(req, tokens)`` for the requests done or preempted (their full pages enter
  the prefix cache);
* rejected drafts dropped the way the drop-in documents: the decode ``alloc`` passes
  the lowered ``alloced_len``, which trims the request first (``truncate(req, n)`` for
  a request without an alloc this iteration);
* ``cache_request(req, tokens)`` for each prefill chunk computed (chunked prefill);
* admission: ``match_prefix(req, tokens, len - 1)``, then ``alloc(req, need, 0)`` (in a
  block the match is not known yet: the alloc counts from 0);
* ``alloc(req, need, alloced_len)`` for every running request; the results resolve at
  the block's end: ``result.ok`` / ``result.status`` (OUT_OF_PAGES preempts) and the
  ``kv_loc``, ``it.collect()`` being the iteration's ``out_cache_loc``.

The block goes out as one Step, after one Open when it starts requests. The model's
forward pass writes the K/V at the ``kv_loc`` values, each request's row being its
request index; it is read back through ``allocator.req_to_page`` (the block table by
request index), as with the batched client.

When the server has no request slot for the block's new requests, its Open fails and
the drop-in applies nothing of the block: the iteration is sent again without its
admissions, which the scheduler requeues (status ``NOT_OPENED``), as it does when the
batched client's Open is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from .backend import NOT_OPENED, Outcome, Plan

if TYPE_CHECKING:
    from kvmem.client.compat import KVAllocator


class CompatBackend:
    """The scheduler's allocator: the drop-in, one iteration block per scheduler
    iteration. ``open`` hands out request indices (no round trip: the drop-in opens
    kvmem requests with the block); an index comes back when its request is finished."""

    def __init__(self, allocator: KVAllocator) -> None:
        from kvmem.client.errors import NoFreeRequestSlot

        self.allocator = allocator
        self.page_size = int(allocator.page_size)
        self._free = list(range(allocator.max_batch_size - 1, -1, -1))  # request indices, lowest first
        self._no_slot = NoFreeRequestSlot

    @property
    def round_trips(self) -> int:
        return int(self.allocator.num_steps + self.allocator.num_opens)

    def open(self, request_ids: list[str]) -> list[int] | None:
        if len(request_ids) > len(self._free):
            return None
        return [self._free.pop() for _ in request_ids]

    def step(self, plan: Plan) -> Outcome:
        try:
            return self._iteration(plan, admit=True)
        except self._no_slot:  # the Open of the new requests: nothing of the block applied
            out = self._iteration(plan, admit=False)
            self._free += [int(index) for index, _, _ in reversed(plan.match)]
            return out

    def _iteration(self, plan: Plan, admit: bool) -> Outcome:
        """One ``with allocator.iteration():`` block of the plan's calls, per request."""
        a = self.allocator
        admitted = {int(index) for index, _, _ in plan.match}
        alloc_slots = list(map(int, plan.alloc_slots))
        allocating = set(alloc_slots)
        release_slots = list(map(int, plan.release_slots))
        with a.iteration() as it:
            for index, tokens in zip(release_slots, plan.release_tokens, strict=True):
                a.finish(index, tokens)
            for index, new_len in zip(map(int, plan.truncate_slots), map(int, plan.truncate_lens), strict=True):
                if index not in allocating:  # else its alloc's lower alloced_len trims it
                    a.truncate(index, new_len)
            for index, tokens in plan.cache:
                a.cache_request(index, tokens)
            matched = [a.match_prefix(index, tokens, limit) for index, tokens, limit in plan.match] if admit else []
            results: list[Any] = []
            needs, expected = map(int, plan.alloc_needs), map(int, plan.alloc_expected)
            for index, need, alloced_len in zip(alloc_slots, needs, expected, strict=True):
                if index in admitted:  # matched in this block: the alloc counts from 0
                    results.append(a.alloc(index, need, 0) if admit else None)
                else:
                    results.append(a.alloc(index, need, alloced_len))
        self._free += release_slots
        n = len(results)
        status = np.zeros(n, dtype=np.int16)
        offsets = np.zeros(n + 1, dtype=np.int64)
        for i, result in enumerate(results):
            if result is None:
                status[i] = NOT_OPENED
            elif result.ok:
                offsets[i + 1] = len(result)
            else:
                status[i] = int(result.status)
        np.cumsum(offsets, out=offsets)
        match_lens = np.array([int(m) for m in matched] if admit else [0] * len(plan.match), dtype=np.int64)
        out_cache_loc = it.collect().numpy()  # every successful alloc's kv_loc, in call order
        return Outcome(status, out_cache_loc, offsets, match_lens)
