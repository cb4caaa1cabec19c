"""The engine: a transformers causal LM generating on kvmem's KV memory.

:class:`Engine` attaches to a kvmem server (its pool checked against the model's
geometry, :func:`~.hf_model.check_geometry`) through kvmem's batched client or through
the drop-in (:class:`kvmem.client.compat.KVAllocator`, driven as a reference scheduler
drives it: :class:`~kvmem.engine.compat_backend.CompatBackend`), and completes prompts
with continuous batching, one Step and one forward pass per iteration: the engine's
scheduler (:class:`kvmem.engine.scheduler.Scheduler`) with this engine's policy (drafts
by prompt lookup, :func:`propose_drafts`; stop strings; a limit on preemptions).
:meth:`Engine.stream` yields each request's new tokens (and text) as they come;
:meth:`Engine.generate` returns the completions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvmem.client import KVMemClient

from ..backend import Backend, KVMemBackend
from ..request import Request
from ..scheduler import Figures, Policy, Scheduler
from .hf_model import Sampling, TransformersModel, check_geometry

if TYPE_CHECKING:
    from ..handoff import Moves

__all__ = ["APIS", "MAX_PREEMPTIONS", "Completion", "Delta", "Engine", "RunFigures", "propose_drafts", "stop_tokens"]

APIS = ("client", "compat")
"""How the engine drives kvmem: the batched client, or the drop-in."""

MAX_PREEMPTIONS = 32
"""A request preempted more often than this fails the run (the pool cannot hold it)."""

RunFigures = Figures
"""One generation run's figures (:class:`kvmem.engine.scheduler.Figures`)."""


def propose_drafts(tokens: np.ndarray, k: int, max_ngram: int = 3) -> np.ndarray:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence
    of ``tokens``' trailing n-gram (the longest of ``max_ngram`` .. 1 that occurs);
    empty when none does. Vectorised over the sequence.

    A decode computes them in the same forward; sample ``s_j`` follows draft ``j``
    (``s_0`` the decode's own); drafts are kept while ``draft[j] == s_j``, then ``s_a``
    is appended: the tokens are exactly those decoding one at a time gives (greedy: the
    same argmax; sampled: each kept token was drawn from the same distribution)."""
    n_tokens = tokens.size
    for n in range(min(max_ngram, n_tokens - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # every earlier n-gram
        hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


def stop_tokens(model: Any, tokenizer: Any) -> list[int]:
    """What ends a completion: the generation config's EOS, else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """One prompt's completion: the sampled ``token_ids`` (the stop token included),
    ``text`` (decoded when the engine has a tokenizer; cut before a stop string), why it
    ended (``"stop"``: a stop token or string; ``"length"``: ``max_new_tokens``), and its
    figures: ``prompt_tokens``; ``matched_tokens``, tokens attached from the prefix cache
    (over its admissions); ``computed_tokens``, tokens whose K/V it computed
    (recomputation and rejected drafts included); ``iterations``, forward passes it took
    part in; ``preemptions``. ``logits``: with ``keep_logits``, the logits each token
    was sampled from, ``[len(token_ids), vocab]``."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    matched_tokens: int
    computed_tokens: int
    iterations: int
    preemptions: int
    logits: torch.Tensor | None = None
    ttft_s: float = 0.0  # its first token's time since the run started (in whichever process)
    tpot_s: float = 0.0  # time per output token in the process that finished it (0: one token only)
    moves: int = 0  # hand-offs it went through (kvmem generate --disaggregate, draining)
    computed_here: int = 0  # tokens whose K/V the process that finished it computed
    admitted_s: float = 0.0  # its (last) admission's time since the run started: ttft_s - admitted_s excludes queueing


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    """What one request took in one iteration (:meth:`Engine.stream`): its new
    ``token_ids``, the ``text`` they add (with a tokenizer: held back while it may be
    the start of a stop string or an unfinished character), and ``finish_reason`` on
    its last delta (None before)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None


class Engine:
    """A transformers causal LM generating on the kvmem server at ``target``.

    ``model``: a transformers causal LM (switched to kvmem's attention); ``tokenizer``:
    optional, to take prompts as text, decode completions and stop on strings; ``name``
    and ``cache_namespace``: the session's (requests share cached pages within a
    namespace); ``max_running``: requests running at once; ``api``: ``"client"`` (the
    batched client) or ``"compat"`` (the drop-in: request indices, one
    ``allocator.iteration()`` block per iteration, K/V read through ``req_to_page``);
    ``load_wait``: how a request whose prefix is still loading from the server's host
    tier waits: ``"layer"`` (it computes; each layer's attention waits for that layer's
    copy) or ``"iteration"`` (held out of the forwards until its load is in).
    ``model_id``: the model with its weights' revision, for a server with a store
    (``kvmem serve --store``: its store keys are made from it; :func:`.models.model_id`);
    ``fetch_wait_ms``: how long at most a request whose prefix that server is fetching
    from its store is held for it (0: never; :class:`~kvmem.engine.scheduler.Scheduler`).
    Attaching checks the pool's geometry against the model's and refuses a mismatch in
    one line that gives the ``kvmem serve`` flags (:class:`~.hf_model.GeometryMismatch`).
    Use as a context manager, or :meth:`close`. :attr:`figures` holds the last run's.
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
        api: str = "client",
        load_wait: str = "layer",
        model_id: str = "",
        fetch_wait_ms: float = 0.0,
    ) -> None:
        if load_wait not in ("layer", "iteration"):
            raise ValueError(f"load_wait must be 'layer' or 'iteration', got {load_wait!r}")
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        if api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_running = max_running
        self.api = api
        self.load_wait = load_wait
        if fetch_wait_ms < 0:
            raise ValueError(f"fetch_wait_ms must be >= 0, got {fetch_wait_ms}")
        self.fetch_wait_s = fetch_wait_ms / 1000
        self.kv = KVMemClient(
            target, name=name, auth_token=auth_token, cache_namespace=cache_namespace, model_id=model_id
        )
        try:
            check_geometry(model.config, self.kv.geometry, next(model.parameters()).dtype)
            self.backend, self.block_table = self._backend(name)
        except BaseException:
            self.kv.close()
            raise
        geometry = self.kv.geometry
        self.page_size = int(geometry.page_size)
        self.max_context = int(geometry.max_context_len)
        self.figures = RunFigures()

    def _backend(self, name: str) -> tuple[Backend, Any]:
        if self.api == "client":
            return KVMemBackend(self.kv), self.kv.block_table
        from kvmem.client.compat import KVAllocator

        from ..compat_backend import CompatBackend

        # Indices held at once: the running requests, and those leaving whose release goes with the next block.
        allocator = KVAllocator(self.kv, max_batch_size=2 * self.max_running, request_id_prefix=f"{name}-")
        return CompatBackend(allocator), allocator.req_to_page

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
        on_delta: Callable[[Delta], None] | None = None,
        **options: Any,
    ) -> list[Completion]:
        """Complete ``prompts`` (text, with a tokenizer, or token ids), in their order;
        the options are :meth:`stream`'s. ``on_delta`` is called with each
        :class:`Delta` as it comes (its ``text`` None: the completions decode once)."""
        run = self._run(prompts, **options)
        run.texts = None  # the completions decode once
        for delta in run:
            if on_delta is not None:
                on_delta(delta)
        return run.completions()

    def stream(self, prompts: Sequence[str | Sequence[int] | np.ndarray], **options: Any) -> Iterator[Delta]:
        """Complete ``prompts`` as :meth:`generate` does, yielding each request's new
        tokens as they are sampled (:class:`Delta`, in the order the iteration took
        them). Options:

        * ``max_new_tokens`` (required): the most tokens a completion takes;
        * ``stop_token_ids``: end on any of them (None: the model's ``eos_token_id``);
        * ``stop``: strings that end a completion (with a tokenizer), cut from its text;
        * ``sampling``: :class:`~.hf_model.Sampling` (greedy by default);
        * ``token_budget``: the most tokens computed per forward pass, prefill chunks,
          decodes and drafts together (512; it also bounds the requests running);
        * ``speculate``: drafts per decode by prompt lookup (0: none; :func:`propose_drafts`);
        * ``keep_logits``: keep each sampled token's logits (:attr:`Completion.logits`);
        * ``moves``: hand-offs and adoptions (:class:`~kvmem.engine.handoff.Moves`: requests leave
          for, or come from, other engine processes, their K/V in place); the
          completions are then those of the requests that finished here;
        * ``started_at``: the run's start (monotonic seconds) for time to first token;
        * ``indices``: the prompts' indices (default 0, 1, ...): a request keeps its
          index when it moves between processes.
        """
        return iter(self._run(prompts, **options))

    def _run(
        self,
        prompts: Sequence[str | Sequence[int] | np.ndarray],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        stop: Sequence[str] = (),
        sampling: Sampling | None = None,
        token_budget: int = 512,
        speculate: int = 0,
        keep_logits: bool = False,
        moves: Moves | None = None,
        started_at: float | None = None,
        indices: Sequence[int] | None = None,
    ) -> _Run:
        if max_new_tokens < 1 or token_budget < 1 or speculate < 0:
            raise ValueError(
                f"max_new_tokens and token_budget must be >= 1 and speculate >= 0, got {max_new_tokens}, "
                f"{token_budget}, {speculate}"
            )
        if stop and self.tokenizer is None:
            raise ValueError(f"stop strings {list(stop)} need a tokenizer (Engine(..., tokenizer=))")
        if any(not s for s in stop):
            raise ValueError(f"stop strings must not be empty, got {list(stop)}")
        order = range(len(prompts)) if indices is None else indices
        reqs = [Request(i, self._encode(i, p), max_new_tokens) for i, p in zip(order, prompts, strict=True)]
        for r in reqs:
            if r.tokens.size > self.max_context:
                raise ValueError(
                    f"prompt {r.index}: {r.prompt_len} tokens + max_new_tokens {max_new_tokens} exceed the server's "
                    f"max context of {self.max_context} tokens (kvmem serve --max-context)"
                )
        tm = TransformersModel(self.model, self.kv.kv_cache(), self.block_table, self.page_size, sampling)
        drafts = None
        if speculate:

            def drafts(r: Request, room: int) -> np.ndarray:
                return propose_drafts(r.tokens[: r.known], min(speculate, room))

        policy = Policy(drafts=drafts, max_preemptions=MAX_PREEMPTIONS, stop_check=self._stop_check(tuple(stop)))
        stops = self._stop_tokens(stop_token_ids)
        sched = Scheduler(
            self.backend,
            tm,
            budget=token_budget,
            max_running=self.max_running,
            policy=policy,
            stops=frozenset(stops),
            keep_logits=keep_logits,
            moves=moves,
            load_wait=self.load_wait,
            fetch_wait_s=self.fetch_wait_s,
        )
        sched.add(reqs)
        run = _Run(self, sched, reqs, tuple(stop))
        run.started_at = sched.started_at = time.monotonic() if started_at is None else started_at
        return run

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

    def _stop_tokens(self, stop_token_ids: Sequence[int] | None) -> list[int]:
        if stop_token_ids is not None:
            return [int(t) for t in stop_token_ids]
        return stop_tokens(self.model, self.tokenizer)

    def _stop_check(self, stop: tuple[str, ...]) -> Callable[[Request], bool] | None:
        """Whether a request's text now holds a stop string: its last tokens decoded
        (as many as the longest stop string has characters: each token adds one)."""
        if not stop:
            return None
        window = max(map(len, stop)) + 1

        def check(r: Request) -> bool:
            tail = self.tokenizer.decode(r.new_tokens()[-window:].tolist(), skip_special_tokens=True)
            return any(s in tail for s in stop)

        return check

    def text(self, token_ids: Sequence[int], stop: tuple[str, ...] = ()) -> str | None:
        """The text of a completion's tokens, cut before the first stop string in it."""
        if self.tokenizer is None:
            return None
        text: str = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=len(text))
        return text[:cut]


class _Run:
    """One :meth:`Engine.stream` run: iterating runs the scheduler and yields the
    deltas; :meth:`completions` once it is done."""

    def __init__(self, engine: Engine, sched: Scheduler, reqs: list[Request], stop: tuple[str, ...]) -> None:
        self.engine, self.sched, self.reqs, self.stop = engine, sched, reqs, stop
        self.texts: dict[int, _Detokenizer] | None = {} if engine.tokenizer is not None else None
        self.started_at = 0.0

    def __iter__(self) -> Iterator[Delta]:
        sched = self.sched
        try:
            while not sched.done:
                for r, n in sched.iteration():
                    yield self._delta(r, n)
        except BaseException:
            with contextlib.suppress(Exception):  # the session may be what failed
                sched.abandon()
            raise
        finally:
            self.engine.figures = sched.figures

    def _delta(self, r: Request, n: int) -> Delta:
        new = r.new_tokens()
        text = None
        if self.texts is not None:
            if r.index not in self.texts:
                self.texts[r.index] = _Detokenizer(self.engine.tokenizer, self.stop)
            text = self.texts[r.index].take(new, self.engine.text(new.tolist(), self.stop) if r.finish else None)
        return Delta(r.index, new[-n:].tolist(), text, r.finish or None)

    def completions(self) -> list[Completion]:
        """The completions of the run's prompts, in their order; with hand-offs, those of
        the requests that finished in this process, in the order they finished."""
        if not self.sched.done:
            raise RuntimeError("the run has not finished: iterate it to the end first")
        return [self._completion(r) for r in (self.reqs if self.sched.moves is None else self.sched.finished)]

    def _completion(self, r: Request) -> Completion:
        new = r.new_tokens().tolist()
        logits = torch.stack(r.logits) if r.logits else None
        figures = (r.prompt_len, r.matched_total, r.computed_total, r.iterations, r.preemptions)
        if r.moves == 0:  # the intervals between its tokens
            tpot = (r.last_at - r.first_at) / (r.taken_here - 1) if r.taken_here > 1 else 0.0
        else:  # taken over: from the adoption to its last token
            tpot = (r.last_at - r.since) / r.taken_here if r.taken_here else 0.0
        timing = (max(r.first_at - self.started_at, 0.0), tpot, r.moves, r.computed_here)
        admitted = max(r.since - self.started_at, 0.0)
        return Completion(r.index, new, self.engine.text(new, self.stop), r.finish, *figures, logits, *timing, admitted)


class _Detokenizer:
    """One request's streamed text, decoded incrementally: each delta decodes a window
    of tokens from the last point whose text is settled (``prefix`` .. ``read``), not
    the whole completion, as vLLM's detokenizer does; text that may be the start of a
    stop string, or an unfinished character, is held back until it is settled."""

    __slots__ = ("emitted", "hold", "pending", "prefix", "read", "tokenizer")

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.hold = max(map(len, stop), default=1) - 1
        self.prefix = self.read = 0
        self.pending = ""
        self.emitted = 0  # characters streamed

    def take(self, tokens: np.ndarray, final: str | None) -> str:
        """The text the completion's ``tokens`` add; ``final``: its whole text once it
        is finished (stop strings cut), of which the rest is returned."""
        if final is not None:
            rest, self.emitted = final[self.emitted :], len(final)
            return rest
        decode = self.tokenizer.decode
        settled = decode(tokens[self.prefix : self.read].tolist(), skip_special_tokens=True)
        now = decode(tokens[self.prefix :].tolist(), skip_special_tokens=True)
        if len(now) > len(settled) and not now.endswith("\ufffd"):
            self.pending += now[len(settled) :]
            self.prefix, self.read = self.read, int(tokens.size)
        upto = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:upto], self.pending[upto:]
        self.emitted += len(out)
        return out
