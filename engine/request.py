"""A request in the scheduler (:class:`Request`), the one shape both engines use, and
its hand-off state (:func:`pack`, :func:`unpack`): what moves with it to another
process.

A request's tokens are one int32 array: its prompt, then what the model sampled.
``computed`` of them have their K/V written, ``known`` are known; the request computes
``tokens[computed:known]`` in chunks, and samples once a chunk reaches ``known`` (a
decode is a chunk of one). A resumed request (preempted, or handed over) is no special
case: it has more known tokens than its prompt. Only the scheduler
(:class:`~.scheduler.Scheduler`) writes a request's fields.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Request", "pack", "unpack"]


class Request:
    """One request. ``name``: its id in the engine (``rid`` adds how often it was
    preempted: the allocator's request id of this admission, kept by the scheduler); ``index``: its place
    among the run's prompts (the youngest-first preemption breaks ties by it);
    ``arrival``: the scheduler iteration it arrives at; ``max_new``: the most tokens it
    samples (its tokens array holds the prompt and as many); ``origin``: what the
    request's source knows of it (the simulator's workload request), opaque to the
    scheduler."""

    __slots__ = (
        "admitted",
        "alloced",
        "arrival",
        "cached_pages",
        "computed",
        "computed_here",
        "computed_total",
        "fetch_until",
        "fetches",
        "finish",
        "first_at",
        "index",
        "iterations",
        "known",
        "last_at",
        "logits",
        "matched",
        "matched_total",
        "max_new",
        "moves",
        "name",
        "not_before",
        "origin",
        "preemptions",
        "prompt_len",
        "rid",
        "since",
        "slot",
        "taken_here",
        "ticket",
        "tokens",
        "truncate_to",
    )

    def __init__(
        self, index: int, prompt: np.ndarray, max_new: int, *, name: str = "", arrival: int = 0, origin: Any = None
    ) -> None:
        self.index = index
        self.name = name or str(index)
        self.arrival = arrival
        self.origin = origin
        self.prompt_len = int(prompt.size)
        self.max_new = max_new
        self.tokens = np.zeros(prompt.size + max_new, dtype=np.int32)
        self.tokens[: prompt.size] = prompt
        self.known = self.prompt_len
        self.slot = self.computed = self.alloced = self.cached_pages = 0
        self.admitted = self.preemptions = self.not_before = 0
        self.matched = self.matched_total = self.computed_total = self.iterations = 0  # matched: this admission's
        self.truncate_to = -1  # rejected drafts: the K/V past this goes in the next Step
        self.finish = ""  # "stop" or "length" once finished
        self.logits: list[Any] = []  # per sampled token kept, with keep_logits
        # Timing (monotonic seconds) and moves: the first token's time (whichever process
        # sampled it), when this process took the request (admission or adoption), its
        # last token; tokens taken and computed here; hand-offs it went through.
        self.first_at = self.last_at = self.since = 0.0
        self.taken_here = self.computed_here = self.moves = 0
        self.ticket = ""
        self.rid = f"{self.name}.0"  # the allocator's id of this admission: name.preemptions
        # A prefix being fetched from the server's store: held (released, admitted again)
        # until this monotonic time at most (0.0: not held yet); how often it was held.
        self.fetch_until = 0.0
        self.fetches = 0

    def new_tokens(self) -> np.ndarray:
        return self.tokens[self.prompt_len : self.known]

    def __repr__(self) -> str:
        return f"Request({self.rid}, known={self.known}, computed={self.computed}, alloced={self.alloced})"


# The hand-off state: int64 fields, the first token's time (float64), the known tokens (int32).
_FIELDS: tuple[str, ...] = ("index", "prompt_len", "max_new", "known", "computed", "cached_pages", "preemptions")
_FIELDS += ("matched_total", "computed_total", "iterations", "moves")
_HEAD = len(_FIELDS) * 8 + 8


def pack(r: Request, **now: int) -> bytes:
    """``r``'s token state for the process that takes it over, with the fields in
    ``now`` as they will be once this Step went through (``r`` itself unchanged)."""
    head = np.array([now.get(f, getattr(r, f)) for f in _FIELDS], dtype="<i8").tobytes()
    return head + np.array([r.first_at], dtype="<f8").tobytes() + r.tokens[: r.known].astype("<i4").tobytes()


def unpack(state: bytes) -> Request:
    """The request a :func:`pack` state describes, its K/V's length its ``computed``
    (the slot: the ticket's, set by whoever adopts it)."""
    if len(state) < _HEAD or (len(state) - _HEAD) % 4:
        raise ValueError(f"a hand-off state of {len(state)} bytes: not one this engine packed")
    values = dict(zip(_FIELDS, np.frombuffer(state[: len(_FIELDS) * 8], dtype="<i8").tolist(), strict=True))
    tokens = np.frombuffer(state[_HEAD:], dtype="<i4").astype(np.int32)
    r = Request(values["index"], tokens[: values["prompt_len"]], values["max_new"])
    r.tokens[: tokens.size] = tokens
    for name, value in values.items():
        setattr(r, name, value)
    r.rid = f"{r.name}.{r.preemptions}"
    r.first_at = float(np.frombuffer(state[len(_FIELDS) * 8 : _HEAD], dtype="<f8")[0])
    r.alloced = r.computed
    return r
