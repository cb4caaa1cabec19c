"""``kvmem simulate --baseline``: the same schedulers on the reference allocator, in-process.

The reference allocator (``../shared/reference/seed_kv_allocator.py``, read and measured
against, never copied) is imported from its file as it is, under a private module name;
its constructor builds a pinned host tensor, which needs a GPU, so on a machine without
one the module's ``torch`` is swapped for a proxy whose ``zeros`` drops ``pin_memory``
while it is constructed (as ``bench/_reference.py`` does for the benchmarks).

Each baseline worker runs the same :class:`~kvmem.engine.scheduler.Scheduler`
and workload as a kvmem worker, with one reference allocator of its own (no sharing, no
prefix cache: the reference has none; a scheduler brings its own tree) as large as the
server's pool, so what it holds is what the workload needs without sharing. Its model is
the same :class:`~kvmem.engine.simulate.synthetic.SyntheticModel` without KV memory (the reference
has none): it samples the workload's tokens, writes nothing, sleeps nothing. What is
compared is the allocator's time per scheduler iteration, the pages held, and the
prefill the shared cache saved.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import signal
import types
from typing import Any

import numpy as np

from ..backend import OUT_OF_PAGES, Outcome, Plan
from ..process import Flag, Messages
from .policy import scheduler
from .synthetic import SyntheticModel
from .worker import WorkerConfig, drive

REFERENCE_RELPATH = pathlib.Path("shared") / "reference" / "seed_kv_allocator.py"


class ReferenceMissing(Exception):
    """The reference allocator cannot be loaded (the message says why and what to do)."""


def default_reference_path() -> pathlib.Path:
    """``../shared/reference/seed_kv_allocator.py`` next to the repository this package
    was installed from (an editable install), else in the current directory's parent."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    found = repo.parent / REFERENCE_RELPATH
    return found if found.is_file() else pathlib.Path.cwd().parent / REFERENCE_RELPATH


def load_reference(path: str | pathlib.Path) -> types.ModuleType:
    """Import the reference allocator's file; :class:`ReferenceMissing` if it is absent
    or does not define ``KVAllocator``."""
    p = pathlib.Path(path).expanduser()
    if not p.is_file():
        raise ReferenceMissing(
            f"--baseline needs the reference allocator, and there is no file at {p}: pass --reference "
            f"PATH/seed_kv_allocator.py (it lives in ../{REFERENCE_RELPATH} beside the kvmem repository)"
        )
    spec = importlib.util.spec_from_file_location("_kvmem_simulate_seed_kv_allocator", p)
    if spec is None or spec.loader is None:
        raise ReferenceMissing(f"cannot import the reference allocator from {p}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # any failure of a foreign file is reported as such
        raise ReferenceMissing(f"importing the reference allocator {p} failed: {type(exc).__name__}: {exc}") from exc
    if not hasattr(module, "KVAllocator"):
        raise ReferenceMissing(f"{p} defines no KVAllocator: not the reference allocator")
    return module


class _NoPinTorch:
    """``torch`` with ``zeros(..., pin_memory=True)`` made unpinned; all else forwarded."""

    def __init__(self, torch: types.ModuleType) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def zeros(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return self._torch.zeros(*args, **kwargs)


def construct(reference: types.ModuleType, **kwargs: Any) -> Any:
    """``reference.KVAllocator(**kwargs)``, with pinning patched out when there is no GPU."""
    module: Any = reference  # its globals, as the file defines them
    real = module.torch
    if real.cuda.is_available():
        return module.KVAllocator(**kwargs)
    module.torch = _NoPinTorch(real)
    try:
        return module.KVAllocator(**kwargs)
    finally:
        module.torch = real


class ReferenceBackend:
    """The scheduler's Step on the reference allocator, as a scheduler written against it
    drives it (its README): releases and trimmed drafts queued, one ``free_group_end``,
    then one ``alloc`` per request. The caller owns ``alloced_len`` (kept here); request
    indices ``1 .. max_running`` (row 0 unused, as in kvmem); no prefix cache."""

    def __init__(
        self, module: types.ModuleType, *, num_pages: int, page_size: int, max_running: int, max_context: int
    ) -> None:
        self.ra = construct(
            module,
            size=num_pages * page_size,
            device="cpu",
            max_batch_size=max_running + 1,
            max_context_len=max_context,
            page_size=page_size,
        )
        self.page_size = page_size
        self.num_pages_total = num_pages - 1
        self._free = list(range(max_running, 0, -1))
        self._alloced = [0] * (max_running + 1)
        self.peak_pages = 0
        self.pages_sum = 0
        self.samples = 0

    def open(self, request_ids: list[str]) -> list[int] | None:
        if len(request_ids) > len(self._free):
            return None
        return [self._free.pop() for _ in request_ids]

    def step(self, plan: Plan) -> Outcome:
        ra, ps, alloced = self.ra, self.page_size, self._alloced
        for slot in plan.release_slots.tolist():
            ra.free_req_cache(slot, alloced[slot])
            alloced[slot] = 0
            self._free.append(slot)
        for slot, new_len in zip(plan.truncate_slots.tolist(), plan.truncate_lens.tolist(), strict=True):
            keep, had = -(-new_len // ps), -(-alloced[slot] // ps)
            if had > keep:  # a copy: the row may be rewritten before the group ends (its defect 3)
                ra.append_to_later_free(ra.req_to_page[slot, keep:had].clone())
            alloced[slot] = new_len
        ra.free_group_end()
        n = len(plan.alloc_slots)
        status = np.zeros(n, dtype=np.int8)
        offsets = np.zeros(n + 1, dtype=np.int64)
        for i, (slot, need) in enumerate(zip(plan.alloc_slots.tolist(), plan.alloc_needs.tolist(), strict=True)):
            if ra.alloc(slot, need, alloced[slot]) is None:  # out of pages or too long: it cannot tell
                status[i] = OUT_OF_PAGES
                offsets[i + 1] = offsets[i]
            else:
                alloced[slot] += need
                offsets[i + 1] = offsets[i] + need
        held = self.num_pages_total - ra.available_size()
        self.peak_pages = max(self.peak_pages, held)
        self.pages_sum += held
        self.samples += 1
        return Outcome(status, None, offsets, np.zeros(len(plan.match), dtype=np.int32))

    def pages(self) -> dict[str, Any]:
        """Pages held now, at the peak and on average per iteration."""
        held = self.num_pages_total - self.ra.available_size()
        mean = self.pages_sum / self.samples if self.samples else 0.0
        return {"pages_held": held, "peak_pages_held": self.peak_pages, "mean_pages_held": mean}


@dataclasses.dataclass(frozen=True, slots=True)
class BaselineConfig:
    """A baseline worker: the kvmem worker's config, the reference's file and the pool."""

    worker: WorkerConfig
    reference: str
    num_pages: int
    page_size: int
    max_context: int


def baseline_main(config: BaselineConfig, messages: Messages, go: Flag, stop: Flag) -> None:
    """The entry point of a baseline worker process (spawned by ``kvmem simulate``)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    w = config.worker
    try:
        import torch

        torch.set_num_threads(1)  # as the benchmarks measure it: small ops, no thread pool
        backend = ReferenceBackend(
            load_reference(config.reference),
            num_pages=config.num_pages,
            page_size=config.page_size,
            max_running=w.max_running,
            max_context=config.max_context,
        )
        model = SyntheticModel(None)  # no KV memory: it samples the workload's tokens
        sim = scheduler(backend, model, w.spec, w.worker, max_running=w.max_running, chunk_tokens=w.chunk_tokens)
        drive(sim, w, messages, go, stop, backend.pages)
    except BaseException as exc:  # reported to the command, which fails the run
        import traceback

        messages.put({"kind": "error", "worker": w.worker, "message": "".join(traceback.format_exception(exc))})
