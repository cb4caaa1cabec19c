"""The engine (:class:`kvmem.engine.generate.Engine`) driving the tiny random Llama
(``tiny_llama.py``, fp32) on a real ``kvmem serve`` of its geometry: every greedy
completion equals transformers' own ``generate(do_sample=False)`` token for token, with
a small token budget (chunked prefill mixed with decodes), on a pool small enough to
force preemptions (requeued, recomputed), and after a prefix match of pages another
session computed; stop tokens, seeded sampling and the geometry check at attach.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import numpy as np
import pytest
from conftest import ServerProcess, short_tmpdir, start_server
from tiny_llama import SERVE_FLAGS, VOCAB, greedy, tiny_config, tiny_llama
from transformers import LlamaForCausalLM

from kvmem.engine.generate.attention import ATTENTION
from kvmem.engine.generate import Engine
from kvmem.engine.generate.hf_model import GeometryMismatch, Sampling

NEW_TOKENS = 8
LENGTHS = (5, 13, 20, 9, 3, 27)
PROMPTS = [np.random.default_rng(70 + i).integers(0, VOCAB, size=n).astype(np.int32) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="module")
def kvmem_model(reference: LlamaForCausalLM) -> LlamaForCausalLM:
    model = copy.deepcopy(reference)
    model.set_attn_implementation(ATTENTION)
    return model


@pytest.fixture(scope="module")
def expected(reference: LlamaForCausalLM) -> list[list[int]]:
    return [greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def serve(page_size: int, num_pages: int, max_context: int) -> ServerProcess:
    return start_server(
        short_tmpdir(), "--device", "cpu", *SERVE_FLAGS.split(), "--page-size", str(page_size),
        "--num-pages", str(num_pages), "--max-requests", "16", "--max-context", str(max_context),
    )  # fmt: skip


@pytest.fixture(scope="module")
def pool() -> Iterator[ServerProcess]:
    srv = serve(16, 64, 128)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def small_pool() -> Iterator[ServerProcess]:
    srv = serve(4, 14, 48)  # 13 pages of 4 tokens: 52 token slots for 6 requests of up to 35 tokens
    yield srv
    assert srv.stop() == 0, srv.log()


def test_greedy_completions_equal_generate_with_chunked_prefill_mixed_with_decodes(
    pool: ServerProcess, kvmem_model: LlamaForCausalLM, expected: list[list[int]]
) -> None:
    """Six prompts of 3 to 27 tokens, at most 12 tokens per forward: the longer prompts
    prefill in chunks, in forwards shared with other requests' decodes."""
    with Engine(kvmem_model, pool.target, name="chunked") as engine:
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, token_budget=12)
        f = engine.figures
    print(f"chunked: {f}")  # pytest -s shows the figures
    for c, want in zip(out, expected, strict=True):
        assert c.token_ids == want, f"prompt {c.index}: {c.token_ids} != generate()'s {want}"
        assert (c.finish_reason, c.prompt_tokens, c.text, c.preemptions) == ("length", LENGTHS[c.index], None, 0)
        assert c.computed_tokens == c.prompt_tokens - c.matched_tokens + NEW_TOKENS - 1, c
    assert f.max_forward_tokens <= 12 and f.mixed_forwards > 0 and f.preemptions == 0, f
    assert out[5].iterations > NEW_TOKENS, out[5]  # its 27 tokens took more than one forward


def test_completions_equal_generate_when_a_small_pool_forces_preemption(
    small_pool: ServerProcess, kvmem_model: LlamaForCausalLM, expected: list[list[int]]
) -> None:
    """13 pages of 4 tokens for about 34 pages of demand: allocs run out of pages, the
    youngest running requests are preempted (released with their tokens, requeued) and
    recompute what the cache no longer holds; every completion still equals generate()'s."""
    with Engine(kvmem_model, small_pool.target, name="preempt") as engine:
        out = engine.generate(PROMPTS, max_new_tokens=NEW_TOKENS, token_budget=32)
        f = engine.figures
    print(f"small pool: {f}; preemptions per prompt {[c.preemptions for c in out]}")
    assert f.out_of_pages > 0 and f.preemptions > 0, f
    assert sum(c.preemptions for c in out) == f.preemptions
    for c, want in zip(out, expected, strict=True):
        assert c.token_ids == want, f"prompt {c.index} ({c.preemptions} preemptions): {c.token_ids} != {want}"


def test_a_shared_system_prompt_is_matched_from_the_cache_of_another_session(
    pool: ServerProcess, reference: LlamaForCausalLM, kvmem_model: LlamaForCausalLM
) -> None:
    """Two prompts sharing a 40-token system prompt, from two engines (sessions) in one
    cache namespace: the second matches the first's 2 full pages (32 tokens), computes
    only the rest, and both completions equal generate()'s."""
    rng = np.random.default_rng(5)
    system = rng.integers(0, VOCAB, size=40)
    first, second = (np.concatenate([system, rng.integers(0, VOCAB, size=n)]).astype(np.int32) for n in (6, 11))
    with Engine(kvmem_model, pool.target, name="a", cache_namespace="shared") as a:
        (one,) = a.generate([first], max_new_tokens=NEW_TOKENS, token_budget=16)
    with Engine(kvmem_model, pool.target, name="b", cache_namespace="shared") as b:
        (two,) = b.generate([second], max_new_tokens=NEW_TOKENS, token_budget=16)
    print(f"shared system prompt: first {one}, second {two}")
    assert one.matched_tokens == 0 and one.computed_tokens == first.size + NEW_TOKENS - 1, one
    assert two.matched_tokens == 32 and two.computed_tokens == second.size - 32 + NEW_TOKENS - 1, two
    assert one.token_ids == greedy(reference, first, NEW_TOKENS)
    assert two.token_ids == greedy(reference, second, NEW_TOKENS)


def test_a_stop_token_ends_a_completion_and_sampling_repeats_with_its_seed(
    pool: ServerProcess, kvmem_model: LlamaForCausalLM, expected: list[list[int]]
) -> None:
    """A stop token ends the completion at its first occurrence (included); a seeded
    sampled run repeats exactly, and differs from the greedy one."""
    stop = expected[1][3]
    with Engine(kvmem_model, pool.target, name="stop", cache_namespace="stop") as engine:
        (c,) = engine.generate([PROMPTS[1]], max_new_tokens=NEW_TOKENS, stop_token_ids=[stop])
        hot = Sampling(temperature=1.5, seed=3)
        runs = [engine.generate(PROMPTS[:3], max_new_tokens=NEW_TOKENS, sampling=hot) for _ in range(2)]
    assert c.finish_reason == "stop" and c.token_ids == expected[1][: expected[1].index(stop) + 1], c
    sampled = [[c.token_ids for c in run] for run in runs]
    assert sampled[0] == sampled[1] and sampled[0] != expected[:3], sampled


class CharTokenizer:
    """A tokenizer of the tiny vocabulary: a character per token id."""

    eos_token_id = None

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(ch) % VOCAB for ch in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)


def test_text_prompts_are_encoded_and_completions_decoded(
    pool: ServerProcess, reference: LlamaForCausalLM, kvmem_model: LlamaForCausalLM
) -> None:
    tok = CharTokenizer()
    with Engine(kvmem_model, pool.target, name="text", tokenizer=tok) as engine:
        (c,) = engine.generate(["What is the capital of France?"], max_new_tokens=4)
    want = greedy(reference, np.array(tok("What is the capital of France?")["input_ids"]), 4)
    assert c.token_ids == want and c.text == tok.decode(want), c
    with (
        Engine(kvmem_model, pool.target, name="no-tokenizer") as engine,
        pytest.raises(ValueError, match="prompt 0 is text: the engine needs a tokenizer"),
    ):
        engine.generate(["hello"], max_new_tokens=1)


def test_attach_refuses_a_pool_of_another_geometry_with_the_serve_flags(pool: ServerProcess) -> None:
    wider = LlamaForCausalLM(tiny_config(num_hidden_layers=3)).eval()
    with pytest.raises(GeometryMismatch, match=r"layers 2 \(the model's 3\).*kvmem serve --format mha --layers 3"):
        Engine(wider, pool.target, name="wrong")
