"""The continuous-batching scheduler of ``kvmem simulate``'s workers.

One :meth:`Scheduler.iteration` is what an inference engine's scheduler does per model
step: one Step of the allocator (plus an Open when it admits requests), then one forward
pass of the model (:mod:`.model`):

1. arrivals join the waiting queue;
2. requests that finished (or were chosen for preemption) last iteration are read back
   through the block table and checked (:class:`SimulationFailure` if a page is wrong),
   then released with their token ids, so their full pages enter the prefix cache;
3. speculative requests drop the drafts the model rejected (truncate);
4. prefill chunks computed last iteration are cached (cache items), so other workers can
   share them at once;
5. allocs, within a per-iteration token budget: every decoding request first (1 token,
   or 1 + k with k drafts), then the next chunk of each prefilling request, then new
   requests: matched against the prefix cache (``len - 1`` tokens at most: one token is
   always computed) with the alloc of their first chunk in the same Step;
6. the model's forward pass computes every token allocated, writing its K/V at its
   ``kv_loc`` (:class:`~.model.ForwardBatch`), and samples the next token of each
   request that reached the end of its prompt or decoded; a decode's drafts are accepted
   as far as the samples confirm them, and the samples extend the request's tokens;
7. an alloc that gets ``OUT_OF_PAGES`` preempts the youngest running request (released
   with its computed tokens next iteration, requeued at the front with a backoff; it
   re-prefills what it had, mostly from the cache) and pauses admissions.

The workload fixes each request's tokens (:mod:`.workload`): its prompt, its length, and
its drafts (the first ones a seeded draw accepts are the request's next tokens, the
others not); what the request's tokens become after its prompt is what the model samples.

The allocator is a :class:`Backend`: kvmem's batched client, one Step (:mod:`.worker`,
``--api client``); the drop-in ``KVAllocator`` driven as a scheduler written against the
reference allocator drives it (:mod:`.compat_driver`, ``--api compat``); or, for the
``--baseline`` run, the reference allocator in-process (:mod:`.reference`).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator

import numpy as np

from .backend import NOT_OPENED, OK, OUT_OF_PAGES, Backend, Outcome, Plan
from .model import Admission, BatchBuilder, ForwardBatch, ForwardOutput, Model, ModelFailure, ReadBack
from .workload import Acceptance, SimRequest, WorkloadDigest, WorkloadSpec, drafts, generate

DECODE, PREFILL, ADMIT = 0, 1, 2


class SimulationFailure(Exception):
    """A page read back wrong: the run fails, naming the request, page and position."""


class Live:
    """A request in the scheduler: waiting, running or about to be released.
    ``computed``: tokens whose K/V are written; ``alloced``: the allocator's alloced_len;
    ``target``: the prefill length (the prompt; after a preemption, all it had);
    ``tokens[:known]``: its tokens so far, the prompt then what the model sampled
    (``known > computed`` once its prompt is computed: the next token to compute)."""

    __slots__ = (
        "accept",
        "admitted",
        "alloced",
        "cached_pages",
        "computed",
        "known",
        "matched",
        "not_before",
        "preemptions",
        "req",
        "slot",
        "target",
        "tokens",
        "truncate_to",
    )

    def __init__(self, req: SimRequest, accept: Acceptance) -> None:
        self.req = req
        self.accept = accept
        self.tokens = np.zeros(req.total_len, dtype=np.int32)
        self.tokens[: req.prompt_len] = req.tokens[: req.prompt_len]
        self.known = req.prompt_len
        self.slot = 0
        self.computed = self.alloced = self.matched = self.cached_pages = 0
        self.target = req.prompt_len
        self.admitted = 0
        self.preemptions = 0
        self.not_before = 0
        self.truncate_to = -1


Item = tuple[Live, int, int]  # (request, kind, a number: its need; drafts or tokens once computing)


@dataclasses.dataclass(slots=True)
class Counters:
    """What a worker reports (cumulative)."""

    generated: int = 0
    done: int = 0
    steps: int = 0  # one per scheduler iteration that had work
    step_seconds: float = 0.0
    open_seconds: float = 0.0
    preemptions: int = 0
    out_of_pages: int = 0
    no_free_slot: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    draft_tokens: int = 0
    rejected_tokens: int = 0
    verified_requests: int = 0
    verified_tokens: int = 0
    verified_pages: int = 0


class Scheduler:
    """One worker's scheduler over ``backend``, computing with ``model`` (one forward
    pass per Step). ``read_back``: checks each request's K/V before its release (the
    model that wrote them; None: no check, as in the baseline). ``corrupt``: test hook,
    change one written value of the first finished request before its check (the check
    must catch it)."""

    def __init__(
        self,
        backend: Backend,
        model: Model,
        spec: WorkloadSpec,
        worker: int,
        *,
        max_running: int,
        chunk_tokens: int,
        read_back: ReadBack | None = None,
        corrupt: bool = False,
    ) -> None:
        self.backend = backend
        self.model = model
        self.read_back = read_back
        self.spec = spec
        self.worker = worker
        self.max_running = max_running
        self.chunk_tokens = chunk_tokens
        self.corrupt = corrupt
        self.ps = backend.page_size
        self.counters = Counters()
        self.latencies: list[float] = []  # seconds of each Step, since the last report took them
        self.digest = WorkloadDigest()
        self._arrivals: Iterator[SimRequest] | None = generate(spec, worker)
        self._next: SimRequest | None = next(self._arrivals, None)
        self.it = 0
        self.waiting: collections.deque[Live] = collections.deque()
        self.running: list[Live] = []
        self.finishing: list[Live] = []
        self.preempting: list[Live] = []
        self._pressure = False
        self._slots_back_at = 0  # no Open before this iteration: the server's request slots ran out
        self._open_limit = max_running  # new requests per Open (halved while slots are short)
        self._admitted: list[Admission] = []  # for the next forward: requests given a row...
        self._released: list[str] = []  # ...and released, since the last

    def stop_arrivals(self) -> None:
        """No more requests arrive (a run by duration ends); those arrived finish."""
        self._arrivals = None
        self._next = None

    @property
    def done(self) -> bool:
        return self._next is None and not (self.waiting or self.running or self.finishing or self.preempting)

    # ------------------------------------------------------------------ one iteration

    def iteration(self) -> None:
        c = self.counters
        self._arrive()
        plan = Plan()
        for live in self.finishing:
            self._check_and_release(live, plan, may_corrupt=True)
            c.done += 1
        for live in self.preempting:
            self._check_and_release(live, plan, may_corrupt=False)
            live.target = max(live.req.prompt_len, live.computed)
            live.slot = live.computed = live.alloced = live.matched = live.cached_pages = 0
            live.truncate_to = -1
            live.preemptions += 1
            live.not_before = self.it + min(2**live.preemptions, 64) + (live.req.index + self.worker) % 8
            self.waiting.appendleft(live)
        self.finishing, self.preempting = [], []
        for live in self.running:
            if live.truncate_to >= 0:
                plan.truncate_slots.append(live.slot)
                plan.truncate_lens.append(live.truncate_to)
                live.alloced, live.truncate_to = live.truncate_to, -1
            if live.computed <= live.target and live.computed // self.ps > live.cached_pages:
                plan.cache.append((live.slot, live.tokens[: live.computed]))
                live.cached_pages = live.computed // self.ps
        items = self._allocs(plan)
        if not (items or plan.release_slots):
            self._idle()
            return
        started = time.perf_counter()
        out = self.backend.step(plan)
        seconds = time.perf_counter() - started
        c.steps += 1
        c.step_seconds += seconds
        self.latencies.append(seconds)
        batch, computing, refused, oom = self._batch(out, items)
        self._advance(batch, self._forward(batch), computing)
        self._after(refused, oom)
        self.it += 1

    def _arrive(self) -> None:
        while self._next is not None and self._next.arrival <= self.it:
            req = self._next
            s = self.spec
            self.waiting.append(Live(req, Acceptance(s.seed, self.worker, req.index, s.accept)))
            self.digest.add(req)
            self.counters.generated += 1
            self._next = next(self._arrivals, None) if self._arrivals is not None else None

    def _idle(self) -> None:
        """Nothing to run: skip to the next arrival (or the end of a backoff). Waiting for
        request slots that other workers hold takes real time: a millisecond's pause."""
        if self.it < self._slots_back_at:
            time.sleep(0.001)
        upcoming = [w.not_before for w in self.waiting]
        if self._next is not None:
            upcoming.append(self._next.arrival)
        self.it = max(self.it + 1, min(upcoming, default=self.it + 1))

    def _check_and_release(self, live: Live, plan: Plan, may_corrupt: bool) -> None:
        """Read the request back through its block-table row and check every position it
        computed, then release it with those tokens (its full pages enter the cache)."""
        if self.read_back is not None and live.computed:
            if self.corrupt and may_corrupt and live.computed > live.target:
                self.read_back.corrupt(live.slot, live.computed - 1)  # a page of its own, never cached
                self.corrupt = False
            num_pages, bad = self.read_back.check(live.req.rid, live.slot, live.computed)
            if bad is not None:
                origin = "attached from the prefix cache" if bad.position < live.matched else "allocated to it"
                raise SimulationFailure(
                    f"worker {self.worker}: request {live.req.rid} (slot {live.slot}, {live.computed} tokens computed) "
                    f"reads wrong K/V at position {bad.position}: page {bad.page} (entry {bad.row_index} of its "
                    f"block-table row, {origin}), offset {bad.offset}, {bad.plane}, element {bad.element}: expected "
                    f"{bad.expected}, read {bad.found:g} ({bad.num_wrong} wrong element(s) in the request)"
                )
            c = self.counters
            c.verified_requests += 1
            c.verified_tokens += live.computed
            c.verified_pages += num_pages
        plan.release_slots.append(live.slot)
        plan.release_tokens.append(live.tokens[: live.computed])
        self._released.append(live.req.rid)

    def _allocs(self, plan: Plan) -> list[Item]:
        """The iteration's alloc items, within the token budget: decodes, then prefill
        chunks, then admissions. Returns ``(request, kind, need)`` per item."""
        items: list[Item] = []
        budget = self.chunk_tokens
        for live in self.running:
            if live.computed >= live.target:
                k = min(live.req.spec_k, live.req.total_len - live.computed - 1)
                items.append((live, DECODE, 1 + max(k, 0)))
                budget -= 1 + max(k, 0)
        for live in self.running:
            if live.computed < live.target and budget > 0:
                n = min(live.target - live.computed, budget)
                items.append((live, PREFILL, n))
                budget -= n
        for live, _, need in items:
            plan.alloc_slots.append(live.slot)
            plan.alloc_needs.append(need)
            plan.alloc_expected.append(live.alloced)
        if not self._pressure and self.it >= self._slots_back_at:
            items += self._admit(plan, budget)
        return items

    def _admit(self, plan: Plan, budget: int) -> list[Item]:
        new: list[Live] = []
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(new) < self.max_running
            and self.waiting[0].not_before <= self.it
            and len(new) < self._open_limit
        ):
            new.append(self.waiting.popleft())
            budget -= min(new[-1].target, budget)
        if not new:
            return []
        started = time.perf_counter()
        slots = self.backend.open([f"{live.req.rid}.{live.preemptions}" for live in new])
        self.counters.open_seconds += time.perf_counter() - started
        if slots is None:  # the server's request slots are all taken (other workers): later
            self._not_opened(new)
            return []
        self._open_limit = min(self.max_running, self._open_limit * 2)
        items = []
        budget = self.chunk_tokens - sum(need for need in plan.alloc_needs)
        for live, slot in zip(new, slots, strict=True):
            live.slot = slot
            live.admitted = self.it
            tokens = live.tokens[: live.target]
            plan.match.append((slot, tokens, live.target - 1))
            need = min(live.target, max(budget, 1))  # counts from 0: the match covers its start
            budget -= need
            plan.alloc_slots.append(slot)
            plan.alloc_needs.append(need)
            plan.alloc_expected.append(-1)
            items.append((live, ADMIT, need))
            self.running.append(live)
        return items

    def _not_opened(self, new: list[Live]) -> None:
        self.waiting.extendleft(reversed(new))
        self.counters.no_free_slot += 1
        self._slots_back_at = self.it + 8
        self._open_limit = max(1, len(new) // 2)

    # ------------------------------------------------------------------ the answer

    def _batch(self, out: Outcome, items: list[Item]) -> tuple[ForwardBatch, list[Item], list[Live], int]:
        """The Step's answer as the forward pass it asks for: per alloc that got its
        token slots, the tokens to compute there (a decode's drafts drawn here). Returns
        the batch, ``(request, kind, drafts or tokens)`` per request in it, the
        admissions not opened and the allocs out of pages."""
        c = self.counters
        status = out.status.tolist()
        offsets = out.offsets.tolist()
        matched = iter(out.match_lens.tolist())
        builder = BatchBuilder()
        computing: list[Item] = []
        refused: list[Live] = []
        oom = 0
        for i, (live, kind, need) in enumerate(items):
            s = status[i]
            if kind == ADMIT:
                m = next(matched)
                if s == NOT_OPENED:  # not admitted after all: nothing of it reached the server
                    self.running.remove(live)
                    refused.append(live)
                    continue
                live.computed = live.alloced = live.matched = m
                live.cached_pages = m // self.ps
                c.prefix_query_tokens += max(live.target - 1, 0)
                c.prefix_hit_tokens += m
                self._admitted.append(Admission(live.req.rid, live.req.tokens))
            if s == OUT_OF_PAGES:
                oom += 1
                continue
            if s != OK:
                raise RuntimeError(
                    f"worker {self.worker}: alloc of {need} tokens for request {live.req.rid} (alloced "
                    f"{live.alloced}, max {self.spec.max_len}) failed with status {s}, not OUT_OF_PAGES"
                )
            got = offsets[i + 1] - offsets[i]
            start = live.computed
            loc = out.kv_loc[offsets[i] : offsets[i + 1]] if out.kv_loc is not None else None
            live.alloced += got
            if kind == DECODE:
                k = need - 1  # drafts: the workload's, the first ones its acceptance draw says right
                tokens = live.tokens[start : start + 1]
                if k > 0:
                    tokens = np.concatenate([tokens, drafts(live.req, start, k, live.accept.draw(k))])
                builder.add(live.req.rid, live.slot, start, tokens, loc, 1 + k)
                computing.append((live, DECODE, k))
            else:
                last = 1 if start + got == live.target else 0  # the prompt's end: sample the next token
                builder.add(live.req.rid, live.slot, start, live.tokens[start : start + got], loc, last)
                computing.append((live, PREFILL, got))
        batch = builder.build(self._admitted, self._released, out.kv_loc is not None)
        self._admitted, self._released = [], []
        return batch, computing, refused, oom

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        try:
            output = self.model.forward(batch)
        except Exception as exc:  # the model's own error: the worker fails, saying where
            raise ModelFailure(
                f"the model's forward pass failed at iteration {self.it} "
                f"({batch.describe()}): {type(exc).__name__}: {exc}"
            ) from exc
        num_samples = int(batch.sample_offsets[-1])
        if output.next_tokens.shape != (num_samples,):
            raise ModelFailure(
                f"the model answered next tokens of shape {tuple(output.next_tokens.shape)} "
                f"at iteration {self.it} for {num_samples} sampled positions ({batch.describe()})"
            )
        return output

    def _advance(self, batch: ForwardBatch, output: ForwardOutput, computing: list[Item]) -> None:
        """The requests after the forward pass: tokens computed, drafts accepted as far
        as the samples confirm them (the rest truncated next iteration), the samples
        appended to their tokens; those at their end finish."""
        c = self.counters
        sampled = output.next_tokens
        samples = batch.sample_offsets.tolist()
        offsets = batch.offsets.tolist()
        for j, (live, kind, n) in enumerate(computing):
            start = live.computed
            total = live.req.total_len
            if kind == DECODE:
                mine = sampled[samples[j] : samples[j + 1]]
                accepted = 0
                if n:
                    drafts = batch.token_ids[offsets[j] + 1 : offsets[j + 1]]
                    wrong = np.flatnonzero(drafts != mine[:n])
                    accepted = int(wrong[0]) if wrong.size else n
                c.decode_tokens += 1 + accepted
                c.draft_tokens += n
                c.rejected_tokens += n - accepted
                live.computed = start + 1 + accepted
                if accepted < n:
                    live.truncate_to = live.computed
                new = min(accepted + 1, total - start - 1)  # none past the request's end
                live.tokens[start + 1 : start + 1 + new] = mine[:new]
                live.known = start + 1 + new
            else:
                c.prefill_tokens += n
                live.computed += n
                if samples[j + 1] > samples[j] and live.known == live.computed < total:
                    live.tokens[live.computed] = sampled[samples[j]]
                    live.known += 1
            if live.computed >= total:
                self.running.remove(live)
                self.finishing.append(live)

    def _after(self, refused: list[Live], oom: int) -> None:
        """Admissions not opened wait; on OUT_OF_PAGES the youngest running request is
        preempted (released next iteration) and admissions pause."""
        c = self.counters
        if refused:
            self._not_opened(refused)
        c.out_of_pages += oom
        self._pressure = oom > 0
        if oom and self.running:
            victim = max(self.running, key=lambda live: (live.admitted, live.req.index))
            self.running.remove(victim)
            self.preempting.append(victim)
            c.preemptions += 1
