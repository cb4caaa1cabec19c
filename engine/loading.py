"""Requests whose prefix is still being copied in from the server's host tier
(``kvmem serve --host-memory``): what the scheduler (:mod:`.scheduler`) does with them.

A Step's match that reaches the host tier answers before the copy ends
(``Outcome.match_loading``: per match item, its last tokens still loading). The
scheduler admits the request either way; ``load_wait`` says how it then waits:

* ``"layer"`` (the default): the request computes in the iteration that admitted it;
  the forward carries a ``wait`` (:class:`~.forward.ForwardBatch`) that the model calls
  before it reads layer *i*, returning once layer *i* of the loading pages is in (the
  layers before it computed meanwhile);
* ``"iteration"``: the request is held out of the forwards until its whole load is in
  (the others compute meanwhile); the tokens its admission was allotted are given back
  in the next Step (a truncate to its match's end, a page boundary) and allotted again
  once it computes.

The waits read the load counters in the client's own memory (the backend's
:class:`~.backend.Loading`): no round trip. Costs: nothing while nothing loads; O(pages
loading) per iteration otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from .forward import ForwardBatch

if TYPE_CHECKING:
    from .request import Request

MODES = ("layer", "iteration")


class Loads:
    """The loads one scheduler's requests wait for; ``figures``: the scheduler's
    :class:`~.scheduler.Figures` (``loading_tokens``, ``load_wait_seconds``,
    ``load_held``)."""

    def __init__(self, backend: Any, mode: str, figures: Any) -> None:
        if mode not in MODES:
            raise ValueError(f"load_wait must be 'layer' or 'iteration', got {mode!r}")
        self.backend = backend
        self.mode = mode
        self.figures = figures
        self.pending: list[np.ndarray] = []  # "layer": pages the next forwards wait for
        self.held: dict[int, tuple[Request, np.ndarray]] = {}  # "iteration": by id(request)

    def note(self, admitted: list[tuple[Request, int, int, int]]) -> None:
        """Admissions ``(request, slot, match_len, loading)`` whose match is still loading."""
        for r, slot, m, n in admitted:
            pages = self.backend.loading_pages(slot, m, n)
            if self.mode == "iteration":
                self.held[id(r)] = (r, pages)
            else:
                self.pending.append(pages)
            self.figures.loading_tokens += n

    def is_held(self, r: Request) -> bool:
        """``r`` was just admitted and is held out of this iteration's forward (counted)."""
        if id(r) not in self.held:
            return False
        self.figures.load_held += 1
        return True

    def blocked(self, running: list[Request]) -> frozenset[int]:
        """The held requests whose loads are still in copy (by id); those whose loads
        are in, or that left, are let go. Non-blocking."""
        if not self.held:
            return frozenset()
        live = {id(r) for r in running}
        for key, (_, pages) in list(self.held.items()):
            if key not in live or self.backend.ready(pages):
                del self.held[key]
        self.figures.load_held += len(self.held)
        return frozenset(self.held)

    def with_wait(self, batch: ForwardBatch) -> ForwardBatch:
        """``batch`` with a ``wait`` for the loads still in copy (those done are
        forgotten): the model waits per layer, while the layers before compute."""
        backend = self.backend
        self.pending = [pages for pages in self.pending if not backend.ready(pages)]
        if not self.pending:
            return batch
        pages = np.concatenate(self.pending) if len(self.pending) > 1 else self.pending[0]
        figures = self.figures

        def wait(layer: int | None) -> float:
            waited = float(backend.wait(pages, layer))
            figures.load_wait_seconds += waited
            return waited

        return dataclasses.replace(batch, wait=wait)


def held_for_store(
    opened: list[Request], fetching: np.ndarray | None, now: float, wait_s: float, figures: Any
) -> frozenset[int]:
    """The admissions (by id) to hold for their prefix coming from the server's store
    (``kvmem serve --store``): those whose match the answer says is being fetched
    (``fetching``, per admission; None: none), within ``wait_s`` of their first hold.
    The scheduler releases them in the next Step and admits them again (their match
    then takes what has arrived). Counted in ``figures`` (``fetch_held``,
    ``fetch_tokens``). O(admissions)."""
    if not wait_s or fetching is None:
        return frozenset()
    held = []
    for r, n in zip(opened, fetching.tolist(), strict=True):
        if not n:
            continue
        if not r.fetch_until:
            r.fetch_until = now + wait_s
        if now < r.fetch_until:
            held.append(id(r))
            figures.fetch_held += 1
            figures.fetch_tokens += n
    return frozenset(held)
