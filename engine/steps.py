"""What one scheduler iteration plans and counts: :class:`Steps` (a Step's columns and
what applying its answer does), :class:`Figures` (the scheduler's figures) and
:class:`Policy` (what an engine decides differently). :mod:`.scheduler` runs them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .backend import Plan

if TYPE_CHECKING:
    from .request import Request

__all__ = ["EMPTY", "Figures", "Policy", "Steps"]

EMPTY = np.zeros(0, dtype=np.int32)
EMPTY.flags.writeable = False  # shared: a plan's empty column, a decode's no drafts


@dataclasses.dataclass(slots=True)
class Figures:
    """One scheduler's figures (cumulative): iterations (Steps) and the seconds in
    them, in Opens and in forwards; requests arrived and finished; preemptions, allocs
    answered ``OUT_OF_PAGES``, admissions put off for want of a request slot; tokens
    queried against the prefix cache and matched; prefill and decode tokens computed;
    drafts proposed and kept; forwards mixing prefill and decode tokens, the most tokens
    in one; each first token's time since the run started."""

    iterations: int = 0
    top_ups: int = 0  # Steps more in an iteration, admitting into the budget its admissions' matches left
    step_seconds: float = 0.0
    open_seconds: float = 0.0
    forward_seconds: float = 0.0
    arrived: int = 0
    finished: int = 0
    preemptions: int = 0
    out_of_pages: int = 0
    no_free_slot: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    drafts_proposed: int = 0
    drafts_kept: int = 0
    mixed_forwards: int = 0
    max_forward_tokens: int = 0
    loading_tokens: int = 0  # matched tokens still loading from the host tier at their Step's answer
    load_wait_seconds: float = 0.0  # forwards' time waiting for them (per layer: what compute did not hide)
    load_held: int = 0  # load_wait "iteration": iterations' count of requests held out while their loads copied
    fetch_held: int = 0  # admissions held (released, admitted again) while their prefix came from the store
    fetch_tokens: int = 0  # tokens the answers said were being fetched from the store, over the holds
    first_token_s: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(slots=True)
class Policy:
    """What an engine decides differently, each None for "nothing":

    * ``drafts(r, room)``: up to ``room`` speculative tokens after ``r``'s known ones,
      proposed at planning (it must not change ``r``);
    * ``told(r)``: the tokens the model is told of at ``r``'s admission (default: those
      known; the synthetic model is told the workload's whole sequence);
    * ``check(r, finished)``: before ``r``'s release (finished, or preempted), e.g. a
      read-back of its K/V; it raises to fail the run;
    * ``backoff(r, it)``: the iteration a preempted ``r`` may be readmitted at;
    * ``max_preemptions``: a request preempted more often fails the run (the pool
      cannot hold it with the others running);
    * ``stop_check(r)``: whether ``r`` now ends (a stop string), after each token."""

    drafts: Callable[[Request, int], np.ndarray] | None = None
    told: Callable[[Request], np.ndarray] | None = None
    check: Callable[[Request, bool], None] | None = None
    backoff: Callable[[Request, int], int] | None = None
    max_preemptions: int | None = None
    stop_check: Callable[[Request], bool] | None = None


class Steps:
    """One planned iteration: the Step's columns (lists until :meth:`plan` makes them
    int32 arrays) and, per item, what applying its answer does."""

    __slots__ = (
        "adopting",
        "alloc_expected",
        "alloc_needs",
        "alloc_slots",
        "cached",
        "decodes",
        "giving",
        "items",
        "leaving",
        "opened",
        "plan",
        "released",
        "truncated",
    )

    def __init__(self) -> None:
        self.plan = Plan()
        self.alloc_slots: list[int] = []
        self.alloc_needs: list[int] = []
        self.alloc_expected: list[int] = []
        self.items: list[tuple[Request, int, np.ndarray]] = []  # per alloc: (request, need, drafts)
        self.decodes: list[Request] = []  # the first items: one-token decodes, no drafts
        self.leaving: list[Request] = []
        self.released: list[str] = []
        self.truncated: list[Request] = []
        self.cached: list[Request] = []
        self.giving: list[Request] = []
        self.adopting: list[Request] = []
        self.opened: list[Request] = []

    def alloc(self, r: Request, slot: int, need: int, expected: int, drafts: np.ndarray = EMPTY) -> None:
        self.alloc_slots.append(slot)
        self.alloc_needs.append(need)
        self.alloc_expected.append(expected)
        self.items.append((r, need, drafts))

    def seal(self) -> Plan:
        """The plan with its columns as int32 arrays: the client sends them as bytes."""
        p = self.plan
        p.alloc_slots = _int32(self.alloc_slots)
        p.alloc_needs = _int32(self.alloc_needs)
        p.alloc_expected = _int32(self.alloc_expected)
        p.release_slots = _int32(p.release_slots)
        p.truncate_slots = _int32(p.truncate_slots)
        p.truncate_lens = _int32(p.truncate_lens)
        p.handoff_slots = _int32(p.handoff_slots)
        return p


def _int32(column: list[int]) -> np.ndarray:
    """A plan column as the int32 array the client sends as bytes (an empty one shared)."""
    return np.array(column, dtype=np.int32) if column else EMPTY
