"""The one scheduler (:class:`kvmem.engine.scheduler.Scheduler`) of both engines, on a
real ``kvmem serve`` of the tiny Llama's geometry.

* The same class drives the synthetic model (``kvmem simulate``'s: a seeded workload,
  its drafts, every page read back before release) and the transformers model (the tiny
  Llama: greedy completions equal to ``generate()``'s), each through prefill in chunks,
  decodes with drafts, preemption on a small pool, and a hand-off of every request from
  a prefill scheduler to a decode scheduler in another session.
* Every Step the engine sends reaches the server in the int32 bytes fields (the
  client's fast path), not the repeated ones.
* A Step that fails at the transport (the server killed) leaves every request as it
  was.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import ServerProcess, short_tmpdir, start_server
from tiny_llama import SERVE_FLAGS, VOCAB, greedy, tiny_llama

import kvmem.client.stepstream
from kvmem.client import KVMemClient
from kvmem.client.errors import KVMemError
from kvmem.engine import scheduler
from kvmem.engine.backend import KVMemBackend
from kvmem.engine.forward import Model
from kvmem.engine.generate.attention import ATTENTION
from kvmem.engine.generate.engine import propose_drafts
from kvmem.engine.generate.hf_model import TransformersModel
from kvmem.engine.handoff import Moves
from kvmem.engine.request import Request
from kvmem.engine.scheduler import Policy, Scheduler
from kvmem.engine.simulate.kv_check import KVMemory, planes_of
from kvmem.engine.simulate.policy import SimulationFailure, requests, workload_drafts
from kvmem.engine.simulate.synthetic import SyntheticModel
from kvmem.engine.simulate.workload import WorkloadSpec

PAGE_SIZE = 4
NEW_TOKENS = 10
BUDGET = 16  # tokens per forward: prompts of up to 40 tokens prefill in chunks
SPEC = WorkloadSpec(
    seed=11, requests=8, arrival_rate=0.0, prompt_len=24, output_len=10, system_prompts=1, system_prompt_len=16,
    shared=0.5, spec=1.0, spec_k=3, accept=0.6, max_len=64,
)  # fmt: skip
MOTIF = np.random.default_rng(5).integers(1, VOCAB, size=6).astype(np.int32)
PROMPTS = [np.concatenate([MOTIF[: 2 + i % 4], np.tile(MOTIF, 1 + i % 5)])[: 8 + 5 * i] for i in range(8)]


def serve(num_pages: int) -> ServerProcess:
    return start_server(
        short_tmpdir(), "--device", "cpu", *SERVE_FLAGS.split(), "--page-size", str(PAGE_SIZE),
        "--num-pages", str(num_pages), "--max-requests", "32", "--max-context", "64",
    )  # fmt: skip


@pytest.fixture(scope="module")
def small_pool() -> Iterator[ServerProcess]:
    srv = serve(20)  # 19 pages of 4 tokens, for 8 requests of up to 64 tokens: preemptions
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def pool() -> Iterator[ServerProcess]:
    srv = serve(200)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def llama() -> Any:
    return tiny_llama()


class Product:
    """One engine's side of the test: its model on a session, its policy, its requests
    and what each request's tokens must be at the end."""

    def __init__(self, kind: str, llama: Any) -> None:
        self.kind = kind
        if kind == "synthetic":
            self.requests = list(requests(SPEC, 0))
            self.origins = {r.index: r.origin for r in self.requests}
            self.expected = {r.index: r.origin[0].tokens for r in self.requests}
        else:
            self.requests = [Request(i, p, NEW_TOKENS) for i, p in enumerate(PROMPTS)]
            self.expected = {i: np.concatenate([p, greedy(llama, p, NEW_TOKENS)]) for i, p in enumerate(PROMPTS)}
            self.llama = copy.deepcopy(llama)
            self.llama.set_attn_implementation(ATTENTION)

    def model(self, kv: KVMemClient) -> tuple[Model, Policy]:
        if self.kind == "synthetic":
            planes = planes_of([kv.memory.kv_cache(rank) for rank in range(kv.memory.num_ranks)])
            synthetic = SyntheticModel(KVMemory(planes, kv.block_table, PAGE_SIZE))
            origins = self.origins

            def check(r: Request, finished: bool) -> None:
                _, bad = synthetic.check(r.rid, r.slot, r.computed)
                if bad is not None:
                    raise SimulationFailure(f"request {r.name} reads wrong K/V at position {bad.position}")

            def drafts(r: Request, room: int) -> np.ndarray:
                return workload_drafts(origins[r.index], r.known, room)

            def told(r: Request) -> np.ndarray:
                return origins[r.index][0].tokens

            return synthetic, Policy(drafts=drafts, told=told, check=check)

        def lookup(r: Request, room: int) -> np.ndarray:
            return propose_drafts(r.tokens[: r.known], min(3, room))

        return TransformersModel(self.llama, kv.kv_cache(), kv.block_table, PAGE_SIZE), Policy(drafts=lookup)

    def check_tokens(self, finished: list[Request]) -> None:
        assert sorted(r.index for r in finished) == sorted(self.expected), [r.index for r in finished]
        for r in finished:
            want = self.expected[r.index]
            got = r.tokens[: want.size] if self.kind == "synthetic" else r.tokens[: r.known]
            assert np.array_equal(got, want), f"{self.kind} request {r.index}: {got.tolist()} != {want.tolist()}"


def run(*scheds: Scheduler, limit: int = 3000) -> None:
    for _ in range(limit):
        if all(s.done for s in scheds):
            return
        for s in scheds:
            if not s.done:
                s.iteration()
    raise AssertionError(f"not done after {limit} iterations")


@pytest.mark.parametrize("kind", ["synthetic", "transformers"])
def test_one_scheduler_drives_both_models_through_chunks_drafts_and_preemption(
    kind: str, small_pool: ServerProcess, llama: Any
) -> None:
    product = Product(kind, llama)
    with KVMemClient(small_pool.target, name=f"one-{kind}", cache_namespace=kind) as kv:
        model, policy = product.model(kv)
        sched = Scheduler(KVMemBackend(kv), model, budget=BUDGET, max_running=8, policy=policy)
        sched.add(product.requests)
        run(sched)
    f = sched.figures
    print(f"{kind}: {f}")
    assert type(sched) is Scheduler
    assert f.finished == len(product.requests) and f.preemptions > 0 and f.out_of_pages > 0, f
    assert f.max_forward_tokens <= BUDGET and f.mixed_forwards > 0, f  # chunks beside decodes
    assert f.drafts_proposed > 0 and f.drafts_kept > 0, f
    product.check_tokens(sched.finished)


@pytest.mark.parametrize("kind", ["synthetic", "transformers"])
def test_one_scheduler_hands_every_request_to_another_after_its_first_token(
    kind: str, pool: ServerProcess, llama: Any
) -> None:
    product = Product(kind, llama)
    inbox: list[tuple[str, bytes]] = []

    def take(n: int, idle: bool) -> list[tuple[str, bytes]]:
        taken = inbox[:n]
        del inbox[:n]
        return taken

    with (
        KVMemClient(pool.target, name=f"prefill-{kind}", cache_namespace=kind) as kv_p,
        KVMemClient(pool.target, name=f"decode-{kind}", cache_namespace=kind) as kv_d,
    ):
        model_p, policy_p = product.model(kv_p)
        model_d, policy_d = product.model(kv_d)
        giver = Moves(give_after_first=True, on_given=inbox.extend)
        prefill = Scheduler(KVMemBackend(kv_p), model_p, budget=BUDGET, max_running=8, policy=policy_p, moves=giver)
        prefill.add(product.requests)
        adopter = Moves(inbox=take, more=lambda: not prefill.done or bool(inbox))
        decode = Scheduler(KVMemBackend(kv_d), model_d, budget=BUDGET, max_running=8, policy=policy_d, moves=adopter)
        run(prefill, decode)
    # Each request goes after its first token, but one its first token ends (a synthetic one-token output).
    moved = len(product.requests) - prefill.figures.finished
    assert giver.num_given == adopter.num_adopted == decode.figures.finished == moved > 0, (giver.num_given, moved)
    assert all(r.finish and r.taken_here == r.known - r.prompt_len for r in prefill.finished)  # ended at once
    assert all(r.moves == 1 and r.computed_here < r.computed for r in decode.finished)  # its prompt not recomputed
    product.check_tokens(prefill.finished + decode.finished)


def test_every_engine_step_reaches_the_server_in_the_int32_fields(
    pool: ServerProcess, llama: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The StepRequests the client puts on the stream, recorded as they go (the server
    answers them): every column the engine fills travels as int32 bytes. The synthetic
    product: its drafts are rejected by construction (accept 0.6), so truncates travel
    too (the tiny Llama's lookup drafts may all be kept)."""
    sent: list[Any] = []
    real_step = kvmem.client.stepstream.StepStream.step

    def recording(self: Any, request: Any, timeout: float) -> Any:
        sent.append(request)
        return real_step(self, request, timeout)

    monkeypatch.setattr(kvmem.client.stepstream.StepStream, "step", recording)
    product = Product("synthetic", llama)
    with KVMemClient(pool.target, name="int32", cache_namespace="int32") as kv:
        model, policy = product.model(kv)
        sched = Scheduler(KVMemBackend(kv), model, budget=BUDGET, max_running=8, policy=policy)
        sched.add(product.requests)
        run(sched)
    product.check_tokens(sched.finished)
    columns = ("release_slots", "truncate_slots", "truncate_lens", "alloc_slots", "alloc_needs", "alloc_expected_lens")
    assert len(sent) == sched.figures.iterations + sched.figures.top_ups
    filled = dict.fromkeys(columns, 0)
    for request in sent:
        for name in columns:
            assert not getattr(request, name), f"{name} went as the repeated field: {request}"
            filled[name] += len(getattr(request, f"{name}_i32")) // 4
    assert all(filled.values()), filled  # every column carried items, as int32 bytes


def test_prompt_tokens_count_as_prefill_and_sampled_ones_as_decodes(pool: ServerProcess, llama: Any) -> None:
    """The figures split what was computed as a user reads it: every prompt token
    computed is prefill, even the last one alone in its chunk (a 17-token prompt in a
    16-token budget) or alone after a match (the same prompt again: 16 tokens matched),
    and every sampled token fed back is a decode. Completions equal ``generate()``'s."""
    prompt = np.tile(MOTIF, 3)[:17]
    product = Product("transformers", llama)
    with KVMemClient(pool.target, name="counts", cache_namespace="counts") as kv:
        model, _ = product.model(kv)
        sched = Scheduler(KVMemBackend(kv), model, budget=BUDGET, max_running=8)
        sched.add([Request(0, prompt, NEW_TOKENS)])
        run(sched)
        sched.add([Request(1, prompt, NEW_TOKENS)])
        run(sched)
    f = sched.figures
    want = np.concatenate([prompt, greedy(llama, prompt, NEW_TOKENS)])
    assert [r.tokens[: r.known].tolist() for r in sched.finished] == [want.tolist()] * 2
    assert f.prefix_hit_tokens == 16, f
    assert (f.prefill_tokens, f.decode_tokens) == (17 + 1, 2 * (NEW_TOKENS - 1)), f


def test_admissions_whose_matches_leave_budget_are_topped_up_within_the_budget(pool: ServerProcess, llama: Any) -> None:
    """Four prompts of 20 tokens whose first 16 are cached, a 16-token budget: the first
    Step charges an admission its whole prompt (its match not known yet), and the answer
    shows its match covers that chunk; top-up Steps give it its 4 tokens and admit the
    next into what is left, so the four are prefilled in one forward, never more than the
    budget, and their completions equal ``generate()``'s. Without top-ups
    (``MAX_TOP_UPS`` 0) one is admitted a forward, computing nothing in that one."""
    stem = np.tile(MOTIF, 3)[:16]
    prompts = [np.concatenate([stem, np.full(4, 1 + i, dtype=np.int32)]) for i in range(4)]
    product = Product("transformers", llama)
    firsts = {}
    for top_ups in (scheduler.MAX_TOP_UPS, 0):
        with KVMemClient(pool.target, name="top-up", cache_namespace=f"top-up-{top_ups}") as kv:
            model, _ = product.model(kv)
            # top_ups=True: the tiny Llama's forward may take less than a Step (None sends none then)
            sched = Scheduler(KVMemBackend(kv), model, budget=BUDGET, max_running=8, top_ups=True)
            sched.add([Request(0, np.concatenate([stem, [7]]).astype(np.int32), 1)])  # caches the stem
            run(sched)
            sched.figures = type(sched.figures)()
            it = sched.it
            sched.add([Request(1 + i, p, NEW_TOKENS) for i, p in enumerate(prompts)])
            saved = scheduler.MAX_TOP_UPS
            scheduler.MAX_TOP_UPS = top_ups
            try:
                first = {}
                while not sched.done:
                    for r, _ in sched.iteration():
                        first.setdefault(r.index, sched.it - it)
            finally:
                scheduler.MAX_TOP_UPS = saved
        f = sched.figures
        assert f.max_forward_tokens <= BUDGET and f.prefix_hit_tokens == 4 * 16 and f.prefill_tokens == 4 * 4, f
        for r in sched.finished[-4:]:
            want = np.concatenate([prompts[r.index - 1], greedy(llama, prompts[r.index - 1], NEW_TOKENS)])
            assert r.tokens[: r.known].tolist() == want.tolist(), r.index
        firsts[top_ups] = (f.top_ups, sorted(first.values()))
    # a top-up gives an admission its chunk and admits the next: every first token in one forward
    assert firsts[scheduler.MAX_TOP_UPS] == (4, [1, 1, 1, 1]), firsts
    assert firsts[0] == (0, [2, 3, 4, 5]), firsts  # one admission a forward, its first computing nothing


def test_a_top_up_admits_no_request_whose_first_page_the_forward_computes(pool: ServerProcess, llama: Any) -> None:
    """R1's match of a cached stem leaves budget, so a top-up Step admits more: R2, whose
    first page nobody computed yet, and not R3, which starts with the same page (the
    forward computes it for R2); the next iteration's R3 matches R2's pages. Prefilled
    4 + 9 + 1 tokens, not R2's 8 new tokens twice; completions equal ``generate()``."""
    stem = np.tile(MOTIF, 3)[:16]
    fresh = np.random.default_rng(9).integers(1, VOCAB, size=8).astype(np.int32)
    prompts = [np.concatenate([stem, [3, 4, 5, 6]]), np.concatenate([fresh, [7]]), np.concatenate([fresh, [8]])]
    product = Product("transformers", llama)
    with KVMemClient(pool.target, name="heads", cache_namespace="heads") as kv:
        model, _ = product.model(kv)
        sched = Scheduler(KVMemBackend(kv), model, budget=BUDGET, max_running=8, top_ups=True)
        sched.add([Request(0, np.concatenate([stem, [7]]).astype(np.int32), 1)])  # caches the stem
        run(sched)
        sched.figures = type(sched.figures)()
        sched.add([Request(1 + i, p.astype(np.int32), NEW_TOKENS) for i, p in enumerate(prompts)])
        run(sched)
    f = sched.figures
    assert f.top_ups >= 1 and f.prefix_hit_tokens == 16 + 8 and f.prefill_tokens == 4 + 9 + 1, f
    assert f.max_forward_tokens <= BUDGET, f
    for r in sched.finished[-3:]:
        p = prompts[r.index - 1]
        assert r.tokens[: r.known].tolist() == np.concatenate([p, greedy(llama, p, NEW_TOKENS)]).tolist(), r.index


def test_top_ups_are_sent_only_while_a_forward_takes_longer_than_a_step(pool: ServerProcess, llama: Any) -> None:
    """The default (``top_ups=None``): a top-up Step adds a round trip to save a forward,
    so it is sent only while forwards take longer than Steps. The tiny Llama, once with
    every Step 100 ms slower (no top-up), once with every forward 100 ms slower (top-ups);
    the completions equal ``generate()``'s either way."""
    stem = np.tile(MOTIF, 3)[:16]
    prompts = [np.concatenate([stem, np.full(4, 1 + i, dtype=np.int32)]) for i in range(4)]
    counts = {}
    for slow in ("step", "forward"):
        with KVMemClient(pool.target, name="top-up-auto", cache_namespace=f"auto-{slow}") as kv:
            model, _ = Product("transformers", llama).model(kv)
            backend = KVMemBackend(kv)
            target = backend if slow == "step" else model
            inner = getattr(target, slow)

            def slower(arg: Any, inner: Any = inner) -> Any:
                time.sleep(0.1)  # far above the other's time, even on a loaded host
                return inner(arg)

            setattr(target, slow, slower)
            sched = Scheduler(backend, model, budget=BUDGET, max_running=8)
            sched.add([Request(0, np.concatenate([stem, [7]]).astype(np.int32), 1)])  # caches the stem
            run(sched)
            sched.add([Request(1 + i, p, NEW_TOKENS) for i, p in enumerate(prompts)])
            run(sched)
        for r in sched.finished[-4:]:
            p = prompts[r.index - 1]
            assert r.tokens[: r.known].tolist() == np.concatenate([p, greedy(llama, p, NEW_TOKENS)]).tolist()
        counts[slow] = sched.figures.top_ups
    assert counts["step"] == 0 and counts["forward"] > 0, counts


def snapshot(sched: Scheduler) -> dict[str, Any]:
    """Every request's fields, and where it is."""
    requests = [*sched.waiting, *sched.running, *sched.leaving, *sched.giving]
    state: dict[str, Any] = {
        "waiting": [r.index for r in sched.waiting],
        "running": [r.index for r in sched.running],
        "leaving": [r.index for r in sched.leaving],
    }
    for r in requests:
        fields = {k: getattr(r, k) for k in Request.__slots__ if k not in ("tokens", "logits", "origin")}
        state[f"r{r.index}"] = (fields, r.tokens.copy().tolist())
    return state


def test_a_step_that_fails_at_the_transport_leaves_every_request_as_it_was(llama: Any) -> None:
    srv = serve(60)
    product = Product("transformers", llama)
    try:
        with KVMemClient(srv.target, name="transport", timeout=5) as kv:
            model, policy = product.model(kv)
            sched = Scheduler(KVMemBackend(kv), model, budget=BUDGET, max_running=8, policy=policy)
            sched.add(product.requests)
            for _ in range(6):  # admissions, chunks, decodes under way
                sched.iteration()
            assert sched.running and any(r.known > r.prompt_len for r in sched.running)
            before = snapshot(sched)
            os.kill(srv.proc.pid, signal.SIGKILL)
            srv.proc.wait()
            with pytest.raises(KVMemError):
                sched.iteration()
            assert snapshot(sched) == before
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
