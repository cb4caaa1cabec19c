"""The engine: a transformers causal LM generating on kvmem's KV memory.

:class:`Engine` attaches a :class:`kvmem.client.KVMemClient` to a kvmem server (its pool
checked against the model's geometry, :func:`~.hf_model.check_geometry`) and
:meth:`Engine.generate` completes prompts with continuous batching, one Step and one
forward pass (:class:`~.hf_model.TransformersModel`) per iteration:

1. requests that finished or were preempted last iteration are released with their
   token ids (their full pages enter the shared prefix cache); running requests still in
   their prompt cache their newly full pages (cache items), so other sessions can match
   them at once;
2. allocs within the token budget: every decode first (1 token), then the next prefill
   chunk of each prefilling request, then new requests from the waiting queue (opened in
   one Open), each matched against the prefix cache (``match=``, at most all but its last
   token: one is always computed, for the logits) with its first chunk allocated in the
   same Step (the need counts from 0: the server gives what the match did not cover);
3. one forward pass over every token allocated, packed ragged (prefill chunks and
   decodes mixed); each request whose computed tokens reached its known ones samples the
   next token, and stops on a stop token or at ``max_new_tokens``;
4. an alloc answered ``OUT_OF_PAGES`` preempts the youngest running request: released
   with its computed tokens next iteration, requeued at the front; when readmitted it
   matches what it had (mostly from the cache) and recomputes the rest. Admissions pause
   for an iteration after an ``OUT_OF_PAGES``.

A request's tokens are one array (its prompt, then what it sampled): ``computed`` of them
have their K/V written, ``known`` are known; the request computes
``tokens[computed:known]`` in chunks, and samples once the chunk reaches ``known`` (a
decode is a chunk of one). A resumed request is no special case: it has more known
tokens than its prompt.

Why not :class:`~.scheduler.Scheduler`: its requests come from the synthetic workload
with a fixed length each (they end when every token of it is computed, drafts drawn from
the workload, K/V read back before release); a real model's requests end on a sampled
stop token, and report per-request figures. The loop here is the same plan (decodes,
chunks, admissions with a match, release into the cache, preemption of the youngest)
without the workload, drafts and read-back.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvmem.client import KVMemClient
from kvmem.client.errors import NoFreeRequestSlot

from .backend import OK, OUT_OF_PAGES
from .hf_model import Sampling, TransformersModel, check_geometry
from .model import Admission, BatchBuilder

__all__ = ["Completion", "Engine", "RunFigures"]

MAX_PREEMPTIONS = 32
"""A request preempted more often than this fails the run (the pool cannot hold it)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """One prompt's completion: the sampled ``token_ids`` (the stop token included),
    ``text`` (decoded when the engine has a tokenizer), why it ended (``"stop"``: a stop
    token; ``"length"``: ``max_new_tokens``), and its figures: ``prompt_tokens``;
    ``matched_tokens``, tokens attached from the prefix cache (over its admissions);
    ``computed_tokens``, tokens whose K/V it computed (recomputation included);
    ``iterations``, forward passes it took part in; ``preemptions``."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    matched_tokens: int
    computed_tokens: int
    iterations: int
    preemptions: int


@dataclasses.dataclass(slots=True)
class RunFigures:
    """One :meth:`Engine.generate` call: ``iterations`` (Steps), forwards of prefill and
    decode tokens together (``mixed_forwards``), the most tokens in a forward,
    preemptions and allocs answered ``OUT_OF_PAGES``, and seconds in Steps and forwards."""

    iterations: int = 0
    mixed_forwards: int = 0
    max_forward_tokens: int = 0
    preemptions: int = 0
    out_of_pages: int = 0
    no_free_slot: int = 0
    step_seconds: float = 0.0
    forward_seconds: float = 0.0


class _Request:
    """A request in the loop (see the module's docstring for ``computed`` and ``known``)."""

    __slots__ = (
        "admitted",
        "alloced",
        "cached_pages",
        "computed",
        "computed_total",
        "finish",
        "index",
        "iterations",
        "known",
        "matched_total",
        "preemptions",
        "prompt_len",
        "slot",
        "tokens",
    )

    def __init__(self, index: int, prompt: np.ndarray, max_new_tokens: int) -> None:
        self.index = index
        self.prompt_len = int(prompt.size)
        self.tokens = np.zeros(prompt.size + max_new_tokens, dtype=np.int32)
        self.tokens[: prompt.size] = prompt
        self.known = self.prompt_len
        self.slot = self.computed = self.alloced = self.cached_pages = 0
        self.admitted = self.preemptions = self.matched_total = self.computed_total = self.iterations = 0
        self.finish = ""

    @property
    def rid(self) -> str:
        return f"{self.index}.{self.preemptions}"


class Engine:
    """A transformers causal LM generating on the kvmem server at ``target``.

    ``model``: a transformers causal LM (switched to kvmem's attention); ``tokenizer``:
    optional, to take prompts as text and decode completions; ``name`` and
    ``cache_namespace``: the session's (requests share cached pages within a
    namespace); ``max_running``: requests running at once. Attaching checks the pool's
    geometry against the model's and refuses a mismatch in one line that gives the
    ``kvmem serve`` flags (:class:`~.hf_model.GeometryMismatch`). Use as a context
    manager, or :meth:`close`. :attr:`figures` holds the last :meth:`generate`'s.
    """

    def __init__(
        self,
        model: Any,
        target: str,
        *,
        tokenizer: Any = None,
        name: str = "kvmem-engine",
        cache_namespace: str = "",
        auth_token: str | None = None,
        max_running: int = 64,
    ) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.kv = KVMemClient(target, name=name, auth_token=auth_token, cache_namespace=cache_namespace)
        try:
            check_geometry(model.config, self.kv.geometry, next(model.parameters()).dtype)
        except BaseException:
            self.kv.close()
            raise
        geometry = self.kv.geometry
        self.page_size = int(geometry.page_size)
        self.max_context = int(geometry.max_context_len)
        self.figures = RunFigures()

    def close(self) -> None:
        """Detach from the server (its open requests are released)."""
        self.kv.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[str | Sequence[int] | np.ndarray],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        sampling: Sampling | None = None,
        token_budget: int = 512,
    ) -> list[Completion]:
        """Complete ``prompts`` (text, with a tokenizer, or token ids), in their order.
        Each ends after ``max_new_tokens`` or on a token of ``stop_token_ids`` (None: the
        model's ``eos_token_id``, if it has one). ``sampling``: greedy by default;
        ``token_budget``: the most tokens computed per forward pass (prefill chunks and
        decodes together; it also bounds the requests running at once)."""
        if max_new_tokens < 1 or token_budget < 1:
            raise ValueError(f"max_new_tokens and token_budget must be >= 1, got {max_new_tokens}, {token_budget}")
        reqs = [_Request(i, self._encode(i, p), max_new_tokens) for i, p in enumerate(prompts)]
        for r in reqs:
            if r.tokens.size > self.max_context:
                raise ValueError(
                    f"prompt {r.index}: {r.prompt_len} tokens + max_new_tokens {max_new_tokens} exceed the server's "
                    f"max context of {self.max_context} tokens (kvmem serve --max-context)"
                )
        stops = frozenset(self._stop_tokens(stop_token_ids))
        tm = TransformersModel(self.model, self.kv.kv_cache(), self.kv.block_table, self.page_size, sampling)
        loop = _Loop(self, tm, reqs, max_new_tokens, stops, token_budget)
        try:
            loop.run()
        except BaseException:
            with contextlib.suppress(Exception):  # the session may be what failed
                loop.abandon()
            raise
        self.figures = loop.figures
        return [self._completion(r) for r in reqs]

    def _encode(self, index: int, prompt: str | Sequence[int] | np.ndarray) -> np.ndarray:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text: the engine needs a tokenizer (Engine(..., tokenizer=))")
            prompt = self.tokenizer(prompt)["input_ids"]
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        vocab = int(self.model.config.vocab_size)
        if ids.size == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"prompt {index}: needs at least one token id in [0, {vocab}), got {ids[:8].tolist()}")
        return ids.astype(np.int32)

    def _stop_tokens(self, stop_token_ids: Sequence[int] | None) -> set[int]:
        if stop_token_ids is not None:
            return {int(t) for t in stop_token_ids}
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            return set()
        return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}

    def _completion(self, r: _Request) -> Completion:
        out = r.tokens[r.prompt_len : r.known].tolist()
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer is not None else None
        return Completion(
            r.index, out, text, r.finish, r.prompt_len, r.matched_total, r.computed_total, r.iterations, r.preemptions
        )


class _Loop:
    """One :meth:`Engine.generate` run: the iterations of the module's docstring."""

    def __init__(
        self,
        engine: Engine,
        model: TransformersModel,
        reqs: list[_Request],
        max_new_tokens: int,
        stops: frozenset[int],
        budget: int,
    ) -> None:
        self.kv = engine.kv
        self.model = model
        self.ps = engine.page_size
        self.max_running = min(engine.max_running, budget)  # every running request's decode fits the budget
        self.max_new = max_new_tokens
        self.stops = stops
        self.budget = budget
        self.waiting: collections.deque[_Request] = collections.deque(reqs)
        self.running: list[_Request] = []
        self.leaving: list[_Request] = []  # finished or preempted: released in the next Step
        self.requeue: list[_Request] = []  # the preempted among them
        self.pressure = False
        self.it = 0
        self.figures = RunFigures()

    def run(self) -> None:
        while self.waiting or self.running or self.leaving:
            self.iteration()

    def abandon(self) -> None:
        """After a failure: release every request this run holds (no tokens cached)."""
        slots = [r.slot for r in self.running + self.leaving]
        if slots:
            self.kv.step(release_slots=slots)

    def iteration(self) -> None:
        f = self.figures
        release_slots = [r.slot for r in self.leaving]
        release_tokens = [r.tokens[: r.computed] for r in self.leaving]
        released = [r.rid for r in self.leaving]
        for r in self.requeue:  # back at the front, in their order, to recompute
            r.preemptions += 1
            if r.preemptions > MAX_PREEMPTIONS:
                raise RuntimeError(
                    f"prompt {r.index} ({r.known} tokens) was preempted {r.preemptions} times: the pool's free pages "
                    f"cannot hold it with the others running (kvmem serve --num-pages, or a smaller max_running)"
                )
            r.slot = r.computed = r.alloced = r.cached_pages = 0
        self.waiting.extendleft(reversed(self.requeue))
        self.leaving, self.requeue = [], []
        cache = []
        for r in self.running:  # newly full pages of prompts (the whole prompt once prefilled): into the cache now
            if r.computed <= r.prompt_len and r.computed // self.ps > r.cached_pages:
                cache.append((r.slot, r.tokens[: r.computed]))
                r.cached_pages = r.computed // self.ps
        items = self._allocs()  # (request, need)
        expected = [r.alloced for r, _ in items]
        admitting = self._admit(items)
        expected += [-1] * len(admitting)  # the match decides where they start
        if not (items or release_slots):
            if self.waiting:  # every request slot is another session's: a moment
                time.sleep(0.001)
            self.pressure = False
            return
        started = time.perf_counter()
        res = self.kv.step(
            release_slots=release_slots,
            release_token_ids=release_tokens if release_slots else None,
            cache=cache or None,
            match=[(r.slot, r.tokens[: r.known], r.known - 1) for r in admitting] or None,
            alloc_slots=[r.slot for r, _ in items],
            alloc_needs=[n for _, n in items],
            alloc_expected_lens=expected if items else None,
        )
        f.step_seconds += time.perf_counter() - started
        f.iterations += 1
        self.it += 1
        for r, m in zip(admitting, res.match_lens.tolist(), strict=True):
            r.computed = r.alloced = m
            r.cached_pages = m // self.ps
            r.matched_total += m
        self._forward(items, res, released, admitting)

    def _allocs(self) -> list[tuple[_Request, int]]:
        """Decodes, then prefill chunks, within the budget."""
        items = [(r, 1) for r in self.running if r.known - r.computed == 1]
        budget = self.budget - len(items)
        for r in self.running:
            if r.known - r.computed > 1 and budget > 0:
                n = min(r.known - r.computed, budget)
                items.append((r, n))
                budget -= n
        return items

    def _admit(self, items: list[tuple[_Request, int]]) -> list[_Request]:
        """New requests within what the budget leaves (opened here), appended to ``items``
        with their first chunk counted from 0 (the match in the same Step covers its start)."""
        budget = self.budget - sum(n for _, n in items)
        new: list[_Request] = []
        while self.waiting and not self.pressure and budget > 0 and len(self.running) + len(new) < self.max_running:
            new.append(self.waiting.popleft())
            budget -= min(new[-1].known, budget)
        self.pressure = False
        if not new:
            return []
        try:
            slots = self.kv.open([r.rid for r in new]).tolist()
        except NoFreeRequestSlot:  # other sessions hold the server's slots: later
            self.waiting.extendleft(reversed(new))
            self.figures.no_free_slot += 1
            return []
        budget = self.budget - sum(n for _, n in items)
        for r, slot in zip(new, slots, strict=True):
            r.slot, r.admitted = slot, self.it
            need = min(r.known, max(budget, 1))
            budget -= need
            items.append((r, need))
            self.running.append(r)
        return new

    def _forward(self, items: list[tuple[_Request, int]], res: Any, released: list[str], new: list[_Request]) -> None:
        f = self.figures
        status = res.status.numpy()
        offsets = res.kv_loc_offsets.numpy()
        kv_loc = res.kv_loc.numpy()
        builder = BatchBuilder()
        computing: list[tuple[_Request, int, bool]] = []
        decodes = prefills = oom = 0
        for i, (r, _) in enumerate(items):
            s = int(status[i])
            if s == OUT_OF_PAGES:
                oom += 1
                continue
            if s != OK:
                raise RuntimeError(f"alloc for prompt {r.index} (slot {r.slot}) failed with status {s}")
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            got = hi - lo
            r.alloced += got
            if got == 0:  # an admission whose match covered its first chunk
                continue
            start = r.computed
            samples = start + got == r.known
            builder.add(r.rid, r.slot, start, r.tokens[start : start + got], kv_loc[lo:hi], int(samples))
            computing.append((r, got, samples))
            if r.known - start == 1:
                decodes += 1
            else:
                prefills += 1
        admitted = [Admission(r.rid, r.tokens[: r.known]) for r in new]
        batch = builder.build(admitted, released, has_kv=True)
        started = time.perf_counter()
        out = self.model.forward(batch).next_tokens
        f.forward_seconds += time.perf_counter() - started
        f.max_forward_tokens = max(f.max_forward_tokens, batch.num_tokens)
        f.mixed_forwards += int(decodes > 0 and prefills > 0)
        k = 0
        for r, got, samples in computing:
            r.computed += got
            r.computed_total += got
            r.iterations += 1
            if not samples:
                continue
            token = int(out[k])
            k += 1
            r.tokens[r.known] = token
            r.known += 1
            if token in self.stops or r.known - r.prompt_len >= self.max_new:
                r.finish = "stop" if token in self.stops else "length"
                self.running.remove(r)
                self.leaving.append(r)
        f.out_of_pages += oom
        if oom:
            self.pressure = True
            if self.running:
                victim = max(self.running, key=lambda r: (r.admitted, r.index))
                self.running.remove(victim)
                self.leaving.append(victim)
                self.requeue.append(victim)
                f.preemptions += 1
