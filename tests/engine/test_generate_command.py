"""``kvmem generate``, run as a real process (``python -m kvmem.cli generate``) with the
tiny random Llama (``tiny_llama.py``) saved to a temporary directory beside a word-level
tokenizer of its vocabulary (``w2`` .. ``w127``, a plain chat template), so text, chat and
token-id prompts all work: 2 worker processes against the server generate starts (every
greedy completion equal to the model's own ``generate()``), against a running server
started with ``--print-serve-flags``'s flags, a server of another geometry refused in one
line with the flags, a mismatch exiting 1, and ``--help`` without torch.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import ServerProcess, short_tmpdir, start_server
from tiny_llama import SERVE_FLAGS, VOCAB, tiny_llama

CLI = [sys.executable, "-m", "kvmem.cli", "generate"]
NEW_TOKENS = 8
SYSTEM = " ".join(f"w{2 + i}" for i in range(24))  # a shared prefix: more than one page of 16 tokens
PROMPTS = [
    {"token_ids": list(range(2, 30)) + [40 + i, 50 + i, 60]} if i % 3 == 0
    else {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"w{70 + i} w{80 + i}"}]}
    if i % 3 == 1
    else {"prompt": f"{SYSTEM} w{90 + i} hello w{100 + i}"}
    for i in range(6)
]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(directory)
    vocab = {"[UNK]": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant{% endif %}"
    )
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    return path


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    env["COLUMNS"] = "200"
    return env


def generate(*args: str | os.PathLike[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*CLI, *map(str, args)], capture_output=True, text=True, env=clean_env(), timeout=timeout
    )  # fmt: skip


@pytest.fixture
def absent_socket() -> Iterator[str]:
    directory = short_tmpdir()
    yield os.path.join(directory, "none.sock")
    os.rmdir(directory)


@pytest.mark.parametrize("how", [[], ["--api", "compat", "--speculate", "3"]], ids=["client", "drop-in-drafts"])
def test_two_workers_on_the_server_generate_starts_pass_the_check(
    model_dir: pathlib.Path, prompts_file: pathlib.Path, absent_socket: str, how: list[str]
) -> None:
    run = generate(
        "--model", model_dir, "--workers", "2", "--prompts", prompts_file, "--max-new-tokens", str(NEW_TOKENS),
        "--socket", absent_socket, "--json", *how,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"no kvmem server answers at unix:{absent_socket}: starting one for this run" in run.stderr
    assert f"kvmem serve --device cpu {SERVE_FLAGS} --page-size 16" in run.stderr
    assert "stopped the server generate started (exit 0)" in run.stderr
    result = json.loads(run.stdout)
    assert (result["ok"], result["checked"], result["mismatches"], result["errors"]) == (True, True, [], [])
    assert [c["index"] for c in result["completions"]] == list(range(len(PROMPTS)))
    for c in result["completions"]:
        assert c["matches_generate"] and c["token_ids"] == c["reference_token_ids"], c
        assert len(c["token_ids"]) == NEW_TOKENS and c["finish_reason"] == "length", c
        assert isinstance(c["text"], str) and len(c["text"].split()) <= NEW_TOKENS, c
    assert [w["worker"] for w in result["workers"]] == [0, 1]
    assert all(w["generated_tokens"] == 3 * NEW_TOKENS and w["tokens_per_s"] > 0 for w in result["workers"])
    pool = result["pool"]
    assert pool["used"] == 0 and pool["cached"] > 0 and pool["used"] + pool["cached"] + pool["free"] == pool["total"]


def test_print_serve_flags_start_a_server_that_generate_runs_on(
    model_dir: pathlib.Path, prompts_file: pathlib.Path
) -> None:
    """The printed flags are accepted by ``kvmem serve``, and generate uses that running
    server (it starts none) with the human-readable report; one request at a time per
    worker, a later prompt matches the pages an earlier one cached."""
    flags = generate("--model", model_dir, "--print-serve-flags")
    assert flags.returncode == 0, flags.stderr[-3000:]
    assert flags.stdout.strip() == SERVE_FLAGS
    srv = start_server(
        short_tmpdir(), "--device", "cpu", *flags.stdout.split(), "--page-size", "16", "--num-pages", "64",
        "--max-context", "256",
    )  # fmt: skip
    try:
        run = generate(
            "--model", model_dir, "--workers", "2", "--prompts", prompts_file, "--max-new-tokens", "4",
            "--socket", srv.socket_path, "--max-running", "1",
        )  # fmt: skip
    finally:
        assert srv.stop() == 0, srv.log()
    assert run.returncode == 0, run.stderr[-4000:]
    assert "starting one" not in run.stdout
    assert "check: all 6 greedy completions equal the model's own generate()" in run.stdout
    assert "w0 mixed: 12 tokens in" in run.stdout and "w1 mixed: 12 tokens in" in run.stdout
    assert "TTFT p50" in run.stdout and "TPOT p50" in run.stdout
    assert "prefix hit rate" in run.stdout and "pool 0 used" in run.stdout
    # one request at a time: prompt 2 (w0's second) starts with the page prompt 0 released into the cache
    hits = re.search(r"^w0 mixed: .* prefix hit (\d+)/(\d+) prompt tokens;", run.stdout, re.M)
    assert hits is not None and int(hits[1]) >= 16, run.stdout


def test_a_server_of_another_geometry_is_refused_in_one_line_with_the_flags(
    model_dir: pathlib.Path, prompts_file: pathlib.Path
) -> None:
    wrong = SERVE_FLAGS.replace("--layers 2", "--layers 3")
    srv: ServerProcess = start_server(
        short_tmpdir(), "--device", "cpu", *wrong.split(), "--num-pages", "64", "--max-context", "256"
    )
    try:
        run = generate("--model", model_dir, "--prompts", prompts_file, "--socket", srv.socket_path)
    finally:
        assert srv.stop() == 0, srv.log()
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith(f"kvmem generate: error: the server at {srv.target}: "), lines[0]
    assert "layers 3 (the model's 2)" in lines[0] and lines[0].endswith(f"kvmem serve {SERVE_FLAGS}"), lines[0]


def test_a_completion_that_differs_from_generate_exits_1_naming_the_prompt_and_token(
    model_dir: pathlib.Path, prompts_file: pathlib.Path, absent_socket: str
) -> None:
    run = generate(
        "--model", model_dir, "--workers", "1", "--prompts", prompts_file, "--max-new-tokens", "4",
        "--socket", absent_socket, "--corrupt-one-token",
    )  # fmt: skip
    assert run.returncode == 1, run.stderr[-3000:]
    mismatches = [line for line in run.stderr.splitlines() if line.startswith("MISMATCH: ")]
    assert len(mismatches) == 1, run.stderr
    assert mismatches[0].startswith("MISMATCH: prompt 0 ('token ids [2, 3, 4, 5, 6, 7, 8, 9]...'): new token 3 is ")
    assert "check: all" not in run.stdout


def test_a_bad_prompts_line_is_refused_in_one_line(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "w5"}\n\n{"token_ids": [1, -2]}\n', encoding="utf-8")
    run = generate("--model", tmp_path, "--prompts", path)
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f'kvmem generate: error: {path}:3: "token_ids" must be a non-empty list of ints >= 0, got [1, -2]'
    )


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--document-words", "40"], "--document-words 40: only with --workload multi-turn"),
        (["--workload", "multi-turn", "--document-words", "-1"], "argument --document-words: must be an integer >= 0"),
    ],
)
def test_a_bad_document_words_is_refused_in_one_line(tmp_path: pathlib.Path, argv: list[str], error: str) -> None:
    run = generate("--model", tmp_path, *argv)
    assert run.returncode == 2 and run.stderr.startswith(f"kvmem generate: error: {error}"), run.stderr


def test_document_words_give_each_users_first_turn_a_long_input_of_its_own() -> None:
    """--document-words: a user's first turn carries a document of its own (seeded: the
    same words every run, another user's differ); later turns add only their follow-up."""
    from kvmem.engine.generate.worker import document, multi_turn_prompts

    plain, long = multi_turn_prompts(3, 2), multi_turn_prompts(3, 2, document_words=50)
    assert multi_turn_prompts(3, 2, document_words=50) == long
    for p, q in zip(plain, long, strict=True):
        assert (p.turn, p.user) == (q.turn, q.user) and p.messages[0] == q.messages[0]
        if q.turn == 0:
            assert document(q.user, 50) in q.messages[1]["content"] and q.messages[1]["content"].endswith(
                p.messages[1]["content"].split(". ", 1)[1]
            )
            assert len(document(q.user, 50).split()) == 52  # 50 words and "Document N."
        else:
            assert q.messages == p.messages
    assert len({document(u, 50) for u in range(3)}) == 3


def test_generate_help_loads_no_torch_or_transformers() -> None:
    code = (
        "import contextlib, io, sys\n"
        "from kvmem.cli import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "    main(['generate', '--help'])\n"
        "assert '--print-serve-flags' in out.getvalue() and '--max-new-tokens' in out.getvalue(), out.getvalue()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy')))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", run.stdout


def moved_and_whole(result: dict, n_prompts: int) -> list[dict]:
    """Every prompt completed and equal to generate(); the completions that moved."""
    assert (result["ok"], result["checked"], result["mismatches"], result["errors"]) == (True, True, [], [])
    assert [c["index"] for c in result["completions"]] == list(range(n_prompts))
    for c in result["completions"]:
        assert c["matches_generate"] and c["token_ids"] == c["reference_token_ids"], c
    moved = [c for c in result["completions"] if c["moves"]]
    for c in moved:  # the adopter computed its decodes only: the prompt's K/V came in place
        assert c["computed_here"] <= len(c["token_ids"]) < c["prompt_tokens"], c
    return moved


def test_disaggregated_prefill_and_decode_workers_give_the_same_tokens(
    model_dir: pathlib.Path, prompts_file: pathlib.Path, absent_socket: str
) -> None:
    """``--disaggregate 1:1``: the prefill worker hands every request off after its first
    token, the decode worker adopts and finishes each; the report times both."""
    run = generate(
        "--model", model_dir, "--disaggregate", "1:1", "--prompts", prompts_file, "--max-new-tokens",
        str(NEW_TOKENS), "--socket", absent_socket, "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "6 prompts on 2 workers (1 prefill, 1 decode)" in run.stderr
    result = json.loads(run.stdout)
    moved = moved_and_whole(result, len(PROMPTS))
    assert len(moved) == len(PROMPTS) and all(c["moves"] == 1 for c in moved)
    prefill, decode = result["workers"]
    assert (prefill["role"], prefill["handed_off"], prefill["time_to_first_token_ms"]["n"]) == ("prefill", 6, 6)
    assert (decode["role"], decode["adopted"], decode["time_per_output_token_ms"]["n"]) == ("decode", 6, 6)
    assert decode["time_per_output_token_ms"]["p50"] > 0 and prefill["generated_tokens"] == 6
    assert result["pool"]["used"] == 0


def test_a_worker_told_to_stop_hands_its_running_requests_to_its_peer(
    model_dir: pathlib.Path, prompts_file: pathlib.Path, absent_socket: str
) -> None:
    """Worker 0 gets SIGTERM (the test hook sends it itself, after 2 tokens): it hands
    its 3 running requests to worker 1, which finishes them without computing their
    prompts again, and exits; every completion equals the undisturbed one."""
    run = generate(
        "--model", model_dir, "--workers", "2", "--prompts", prompts_file, "--max-new-tokens", str(NEW_TOKENS),
        "--socket", absent_socket, "--json", "--drain-worker-after", "0:2",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout)
    moved = moved_and_whole(result, len(PROMPTS))
    w0, w1 = result["workers"]
    assert (w0["drained"], w0["handed_off"], w1["adopted"], w1["drained"]) == (True, 3, 3, False)
    assert sorted(c["index"] for c in moved) == [0, 2, 4]  # worker 0's share


@pytest.mark.parametrize(("load_wait", "words"), [("layer", 0), ("iteration", 24)])
def test_tier_multi_turn_conversations_come_back_from_the_host_tier_token_identical(
    model_dir: pathlib.Path, absent_socket: str, load_wait: str, words: int
) -> None:
    """--workload multi-turn on a pool that holds one running conversation, not all 6:
    later turns match their history from the host tier (loaded, not prefilled again) and
    every turn's completion equals the model's own generate() on the whole conversation,
    whether a loading request computes at once and waits per layer or is held out of the
    forwards until its load is in (--load-wait); the second with a document in each
    conversation (--document-words)."""
    run = generate(
        "--model", model_dir, "--workload", "multi-turn", "--users", "6", "--turns", "3", "--workers", "1",
        "--max-running", "1", "--max-new-tokens", str(NEW_TOKENS), "--num-pages", "12",
        "--host-memory", "4MiB", "--load-wait", load_wait, "--document-words", str(words),
        "--socket", absent_socket, "--json",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "--host-memory 4MiB" in run.stderr
    result = json.loads(run.stdout)
    assert (result["ok"], result["checked"], result["mismatches"]) == (True, True, []), result["errors"]
    assert len(result["completions"]) == 18 and all(c["matches_generate"] for c in result["completions"])
    assert [t["turn"] for t in result["turns"]] == [1, 2, 3]
    assert all(t["time_to_first_token_ms"]["n"] == 6 for t in result["turns"])
    later = result["turns"][2]
    assert later["matched_tokens"] > later["prompt_tokens"] // 2, later  # the history, matched
    tier = result["host_tier"]
    assert tier["demoted"] > 0 and tier["loaded"] > 0 and tier["hit_tokens"] == 16 * tier["loaded"], tier
    # the loads are copied after their Steps answer; the forwards waited for them per layer, or
    # the requests loading were held out of the forwards until their loads were in
    assert 0 <= tier["loading_tokens"] <= tier["hit_tokens"] and tier["load_wait_ms"] >= 0, tier
    if load_wait == "iteration":  # a request whose load was in copy was held out of its first forward
        assert tier["load_held"] >= (tier["loading_tokens"] > 0) and tier["load_wait_ms"] == 0, tier
    else:
        assert tier["load_held"] == 0, tier
