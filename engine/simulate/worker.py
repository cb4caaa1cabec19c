"""A ``kvmem simulate`` worker process: the engine's scheduler with the simulator's
policy (:mod:`.policy`) on kvmem's batched client (``--api client``) or on the drop-in
for the reference allocator's users (``--api compat``, :mod:`kvmem.engine.compat_backend`),
its model (:mod:`.synthetic`, unless the config names another) writing K/V through the
mapped memory, and checking it.

The command (:mod:`.run`) starts these with multiprocessing's spawn and
reads their messages from a queue, each a dict with a ``kind``:

* ``ready``: attached and mapped; the worker waits for the ``go`` event;
* ``progress``: the cumulative figures (:func:`.policy.counters`), the Step
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
from typing import TYPE_CHECKING, Any

from ..backend import KVMemBackend
from ..forward import Model, ModelFailure
from ..process import Flag, Messages
from .policy import SimulationFailure, SimWorker, progress, scheduler
from .synthetic import ReadBack, SyntheticModel
from .workload import WorkloadSpec

if TYPE_CHECKING:
    from kvmem.client.compat import KVAllocator

    from ..compat_backend import CompatBackend
    from .kv_check import KVMemory

NAMESPACE = "kvmem-simulate-1"  # the prefix-cache namespace: only simulate's own K/V pattern in it


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One worker's run. ``duration_s``: arrivals stop after this long (None: the
    workload's request count ends the run); ``forward_s``: the synthetic model's forward
    pass per iteration, slept after it writes the K/V (the scheduler's own work comes on
    top, as in an engine that schedules between forward passes); ``corrupt``: the test
    hook of :func:`.policy.scheduler`; ``api``: ``client`` (the batched client) or
    ``compat`` (the drop-in); ``model``: builds the worker's model from its mapped KV
    memory (picklable: a module-level function; None: :class:`~.synthetic.SyntheticModel`);
    a model that is a :class:`~.synthetic.ReadBack` has each request checked before its
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
    # With a server that has a store (kvmem serve --store): the model id its keys are made for,
    # and how long a request whose prefix that server is fetching is held for it.
    model_id: str = ""
    fetch_wait_s: float = 0.0


def drive(
    sim: SimWorker,
    config: WorkerConfig,
    messages: Messages,
    go: Flag,
    stop: Flag,
    extra: Callable[[], dict[str, Any]] = dict,
) -> None:
    """Run ``sim`` to the end of its workload (or ``stop``), reporting to ``messages``
    every ``config.report_interval_s``. ``extra``: more fields for each message."""
    sched = sim.sched
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
            messages.put(progress(sim, now - start, "failure", message=str(failure), **extra()))
            return
        if now - last >= config.report_interval_s:
            messages.put(progress(sim, now - start, **extra()))
            last = now
    elapsed = time.perf_counter() - start
    final = progress(
        sim, elapsed, "done", stopped=not sched.done, digest=sim.digest.hexdigest(), ttft=sim.ttft_by_turn(), **extra()
    )
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
            from ..compat_backend import CompatBackend

            with compat_allocator(config) as allocator:
                # A switched scheduler reads its block table as req_to_page, by request index.
                _run(CompatBackend(allocator), allocator.client, allocator.req_to_page, config, messages, go, stop)
            return
        name = f"simulate-{config.run_id}-w{config.worker}"
        with KVMemClient(
            config.target, name=name, auth_token=config.auth_token, cache_namespace=NAMESPACE, model_id=config.model_id
        ) as kv:
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
    sim = scheduler(
        backend,
        model,
        config.spec,
        config.worker,
        max_running=config.max_running,
        chunk_tokens=config.chunk_tokens,
        read_back=model if isinstance(model, ReadBack) else None,
        corrupt=config.corrupt,
        fetch_wait_s=config.fetch_wait_s,
    )

    def round_trips() -> dict[str, Any]:
        return {"api": config.api, "round_trips": backend.round_trips}

    drive(sim, config, messages, go, stop, round_trips)


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


def compat_allocator(config: WorkerConfig) -> KVAllocator:
    """The drop-in as a switched scheduler constructs it: the server's address, its
    request pool's size, a name and the cache namespace."""
    from kvmem.client.compat import KVAllocator

    return KVAllocator(
        config.target,
        # Indices held at once: the running requests, and those finished or preempted whose
        # release goes out with the next iteration's block.
        max_batch_size=2 * config.max_running,
        name=f"simulate-{config.run_id}-w{config.worker}",
        cache_namespace=NAMESPACE,
        auth_token=config.auth_token,
        request_id_prefix=f"w{config.worker}-i",
        model_id=config.model_id,
    )
