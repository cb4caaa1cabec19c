"""The engine's tokens and logits against transformers' own ``generate()`` (the tiny random
Llama of ``tiny_llama.py``, fp32, its own cache and "sdpa" attention): on real
``kvmem serve`` pools of page size 1, 16 and 7 (which divides none of the prompts),
through kvmem's batched client and through the drop-in, with prefill chunks and decodes
mixed in one forward, preempted and resumed requests, and prompt-lookup drafts whose
rejected tails are truncated. Every greedy token equals generate()'s and every logit
agrees to 1e-4; the same from a second process that matches the pages a first one
computed, through the drop-in.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from conftest import ServerProcess, short_tmpdir, start_server
from tiny_llama import SERVE_FLAGS, VOCAB, tiny_llama
from transformers import LlamaForCausalLM

from kvmem.engine.generate.attention import ATTENTION
from kvmem.engine.generate import Engine
from kvmem.engine.generate.engine import propose_drafts

NEW_TOKENS = 16
LENGTHS = (5, 13, 20, 9, 3, 27)
PROMPTS = [np.random.default_rng(70 + i).integers(0, VOCAB, size=n).astype(np.int32) for i, n in enumerate(LENGTHS)]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def kvmem_model(reference: LlamaForCausalLM) -> LlamaForCausalLM:
    model = copy.deepcopy(reference)
    model.set_attn_implementation(ATTENTION)
    return model


def generate_with_logits(model: LlamaForCausalLM, prompt: np.ndarray, n: int) -> tuple[list[int], torch.Tensor]:
    """generate()'s greedy tokens and the logits each came from, ``[n, vocab]``."""
    ids = torch.from_numpy(prompt).long()[None].to(model.device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits)


@pytest.fixture(scope="module")
def expected(reference: LlamaForCausalLM) -> list[tuple[list[int], torch.Tensor]]:
    return [generate_with_logits(reference, p, NEW_TOKENS) for p in PROMPTS]


def serve(page_size: int, num_pages: int, max_context: int = 64) -> ServerProcess:
    return start_server(
        short_tmpdir(), "--device", "cpu", *SERVE_FLAGS.split(), "--page-size", str(page_size),
        "--num-pages", str(num_pages), "--max-requests", "32", "--max-context", str(max_context),
    )  # fmt: skip


@pytest.fixture(scope="module", params=[1, 7, 16], ids=lambda ps: f"page_size={ps}")
def pool(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    page_size = request.param
    srv = serve(page_size, 1 + 512 // page_size)  # room for every prompt at once: no preemption
    yield srv
    assert srv.stop() == 0, srv.log()


def check(out: list, expected: list[tuple[list[int], torch.Tensor]], what: str) -> None:
    for c, (tokens, logits) in zip(out, expected, strict=True):
        assert c.token_ids == tokens, f"{what}, prompt {c.index}: {c.token_ids} != generate()'s {tokens}"
        assert c.logits is not None and c.logits.shape == logits.shape, (what, c.index)
        diff = float((c.logits.cpu() - logits.cpu()).abs().max())
        assert diff <= TOLERANCE, f"{what}, prompt {c.index}: logits differ by {diff:.2e} (> {TOLERANCE})"


@pytest.mark.parametrize("api", ["client", "compat"])
@pytest.mark.parametrize("speculate", [0, 3], ids=["decode", "drafts"])
def test_tokens_and_logits_equal_generate_with_chunks_mixed_with_decodes(
    pool: ServerProcess, kvmem_model: LlamaForCausalLM, expected: list, api: str, speculate: int
) -> None:
    """At most 12 tokens a forward: the longer prompts prefill in chunks, in forwards
    shared with other requests' decodes (and their drafts)."""
    with Engine(kvmem_model, pool.target, name=f"exact-{api}", cache_namespace=f"{api}-{speculate}", api=api) as engine:
        out = engine.generate(
            PROMPTS, max_new_tokens=NEW_TOKENS, token_budget=12, speculate=speculate, keep_logits=True
        )
        f = engine.figures
    print(f"{api}, speculate {speculate}: {f}")  # pytest -s shows the figures
    check(out, expected, f"{api}, speculate {speculate}")
    assert f.max_forward_tokens <= 12 and f.mixed_forwards > 0 and f.preemptions == 0, f
    if speculate:  # drafts were kept and rejected (their K/V truncated)
        assert 0 < f.drafts_kept < f.drafts_proposed, f
    rejected = f.drafts_proposed - f.drafts_kept  # each computed once more than a plain decode does
    assert (
        sum(c.computed_tokens + c.matched_tokens for c in out)
        == sum(LENGTHS) + len(LENGTHS) * (NEW_TOKENS - 1) + rejected
    )


@pytest.mark.parametrize("api", ["client", "compat"])
@pytest.mark.parametrize("speculate", [0, 3], ids=["decode", "drafts"])
def test_tokens_and_logits_equal_generate_when_requests_are_preempted(
    kvmem_model: LlamaForCausalLM, expected: list, api: str, speculate: int
) -> None:
    """21 pages of 4 tokens for about 60 pages of demand: allocs run out of pages, the
    youngest running requests are preempted and later recompute what the cache no longer
    holds; every token and logit still equals generate()'s."""
    srv = serve(4, 22)
    try:
        with Engine(kvmem_model, srv.target, name=f"preempt-{api}", api=api) as engine:
            out = engine.generate(
                PROMPTS, max_new_tokens=NEW_TOKENS, token_budget=32, speculate=speculate, keep_logits=True
            )
            f = engine.figures
    finally:
        assert srv.stop() == 0, srv.log()
    print(f"small pool, {api}, speculate {speculate}: {f}; preemptions {[c.preemptions for c in out]}")
    assert f.out_of_pages > 0 and f.preemptions > 0, f
    check(out, expected, f"preempted, {api}, speculate {speculate}")


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence_of_the_tail() -> None:
    seq = np.array([5, 6, 7, 1, 2, 5, 6, 7, 3, 4, 9, 5, 6, 7], dtype=np.int32)
    assert propose_drafts(seq, 2).tolist() == [3, 4]  # the 3-gram 5 6 7 last occurred before 3 4
    assert propose_drafts(seq, 9).tolist() == [3, 4, 9, 5, 6, 7]
    assert propose_drafts(np.array([1, 2, 3, 2], dtype=np.int32), 2).tolist() == [3, 2]  # a 1-gram
    assert propose_drafts(np.array([1, 2, 3], dtype=np.int32), 2).size == 0


# A process that computes and caches a prompt on the server, through the drop-in; the
# test's own process then matches its pages.
CACHER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    import numpy as np
    from tiny_llama import tiny_llama
    from kvmem.engine.generate import Engine

    model = tiny_llama()
    prompt = np.array([int(t) for t in sys.argv[2].split(",")], dtype=np.int32)
    with Engine(model, sys.argv[1], name="cacher", cache_namespace="cross", api="compat") as engine:
        (c,) = engine.generate([prompt], max_new_tokens=1)
    assert c.matched_tokens == 0 and c.computed_tokens == prompt.size, c
    """
)


def test_a_second_process_through_the_drop_in_computes_only_what_the_first_did_not(
    kvmem_model: LlamaForCausalLM, reference: LlamaForCausalLM
) -> None:
    """Process A (the drop-in) computes and caches a 40-token prompt; this process (the
    drop-in too) matches A's 5 pages of 8 for a longer prompt starting with it, computes
    only the rest, and its tokens and logits equal generate()'s from scratch."""
    rng = np.random.default_rng(11)
    shared = rng.integers(0, VOCAB, size=40).astype(np.int32)
    longer = np.concatenate([shared, rng.integers(0, VOCAB, size=9).astype(np.int32)])
    srv = serve(8, 64, max_context=128)
    try:
        done = subprocess.run(
            [sys.executable, "-c", CACHER, srv.target, ",".join(map(str, shared)), os.path.dirname(__file__)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        with Engine(kvmem_model, srv.target, name="matcher", cache_namespace="cross", api="compat") as engine:
            (c,) = engine.generate([longer], max_new_tokens=NEW_TOKENS, keep_logits=True)
    finally:
        assert srv.stop() == 0, srv.log()
    assert c.matched_tokens == 40 and c.computed_tokens == longer.size - 40 + NEW_TOKENS - 1, c
    check([c], [generate_with_logits(reference, longer, NEW_TOKENS)], "after a cross-process match")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("api", ["client", "compat"])
def test_on_a_gpu_the_engine_writes_and_reads_kv_through_cuda_ipc(reference: LlamaForCausalLM, api: str) -> None:
    """``kvmem serve --device cuda:0``: the model on the GPU writes and reads its K/V in
    the server's device memory through the CUDA IPC mapping; tokens equal generate()'s on
    the same GPU and logits agree to 1e-4, with chunks, decodes and drafts mixed."""
    gpu = copy.deepcopy(reference).to("cuda:0")
    want = [generate_with_logits(gpu, p, NEW_TOKENS) for p in PROMPTS]
    srv = start_server(
        short_tmpdir(), "--device", "cuda:0", *SERVE_FLAGS.split(), "--page-size", "16", "--num-pages", "64",
        "--max-requests", "32", "--max-context", "64",
    )  # fmt: skip
    try:
        with Engine(gpu, srv.target, name=f"cuda-{api}", api=api) as engine:
            assert engine.kv.kv_cache()[0][0].is_cuda
            out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, token_budget=12, speculate=3, keep_logits=True)
    finally:
        assert srv.stop() == 0, srv.log()
    check(out, want, f"cuda, {api}")
