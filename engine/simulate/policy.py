"""The simulator's side of the one scheduler (:class:`~kvmem.engine.scheduler.Scheduler`):
its requests, drafts, read-back and backoff (:func:`scheduler`), and the figures a
worker reports (:func:`progress`).

* requests arrive from the seeded workload (:mod:`.workload`) at their iteration; each
  has a fixed length: it samples until every token of its sequence has its K/V (its
  ``max_new`` counts one sample past the end, which the synthetic model answers with a
  token no sequence holds);
* a speculative request's drafts are the workload's: its next tokens as far as a seeded
  acceptance draw says, then others the model rejects;
* the model is told a request's whole sequence at admission (it "samples" it);
* before a release, the request's K/V is read back through its block-table row and
  checked (:class:`SimulationFailure` names the request, page and position when a value
  is wrong);
* a preempted request waits a backoff, doubling with its preemptions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..backend import Backend
from ..forward import Model
from ..request import Request
from ..scheduler import Figures, Policy, Scheduler
from .synthetic import ReadBack
from .workload import Acceptance, SimRequest, WorkloadDigest, WorkloadSpec, drafts, generate

__all__ = ["COUNTERS", "SimWorker", "SimulationFailure", "Verified", "progress", "scheduler"]


_NONE = np.zeros(0, dtype=np.int32)


class SimulationFailure(Exception):
    """A page read back wrong: the run fails, naming the request, page and position."""


@dataclasses.dataclass(slots=True)
class Verified:
    """Requests read back before release, their tokens and pages."""

    verified_requests: int = 0
    verified_tokens: int = 0
    verified_pages: int = 0


class _Check:
    """The read-back before each release (``corrupt``: the test hook, change one value
    of the first finished request first: the check must catch it)."""

    def __init__(self, read_back: ReadBack, worker: int, corrupt: bool) -> None:
        self.read_back = read_back
        self.worker = worker
        self.corrupt = corrupt
        self.verified = Verified()

    def __call__(self, r: Request, finished: bool) -> None:
        if not r.computed:
            return
        if self.corrupt and finished and r.computed > r.prompt_len:
            self.read_back.corrupt(r.slot, r.computed - 1)  # a page of its own, never cached
            self.corrupt = False
        num_pages, bad = self.read_back.check(r.rid, r.slot, r.computed)
        if bad is not None:
            origin = "attached from the prefix cache" if bad.position < r.matched else "allocated to it"
            raise SimulationFailure(
                f"worker {self.worker}: request {r.name} (slot {r.slot}, {r.computed} tokens computed) "
                f"reads wrong K/V at position {bad.position}: page {bad.page} (entry {bad.row_index} of its "
                f"block-table row, {origin}), offset {bad.offset}, {bad.plane}, element {bad.element}: expected "
                f"{bad.expected}, read {bad.found:g} ({bad.num_wrong} wrong element(s) in the request)"
            )
        v = self.verified
        v.verified_requests += 1
        v.verified_tokens += r.computed
        v.verified_pages += num_pages


def workload_drafts(origin: tuple[SimRequest, Acceptance], known: int, room: int) -> np.ndarray:
    """A decode's drafts after its ``known`` tokens (at most ``room``): the workload's."""
    sim, accept = origin
    k = min(sim.spec_k, room)
    if k <= 0:
        return _NONE
    return drafts(sim, known - 1, k, accept.draw(k))


def _drafts(r: Request, room: int) -> np.ndarray:
    return workload_drafts(r.origin, r.known, room)


def _told(r: Request) -> np.ndarray:
    sim: SimRequest = r.origin[0]
    return sim.tokens


def requests(spec: WorkloadSpec, worker: int) -> Iterator[Request]:
    """Worker ``worker``'s workload as the scheduler's requests, in arrival order; each
    request's ``origin``: its workload request and acceptance draws."""
    for sim in generate(spec, worker):
        accept = Acceptance(spec.seed, worker, sim.index, spec.accept)
        max_new = sim.total_len - sim.prompt_len + 1  # the last sample is past the sequence's end
        yield Request(
            sim.index, sim.tokens[: sim.prompt_len], max_new, name=sim.rid, arrival=sim.arrival, origin=(sim, accept)
        )


@dataclasses.dataclass(slots=True)
class SimWorker:
    """One worker's scheduler, with what the simulator reports beside its figures: the
    workload's digest and the read-backs."""

    sched: Scheduler
    worker: int
    digest: WorkloadDigest
    verified: Verified
    arrived: dict[str, float] = dataclasses.field(default_factory=dict)  # request name -> when it arrived

    def ttft_by_turn(self) -> dict[int, list[float]]:
        """Time to first token of each finished request (from its arrival: queueing and
        the wait for its prefix included), by its conversation's turn (0 for a
        workload of single requests)."""
        out: dict[int, list[float]] = {}
        for r in self.sched.finished:
            at = self.arrived.get(r.name)
            if at is not None and r.first_at:
                out.setdefault(r.origin[0].turn, []).append(r.first_at - at)
        return out


def scheduler(
    backend: Backend,
    model: Model,
    spec: WorkloadSpec,
    worker: int,
    *,
    max_running: int,
    chunk_tokens: int,
    read_back: ReadBack | None = None,
    corrupt: bool = False,
    fetch_wait_s: float = 0.0,
) -> SimWorker:
    """Worker ``worker``'s scheduler over ``backend``, computing with ``model``, on its
    share of the workload; ``read_back``: checks each request's K/V before its release
    (None: no check, as in the baseline)."""
    digest = WorkloadDigest()
    check = _Check(read_back, worker, corrupt) if read_back is not None else None
    arrived: dict[str, float] = {}

    def on_arrival(r: Request) -> None:
        digest.add(r.origin[0])
        arrived[r.name] = time.monotonic()

    def backoff(r: Request, it: int) -> int:
        return it + min(2**r.preemptions, 64) + (r.index + worker) % 8

    speculative = spec.spec > 0 and spec.spec_k > 0  # else no request drafts: no drafter to ask
    policy = Policy(drafts=_drafts if speculative else None, told=_told, check=check, backoff=backoff)
    sched = Scheduler(
        backend,
        model,
        budget=chunk_tokens,
        max_running=max_running,
        policy=policy,
        on_arrival=on_arrival,
        fetch_wait_s=fetch_wait_s,
    )
    sched.add(requests(spec, worker))
    return SimWorker(sched, worker, digest, check.verified if check is not None else Verified(), arrived)


COUNTERS: tuple[str, ...] = (
    "generated",
    "done",
    "steps",
    "iterations",
    "step_seconds",
    "open_seconds",
    "preemptions",
    "out_of_pages",
)
COUNTERS += ("no_free_slot", "prefix_query_tokens", "prefix_hit_tokens", "prefill_tokens", "decode_tokens")
COUNTERS += ("draft_tokens", "rejected_tokens", *(f.name for f in dataclasses.fields(Verified)))


def counters(sim: SimWorker) -> dict[str, Any]:
    """The worker's cumulative figures under the names the run's report reads."""
    f: Figures = sim.sched.figures
    return {
        "generated": f.arrived,
        "done": f.finished,
        "steps": f.iterations + f.top_ups,  # Steps sent: an iteration's, and its top-ups
        "iterations": f.iterations,  # scheduler iterations (a forward each)
        "step_seconds": f.step_seconds,
        "open_seconds": f.open_seconds,
        "preemptions": f.preemptions,
        "out_of_pages": f.out_of_pages,
        "no_free_slot": f.no_free_slot,
        "prefix_query_tokens": f.prefix_query_tokens,
        "prefix_hit_tokens": f.prefix_hit_tokens,
        "prefill_tokens": f.prefill_tokens,
        "decode_tokens": f.decode_tokens,
        "draft_tokens": f.drafts_proposed,
        "rejected_tokens": f.drafts_proposed - f.drafts_kept,
        **dataclasses.asdict(sim.verified),
    }


def progress(sim: SimWorker, elapsed_s: float, kind: str = "progress", **extra: Any) -> dict[str, Any]:
    """A message of the scheduler's state; takes the latencies gathered since the last."""
    sched = sim.sched
    latencies, sched.latencies = sched.latencies, []
    return {
        "kind": kind,
        "worker": sim.worker,
        "elapsed_s": elapsed_s,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "latencies": latencies,
        **counters(sim),
        **extra,
    }
