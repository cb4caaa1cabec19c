"""The allocator seam: what the scheduler (:mod:`.scheduler`) asks of the allocator it
drives, once per iteration, and what it gets back.

A :class:`Backend` hands out request slots (:meth:`Backend.open`) and takes one
:class:`Plan` per iteration, the Step's columns, answering an :class:`Outcome`. Three
implement it: kvmem's batched client (:class:`KVMemBackend`, here), the drop-in driven
as a reference scheduler drives it (:class:`~.compat_backend.CompatBackend`) and, for
``kvmem simulate --baseline``, the reference allocator in-process
(:class:`.simulate.reference.ReferenceBackend`).

The plan's integer columns are int32 arrays from the scheduler to the wire: the client
sends them as their bytes (the Step's ``*_i32`` fields), with no per-item encoding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np

OK, OUT_OF_PAGES = 0, 1  # AllocStatus values (kvmem.v1); others end the run as errors
NOT_OPENED = -1  # an admission's status when the backend opens in its step and the server had no request slot


Ints = Any  # an int32 array once the scheduler seals its plan (a list while it builds it)


@dataclasses.dataclass(slots=True)
class Plan:
    """One iteration's Step, as columns (see ``KVMemClient.step``): the integer ones
    int32 arrays as the scheduler sends them (lists while it builds them)."""

    release_slots: Ints = dataclasses.field(default_factory=list)
    release_tokens: list[np.ndarray] = dataclasses.field(default_factory=list)
    truncate_slots: Ints = dataclasses.field(default_factory=list)
    truncate_lens: Ints = dataclasses.field(default_factory=list)
    cache: list[tuple[int, np.ndarray]] = dataclasses.field(default_factory=list)
    match: list[tuple[int, np.ndarray, int]] = dataclasses.field(default_factory=list)
    alloc_slots: Ints = dataclasses.field(default_factory=list)
    alloc_needs: Ints = dataclasses.field(default_factory=list)
    alloc_expected: Ints = dataclasses.field(default_factory=list)
    handoff_slots: Ints = dataclasses.field(default_factory=list)  # hand-offs (kvmem's client only)
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
    # Per match item, of its match_lens the last tokens still loading from the host tier;
    # None: none (a backend without one).
    match_loading: np.ndarray | None = None
    # Per match item, the tokens after its match the server is fetching from its store
    # (kvmem serve --store); None: none.
    match_fetching: np.ndarray | None = None


class Backend(Protocol):
    """An allocator the scheduler drives: request slots, and one step per iteration."""

    page_size: int

    def open(self, request_ids: list[str]) -> list[int] | None:
        """Slots for new requests, or None when there are not enough free slots (a
        backend that opens them in its step answers their items NOT_OPENED instead)."""
        ...

    def step(self, plan: Plan) -> Outcome: ...


class Loading(Protocol):
    """A backend whose matches may load from a host tier: the pages a match item waits
    for, and the wait (:class:`kvmem.client.loads.PageLoads`)."""

    def loading_pages(self, slot: int, match_len: int, loading: int) -> np.ndarray: ...

    def ready(self, pages: np.ndarray) -> bool: ...

    def wait(self, pages: np.ndarray, layer: int | None) -> float: ...


class KVMemBackend:
    """The scheduler's allocator: a kvmem session (:class:`kvmem.client.KVMemClient`),
    one Step per iteration, its columns as the scheduler's int32 arrays."""

    def __init__(self, kv: Any) -> None:
        from kvmem.client.errors import NoFreeRequestSlot

        self.kv = kv
        self.page_size = int(kv.geometry.page_size)
        self._no_slot = NoFreeRequestSlot
        self.round_trips = 0

    def open(self, request_ids: list[str]) -> list[int] | None:
        self.round_trips += 1
        try:
            slots: list[int] = self.kv.open(request_ids).tolist()
        except self._no_slot:
            return None
        return slots

    def step(self, plan: Plan) -> Outcome:
        self.round_trips += 1
        allocs = len(plan.alloc_slots) > 0
        r = self.kv.step(
            release_slots=plan.release_slots,
            release_token_ids=plan.release_tokens if len(plan.release_slots) else None,
            truncate_slots=plan.truncate_slots,
            truncate_lens=plan.truncate_lens,
            cache=plan.cache or None,
            match=plan.match or None,
            alloc_slots=plan.alloc_slots,
            alloc_needs=plan.alloc_needs,
            alloc_expected_lens=plan.alloc_expected if allocs else None,
            handoff=plan.handoff_slots if len(plan.handoff_slots) else None,
            handoff_states=plan.handoff_states or None,
            adopt=plan.adopt or None,
        )
        col = r.array  # numpy views of the answer's bytes: no tensors made
        out = Outcome(col("status"), col("kv_loc"), col("kv_loc_offsets"), col("match_lens"))
        if len(plan.handoff_slots):
            out.tickets = r.tickets
        if plan.match:
            loading = col("match_loading")
            if loading.any():
                out.match_loading = loading
            fetching = col("match_fetching")
            if fetching.any():
                out.match_fetching = fetching
        return out

    # Loading (the server's host tier): in this process's memory, no call.

    def loading_pages(self, slot: int, match_len: int, loading: int) -> np.ndarray:
        loads = self.kv.page_loads
        return loads.pages_of(self.kv.block_table[slot], match_len, loading)

    def ready(self, pages: np.ndarray) -> bool:
        return bool(self.kv.page_loads.ready(pages))

    def wait(self, pages: np.ndarray, layer: int | None) -> float:
        return float(self.kv.page_loads.wait(pages, layer))
