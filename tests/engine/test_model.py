"""The model seam (:mod:`kvmem.engine.forward`): what the scheduler hands its model
each iteration, and what it does with the answer.

The in-process runs drive the real :class:`~kvmem.engine.scheduler.Scheduler` (with the
simulator's policy) on :class:`PagedBackend`, a paged allocator in the test's process
(rows of page ids per request slot, a free list, no prefix cache, OUT_OF_PAGES when an
alloc does not fit), with :class:`~kvmem.engine.simulate.synthetic.SyntheticModel`
writing K/V into plain tensors read through that block table. A recording model between
them checks every batch as it passes: one forward per Step, positions contiguous per
request from what it kept, ``kv_loc`` the Step's token slots for that request and its
row's addresses, the tokens the request's own (drafts apart). Then a model that raises,
or answers the wrong shape, fails the scheduler, and a worker process's loop (in a
thread, on a real server) says so.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest
import torch
from conftest import ServerProcess

from kvmem.engine.backend import OK, OUT_OF_PAGES, Outcome, Plan
from kvmem.engine.simulate.kv_check import KVMemory, Plane
from kvmem.engine.forward import Admission, ForwardBatch, ForwardOutput, ModelFailure
from kvmem.engine.simulate.policy import SimulationFailure, SimWorker, counters, scheduler
from kvmem.engine.simulate.synthetic import SyntheticModel
from kvmem.engine.simulate.worker import WorkerConfig, worker_main
from kvmem.engine.simulate.workload import WorkloadSpec, generate

SPEC = WorkloadSpec(
    seed=5, requests=16, arrival_rate=0.5, prompt_len=40, output_len=30, system_prompts=2, system_prompt_len=32,
    spec=0.5, spec_k=3, accept=0.6, max_len=128,
)  # fmt: skip
PAGE_SIZE = 4


class PagedBackend:
    """A paged allocator: ``table[slot]`` the pages of the request in ``slot`` (page 0
    and slot 0 unused); ``handed[i]``: what Step ``i`` gave, slot -> kv_loc;
    ``released``: (request id, tokens) of every release."""

    def __init__(self, num_pages: int, num_slots: int) -> None:
        self.page_size = PAGE_SIZE
        self.table = torch.zeros((num_slots, SPEC.max_len // PAGE_SIZE + 1), dtype=torch.int32)
        self.free_pages = list(range(num_pages - 1, 0, -1))
        self.free_slots = list(range(num_slots - 1, 0, -1))
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.ids: dict[int, str] = {}
        self.handed: list[dict[int, np.ndarray]] = []
        self.released: list[tuple[str, np.ndarray]] = []

    def open(self, request_ids: list[str]) -> list[int] | None:
        if len(request_ids) > len(self.free_slots):
            return None
        slots = [self.free_slots.pop() for _ in request_ids]
        for slot, rid in zip(slots, request_ids, strict=True):
            self.pages[slot], self.lens[slot], self.ids[slot] = [], 0, rid.rsplit(".", 1)[0]
        return slots

    def step(self, plan: Plan) -> Outcome:
        ps = self.page_size
        for slot, tokens in zip(plan.release_slots, plan.release_tokens, strict=True):
            self.released.append((self.ids.pop(slot), tokens.copy()))
            self.free_pages += self.pages.pop(slot)
            del self.lens[slot]
            self.free_slots.append(slot)
        for slot, new_len in zip(plan.truncate_slots, plan.truncate_lens, strict=True):
            keep = -(-new_len // ps)
            self.free_pages += self.pages[slot][keep:]
            del self.pages[slot][keep:]
            self.lens[slot] = new_len
        status, locs, handed = [], [], {}
        for slot, need, expected in zip(plan.alloc_slots, plan.alloc_needs, plan.alloc_expected, strict=True):
            have, pages = self.lens[slot], self.pages[slot]
            assert expected in (-1, have), (slot, expected, have)
            more = -(-(have + need) // ps) - len(pages)
            if more > len(self.free_pages):
                status.append(OUT_OF_PAGES)
                locs.append(np.zeros(0, dtype=np.int64))
                continue
            for _ in range(more):
                self.table[slot, len(pages)] = self.free_pages[-1]
                pages.append(self.free_pages.pop())
            pos = np.arange(have, have + need)
            handed[slot] = np.array(pages, dtype=np.int64)[pos // ps] * ps + pos % ps
            self.lens[slot] = have + need
            status.append(OK)
            locs.append(handed[slot])
        self.handed.append(handed)
        offsets = np.concatenate([[0], np.cumsum([loc.size for loc in locs])]).astype(np.int64)
        kv_loc = np.concatenate(locs) if locs else np.zeros(0, dtype=np.int64)
        return Outcome(np.array(status, dtype=np.int16), kv_loc, offsets, np.zeros(len(plan.match), dtype=np.int64))


def memory_of(backend: PagedBackend, num_pages: int) -> KVMemory:
    """Two layers' K and V, 2 heads of 8 in bfloat16, read through the backend's table."""
    planes = [Plane(torch.zeros((num_pages * PAGE_SIZE, 2, 8), dtype=torch.bfloat16), f"layer {i // 2} {'KV'[i % 2]}")
              for i in range(4)]  # fmt: skip
    return KVMemory(planes, backend.table, PAGE_SIZE)


class Recording:
    """The synthetic model, with every batch checked against the backend as it passes."""

    def __init__(self, inner: SyntheticModel, backend: PagedBackend) -> None:
        self.inner = inner
        self.backend = backend
        self.batches: list[ForwardBatch] = []
        self.live: dict[str, np.ndarray] = {}  # admitted, not released: id -> its tokens
        self.kept: dict[str, int] = {}  # id -> where its next forward must start

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        step = len(self.batches)
        self.batches.append(batch)
        assert len(self.backend.handed) == step + 1  # one forward per Step, right after it
        for rid in batch.released:
            assert self.live.pop(rid, None) is not None, rid
        for a in batch.admitted:
            assert a.request_id not in self.live, a.request_id
            self.live[a.request_id] = a.tokens
            self.kept[a.request_id] = 0  # no prefix cache: everything from position 0
        handed = self.backend.handed[step]
        assert sorted(batch.rows.tolist()) == sorted(handed)  # every alloc that got slots computes
        assert batch.kv_loc is not None and batch.offsets[0] == 0 and batch.offsets[-1] == batch.num_tokens
        ps = PAGE_SIZE
        for i, rid in enumerate(batch.request_ids):
            row = int(batch.rows[i])
            a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
            pos, loc, tokens = batch.positions[a:b], batch.kv_loc[a:b], batch.token_ids[a:b]
            start, end = self.kept[rid], int(batch.seq_lens[i])
            assert self.backend.ids[row] == rid.rsplit(".", 1)[0]  # the allocator's id: this admission's
            assert np.array_equal(pos, np.arange(start, end)), (rid, pos, start)  # contiguous, from what it kept
            assert np.array_equal(loc, handed[row])  # the Step's slots for this request...
            pages = self.backend.table[row].numpy().astype(np.int64)
            assert np.array_equal(loc, pages[pos // ps] * ps + pos % ps)  # ...addressed through its row
            ns = int(batch.sample_offsets[i + 1] - batch.sample_offsets[i])
            num_drafts = max(ns - 1, 0)
            own = tokens[: tokens.size - num_drafts]
            assert np.array_equal(own, self.live[rid][start : start + own.size])  # its tokens; drafts after
            self.kept[rid] = start + own.size  # and the drafts the samples confirm, below
        out = self.inner.forward(batch)
        for i, rid in enumerate(batch.request_ids):
            ns = int(batch.sample_offsets[i + 1] - batch.sample_offsets[i])
            if ns > 1:
                drafts = batch.token_ids[int(batch.offsets[i + 1]) - (ns - 1) : int(batch.offsets[i + 1])]
                mine = out.next_tokens[int(batch.sample_offsets[i]) :][: ns - 1]
                wrong = np.flatnonzero(drafts != mine)
                self.kept[rid] += int(wrong[0]) if wrong.size else ns - 1
        return out


def simulation(model: Any, backend: PagedBackend, read_back: Any = None, corrupt: bool = False) -> SimWorker:
    return scheduler(backend, model, SPEC, 0, max_running=6, chunk_tokens=96, read_back=read_back, corrupt=corrupt)


def run(sim: SimWorker, limit: int = 5000) -> None:
    for _ in range(limit):
        if sim.sched.done:
            return
        sim.sched.iteration()
    raise AssertionError(f"not done after {limit} iterations")


def test_each_iteration_hands_the_model_one_packed_batch_of_what_the_step_allocated() -> None:
    backend = PagedBackend(num_pages=60, num_slots=16)
    synthetic = SyntheticModel(memory_of(backend, 60))
    model = Recording(synthetic, backend)
    sim = simulation(model, backend, read_back=synthetic)
    run(sim)
    c = counters(sim)
    assert len(model.batches) == len(backend.handed) == c["steps"] == synthetic.num_forwards
    assert c["done"] == 16 and c["preemptions"] > 0 and c["rejected_tokens"] > 0, c  # a small pool; drafts rejected
    assert c["verified_requests"] >= c["done"]  # every release read back what the model wrote
    assert not model.live  # every admitted request was released, and the model told
    assert any(b.num_requests > 1 for b in model.batches) and any(b.num_tokens == 0 for b in model.batches)
    # What the model sampled became the requests' tokens: each finished one is the workload's.
    requests = {r.rid: r.tokens for r in generate(SPEC, 0)}
    finished = [(rid, tokens) for rid, tokens in backend.released if tokens.size == requests[rid].size]
    assert len(finished) == 16 and all(np.array_equal(tokens, requests[rid]) for rid, tokens in finished)


def test_the_synthetic_model_writes_its_sequence_then_what_it_is_given_and_samples_the_next_tokens() -> None:
    backend = PagedBackend(num_pages=8, num_slots=2)
    memory = memory_of(backend, 8)
    model = SyntheticModel(memory)
    tokens = np.arange(1, 11, dtype=np.int32)
    given = tokens[:6].copy()
    given[4:] += 1  # positions 4 and 5: another sequence (rejected drafts)
    loc = np.arange(8, 14, dtype=np.int64)
    batch = ForwardBatch(
        ["a"], np.array([1]), np.array([0, 6]), given, np.arange(6), loc, np.array([6]), np.array([0, 3]),
        admitted=[Admission("a", tokens)],
    )  # fmt: skip
    out = model.forward(batch)
    assert out.next_tokens.tolist() == [5, 6, 7]  # the sequence's tokens after positions 3, 4, 5
    p = memory.pattern
    truth = p.prefix_values(tokens)
    other = np.concatenate([truth[:4], p.extend(truth[3], given[4:], 4)])
    written = memory.planes[0].tensor[torch.from_numpy(loc)].reshape(6, -1).float().numpy()
    assert np.array_equal(written, p.values(p.hashes(other, 0))[:, 0].astype(np.float32))
    assert not np.array_equal(written[4:], p.values(p.hashes(truth[:6], 0))[4:, 0])
    # Past the sequence's end it samples 0; a request it was never told of is an error.
    end = ForwardBatch(["a"], np.array([1]), np.array([0, 1]), tokens[9:], np.array([9]), loc[:1],
                       np.array([10]), np.array([0, 1]))  # fmt: skip
    assert model.forward(end).next_tokens.tolist() == [0]
    with pytest.raises(KeyError, match="request b is in the batch but was never admitted"):
        model.forward(dataclasses.replace(end, request_ids=["b"]))


def test_a_wrong_value_the_model_wrote_is_caught_at_the_read_back() -> None:
    backend = PagedBackend(num_pages=60, num_slots=16)
    model = SyntheticModel(memory_of(backend, 60))
    with pytest.raises(SimulationFailure, match=r"worker 0: request w0-r\d+ .* reads wrong K/V at position \d+"):
        run(simulation(model, backend, read_back=model, corrupt=True))


class Boom:
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        raise ValueError("boom")


class NoSamples:
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        return ForwardOutput(np.zeros(0, dtype=np.int32))


def test_a_model_that_raises_or_answers_the_wrong_shape_fails_the_loop_saying_where() -> None:
    backend = PagedBackend(num_pages=60, num_slots=16)
    with pytest.raises(ModelFailure, match=r"the model's forward pass failed at iteration 0 \(\d+ requests, "
                                           r"\d+ tokens\): ValueError: boom"):  # fmt: skip
        run(simulation(Boom(), backend))
    with pytest.raises(ModelFailure, match=r"answered next tokens of shape \(0,\) at iteration \d+ for \d+ sampled"):
        run(simulation(NoSamples(), PagedBackend(num_pages=60, num_slots=16)))


class Messages:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []

    def put(self, item: dict[str, Any]) -> None:
        self.items.append(item)


def test_a_worker_whose_model_raises_fails_with_a_clear_message(server: ServerProcess) -> None:
    """A worker's loop on a real server (in a thread here, as its process runs it), its
    model named by the config: the error message says what failed first, then the
    traceback of what the model raised."""
    config = WorkerConfig(
        f"unix:{server.socket_path}", None, SPEC, 0, "t", max_running=4, chunk_tokens=64,
        model=lambda memory: Boom(),
    )  # fmt: skip
    messages, go, stop = Messages(), threading.Event(), threading.Event()
    go.set()
    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=worker_main, args=(config, messages, go, stop))
        worker.start()
        worker.join(timeout=60)
    finally:
        torch.set_num_threads(threads)  # the worker sets its process's to 1
    assert not worker.is_alive()
    assert [m["kind"] for m in messages.items] == ["ready", "error"], messages.items
    message = messages.items[-1]["message"]
    first, *rest = message.splitlines()
    assert first.startswith("the model's forward pass failed at iteration 0 ("), message  # the report adds "worker 0: "
    assert first.endswith("): ValueError: boom"), message
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: boom", message
