"""kvmem's attention hook and the transformers model behind the engine's seam
(:mod:`kvmem.engine.generate.attention`, :mod:`kvmem.engine.generate.hf_model`), proven exact on a tiny
random-initialised Llama (``tiny_llama.py``: 2 layers, hidden 64, 4 query heads, 2 KV
heads of 16, vocab 128, fp32, seeded).

The reference is the same weights with transformers' own attention ("sdpa") and cache:
``generate(do_sample=False)`` for the greedy tokens, its ``output_logits`` (or a full
forward) for the logits. The kvmem runs pack requests ragged into one forward per
iteration through :class:`~kvmem.engine.forward.BatchBuilder` (the scheduler's packing):
prompts of different lengths prefilled together, prefill chunks and decodes mixed,
chunked prefill across page boundaries; first on plain tensors with a hand-made block
table (page sizes 1, 7 and 16), then on a real ``kvmem serve`` (its mapped memory, its
Steps' allocations), and across processes through the prefix cache.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import tomllib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from conftest import LineProcess, ServerProcess, short_tmpdir, start_server
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from tiny_llama import HEAD_DIM, KV_HEADS, LAYERS, SERVE_FLAGS, VOCAB, tiny_config, tiny_llama
from transformers import LlamaForCausalLM

from kvmem.client import KVMemClient
from kvmem.engine.generate.attention import ATTENTION, PagedBatch
from kvmem.engine.generate.hf_model import (
    TRANSFORMERS_TESTED,
    GeometryMismatch,
    Sampling,
    TransformersModel,
    check_geometry,
    sample,
    serve_flags,
)
from kvmem.engine.forward import BatchBuilder
from kvmem.v1 import kvmem_pb2

NEW_TOKENS = 6
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def kvmem_model(reference: LlamaForCausalLM) -> LlamaForCausalLM:
    model = copy.deepcopy(reference)
    model.set_attn_implementation(ATTENTION)
    return model


PROMPTS = [
    np.random.default_rng(7 + i).integers(0, VOCAB, size=n).astype(np.int32) for i, n in enumerate((5, 13, 20, 9, 3))
]
# Per prompt: the iteration it arrives at and its prefill chunk (tokens per forward).
SCHEDULE = [(0, 64), (0, 64), (1, 6), (2, 4), (3, 64)]


@pytest.fixture(scope="module")
def expected(reference: LlamaForCausalLM) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: ``generate()``'s greedy tokens and its logits before each."""
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.from_numpy(prompt).long()[None]
            gen = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
            out.append((gen.sequences[0, prompt.size :].tolist(), torch.cat(gen.logits)))
    return out


@dataclasses.dataclass
class Request:
    rid: str
    prompt: np.ndarray
    arrive: int
    chunk: int
    row: int = 0
    done: int = 0  # positions computed
    out: list[int] = dataclasses.field(default_factory=list)
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)


Alloc = Callable[[list[tuple[Request, int]]], list[np.ndarray]]


def run(model: TransformersModel, reqs: list[Request], alloc: Alloc) -> list[int]:
    """Drive the requests to ``NEW_TOKENS`` each, one packed forward per iteration:
    each running request adds its next prefill chunk (sampled if it is the last) or
    its decode. Returns the batch sizes (requests per forward)."""
    sizes = []
    iteration = 0
    while any(len(r.out) < NEW_TOKENS for r in reqs):
        active = []
        for r in reqs:
            if r.arrive > iteration or len(r.out) >= NEW_TOKENS:
                continue
            if r.done < r.prompt.size:
                tokens = r.prompt[r.done : r.done + r.chunk]
                active.append((r, tokens, int(r.done + tokens.size == r.prompt.size)))
            else:
                active.append((r, np.array([r.out[-1]], dtype=np.int32), 1))
        builder = BatchBuilder()
        for (r, tokens, samples), kv_loc in zip(active, alloc([(r, t.size) for r, t, _ in active]), strict=True):
            builder.add(r.rid, r.row, r.done, tokens, kv_loc, samples)
        out = model.forward(builder.build([], [], has_kv=True))
        assert model.last_logits is not None
        k = 0
        for r, tokens, samples in active:
            r.done += tokens.size
            if samples:
                r.out.append(int(out.next_tokens[k]))
                r.logits.append(model.last_logits[k].clone())
                k += 1
        assert k == out.next_tokens.size
        sizes.append(len(active))
        iteration += 1
    return sizes


def assert_exact(name: str, reqs: list[Request], expected: list[tuple[list[int], torch.Tensor]]) -> None:
    diff = 0.0
    for r, (tokens, logits) in zip(reqs, expected, strict=True):
        assert r.out == tokens, f"{name} {r.rid}: greedy tokens {r.out} != generate()'s {tokens}"
        diff = max(diff, float((torch.stack(r.logits) - logits).abs().max()))
    print(f"{name}: max logit difference {diff:.3g}")  # pytest -s shows the figures
    assert diff < TOLERANCE, f"{name}: logits differ from generate()'s by {diff}"


def requests() -> list[Request]:
    return [Request(f"r{i}", p, a, c) for i, (p, (a, c)) in enumerate(zip(PROMPTS, SCHEDULE, strict=True))]


# --------------------------------------------------------------- plain tensors


@pytest.mark.parametrize("page_size", [1, 7, 16])
def test_greedy_tokens_and_logits_equal_generate_on_plain_tensors(
    page_size: int, kvmem_model: LlamaForCausalLM, expected: list[tuple[list[int], torch.Tensor]]
) -> None:
    """Plain tensors as the KV memory, a hand-made block table of shuffled pages: every
    prompt's greedy tokens equal ``generate()``'s and its logits agree to 1e-4, with
    prompts of different lengths prefilled in one forward, prefill chunks mixed with
    decodes, and a 20-token prompt prefilled 6 at a time (page size 7 divides none)."""
    max_len = max(p.size for p in PROMPTS) + NEW_TOKENS
    pages_per = -(-max_len // page_size)
    num_pages = 1 + pages_per * len(PROMPTS)
    shape = (num_pages * page_size, KV_HEADS, HEAD_DIM)
    kv_cache = [(torch.full(shape, torch.nan), torch.full(shape, torch.nan)) for _ in range(LAYERS)]  # unwritten: NaN
    table = torch.zeros((len(PROMPTS) + 2, pages_per), dtype=torch.int32)
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(page_size)) + 1
    table[1 : len(PROMPTS) + 1] = order.view(len(PROMPTS), pages_per).to(torch.int32)
    reqs = requests()
    for i, r in enumerate(reqs):
        r.row = i + 1

    def alloc(items: list[tuple[Request, int]]) -> list[np.ndarray]:
        out = []
        for r, n in items:
            pos = np.arange(r.done, r.done + n)
            out.append(table[r.row].numpy().astype(np.int64)[pos // page_size] * page_size + pos % page_size)
        return out

    model = TransformersModel(kvmem_model, kv_cache, table, page_size)
    sizes = run(model, reqs, alloc)
    assert max(sizes) == len(PROMPTS) and model.num_forwards == len(sizes)
    assert_exact(f"plain tensors, page size {page_size}", reqs, expected)


def test_tier_the_attention_hook_waits_for_each_layers_copy_before_reading_it(kvmem_model: LlamaForCausalLM) -> None:
    """K/V still loading from a host tier: the forward's ``wait`` is called with each
    layer's index, in order, before that layer reads the cache (layer 1 waits while
    layer 0 has computed), and nothing else changes: the logits equal a forward with
    nothing to wait for."""
    page_size, prompt = 4, PROMPTS[0]
    shape = (8 * page_size, KV_HEADS, HEAD_DIM)
    kv_cache = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]
    table = torch.zeros((2, 8), dtype=torch.int32)
    table[1] = torch.arange(1, 9, dtype=torch.int32)
    model = TransformersModel(kvmem_model, kv_cache, table, page_size)
    builder = BatchBuilder()
    builder.add("r", 1, 0, prompt, np.arange(page_size, page_size + prompt.size), 1)
    batch = builder.build([], [], has_kv=True)
    plain = model.forward(batch)
    plain_logits = model.last_logits.clone()
    calls: list[int | None] = []
    seen_written: list[bool] = []

    def wait(layer: int | None) -> float:
        calls.append(layer)
        # what this layer writes is not there yet when it waits: the wait comes first
        seen_written.append(bool(kv_cache[layer][0][page_size : page_size + prompt.size].abs().sum() == 0))
        return 0.0

    for k, v in kv_cache:
        k.zero_()
        v.zero_()
    waited = model.forward(dataclasses.replace(batch, wait=wait))
    assert calls == list(range(LAYERS)) and all(seen_written)
    assert waited.next_tokens.tolist() == plain.next_tokens.tolist()
    assert torch.equal(model.last_logits, plain_logits)


def test_paged_batch_masks_by_position_within_each_request() -> None:
    """The metadata of two requests (3 prefill tokens from position 2; one decode at
    position 4) over page size 2: each query sees its own request's positions up to its
    own, through its row's pages; padding points at the request's first slot."""
    table = torch.tensor([[0, 0, 0], [5, 3, 9], [7, 2, 4]], dtype=torch.int32)
    kv = [(torch.zeros(20, KV_HEADS, HEAD_DIM), torch.zeros(20, KV_HEADS, HEAD_DIM))]
    b = PagedBatch.build(
        kv, table, 2, torch.tensor([1, 2]), torch.tensor([0, 3, 4]), torch.tensor([2, 3, 4, 4]),
        torch.tensor([6, 7, 18, 8]), torch.tensor([5, 5]),
    )  # fmt: skip
    assert b.kv_index.tolist() == [[10, 11, 6, 7, 18], [14, 15, 4, 5, 8]]
    assert b.q_index.tolist() == [[0, 1, 2], [3, 0, 0]] and b.q_valid.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert b.mask[1, 0, 0].int().tolist() == [1, 1, 1, 1, 1]
    with pytest.raises(ValueError, match="last position must be its seq_len - 1"):
        PagedBatch.build(kv, table, 2, torch.tensor([1]), torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([6]),
                         torch.tensor([5]))  # fmt: skip


def test_a_geometry_mismatch_is_refused_in_one_line_with_the_serve_flags(kvmem_model: LlamaForCausalLM) -> None:
    config = tiny_config()
    assert serve_flags(config) == SERVE_FLAGS
    layout = kvmem_pb2.KVLayout(format=kvmem_pb2.KV_FORMAT_MHA, num_layers=LAYERS, num_kv_heads=KV_HEADS,
                                head_dim=HEAD_DIM, dtype="float32")  # fmt: skip
    check_geometry(config, kvmem_pb2.PoolGeometry(page_size=16, layout=layout))
    layout.num_layers, layout.head_dim, layout.dtype = 4, 64, "bfloat16"
    with pytest.raises(GeometryMismatch) as err:
        check_geometry(config, kvmem_pb2.PoolGeometry(page_size=16, layout=layout))
    message = str(err.value)
    assert "\n" not in message and message.endswith(f"kvmem serve {SERVE_FLAGS}"), message
    assert "layers 4 (the model's 2)" in message and "head dim 64 (the model's 16)" in message, message
    assert "dtype bfloat16 (the model's float32)" in message and "kv heads" not in message, message
    with pytest.raises(GeometryMismatch, match="no MHA KV memory"):
        check_geometry(config, kvmem_pb2.PoolGeometry(page_size=16))
    wrong = [(torch.zeros(16, KV_HEADS + 1, HEAD_DIM), torch.zeros(16, KV_HEADS + 1, HEAD_DIM))] * LAYERS
    with pytest.raises(GeometryMismatch, match=r"kv heads 3 \(the model's 2\).*--kv-heads 2"):
        TransformersModel(kvmem_model, wrong, torch.zeros((2, 1), dtype=torch.int32), 16)


def test_sampling_is_seeded_and_narrows_to_top_k_and_top_p() -> None:
    """Greedy is the argmax; a seed repeats its draws; top-k 1 and a tiny top-p leave
    only the argmax; top-k 3 draws only among the 3 most likely."""
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, Sampling(), None), best)

    def draw(s: Sampling) -> torch.Tensor:
        assert s.seed is not None
        return sample(logits, s, torch.Generator().manual_seed(s.seed))

    hot = Sampling(temperature=2.0, seed=11)
    assert torch.equal(draw(hot), draw(hot)) and not torch.equal(draw(hot), best)
    assert torch.equal(draw(Sampling(temperature=2.0, top_k=1, seed=1)), best)
    assert torch.equal(draw(Sampling(temperature=2.0, top_p=1e-6, seed=1)), best)
    top3 = torch.topk(logits, 3, dim=-1).indices
    assert (draw(Sampling(temperature=5.0, top_k=3, seed=2))[:, None] == top3).any(-1).all()
    with pytest.raises(ValueError, match="top_p 0"):
        Sampling(top_p=0)


def test_the_installed_transformers_is_in_the_tested_range() -> None:
    """The model extra pins transformers to the range this hook was proven on."""
    tested = SpecifierSet(TRANSFORMERS_TESTED)
    assert Version(transformers.__version__) in tested, (
        f"transformers {transformers.__version__} is outside the range kvmem's attention hook is tested on "
        f"({TRANSFORMERS_TESTED}): install kvmem[model], or test the hook on it and widen TRANSFORMERS_TESTED"
    )
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    pins = [d for d in extras["model"] if d.startswith("transformers")]
    assert pins == [f"transformers{TRANSFORMERS_TESTED}"], pins
    assert "kvmem[model]" in extras["test"]


# ----------------------------------------------------------- a real server

PAGE_SIZE = 16


@pytest.fixture(scope="module")
def pool() -> Iterator[ServerProcess]:
    directory = short_tmpdir()
    srv = start_server(
        directory, "--device", "cpu", *SERVE_FLAGS.split(), "--page-size", str(PAGE_SIZE), "--num-pages", "64",
        "--max-requests", "16", "--max-context", "128",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


def server_alloc(kv: KVMemClient) -> Alloc:
    def alloc(items: list[tuple[Request, int]]) -> list[np.ndarray]:
        res = kv.step(alloc_slots=[r.row for r, _ in items], alloc_needs=[n for _, n in items])
        assert res.ok, res
        return [res.kv_loc_of(i).numpy().astype(np.int64) for i in range(len(items))]

    return alloc


def test_greedy_tokens_and_logits_equal_generate_on_a_kvmem_server(
    pool: ServerProcess, kvmem_model: LlamaForCausalLM, expected: list[tuple[list[int], torch.Tensor]]
) -> None:
    """The same schedule on a real ``kvmem serve``: K/V written into its shared memory
    through ``kv_cache()``, read through its ``block_table``, every alloc one Step."""
    with KVMemClient(pool.target, name="exact") as kv:
        check_geometry(kvmem_model.config, kv.geometry)
        reqs = requests()
        for r, slot in zip(reqs, kv.open([r.rid for r in reqs]).tolist(), strict=True):
            r.row = slot
        model = TransformersModel(kvmem_model, kv.kv_cache(), kv.block_table, int(kv.geometry.page_size))
        run(model, reqs, server_alloc(kv))
        assert_exact("kvmem server", reqs, expected)
        kv.step(release_slots=[r.row for r in reqs])


CHILD = r"""
import dataclasses, json, sys
import numpy as np
from kvmem.client import KVMemClient
from kvmem.engine.generate.attention import ATTENTION
from kvmem.engine.generate.hf_model import TransformersModel, check_geometry
from kvmem.engine.forward import BatchBuilder
from transformers import LlamaForCausalLM

target, model_dir, out_path, prompt = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
model = LlamaForCausalLM.from_pretrained(model_dir, attn_implementation=ATTENTION).eval()
with KVMemClient(target, name="second") as kv:
    check_geometry(model.config, kv.geometry)
    (slot,) = kv.open(["b"]).tolist()
    res = kv.step(match=[(slot, prompt, len(prompt) - 1)], alloc_slots=[slot], alloc_needs=[len(prompt)])
    matched, loading = int(res.match_lens[0]), int(res.match_loading[0])
    engine = TransformersModel(model, kv.kv_cache(), kv.block_table, int(kv.geometry.page_size))
    builder = BatchBuilder()
    rest = np.array(prompt[matched:], dtype=np.int32)
    builder.add("b", slot, matched, rest, res.kv_loc_of(0).numpy(), rest.size)
    batch = builder.build([], [], has_kv=True)
    if loading:  # still being copied in from the host tier: each layer waits for its copy
        pages = kv.page_loads.pages_of(kv.block_table[slot], matched, loading)
        batch = dataclasses.replace(batch, wait=lambda layer: kv.page_loads.wait(pages, layer, timeout=30))
    out = engine.forward(batch)
    np.save(out_path, engine.last_logits.numpy())
    kv.step(release_slots=[slot])
print("RESULT", json.dumps({"matched": matched, "computed": int(rest.size), "tokens": out.next_tokens.tolist(),
                          "loading": loading}), flush=True)
"""


def test_a_second_process_reads_the_prefix_the_first_computed(
    pool: ServerProcess, reference: LlamaForCausalLM, kvmem_model: LlamaForCausalLM, tmp_path: Any
) -> None:
    """This process prefills a 40-token prompt through kvmem and releases it with its
    tokens into the prefix cache (2 full pages); a separate process (the model loaded
    from disk with ``attn_implementation="kvmem"``) matches them for a prompt that
    shares 35 tokens, computes only its other 10, and its logits there equal a
    from-scratch forward's."""
    _second_process_reads_the_prefix(pool, reference, kvmem_model, tmp_path, evict=False)


def test_tier_a_second_process_reads_the_prefix_back_from_the_host_tier(
    reference: LlamaForCausalLM, kvmem_model: LlamaForCausalLM, tmp_path: Any
) -> None:
    """The same on a server with a host tier whose pool is small: between the two, an
    alloc of the whole pool evicts the prompt's pages to the host tier; the second
    process's match loads them back (its forward waiting per layer for their copy), and
    its logits still equal a from-scratch forward's."""
    srv = start_server(
        short_tmpdir(), "--device", "cpu", *SERVE_FLAGS.split(), "--page-size", str(PAGE_SIZE), "--num-pages", "8",
        "--max-requests", "16", "--max-context", "112", "--host-memory", "1MiB",
    )  # fmt: skip
    try:
        _second_process_reads_the_prefix(srv, reference, kvmem_model, tmp_path, evict=True)
        with KVMemClient(srv.target, name="look") as kv:
            st = kv.stats(audit=True)
            assert st.audit.ok and st.host_tier.num_loaded == 2, (st.audit.problems, st.host_tier)
    finally:
        assert srv.stop() == 0, srv.log()


def _second_process_reads_the_prefix(
    pool: ServerProcess, reference: LlamaForCausalLM, kvmem_model: LlamaForCausalLM, tmp_path: Any, evict: bool
) -> None:
    first = np.random.default_rng(99).integers(0, VOCAB, size=40).astype(np.int32)
    second = np.concatenate([first[:35], np.random.default_rng(100).integers(0, VOCAB, size=7).astype(np.int32)])
    with KVMemClient(pool.target, name="first") as kv:
        (slot,) = kv.open(["a"]).tolist()
        req = Request("a", first, 0, 64, row=slot)
        model = TransformersModel(kvmem_model, kv.kv_cache(), kv.block_table, PAGE_SIZE)
        builder = BatchBuilder()
        (kv_loc,) = server_alloc(kv)([(req, first.size)])
        builder.add("a", slot, 0, first, kv_loc, 1)
        model.forward(builder.build([], [], has_kv=True))
        released = kv.step(release_slots=[slot], release_token_ids=[first])
        assert released.num_pages_cached == 2, released
        if evict:  # every page of the pool: the prompt's two go to the host tier
            (big,) = kv.open(["fill"]).tolist()
            filled = kv.step(alloc_slots=[big], alloc_needs=[7 * PAGE_SIZE])
            assert filled.ok and filled.num_pages_evicted == 2, filled
            kv.step(release_slots=[big])
    model_dir, out_path = str(tmp_path / "model"), str(tmp_path / "logits.npy")
    reference.save_pretrained(model_dir)
    child = LineProcess("second engine", CHILD, pool.target, model_dir, out_path, json.dumps(second.tolist()))
    try:
        result = json.loads(child.expect("RESULT", timeout=120))
    finally:
        child.kill()
    assert (result["matched"], result["computed"]) == (32, 10), result
    with torch.inference_mode():
        scratch = reference(input_ids=torch.from_numpy(second).long()[None]).logits[0, 32:]
    got = torch.from_numpy(np.load(out_path))
    diff = float((got - scratch).abs().max())
    print(f"second process after a prefix match: max logit difference {diff:.3g}")
    assert diff < TOLERANCE, f"the second process's logits differ from a from-scratch run by {diff}"
    assert result["tokens"] == scratch.argmax(-1).tolist()
