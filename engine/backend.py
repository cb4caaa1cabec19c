"""The allocator seam: what the scheduler (:mod:`.scheduler`) asks of the allocator it
drives, once per iteration, and what it gets back.

A :class:`Backend` hands out request slots (:meth:`Backend.open`) and takes one
:class:`Plan` per iteration, the Step's columns, answering an :class:`Outcome`. Three
implement it: kvmem's batched client (:class:`.worker.KVMemBackend`), the drop-in driven
as a reference scheduler drives it (:class:`.compat_driver.CompatBackend`) and the
reference allocator in-process (:class:`.reference.ReferenceBackend`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

OK, OUT_OF_PAGES = 0, 1  # AllocStatus values (kvmem.v1); others end the run as errors
NOT_OPENED = -1  # an admission's status when the backend opens in its step and the server had no request slot


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
    handoff_slots: list[int] = dataclasses.field(default_factory=list)  # hand-offs (kvmem's client only)
    handoff_states: list[bytes] = dataclasses.field(default_factory=list)
    adopt: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (ticket, request id)


@dataclasses.dataclass(slots=True)
class Outcome:
    """A Step's answer: per alloc item its status and token slots (``kv_loc[off[i] :
    off[i + 1]]``; None when the backend has no KV memory), per match item the tokens
    matched, per hand-off item its ticket."""

    status: np.ndarray
    kv_loc: np.ndarray | None
    offsets: np.ndarray
    match_lens: np.ndarray
    tickets: list[str] = dataclasses.field(default_factory=list)


class Backend(Protocol):
    """An allocator the scheduler drives: request slots, and one step per iteration."""

    page_size: int

    def open(self, request_ids: list[str]) -> list[int] | None:
        """Slots for new requests, or None when there are not enough free slots (a
        backend that opens them in its step answers their items NOT_OPENED instead)."""
        ...

    def step(self, plan: Plan) -> Outcome: ...
