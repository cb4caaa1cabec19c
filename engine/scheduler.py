"""The continuous-batching scheduler both engines run: ``kvmem simulate``'s workers
(the synthetic model) and the real-model engine (a transformers model).

One :meth:`Scheduler.iteration` is what an inference engine's scheduler does per model
step: one Step of the allocator (a :class:`~.backend.Backend`: kvmem's batched client,
the drop-in, or the reference allocator; plus an Open when it admits requests), then one
forward pass of the model (a :class:`~.forward.Model`):

1. **plan** (:meth:`Scheduler._plan`), changing no request: the requests that finished
   or were preempted last iteration are released with their tokens (their full pages
   enter the prefix cache; a check may read them back first); rejected drafts' K/V is
   truncated; requests handed off go with their state; a prefilling request caches its
   newly full pages (other sessions match them at once); then allocs within the token
   budget: every decode first (1 token, or 1 + its drafts), then the next chunk of each
   prefilling request, then adopted requests and new ones, each new one matched against
   the prefix cache (all but its last token at most: one is always computed) with its
   first chunk allocated in the same Step (the need counts from 0); a new request is
   charged its whole prompt, its match not known yet;
2. **send** the Step, its columns int32 arrays (the client's bytes fast path); when its
   answer shows that admissions' matches (or holds for the store) left part of the
   budget and requests wait, a **top-up** Step admits more into what is left (at most
   :data:`MAX_TOP_UPS`; their tokens join the same forward; only while a forward takes
   longer than a Step, which a top-up adds), so a prefix hit costs neither the forward's
   tokens nor the queue's time;
3. **apply** the answer (:meth:`Scheduler._apply`), the one place requests change on
   it: releases done, truncates, caches, matches, adoptions, hand-offs, each alloc's
   token slots; a Step that raised changed nothing here, so the iteration can be
   planned again;
4. **forward** over every token allocated, packed ragged (prefill chunks and decodes
   mixed), then **take** the samples (:meth:`Scheduler._take`): a request whose chunk
   reached its known tokens samples the next one (a decode with drafts samples after
   each and keeps the drafts the samples confirm, plus one), and stops on a stop token,
   a stop check or at ``max_new``;
5. an alloc answered ``OUT_OF_PAGES`` preempts the youngest running request: released
   with its computed tokens next iteration, requeued at the front (after a backoff,
   when the policy has one); when readmitted it matches what it had (mostly from the
   cache) and recomputes the rest. Admissions pause for an iteration after it.

What differs between the engines is the :class:`Policy` (drafts, the tokens a model is
told of at admission, the check before release, the preemption backoff and limit) and
the hand-off policy (:class:`~.handoff.Moves`); the loop is this one.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from .backend import NOT_OPENED, OK, OUT_OF_PAGES, Backend, Outcome, Plan
from .forward import Admission, BatchBuilder, ForwardBatch, ForwardOutput, Model, ModelFailure
from .handoff import Moves
from .loading import Loads, held_for_store
from .request import Request, pack, unpack
from .steps import EMPTY as _EMPTY
from .steps import Figures, Policy, Steps

__all__ = ["MAX_TOP_UPS", "Figures", "Policy", "Scheduler"]

MAX_TOP_UPS = 8  # top-up Steps an iteration may send after its Step (see Scheduler.iteration)

# Per request in a forward pass: (request, tokens, samples, drafts, decode). A decode
# computes a sampled token of a request already running (one, or one and its drafts);
# the rest is prefill: prompt tokens (the last one too, alone in its chunk), and what an
# admission computes in its first Step (a resumed request's sampled tokens too).
_Computing = tuple["Request", int, int, int, bool]


def _moving(mean: float, x: float) -> float:
    """A moving average of seconds (the first sample as it is; then 1/8 of each new one)."""
    return x if not mean else mean + (x - mean) / 8


class _Forming:
    """An iteration's forward pass while its Steps are applied: the batch's tokens, their
    token slots per Step, per request ``(request, tokens, samples, drafts, decode)``;
    ``under``: the last Step's admissions computed fewer tokens than they were charged;
    ``idle``: admissions computing none (their match covered the chunk they were given);
    ``heads``: the first pages (their tokens' bytes) that requests compute in this
    forward: not cached yet, so a top-up admits no request that starts with one."""

    __slots__ = ("builder", "computing", "heads", "idle", "kv_locs", "under")

    def __init__(self) -> None:
        self.builder = BatchBuilder()
        self.computing: list[_Computing] = []
        self.kv_locs: list[np.ndarray | None] = []
        self.under = False
        self.idle: list[Request] = []  # admitted, computing nothing yet: the match covered their chunk
        self.heads: set[bytes] = set()

    def tokens(self) -> int:
        return sum(c[1] for c in self.computing)


class Scheduler:
    """One continuous-batching scheduler over ``backend``, computing with ``model`` (see
    the module's docstring). ``budget``: tokens computed per forward, decodes, drafts
    and prefill chunks together; ``max_running``: requests running at once (at most the
    budget: every running request's decode fits). Requests come from :meth:`add` (all
    at once, or an iterator in arrival order, taken as the iterations reach each one's
    ``arrival``); :meth:`iteration` returns the requests that took new tokens, with how
    many each took. ``load_wait``: how a request whose prefix is still loading from
    the server's host tier waits, ``"layer"`` or ``"iteration"`` (:mod:`.loading`).
    ``fetch_wait_s``: how long at most an admission whose prefix the server is fetching
    from its store (``kvmem serve --store``; the answer's ``match_fetching``) is held
    for it: released in the next Step and admitted again (its match then takes what has
    arrived) until nothing more is being fetched or the time is up; 0 (the default):
    never held, its tokens computed at once. ``top_ups``: whether an iteration sends
    top-up Steps; None (the default): while a forward takes longer than a Step (a
    top-up adds a round trip to save a forward: a model whose forward costs less, as the
    simulator's, sends none)."""

    def __init__(
        self,
        backend: Backend,
        model: Model,
        *,
        budget: int,
        max_running: int,
        policy: Policy | None = None,
        stops: frozenset[int] = frozenset(),
        keep_logits: bool = False,
        moves: Moves | None = None,
        on_arrival: Callable[[Request], None] | None = None,
        load_wait: str = "layer",
        fetch_wait_s: float = 0.0,
        top_ups: bool | None = None,
    ) -> None:
        self.backend = backend
        self.top_ups = top_ups
        self.fetch_wait_s = fetch_wait_s
        self.model = model
        self.ps = backend.page_size
        self.budget = budget
        self.max_running = min(max_running, budget)
        self.policy = policy or Policy()
        self.stops = np.array(sorted(stops), dtype=np.int32)
        self._stop_set = frozenset(int(t) for t in stops)
        self.keep_logits = keep_logits
        self.moves = moves
        self.on_arrival = on_arrival
        self.figures = Figures()
        self.latencies: list[float] = []  # seconds of each Step since a reader last took them
        # a Step's and a forward's recent seconds (moving averages): a top-up Step costs a round
        # trip to save a forward, so it is sent only while a forward costs more than a Step
        self._step_s = self._forward_s = 0.0
        self.it = 0
        self.started_at = time.monotonic()  # the run's start, for the first tokens' times
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.leaving: list[Request] = []  # finished or preempted: released in the next Step
        self.giving: list[Request] = []  # handed off in the next Step
        self.finished: list[Request] = []  # in the order they finished here
        self._adopting: list[Request] = []  # taken from the inbox, adopted in the next Step
        self._taken = 0  # inbox items taken since the last Step
        self._opened: dict[str, int] = {}  # request id -> slot opened, not yet admitted (a Step failed)
        self.loads = Loads(backend, load_wait, self.figures)  # matches still loading from the host tier
        self._fetch_held: set[int] = set()  # admissions released to be admitted again (their prefix in fetch)
        self._admitted: list[Admission] = []  # for the next forward: requests given a row...
        self._released: list[str] = []  # ...and released, since the last
        self._arrivals: Iterator[Request] | None = None
        self._next: Request | None = None
        self._pressure = False  # an alloc ran out of pages last iteration: no admission
        self._slots_back_at = 0  # no Open before this iteration: the server's request slots ran out
        self._open_limit = self.max_running  # new requests per Open (halved while slots are short)

    # ------------------------------------------------------------------ requests in and out

    def add(self, requests: Iterable[Request]) -> None:
        """Requests to run, in arrival order (an iterator is drawn as they arrive)."""
        chained = requests if self._arrivals is None else _chain(self._next, self._arrivals, requests)
        self._arrivals = iter(chained)
        self._next = next(self._arrivals, None)

    def stop_arrivals(self) -> None:
        """No more requests arrive (a run by duration ends); those arrived finish."""
        self._arrivals = None
        self._next = None

    @property
    def done(self) -> bool:
        busy = self._next is not None or self.waiting or self.running or self.leaving or self.giving
        return not (busy or self._adopting) and (self.moves is None or not self.moves.expecting())

    def abandon(self) -> None:
        """After a failure: release every request this scheduler holds (no tokens cached)."""
        slots = [r.slot for r in self.running + self.leaving]
        if slots:
            self.backend.step(Plan(release_slots=slots, release_tokens=[_EMPTY for _ in slots]))

    # ------------------------------------------------------------------ one iteration

    def iteration(self) -> list[tuple[Request, int]]:
        self._arrive()
        if self.moves is not None and self.moves.draining:
            self._drain()
        steps = self._plan()
        if not (steps.items or steps.leaving or steps.giving):
            self._idle()
            return []
        out = self._send(steps)
        self.figures.iterations += 1
        self.leaving = []  # released in this Step (the held for the store join it again)
        forming = _Forming()
        oom = self._apply(steps, out, forming)
        for _ in range(MAX_TOP_UPS):  # the admissions' matches left budget: their chunks, more admissions
            left = self.budget - forming.tokens()
            if oom or left <= 0 or not forming.under or not self._top_ups_pay():
                break
            steps, idle = Steps(), forming.idle
            forming.under, forming.idle = False, []
            if idle:  # admitted, their match covering the chunk they were given: the next one now
                left = self._allocs(steps, idle, left)
            if self.waiting and left > 0 and not self._pressure and self.it >= self._slots_back_at:
                self._admissions(steps, left, forming.heads)
            if not steps.items:
                break
            self.figures.top_ups += 1
            oom += self._apply(steps, self._send(steps), forming)
        batch = self._build(forming)
        took = self._take(batch, self._forward(batch), forming.computing)
        self._preempt(oom)
        self.it += 1
        return took

    def _top_ups_pay(self) -> bool:
        """Whether to send a top-up Step now (``top_ups``; None: while the recent forwards
        took longer than the recent Steps)."""
        if self.top_ups is not None:
            return self.top_ups
        return self._forward_s >= self._step_s

    def _send(self, steps: Steps) -> Outcome:
        plan = steps.seal()
        started = time.perf_counter()
        out = self.backend.step(plan)
        seconds = time.perf_counter() - started
        self.figures.step_seconds += seconds
        self.latencies.append(seconds)
        self._step_s = _moving(self._step_s, seconds)
        return out

    def _arrive(self) -> None:
        while self._next is not None and self._next.arrival <= self.it:
            r = self._next
            self.waiting.append(r)
            self.figures.arrived += 1
            if self.on_arrival is not None:
                self.on_arrival(r)
            self._next = next(self._arrivals, None) if self._arrivals is not None else None

    def _drain(self) -> None:
        """A drain: every running request is handed off in the next Step, the waiting
        prompts are passed on as they are (not computed: no ticket)."""
        self.giving += self.running
        self.running = []
        if self.waiting and self.moves is not None:
            self.moves.given([("", pack(r, computed=0, cached_pages=0)) for r in self.waiting])
        self.waiting.clear()

    def _idle(self) -> None:
        """Nothing to send: on to the next arrival or the end of a backoff. Waiting for
        request slots that other sessions hold takes real time: a millisecond's pause."""
        if self.waiting and (self.it < self._slots_back_at or not self._pressure):
            time.sleep(0.001)
        self._pressure = False
        upcoming = [r.not_before for r in self.waiting]
        if self._next is not None:
            upcoming.append(self._next.arrival)
        self.it = max(self.it + 1, min(upcoming, default=self.it + 1))

    # ------------------------------------------------------------------ plan

    def _plan(self) -> Steps:
        """This iteration's Step, from the requests as they are: nothing changes here but
        what comes from outside (the inbox's items, the server's request slots)."""
        steps = Steps()
        plan = steps.plan
        check = self.policy.check
        for r in self.leaving:
            if check is not None:
                check(r, bool(r.finish))
            plan.release_slots.append(r.slot)
            plan.release_tokens.append(r.tokens[: r.computed])
            steps.released.append(r.rid)
        steps.leaving = self.leaving
        for r in self.giving:
            computed = r.computed
            if r.truncate_to >= 0:
                plan.truncate_slots.append(r.slot)
                plan.truncate_lens.append(r.truncate_to)
                computed = min(computed, r.truncate_to)
            plan.handoff_slots.append(r.slot)
            plan.handoff_states.append(pack(r, computed=computed, moves=r.moves + 1))
        steps.giving = self.giving
        decoding = []
        ps = self.ps
        blocked = self.loads.blocked(self.running)
        for r in self.running:
            computed = r.computed
            if r.known - computed == 1 and id(r) not in blocked:
                decoding.append(r)
            if r.truncate_to >= 0:  # rejected drafts: their K/V goes
                plan.truncate_slots.append(r.slot)
                plan.truncate_lens.append(r.truncate_to)
                steps.truncated.append(r)
            if computed <= r.prompt_len and computed // ps > r.cached_pages:  # new full pages
                plan.cache.append((r.slot, r.tokens[:computed]))
                steps.cached.append(r)
        running = self.running if not blocked else [r for r in self.running if id(r) not in blocked]
        budget = self._allocs(steps, running, self.budget, decoding)
        if self.moves is not None:
            budget = self._adoptions(steps, budget)
        if not self._pressure and self.it >= self._slots_back_at:
            self._admissions(steps, budget)
        return steps

    def _allocs(self, steps: Steps, requests: list[Request], budget: int, decoding: list[Request] | None = None) -> int:
        """Decodes (with their drafts), then prefill chunks, within ``budget``; the
        budget left. ``decoding``: those of ``requests`` decoding, when known."""
        drafter = self.policy.drafts
        if decoding is None:
            decoding = [r for r in requests if r.known - r.computed == 1]
        budget -= len(decoding)
        if drafter is None:  # one token each: the columns in one pass each
            if not steps.items:  # the Step's first items: applied in bulk
                steps.decodes = decoding
            steps.alloc_slots += [r.slot for r in decoding]
            steps.alloc_needs += [1] * len(decoding)
            steps.alloc_expected += [r.truncate_to if r.truncate_to >= 0 else r.alloced for r in decoding]
            steps.items += [(r, 1, _EMPTY) for r in decoding]
            decoding = []
        for r in decoding:
            drafts = _EMPTY
            room = min(budget, r.max_new - (r.known - r.prompt_len) - 1)
            if drafter is not None and room > 0:
                drafts = drafter(r, room)
                budget -= drafts.size
            expected = r.truncate_to if r.truncate_to >= 0 else r.alloced
            steps.alloc(r, r.slot, 1 + drafts.size, expected, drafts)
        for r in requests:
            if r.known - r.computed > 1 and budget > 0:
                n = min(r.known - r.computed, budget)
                steps.alloc(r, r.slot, n, r.truncate_to if r.truncate_to >= 0 else r.alloced)
                budget -= n
        return budget

    def _adoptions(self, steps: Steps, budget: int) -> int:
        """Requests from the inbox: adopted in this Step with their next tokens' allocs
        (their slots the tickets'); prompts passed on join the waiting queue."""
        moves = self.moves
        assert moves is not None
        if not moves.draining:
            idle = not (self.running or self.waiting or self.leaving or self.giving or self._adopting)
            free = self.max_running - len(self.running) - len(self._adopting)
            for ticket, state in moves.take(free, idle):
                self._taken += 1
                r = unpack(state)
                if ticket:
                    r.ticket = ticket
                    r.slot = _ticket_slot(ticket)
                    self._adopting.append(r)
                else:
                    r.computed = r.alloced = r.cached_pages = 0
                    self.waiting.append(r)
        for r in self._adopting:
            steps.plan.adopt.append((r.ticket, r.rid))
        steps.adopting = self._adopting
        return self._allocs(steps, self._adopting, budget)

    def _admissions(self, steps: Steps, budget: int, computing: set[bytes] | None = None) -> None:
        """New requests from the front of the waiting queue, within what the budget
        leaves, opened here (their slots from the server), each with a match and the
        alloc of its first chunk counted from 0 (the match in the same Step covers its
        start). ``budget``: the tokens this Step's allocs may take; an admission is
        charged its whole prompt (its match is not known yet: a top-up Step admits more
        when the answer shows the matches left some). ``computing`` (a top-up's): the
        first pages this forward computes; admissions stop at a request that starts with
        one, or with the first page of another admitted in this Step (the next Step
        matches it instead of computing it twice)."""
        left = budget
        new: list[Request] = []
        ps = self.ps
        heads: set[bytes] = set()
        for r in self.waiting:
            full = len(self.running) + len(self._adopting) + len(new) >= self.max_running
            if budget <= 0 or full or r.not_before > self.it or len(new) >= self._open_limit:
                break
            if computing is not None and r.known > ps:  # a match may cover its first page
                head = r.tokens[:ps].tobytes()
                if head in computing or head in heads:
                    break
                heads.add(head)
            new.append(r)
            budget -= min(r.known, budget)
        if not new:
            return
        need_slots = [r.rid for r in new if r.rid not in self._opened]
        if need_slots:
            started = time.perf_counter()
            slots = self.backend.open(need_slots)
            self.figures.open_seconds += time.perf_counter() - started
            if slots is None:  # the server's request slots are all another's: later
                self._not_opened()
                return
            self._opened.update(zip(need_slots, slots, strict=True))
        self._open_limit = min(self.max_running, self._open_limit * 2)
        budget = left
        for r in new:
            slot = self._opened[r.rid]
            steps.plan.match.append((slot, r.tokens[: r.known], r.known - 1))
            need = min(r.known, max(budget, 1))
            budget -= need
            steps.alloc(r, slot, need, -1)
            steps.opened.append(r)

    def _not_opened(self) -> None:
        self.figures.no_free_slot += 1
        self._slots_back_at = self.it + 8
        self._open_limit = max(1, self._open_limit // 2)

    # ------------------------------------------------------------------ apply

    def _apply(self, steps: Steps, out: Outcome, forming: _Forming) -> int:
        """The Step went through: the requests as its answer leaves them, and what it
        adds to the forward pass (into ``forming``: the batch's tokens and token slots,
        per request in it ``(request, tokens, samples, drafts)``). Returns the allocs
        out of pages."""
        f = self.figures
        now = time.monotonic()
        self._released += steps.released
        for r in steps.truncated:
            r.alloced, r.truncate_to = r.truncate_to, -1
        for r in steps.cached:
            r.cached_pages = r.computed // self.ps
        if steps.giving:
            states = steps.plan.handoff_states
            self.giving = []
            if self.moves is not None:
                self.moves.given(list(zip(out.tickets, states, strict=True)))
        if self._taken and self.moves is not None:
            self.moves.adopted([r.ticket for r in steps.adopting], self._taken)
            self._taken = 0
        for r in steps.adopting:
            r.since, r.admitted = now, self.it
            self.running.append(r)
        self._adopting = []
        status, offsets = out.status.tolist(), out.offsets.tolist()
        unopened = []
        if NOT_OPENED in status:
            unopened = [item[0] for item, st in zip(steps.items, status, strict=True) if st == NOT_OPENED]
        if out.match_loading is not None:
            loading = zip(steps.opened, out.match_lens.tolist(), out.match_loading.tolist(), strict=True)
            self.loads.note([(r, self._opened[r.rid], m, n) for r, m, n in loading if n])
        fetching = held_for_store(steps.opened, out.match_fetching, now, self.fetch_wait_s, f)
        for r, m in zip(steps.opened, out.match_lens.tolist(), strict=True):
            self.waiting.popleft()  # the admissions are the front of the queue, in order
            slot = self._opened.pop(r.rid)
            if r in unopened:  # the drop-in's Open found no request slot: nothing of it applied
                continue
            r.slot, r.admitted, r.since = slot, self.it, now
            r.computed = r.alloced = r.matched = m
            r.cached_pages = m // self.ps
            if id(r) in fetching:  # its prefix is coming from the store: released next Step, admitted again
                self.leaving.append(r)
                self._fetch_held.add(id(r))
                continue
            r.matched_total += m
            f.prefix_query_tokens += max(r.known - 1, 0)
            f.prefix_hit_tokens += m
            self.running.append(r)
        if unopened:
            self._not_opened()
            self.waiting.extendleft(reversed(unopened))
        requeued = [r for r in steps.leaving if not r.finish]  # preempted or held: first in the queue
        for r in requeued:
            if id(r) in self._fetch_held:  # held for the store: not a preemption
                self._fetch_held.discard(id(r))
                r.fetches += 1
                r.rid = f"{r.name}.{r.preemptions}.{r.fetches}"
                r.slot = r.computed = r.alloced = r.cached_pages = 0
                continue
            self._back_to_waiting(r)
        self.waiting.extendleft(reversed(requeued))
        kv_loc = out.kv_loc
        builder = forming.builder
        add = builder.add
        computing = forming.computing
        oom = 0
        first = self._decodes(steps.decodes, out, builder, computing)
        admitted = {id(r) for r in steps.opened}
        skipped: list[tuple[int, int]] = []  # token slots of admissions held out (load_wait "iteration")
        for i in range(first, len(steps.items)):
            r, need, drafts = steps.items[i]
            s = status[i]
            if s == OK and need == 1 and offsets[i + 1] - offsets[i] == 1:  # a decode (or a one-token chunk)
                r.alloced += 1
                start = r.computed
                samples = 1 if start + 1 == r.known else 0
                add(r.rid, r.slot, start, r.tokens.item(start), None, samples)
                computing.append((r, 1, samples, 0, samples == 1 and start >= r.prompt_len and id(r) not in admitted))
                continue
            if s != OK:
                if s == OUT_OF_PAGES:
                    oom += 1
                elif s != NOT_OPENED:
                    raise RuntimeError(
                        f"alloc of {need} tokens for request {r.rid} (slot {r.slot}, alloced {r.alloced}) "
                        f"failed with status {s}, not OUT_OF_PAGES"
                    )
                continue
            lo, hi = offsets[i], offsets[i + 1]
            got = hi - lo
            r.alloced += got
            if got == 0:  # an admission whose match covered its first chunk: its next one in a top-up
                forming.idle.append(r)
                continue
            if fetching and id(r) in fetching:  # held for the store: released in the next Step
                skipped.append((lo, hi))
                continue
            if self.loads.held and id(r) in admitted and self.loads.is_held(r):
                # load_wait "iteration": its match is loading: not computed now; the next Step
                # gives back what this one allotted it (a page boundary: the match's end)
                r.truncate_to = r.computed
                skipped.append((lo, hi))
                continue
            start = r.computed
            if start < self.ps < r.known:  # computes its first page: a top-up admits nothing starting so
                forming.heads.add(r.tokens[: self.ps].tobytes())
            d = drafts.size
            tokens = r.tokens[start : start + got] if not d else np.concatenate([r.tokens[start : r.known], drafts])
            samples = 1 + d if start + got == r.known + d else 0
            add(r.rid, r.slot, start, tokens, None, samples)
            decode = r.known - start == 1 and start >= r.prompt_len and id(r) not in admitted
            computing.append((r, got, samples, d, decode))
        told = self.policy.told
        for r in [*steps.adopting, *(r for r in steps.opened if r not in unopened)]:
            self._admitted.append(Admission(r.rid, told(r) if told is not None else r.tokens[: r.known]))
        # The Step's token slots are those of its allocs that got some, in item order: the batch's
        # (but those of admissions held out).
        if skipped and kv_loc is not None:
            keep = np.ones(kv_loc.size, dtype=bool)
            for lo, hi in skipped:
                keep[lo:hi] = False
            kv_loc = kv_loc[keep]
        forming.kv_locs.append(kv_loc)
        charged = sum(need for r, need, _ in steps.items if id(r) in admitted)
        forming.under = sum(c[1] for c in computing if id(c[0]) in admitted) < charged
        return oom

    def _build(self, forming: _Forming) -> ForwardBatch:
        """The forward pass of an iteration's Steps (one, or one and its top-ups)."""
        locs = [loc for loc in forming.kv_locs if loc is not None]  # none: a backend without token slots
        kv_loc = None if not locs else locs[0] if len(locs) == 1 else np.concatenate(locs)
        batch = forming.builder.build(self._admitted, self._released, kv_loc is not None, kv_loc)
        self._admitted, self._released = [], []
        if self.loads.pending:
            batch = self.loads.with_wait(batch)
        return batch

    @staticmethod
    def _decodes(decodes: list[Request], out: Outcome, builder: BatchBuilder, computing: list[_Computing]) -> int:
        """The Step's leading decodes, when each got its one token slot: into the batch
        in one pass (each samples its next token). Returns how many items that applied
        (0 when one of them did not get its slot: the item loop applies them all)."""
        n = len(decodes)
        if not n or out.status[:n].any() or out.offsets[n] != n:  # offsets[n] == n: one slot each
            return 0
        ids, rows, starts, tokens = [], [], [], []
        for r in decodes:
            r.alloced += 1
            start = r.computed
            ids.append(r.rid)
            rows.append(r.slot)
            starts.append(start)
            tokens.append(r.tokens.item(start))
            computing.append((r, 1, 1, 0, start >= r.prompt_len))
        builder.add_decodes(ids, rows, starts, tokens)
        return n

    def _back_to_waiting(self, r: Request) -> None:
        """A preempted request, released: to the front of the queue, to recompute."""
        r.preemptions += 1
        r.rid = f"{r.name}.{r.preemptions}"
        limit = self.policy.max_preemptions
        if limit is not None and r.preemptions > limit:
            raise RuntimeError(
                f"request {r.name} ({r.known} tokens) was preempted {r.preemptions} times: the pool's free pages "
                f"cannot hold it with the others running (kvmem serve --num-pages, or a smaller max_running)"
            )
        r.slot = r.computed = r.alloced = r.cached_pages = 0
        r.truncate_to = -1
        if self.policy.backoff is not None:
            r.not_before = self.policy.backoff(r, self.it)

    # ------------------------------------------------------------------ forward and take

    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        f = self.figures
        started = time.perf_counter()
        try:
            output = self.model.forward(batch)
        except Exception as exc:  # the model's own error: the run fails, saying where
            raise ModelFailure(
                f"the model's forward pass failed at iteration {self.it} "
                f"({batch.describe()}): {type(exc).__name__}: {exc}"
            ) from exc
        seconds = time.perf_counter() - started
        f.forward_seconds += seconds
        self._forward_s = _moving(self._forward_s, seconds)
        num_samples = int(batch.sample_offsets[-1])
        if output.next_tokens.shape != (num_samples,):
            raise ModelFailure(
                f"the model answered next tokens of shape {tuple(output.next_tokens.shape)} "
                f"at iteration {self.it} for {num_samples} sampled positions ({batch.describe()})"
            )
        f.max_forward_tokens = max(f.max_forward_tokens, batch.num_tokens)
        return output

    def _take(
        self, batch: ForwardBatch, output: ForwardOutput, computing: list[_Computing]
    ) -> list[tuple[Request, int]]:
        """The requests after the forward pass: prefill chunks computed; each sampled
        request keeps its drafts while the samples confirm them, then one sample, and
        ends on a stop, a stop check or ``max_new``. Returns who took how many."""
        f = self.figures
        tokens = output.next_tokens.tolist()
        stops = self._stop_set
        fast = self.policy.stop_check is None and not self.keep_logits
        took: list[tuple[Request, int]] = []
        decodes = prefills = k = 0
        now = time.monotonic()
        give = self.moves is not None and self.moves.give_after_first
        for j, (r, got, samples, d, decode) in enumerate(computing):
            r.computed_total += got
            r.computed_here += got
            r.iterations += 1
            decodes += decode
            prefills += not decode
            if not samples:
                r.computed += got
                f.prefill_tokens += got
                continue
            if samples == 1 and fast:  # one sample, no drafts: scalars, no array work
                known = r.known
                token = tokens[k]
                k += 1
                r.tokens[known] = token
                r.known = known + 1
                r.computed = known
                if r.alloced > known:
                    r.truncate_to = known
                if token in stops:
                    r.finish = "stop"
                elif known + 1 - r.prompt_len >= r.max_new:
                    r.finish = "length"
                first = known == r.prompt_len
                taken = 1
                if decode:
                    f.decode_tokens += 1
                else:
                    f.prefill_tokens += got
            else:
                first, taken = self._sampled(r, batch, output, j, k, samples, d, decode, got)
                k += samples
            took.append((r, taken))
            if not r.first_at:
                r.first_at = now
                f.first_token_s.append(now - self.started_at)
            r.last_at, r.taken_here = now, r.taken_here + taken
            if r.finish:
                self.running.remove(r)
                self.leaving.append(r)
                self.finished.append(r)
                f.finished += 1
            elif give and first:
                self.running.remove(r)  # its first tokens: on to a decode worker, from the next Step
                self.giving.append(r)
        f.mixed_forwards += int(decodes > 0 and prefills > 0)
        return took

    def _sampled(
        self,
        r: Request,
        batch: ForwardBatch,
        output: ForwardOutput,
        j: int,
        k: int,
        samples: int,
        d: int,
        decode: bool,
        got: int,
    ) -> tuple[bool, int]:
        """Batch entry ``j``'s samples (from ``k``) taken by ``r``, drafts and all;
        whether they were its first, and how many it took."""
        f = self.figures
        mine = output.next_tokens[k : k + samples]
        kept = 0
        if d:
            end = int(batch.offsets[j + 1])
            wrong = np.flatnonzero(batch.token_ids[end - d : end] != mine[:d])
            kept = int(wrong[0]) if wrong.size else d
        known = r.known
        taken = self._append(r, mine[: kept + 1], output.logits, k)
        r.computed = min(known + kept, r.known)  # the chunk, and the drafts kept, have K/V
        if r.alloced > r.computed:
            r.truncate_to = r.computed  # the rejected drafts' K/V goes in the next Step
        if decode:
            f.decode_tokens += 1 + kept
            f.drafts_proposed += d
            f.drafts_kept += kept
        else:
            f.prefill_tokens += got
        return known == r.prompt_len, taken

    def _append(self, r: Request, tokens: np.ndarray, logits: Any, first: int) -> int:
        """Append the sampled ``tokens`` ``r`` keeps, up to its end: a stop token, the
        stop check (after the token that completes a stop string) or ``max_new``.
        Returns how many it took."""
        n = min(tokens.size, r.max_new - (r.known - r.prompt_len))
        finish = ""
        if self.stops.size:
            hits = np.flatnonzero(np.isin(tokens[:n], self.stops))
            if hits.size:
                n, finish = int(hits[0]) + 1, "stop"
        start = r.known
        r.tokens[start : start + n] = tokens[:n]
        stop_check = self.policy.stop_check
        if stop_check is not None:
            for j in range(1, n + 1):  # k + 1 tokens at most
                r.known = start + j
                if stop_check(r):
                    n, finish = j, "stop"
                    break
        r.known = start + n
        if not finish and r.known - r.prompt_len >= r.max_new:
            finish = "length"
        r.finish = finish
        if self.keep_logits and logits is not None:
            r.logits += [logits[first + j].clone() for j in range(n)]
        return n

    def _preempt(self, oom: int) -> None:
        """On ``OUT_OF_PAGES`` the youngest running request is preempted (released next
        iteration, then requeued) and admissions pause."""
        f = self.figures
        f.out_of_pages += oom
        self._pressure = oom > 0
        if oom and self.running:
            victim = max(self.running, key=lambda r: (r.admitted, r.index))
            self.running.remove(victim)
            self.leaving.append(victim)
            f.preemptions += 1


def _ticket_slot(ticket: str) -> int:
    from kvmem.client.handoff import ticket_slot

    return ticket_slot(ticket)


def _chain(head: Request | None, rest: Iterator[Request], more: Iterable[Request]) -> Iterator[Request]:
    if head is not None:
        yield head
    yield from rest
    yield from more
