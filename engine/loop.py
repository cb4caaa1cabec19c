"""The engine's iteration loop (:class:`Loop`): one :meth:`Loop.iteration` is one Step of
the allocator (a :class:`~.backend.Backend`: kvmem's batched client or the drop-in) and
one forward pass of the model (:class:`~.hf_model.TransformersModel`):

1. requests that finished or were preempted last iteration are released with their
   token ids (their full pages enter the shared prefix cache); a request whose rejected
   drafts left K/V past what it keeps is truncated; running requests still in their
   prompt cache their newly full pages (cache items), so other sessions match them at
   once;
2. allocs within the token budget: every decode first (1 token, or 1 + its drafts), then
   the next prefill chunk of each prefilling request, then new requests from the waiting
   queue, each matched against the prefix cache (``match=``, at most all but its last
   token: one is always computed, for the logits) with its first chunk allocated in the
   same Step (the need counts from 0: the server gives what the match did not cover);
3. one forward pass over every token allocated, packed ragged (prefill chunks and
   decodes mixed); each request whose computed tokens reached its known ones samples the
   next token (a decode with drafts samples after each draft too and keeps the drafts
   the samples confirm, plus one), and stops on a stop token, a stop string
   (``stop_check``) or at ``max_new_tokens``;
4. an alloc answered ``OUT_OF_PAGES`` preempts the youngest running request: released
   with its computed tokens next iteration, requeued at the front; when readmitted it
   matches what it had (mostly from the cache) and recomputes the rest. Admissions pause
   for an iteration after an ``OUT_OF_PAGES``.

A request's tokens are one array (its prompt, then what it sampled): ``computed`` of them
have their K/V written, ``known`` are known; the request computes
``tokens[computed:known]`` in chunks, and samples once the chunk reaches ``known`` (a
decode is a chunk of one). A resumed request is no special case: it has more known
tokens than its prompt.

**Drafts** (``speculate=k``, prompt lookup): a decode proposes up to ``k`` tokens that
followed the last occurrence of its trailing n-gram (3, else 2, else 1 tokens) earlier in
its own tokens, and computes them in the same forward. Sample ``s_j`` follows draft
``j`` (``s_0`` the decode's own); drafts are kept while ``draft[j] == s_j``, then
``s_a`` is appended: the tokens are exactly those decoding one at a time gives (greedy:
the same argmax; sampled: each kept token was drawn from the same distribution). The
K/V of the rejected drafts is dropped with a truncate in the next Step.

Why not :class:`~.scheduler.Scheduler`: its requests come from the synthetic workload
with a fixed length each (they end when every token of it is computed, drafts drawn from
the workload, K/V read back before release); a real model's requests end on a sampled
stop token, and report per-request figures. The loop here is the same plan without the
workload and read-back.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from .backend import NOT_OPENED, OK, OUT_OF_PAGES, Backend, Outcome, Plan
from .hf_model import TransformersModel
from .model import Admission, BatchBuilder

if TYPE_CHECKING:
    from .handoff import Moves

__all__ = ["MAX_PREEMPTIONS", "Loop", "Request", "RunFigures", "propose_drafts"]

MAX_PREEMPTIONS = 32
"""A request preempted more often than this fails the run (the pool cannot hold it)."""


@dataclasses.dataclass(slots=True)
class RunFigures:
    """One generation run: ``iterations`` (Steps), forwards of prefill and decode tokens
    together (``mixed_forwards``), the most tokens in a forward, preemptions, allocs
    answered ``OUT_OF_PAGES``, admissions put off for want of a request slot, drafts
    proposed and kept, and seconds in Steps and forwards."""

    iterations: int = 0
    mixed_forwards: int = 0
    max_forward_tokens: int = 0
    preemptions: int = 0
    out_of_pages: int = 0
    no_free_slot: int = 0
    drafts_proposed: int = 0
    drafts_kept: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0
    first_token_s: list[float] = dataclasses.field(default_factory=list)  # per first token sampled here


class Request:
    """A request in the loop (see the module's docstring for ``computed`` and ``known``)."""

    __slots__ = (
        "admitted",
        "alloced",
        "cached_pages",
        "computed",
        "computed_here",
        "computed_total",
        "drafts",
        "finish",
        "first_at",
        "index",
        "iterations",
        "known",
        "last_at",
        "logits",
        "matched_total",
        "moves",
        "preemptions",
        "prompt_len",
        "since",
        "slot",
        "taken_here",
        "ticket",
        "tokens",
        "truncate_to",
    )

    def __init__(self, index: int, prompt: np.ndarray, max_new_tokens: int) -> None:
        self.index = index
        self.prompt_len = int(prompt.size)
        self.tokens = np.zeros(prompt.size + max_new_tokens, dtype=np.int32)
        self.tokens[: prompt.size] = prompt
        self.known = self.prompt_len
        self.slot = self.computed = self.alloced = self.cached_pages = self.drafts = 0
        self.admitted = self.preemptions = self.matched_total = self.computed_total = self.iterations = 0
        self.truncate_to = -1
        self.finish = ""
        self.logits: list[torch.Tensor] = []
        # Timing (monotonic seconds) and moves: the first token's time (whichever process
        # sampled it), when this process took the request (admission or adoption), its
        # last token; tokens taken and computed here; hand-offs it went through.
        self.first_at = self.last_at = self.since = 0.0
        self.taken_here = self.computed_here = self.moves = 0
        self.ticket = ""

    @property
    def rid(self) -> str:
        return f"{self.index}.{self.preemptions}"

    def new_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len : self.known]


def propose_drafts(tokens: np.ndarray, k: int, max_ngram: int = 3) -> np.ndarray:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence
    of ``tokens``' trailing n-gram (the longest of ``max_ngram`` .. 1 that occurs);
    empty when none does. Vectorised over the sequence."""
    n_tokens = tokens.size
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class Loop:
    """One generation run over ``reqs`` (see the module's docstring); :meth:`iteration`
    returns the requests that took new tokens, with how many each took."""

    def __init__(
        self,
        backend: Backend,
        model: TransformersModel,
        reqs: list[Request],
        *,
        max_new_tokens: int,
        stops: frozenset[int],
        budget: int,
        max_running: int,
        speculate: int = 0,
        stop_check: Callable[[Request], bool] | None = None,
        keep_logits: bool = False,
        moves: Moves | None = None,
    ) -> None:
        self.backend = backend
        self.model = model
        self.ps = backend.page_size
        self.max_running = min(max_running, budget)  # every running request's decode fits the budget
        self.max_new = max_new_tokens
        self.stops = stops
        self.budget = budget
        self.speculate = speculate
        self.stop_check = stop_check
        self.keep_logits = keep_logits
        self.waiting: collections.deque[Request] = collections.deque(reqs)
        self.running: list[Request] = []
        self.leaving: list[Request] = []  # finished or preempted: released in the next Step
        self.requeue: list[Request] = []  # the preempted among them
        self.pressure = False
        self.it = 0
        self.figures = RunFigures()
        self.moves = moves  # hand-offs and adoptions (see .handoff)
        self.finished: list[Request] = []  # in the order they finished here
        self.started_at = time.monotonic()  # the run's start, for the first tokens' times

    @property
    def done(self) -> bool:
        busy = self.waiting or self.running or self.leaving
        return not busy and (self.moves is None or not self.moves.expecting())

    def abandon(self) -> None:
        """After a failure: release every request this run holds (no tokens cached)."""
        slots = [r.slot for r in self.running + self.leaving]
        if slots:
            self.backend.step(Plan(release_slots=slots, release_tokens=[np.zeros(0, np.int32) for _ in slots]))

    def iteration(self) -> list[tuple[Request, int]]:
        f = self.figures
        plan = Plan()
        for r in self.leaving:
            plan.release_slots.append(r.slot)
            plan.release_tokens.append(r.tokens[: r.computed])
        released = [r.rid for r in self.leaving]
        for r in self.requeue:  # back at the front, in their order, to recompute
            r.preemptions += 1
            if r.preemptions > MAX_PREEMPTIONS:
                raise RuntimeError(
                    f"prompt {r.index} ({r.known} tokens) was preempted {r.preemptions} times: the pool's free pages "
                    f"cannot hold it with the others running (kvmem serve --num-pages, or a smaller max_running)"
                )
            r.slot = r.computed = r.alloced = r.cached_pages = 0
            r.truncate_to = -1
        self.waiting.extendleft(reversed(self.requeue))
        self.leaving, self.requeue = [], []
        moves = self.moves
        if moves is not None:
            self._moves(plan, moves)
        for r in self.running:
            if r.truncate_to >= 0:  # rejected drafts: their K/V goes
                plan.truncate_slots.append(r.slot)
                plan.truncate_lens.append(r.truncate_to)
                r.alloced, r.truncate_to = r.truncate_to, -1
            fresh = r.ticket and r.admitted == self.it  # adopted in this Step: its cache items after it
            if r.computed <= r.prompt_len and r.computed // self.ps > r.cached_pages and not fresh:  # new full pages
                plan.cache.append((r.slot, r.tokens[: r.computed]))
                r.cached_pages = r.computed // self.ps
        items = self._allocs()  # (request, need)
        admitting = self._admit(items)
        if not (items or plan.release_slots or plan.handoff_slots):
            if self.waiting:  # every request slot is another session's: a moment
                time.sleep(0.001)
            self.pressure = False
            return []
        for r, need in items:
            plan.alloc_slots.append(r.slot)
            plan.alloc_needs.append(need)
            plan.alloc_expected.append(-1 if r in admitting else r.alloced)  # the match decides where they start
        plan.match = [(r.slot, r.tokens[: r.known], r.known - 1) for r in admitting]
        started = time.perf_counter()
        res = self.backend.step(plan)
        if moves is not None:
            moves.stepped(res.tickets)
        f.step_seconds += time.perf_counter() - started
        f.iterations += 1
        self.it += 1
        for r, m in zip(admitting, res.match_lens.tolist(), strict=True):
            r.computed = r.alloced = m
            r.cached_pages = m // self.ps
            r.matched_total += m
        return self._forward(items, res, released, admitting)

    def _moves(self, plan: Plan, moves: Moves) -> None:
        """Hand-offs (a drain gives everything) and adoptions into ``plan``: the adopted
        requests run from now on (their allocs go in the same Step)."""
        if moves.draining and (self.running or self.waiting):
            moves.drain(self.running, list(self.waiting))
            self.waiting.clear()
        plan.handoff_slots, plan.handoff_states, truncates = moves.plan_giving()
        for slot, n in truncates:
            plan.truncate_slots.append(slot)
            plan.truncate_lens.append(n)
        if moves.draining:
            return
        idle = not (self.running or self.waiting or self.leaving or plan.handoff_slots)
        adopted, prompts = moves.take(self.max_running - len(self.running), idle)
        now = time.monotonic()
        for r in adopted:
            plan.adopt.append((r.ticket, r.rid))
            r.since, r.admitted = now, self.it
            self.running.append(r)
        self.waiting.extend(prompts)

    def _allocs(self) -> list[tuple[Request, int]]:
        """Decodes (with their drafts), then prefill chunks, within the budget."""
        items = []
        budget = self.budget - sum(r.known - r.computed == 1 for r in self.running)
        for r in self.running:
            if r.known - r.computed == 1:
                r.drafts = 0
                room = min(self.speculate, budget, self.max_new - (r.known - r.prompt_len) - 1)
                if room > 0:
                    drafts = propose_drafts(r.tokens[: r.known], room)
                    r.tokens[r.known : r.known + drafts.size] = drafts  # overwritten by what is kept
                    r.drafts = int(drafts.size)
                    budget -= r.drafts
                    self.figures.drafts_proposed += r.drafts
                items.append((r, 1 + r.drafts))
        for r in self.running:
            if r.known - r.computed > 1 and budget > 0:
                n = min(r.known - r.computed, budget)
                items.append((r, n))
                budget -= n
        return items

    def _admit(self, items: list[tuple[Request, int]]) -> list[Request]:
        """New requests within what the budget leaves (given slots here), appended to
        ``items`` with their first chunk counted from 0 (the match in the same Step
        covers its start)."""
        budget = self.budget - sum(n for _, n in items)
        new: list[Request] = []
        while self.waiting and not self.pressure and budget > 0 and len(self.running) + len(new) < self.max_running:
            new.append(self.waiting.popleft())
            budget -= min(new[-1].known, budget)
        self.pressure = False
        if not new:
            return []
        slots = self.backend.open([r.rid for r in new])
        if slots is None:  # other sessions hold the server's slots: later
            self.waiting.extendleft(reversed(new))
            self.figures.no_free_slot += 1
            return []
        budget = self.budget - sum(n for _, n in items)
        now = time.monotonic()
        for r, slot in zip(new, slots, strict=True):
            r.slot, r.admitted, r.drafts, r.since = slot, self.it, 0, now
            need = min(r.known, max(budget, 1))
            budget -= need
            items.append((r, need))
            self.running.append(r)
        return new

    def _forward(
        self, items: list[tuple[Request, int]], res: Outcome, released: list[str], new: list[Request]
    ) -> list[tuple[Request, int]]:
        f = self.figures
        status, offsets = res.status, res.offsets
        assert res.kv_loc is not None, "the engine's backend has KV memory"
        builder = BatchBuilder()
        computing: list[tuple[Request, int, int]] = []  # (request, tokens computed, samples)
        decodes = prefills = oom = 0
        unopened: list[Request] = []
        for i, (r, _) in enumerate(items):
            s = int(status[i])
            if s == OUT_OF_PAGES:
                oom += 1
                continue
            if s == NOT_OPENED:  # the drop-in's Open found no request slot: back to the queue
                unopened.append(r)
                continue
            if s != OK:
                raise RuntimeError(f"alloc for prompt {r.index} (slot {r.slot}) failed with status {s}")
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            got = hi - lo
            r.alloced += got
            if got == 0:  # an admission whose match covered its first chunk
                continue
            start = r.computed
            samples = 1 + r.drafts if start + got == r.known + r.drafts else 0
            builder.add(r.rid, r.slot, start, r.tokens[start : start + got], res.kv_loc[lo:hi], samples)
            computing.append((r, got, samples))
            if r.known - start == 1:
                decodes += 1
            else:
                prefills += 1
        self._requeue_unopened(unopened)
        admitted = [Admission(r.rid, r.tokens[: r.known]) for r in new if r not in unopened]
        batch = builder.build(admitted, released, has_kv=True)
        started = time.perf_counter()
        out = self.model.forward(batch).next_tokens
        f.forward_seconds += time.perf_counter() - started
        f.max_forward_tokens = max(f.max_forward_tokens, batch.num_tokens)
        f.mixed_forwards += int(decodes > 0 and prefills > 0)
        took: list[tuple[Request, int]] = []
        k = 0
        now = time.monotonic()
        for r, got, samples in computing:
            r.computed_total += got
            r.computed_here += got
            r.iterations += 1
            if not samples:
                r.computed += got
                continue
            taken = self._take(r, out[k : k + samples], k)
            k += samples
            took.append((r, taken))
            if not r.first_at:
                r.first_at = now
                f.first_token_s.append(now - self.started_at)
            r.last_at, r.taken_here = now, r.taken_here + taken
            if r.finish:
                self.finished.append(r)
            elif self.moves is not None and self.moves.give_after_first and r.known - r.prompt_len == 1:
                self.running.remove(r)  # its first token: on to a decode worker, from the next Step
                self.moves.giving.append(r)
        f.out_of_pages += oom
        if oom:
            self.pressure = True
            if self.running:
                victim = max(self.running, key=lambda r: (r.admitted, r.index))
                self.running.remove(victim)
                self.leaving.append(victim)
                self.requeue.append(victim)
                f.preemptions += 1
        return took

    def _take(self, r: Request, sampled: np.ndarray, first: int) -> int:
        """Append the sampled tokens ``r`` keeps (its drafts while they match, then one);
        returns how many. Its K/V past what it keeps is truncated next iteration."""
        drafts = r.tokens[r.known : r.known + r.drafts].copy()
        kept = int(np.cumprod(drafts == sampled[: r.drafts]).sum()) if r.drafts else 0
        self.figures.drafts_kept += kept
        old_known = r.known
        taken = 0
        for j in range(kept + 1):
            token = int(sampled[j])
            r.tokens[r.known] = token
            r.known += 1
            taken += 1
            if self.keep_logits:
                assert self.model.last_logits is not None
                r.logits.append(self.model.last_logits[first + j].clone())
            if token in self.stops or (self.stop_check is not None and self.stop_check(r)):
                r.finish = "stop"
            elif r.known - r.prompt_len >= self.max_new:
                r.finish = "length"
            if r.finish:
                break
        r.computed = min(old_known + kept, r.known)  # the decode's token and the kept drafts have K/V
        if r.alloced > r.computed:
            r.truncate_to = r.computed
        r.drafts = 0
        if r.finish:
            self.running.remove(r)
            self.leaving.append(r)
        return taken

    def _requeue_unopened(self, unopened: list[Request]) -> None:
        if not unopened:
            return
        self.figures.no_free_slot += 1
        for r in unopened:
            self.running.remove(r)
            r.slot = r.computed = r.alloced = r.cached_pages = 0
        self.waiting.extendleft(reversed(unopened))
