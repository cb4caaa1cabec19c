"""A ``kvmem simulate`` worker process: one scheduler (:mod:`.scheduler`) on kvmem's
batched client (``--api client``) or on the drop-in for the reference allocator's users
(``--api compat``, :mod:`.compat_driver`), its model (:mod:`.model`; the synthetic one
unless the config names another) writing K/V through the mapped memory, and checking it.

The command (``kvmem.engine.run``) starts these with multiprocessing's spawn and
reads their messages from a queue, each a dict with a ``kind``:

* ``ready``: attached and mapped; the worker waits for the ``go`` event;
* ``progress``: the cumulative :class:`~.scheduler.Counters`, the Step
  latencies since the last message (seconds), requests running and waiting, the
  allocator's round trips to the server (Steps and Opens);
* ``done``: the last progress, the workload digest, ``stopped`` if told to stop early;
* ``failure``: a page read back wrong (the message names the request, page and
  position); ``error``: anything else that ended the worker (a line for what a user can
  act on, or the model's failure, then its traceback; a traceback for a bug).

This module imports only the client: a worker is a client like any scheduler.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .backend import Outcome, Plan
from .model import Model, ModelFailure, ReadBack, SyntheticModel
from .scheduler import Scheduler, SimulationFailure
from .workload import WorkloadSpec

if TYPE_CHECKING:
    from .compat_driver import CompatBackend
    from .kv_check import KVMemory

NAMESPACE = "kvmem-simulate-1"  # the prefix-cache namespace: only simulate's own K/V pattern in it


class Messages(Protocol):
    """What the workers report into (a ``multiprocessing`` queue)."""

    def put(self, item: dict[str, Any]) -> None: ...


class Flag(Protocol):
    """A ``multiprocessing`` event."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool: ...


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker's run. ``duration_s``: arrivals stop after this long (None: the
    workload's request count ends the run); ``forward_s``: the synthetic model's forward
    pass per iteration, slept after it writes the K/V (the scheduler's own work comes on
    top, as in an engine that schedules between forward passes); ``corrupt``: the test
    hook of :class:`~.scheduler.Scheduler`; ``api``: ``client`` (the batched client) or
    ``compat`` (the drop-in); ``model``: builds the worker's model from its mapped KV
    memory (picklable: a module-level function; None: :class:`~.model.SyntheticModel`);
    a model that is a :class:`~.model.ReadBack` has each request checked before its
    release."""

    target: str
    auth_token: str | None
    spec: WorkloadSpec
    worker: int
    run_id: str
    max_running: int
    chunk_tokens: int
    duration_s: float | None = None
    forward_s: float = 0.0
    report_interval_s: float = 0.25
    corrupt: bool = False
    api: str = "client"
    model: Callable[[KVMemory], Model] | None = None


class KVMemBackend:
    """The scheduler's allocator: a kvmem session, one Step per iteration."""

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
        r = self.kv.step(
            release_slots=plan.release_slots,
            release_token_ids=plan.release_tokens if plan.release_slots else None,
            truncate_slots=plan.truncate_slots,
            truncate_lens=plan.truncate_lens,
            cache=plan.cache or None,
            match=plan.match or None,
            alloc_slots=plan.alloc_slots,
            alloc_needs=plan.alloc_needs,
            alloc_expected_lens=plan.alloc_expected if plan.alloc_slots else None,
            handoff=plan.handoff_slots or None,
            handoff_states=plan.handoff_states or None,
            adopt=plan.adopt or None,
        )
        out = Outcome(r.status.numpy(), r.kv_loc.numpy(), r.kv_loc_offsets.numpy(), r.match_lens.numpy())
        if plan.handoff_slots:
            out.tickets = r.tickets
        return out


def progress(sched: Scheduler, elapsed_s: float, kind: str = "progress", **extra: Any) -> dict[str, Any]:
    """A message of the scheduler's state; takes the latencies gathered since the last."""
    latencies, sched.latencies = sched.latencies, []
    return {
        "kind": kind,
        "worker": sched.worker,
        "elapsed_s": elapsed_s,
        "running": len(sched.running),
        "waiting": len(sched.waiting),
        "latencies": latencies,
        **dataclasses.asdict(sched.counters),
        **extra,
    }


def drive(
    sched: Scheduler,
    config: WorkerConfig,
    messages: Messages,
    go: Flag,
    stop: Flag,
    extra: Callable[[], dict[str, Any]] = dict,
) -> None:
    """Run ``sched`` to the end of its workload (or ``stop``), reporting to ``messages``
    every ``config.report_interval_s``. ``extra``: more fields for each message."""
    messages.put({"kind": "ready", "worker": config.worker})
    go.wait()
    start = last = time.perf_counter()
    arriving = True
    while not sched.done and not stop.is_set():
        now = time.perf_counter()
        if arriving and config.duration_s is not None and now - start >= config.duration_s:
            sched.stop_arrivals()
            arriving = False
        try:
            sched.iteration()  # its Step, then its model's forward pass
        except SimulationFailure as failure:
            messages.put(progress(sched, now - start, "failure", message=str(failure), **extra()))
            return
        if now - last >= config.report_interval_s:
            messages.put(progress(sched, now - start, **extra()))
            last = now
    elapsed = time.perf_counter() - start
    final = progress(sched, elapsed, "done", stopped=not sched.done, digest=sched.digest.hexdigest(), **extra())
    messages.put(final)


def worker_main(config: WorkerConfig, messages: Messages, go: Flag, stop: Flag) -> None:
    """The entry point of a worker process (spawned by ``kvmem simulate``)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the command stops its workers itself
    try:
        import torch

        from kvmem.client.sync import KVMemClient

        # Many workers share the host's cores: torch's intra-op thread pool only contends
        # (its small CPU ops here ran 100x slower with 2 threads on a busy 2-core host).
        torch.set_num_threads(1)

        if config.api == "compat":
            from .compat_driver import CompatBackend, compat_allocator

            with compat_allocator(config) as allocator:
                # A switched scheduler reads its block table as req_to_page, by request index.
                _run(CompatBackend(allocator), allocator.client, allocator.req_to_page, config, messages, go, stop)
            return
        name = f"simulate-{config.run_id}-w{config.worker}"
        with KVMemClient(config.target, name=name, auth_token=config.auth_token, cache_namespace=NAMESPACE) as kv:
            _run(KVMemBackend(kv), kv, kv.block_table, config, messages, go, stop)
    except BaseException as exc:  # reported to the command, which fails the run
        messages.put({"kind": "error", "worker": config.worker, "message": _describe(exc)})


def _run(
    backend: KVMemBackend | CompatBackend,
    kv: Any,
    block_table: Any,
    config: WorkerConfig,
    messages: Messages,
    go: Flag,
    stop: Flag,
) -> None:
    """The scheduler on ``backend``, its model writing through ``kv``'s mapped memory
    and reading back through ``block_table``."""
    from .kv_check import KVMemory, planes_of

    mapped = kv.memory
    planes = planes_of([mapped.kv_cache(rank) for rank in range(mapped.num_ranks)])
    memory = KVMemory(planes, block_table, backend.page_size)
    model = config.model(memory) if config.model is not None else SyntheticModel(memory, config.forward_s)
    sched = Scheduler(
        backend,
        model,
        config.spec,
        config.worker,
        max_running=config.max_running,
        chunk_tokens=config.chunk_tokens,
        read_back=model if isinstance(model, ReadBack) else None,
        corrupt=config.corrupt,
    )
    drive(sched, config, messages, go, stop, lambda: {"api": config.api, "round_trips": backend.round_trips})


def _describe(exc: BaseException) -> str:
    """One line for the errors a user can act on (the server went away, a refusal); the
    model's failure in a line, then the traceback of what it raised; the traceback for
    anything else (a bug)."""
    from kvmem.client.errors import KVMemError

    if isinstance(exc, KVMemError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModelFailure):
        cause = exc.__cause__
        return f"{exc}" + ("\n" + "".join(traceback.format_exception(cause)).rstrip() if cause is not None else "")
    return "".join(traceback.format_exception(exc)).rstrip()
