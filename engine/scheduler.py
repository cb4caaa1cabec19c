"""The continuous-batching scheduler of ``kvmem simulate``'s workers.

One :meth:`Scheduler.iteration` is what an inference engine's scheduler does per model
step, in one Step of the allocator (plus an Open when it admits requests):

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
6. K/V of every token allocated is written at its ``kv_loc`` (:mod:`.simulate_kv`);
7. an alloc that gets ``OUT_OF_PAGES`` preempts the youngest running request (released
   with its computed tokens next iteration, requeued at the front with a backoff; it
   re-prefills what it had, mostly from the cache) and pauses admissions.

The allocator is a :class:`Backend`: kvmem's batched client, one Step
(:mod:`.simulate_worker`, ``--api client``); the drop-in ``KVAllocator`` driven as a
scheduler written against the reference allocator drives it (:mod:`.simulate_compat`,
``--api compat``); or, for the ``--baseline`` run, the reference allocator in-process (its
adapter lives with the command, in ``kvmem.server``).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from .workload import Acceptance, SimRequest, WorkloadDigest, WorkloadSpec, generate

if TYPE_CHECKING:
    from .kv_check import KVMemory  # torch: imported by the workers that write K/V, not by the command

OK, OUT_OF_PAGES = 0, 1  # AllocStatus values (kvmem.v1); others end the run as errors
NOT_OPENED = -1  # an admission's status when the backend opens in its step and the server had no request slot
DECODE, PREFILL, ADMIT = 0, 1, 2


class SimulationFailure(Exception):
    """A page read back wrong: the run fails, naming the request, page and position."""


@dataclasses.dataclass(slots=True)
class Plan:
    """One iteration's Step, as columns (see ``KVMemClient.step``)."""

    release_slots: list[int] = dataclasses.field(default_factory=list)
    release_tokens: list[np.ndarray] = dataclasses.field(default_factory=list)
    truncate_slots: list[int] = dataclasses.field(default_factory=list)
    truncate_lens: list[int] = dataclasses.field(default_factory=list)
    cache: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    match: list[tuple[int, np.ndarray, int]] = dataclasses.field(default_factory=list)
    alloc_slots: list[int] = dataclasses.field(default_factory=list)
    alloc_needs: list[int] = dataclasses.field(default_factory=list)
    alloc_expected: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class Outcome:
    """A Step's answer: per alloc item its status and token slots (``kv_loc[off[i] :
    off[i + 1]]``; None when the backend has no KV memory), per match item the tokens
    matched."""

    status: np.ndarray
    kv_loc: np.ndarray | None
    offsets: np.ndarray
    match_lens: np.ndarray


class Backend(Protocol):
    """An allocator the scheduler drives: request slots, and one step per iteration."""

    page_size: int

    def open(self, request_ids: list[str]) -> list[int] | None:
        """Slots for new requests, or None when there are not enough free slots (a
        backend that opens them in its step answers their items NOT_OPENED instead)."""
        ...

    def step(self, plan: Plan) -> Outcome: ...


class Live:
    """A request in the scheduler: waiting, running or about to be released.
    ``computed``: tokens whose K/V are written; ``alloced``: the allocator's alloced_len;
    ``target``: the prefill length (the prompt; after a preemption, all it had)."""

    __slots__ = (
        "accept",
        "admitted",
        "alloced",
        "cached_pages",
        "computed",
        "matched",
        "not_before",
        "preemptions",
        "prefix",
        "req",
        "slot",
        "target",
        "truncate_to",
    )

    def __init__(self, req: SimRequest, accept: Acceptance) -> None:
        self.req = req
        self.accept = accept
        self.prefix: np.ndarray | None = None
        self.slot = 0
        self.computed = self.alloced = self.matched = self.cached_pages = 0
        self.target = req.prompt_len
        self.admitted = 0
        self.preemptions = 0
        self.not_before = 0
        self.truncate_to = -1


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
    """One worker's scheduler over ``backend``; ``memory`` None: no K/V written or checked
    (the baseline). ``corrupt``: test hook, change one written value of the first
    finished request before its check (the check must catch it)."""

    def __init__(
        self,
        backend: Backend,
        memory: KVMemory | None,
        spec: WorkloadSpec,
        worker: int,
        *,
        max_running: int,
        chunk_tokens: int,
        corrupt: bool = False,
    ) -> None:
        self.backend = backend
        self.memory = memory
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
                plan.cache.append((live.slot, live.req.tokens[: live.computed]))
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
        self._apply(out, items)
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
        if self.memory is not None and live.computed:
            assert live.prefix is not None
            if self.corrupt and may_corrupt and live.computed > live.target:
                self.memory.corrupt(live.slot, live.computed - 1)  # a page of its own, never cached
                self.corrupt = False
            h = self.memory.pattern.hashes(live.prefix[: live.computed], 0)
            num_pages, bad = self.memory.check(live.slot, h)
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
        plan.release_tokens.append(live.req.tokens[: live.computed])

    def _allocs(self, plan: Plan) -> list[tuple[Live, int, int]]:
        """The iteration's alloc items, within the token budget: decodes, then prefill
        chunks, then admissions. Returns ``(request, kind, need)`` per item."""
        items: list[tuple[Live, int, int]] = []
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

    def _admit(self, plan: Plan, budget: int) -> list[tuple[Live, int, int]]:
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
            if live.prefix is None and self.memory is not None:
                live.prefix = self.memory.pattern.prefix_values(live.req.tokens)
            tokens = live.req.tokens[: live.target]
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

    def _apply(self, out: Outcome, items: list[tuple[Live, int, int]]) -> None:
        c = self.counters
        status = out.status
        offsets = out.offsets
        locs: list[np.ndarray] = []
        hashes: list[np.ndarray] = []
        matched = iter(out.match_lens.tolist())
        oom = 0
        refused: list[Live] = []
        for i, (live, kind, need) in enumerate(items):
            s = int(status[i])
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
            if s == OUT_OF_PAGES:
                oom += 1
                continue
            if s != OK:
                raise RuntimeError(
                    f"worker {self.worker}: alloc of {need} tokens for request {live.req.rid} (alloced "
                    f"{live.alloced}, max {self.spec.max_len}) failed with status {s}, not OUT_OF_PAGES"
                )
            got = int(offsets[i + 1] - offsets[i])
            start = live.computed
            if kind == DECODE:
                k = need - 1
                accepted = live.accept.draw(k)
                c.decode_tokens += 1 + accepted
                c.draft_tokens += k
                c.rejected_tokens += k - accepted
                live.alloced += got
                live.computed = start + 1 + accepted
                if accepted < k:
                    live.truncate_to = live.computed
                h = self._draft_hashes(live, start, k, accepted)
            else:
                c.prefill_tokens += got
                live.alloced += got
                live.computed += got
                h = self._hashes(live, start, got)
            if out.kv_loc is not None and h is not None:
                locs.append(out.kv_loc[offsets[i] : offsets[i + 1]])
                hashes.append(h)
            if live.computed >= live.req.total_len:
                self.running.remove(live)
                self.finishing.append(live)
        if self.memory is not None and locs:
            self.memory.write(np.concatenate(locs), np.concatenate(hashes))
        if refused:
            self._not_opened(refused)
        c.out_of_pages += oom
        self._pressure = oom > 0
        if oom and self.running:
            victim = max(self.running, key=lambda live: (live.admitted, live.req.index))
            self.running.remove(victim)
            self.preempting.append(victim)
            c.preemptions += 1

    def _hashes(self, live: Live, start: int, n: int) -> np.ndarray | None:
        if self.memory is None or live.prefix is None:
            return None
        return self.memory.pattern.hashes(live.prefix[start : start + n], start)

    def _draft_hashes(self, live: Live, start: int, k: int, accepted: int) -> np.ndarray | None:
        """Hashes of positions ``start .. start + k``: the request's own tokens up to
        ``start + accepted``, then rejected drafts (other tokens: their K/V is of another
        sequence, and is truncated next iteration)."""
        if self.memory is None or live.prefix is None:
            return None
        good = live.prefix[start : start + 1 + accepted]
        if accepted == k:
            return self.memory.pattern.hashes(good, start)
        first_bad = start + 1 + accepted
        wrong = live.req.tokens[first_bad : start + 1 + k] + 1
        v = self.memory.pattern.extend(live.prefix[first_bad - 1], wrong, first_bad)
        return self.memory.pattern.hashes(np.concatenate([good, v]), start)
