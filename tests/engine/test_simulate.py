"""``kvmem simulate``, run as a real process (``python -m kvmem.cli simulate``)
against a real server, its workers real spawned processes; and, in-process, the pieces
whose properties the runs rely on: the workload's seed, the K/V pattern's exactness.

The workload of the runs is small (2 workers x 12 requests of about 160 tokens, all
arriving at once, no simulated forward pass) on the ``server`` fixture's pool of 256
pages of 4 tokens (conftest): 16 running requests need about twice the pool, so
requests are preempted (each worker's 8 alone fill it), and most start with one of two
64-token system prompts, so the prefix cache hits. The runs go through the drop-in
(``--api compat``, the default) and the batched client (``--api client``): the same
workload, the same checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ServerProcess, start_server

from kvmem.engine.simulate.kv_check import KVPattern, exact_bits
from kvmem.engine.simulate.workload import WorkloadDigest, WorkloadSpec, combined_digest, generate, system_prompts

CLI = [sys.executable, "-m", "kvmem.cli", "simulate"]
SMALL = [
    "--workers", "2", "--requests", "12", "--seed", "3", "--max-running", "8", "--prompt-len", "48",
    "--output-len", "64", "--system-prompts", "2", "--system-prompt-len", "64", "--arrival-rate", "0",
    "--forward-ms", "0", "--chunk-tokens", "256", "--interval", "0.5",
]  # fmt: skip
# What the runs must generate: requests are capped at a quarter of the pool (1,024 tokens
# on the fixture's server and on the one simulate starts with --num-pages 65).
SMALL_SPEC = WorkloadSpec(
    seed=3, requests=12, arrival_rate=0, prompt_len=48, output_len=64, system_prompts=2, system_prompt_len=64,
    max_len=256,
)  # fmt: skip


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    env["COLUMNS"] = "200"
    return env


def simulate(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=clean_env(), timeout=timeout)


def reference_path() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(here))), "shared", "reference", "seed_kv_allocator.py"
    )


# ------------------------------------------------------------------ in-process


def test_the_seed_gives_the_same_workload_and_another_seed_another() -> None:
    def fingerprint(spec: WorkloadSpec, worker: int) -> list[tuple[int, int, int, int, bytes]]:
        return [(r.arrival, r.prompt_len, r.system, r.spec_k, r.tokens.tobytes()) for r in generate(spec, worker)]

    again = WorkloadSpec(**vars_of(SMALL_SPEC))
    assert fingerprint(SMALL_SPEC, 0) == fingerprint(again, 0)
    assert fingerprint(SMALL_SPEC, 0) != fingerprint(SMALL_SPEC, 1)  # each worker its own requests
    other = WorkloadSpec(**{**vars_of(SMALL_SPEC), "seed": 4})
    assert fingerprint(SMALL_SPEC, 0) != fingerprint(other, 0)
    # The system prompts are the seed's, common to every worker: what the cache shares.
    prompts = system_prompts(SMALL_SPEC)
    starts = [(r.system, r.tokens) for w in (0, 1) for r in generate(SMALL_SPEC, w) if r.system >= 0]
    assert len(prompts) == 2 and len({s for s, _ in starts}) == 2
    assert all(np.array_equal(tokens[: prompts[s].size], prompts[s]) for s, tokens in starts)


def vars_of(spec: WorkloadSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in spec.__dataclass_fields__}


def expected_digest(spec: WorkloadSpec, workers: int) -> str:
    """The digest a run of ``spec`` must report: its requests, generated here."""
    digests = []
    for w in range(workers):
        d = WorkloadDigest()
        for r in generate(spec, w):
            d.add(r)
        digests.append(d.hexdigest())
    return combined_digest(digests)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_the_kv_values_are_exact_in_the_dtype_and_a_function_of_the_whole_prefix(dtype: torch.dtype) -> None:
    bits = exact_bits(dtype)
    pattern = KVPattern(num_planes=4, elements=128, bits=bits)
    rng = np.random.default_rng(0)
    a = rng.integers(1, 32000, size=64, dtype=np.int32)
    b = a.copy()
    b[40] += 1  # same first 40 tokens, then another sequence
    va, vb = (pattern.values(pattern.hashes(pattern.prefix_values(t), 0)) for t in (a, b))
    assert va.max() < 2**bits
    assert torch.equal(torch.from_numpy(va).to(dtype).to(torch.float32), torch.from_numpy(va).to(torch.float32))
    assert np.array_equal(va[:40], vb[:40])  # a shared prefix holds the same K/V...
    assert all(not np.array_equal(va[p], vb[p]) for p in range(40, 64))  # ...and every later position differs
    assert not np.array_equal(va[0, 0], va[0, 1])  # planes (layers, K/V) differ too
    # A draft extension computes the same values as the prefix it continues.
    ext = pattern.extend(pattern.prefix_values(a)[29], a[30:50], 30)
    assert np.array_equal(ext, pattern.prefix_values(a)[30:50])


# ------------------------------------------------------------------- real runs


def test_help_says_what_it_does_and_what_the_numbers_mean() -> None:
    run = subprocess.run([*CLI, "--help"], capture_output=True, text=True, env=clean_env(), timeout=60)
    assert run.returncode == 0, run.stderr
    for words in ("scheduler worker", "prefix-cache match", "preempted", "block table", "exit status",
                  "step p50/p99", "prefix hit", "--baseline", "--duration", "--seed", "kvmem[plot]", "--api",
                  "KVAllocator", "req_to_page", "round trips"):  # fmt: skip
        assert words in run.stdout, words


@pytest.mark.parametrize("api", ["compat", "client"])
def test_a_short_run_finishes_every_request_and_reports_consistent_totals(server: ServerProcess, api: str) -> None:
    """On the drop-in (``KVAllocator``: request indices, per-request calls in one
    iteration block, ``req_to_page`` for the read-back) and on the batched client: the
    same loop, the same workload (digest), every page read back as written."""
    run = simulate("--socket", server.socket_path, *SMALL, "--api", api, "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)  # stdout is the JSON alone; the live view went to stderr
    assert "kvmem: done" in run.stderr and f"(--api {api})" in run.stderr
    t = report["totals"]
    assert report["ok"] and not report["failures"] and not report["errors"]
    assert report["config"]["api"] == api and [w["api"] for w in report["workers"]] == [api, api]
    # one Step (and top-ups when matches left budget), and an Open when it starts requests
    assert 1 <= t["round_trips_per_iteration"] <= 2 and t["steps"] >= t["iterations"] > 0, t
    assert report["server"]["started_by_simulate"] is False
    assert t["generated"] == t["done"] == 2 * 12, t
    assert [w["done"] for w in report["workers"]] == [12, 12]
    assert t["prefix_hit_tokens"] > 0 and 0 < t["prefix_hit_rate"] <= 1, t  # the shared system prompts
    assert t["preemptions"] > 0 and t["out_of_pages"] >= t["preemptions"], t  # the small pool
    assert t["draft_tokens"] > 0 and t["rejected_tokens"] > 0, t  # speculative drafts, some truncated
    # Every release was read back first: each finished request, and each preempted one that
    # had computed anything (one preempted in the Step that admitted it may hold nothing).
    assert t["done"] <= t["verified_requests"] <= t["done"] + t["preemptions"], t
    assert t["steps"] > 0 and t["step_latency_us"]["p50"] > 0
    assert report["pool"]["samples"] > 0 and report["pool"]["peak_used_pages"] <= report["server"]["num_pages_total"]
    assert report["workload"]["digest"] == expected_digest(SMALL_SPEC, 2)  # the seed's requests, no others
    assert os.path.exists(server.socket_path)  # a server it did not start is left alone


def test_the_drop_in_requeues_admissions_when_the_server_has_no_request_slot(tmpdir_short: str) -> None:
    """The drop-in opens new requests with its iteration's Step; when the server's
    request slots are taken, the block is sent again without them and the scheduler
    requeues them, as when the batched client's Open is refused (4 slots, 8 running)."""
    srv = start_server(
        tmpdir_short, "--num-pages", "257", "--page-size", "4", "--max-requests", "4", "--max-context", "256",
    )  # fmt: skip
    try:
        run = simulate("--socket", srv.socket_path, *SMALL, "--workers", "1", "--api", "compat", "--json")
    finally:
        assert srv.stop() == 0, srv.log()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 workers on the drop-in KVAllocator, one iteration block each (--api compat)" in run.stderr
    report = json.loads(run.stdout)
    t = report["totals"]
    assert report["ok"] and t["done"] == 12 and t["no_free_slot"] > 0, t
    assert t["verified_requests"] >= t["done"], t
    assert report["workload"]["digest"] == expected_digest(SMALL_SPEC, 1)


def test_without_a_server_it_starts_one_says_so_and_stops_it(tmpdir_short: str) -> None:
    socket_path = os.path.join(tmpdir_short, "nobody.sock")
    png = os.path.join(tmpdir_short, "pool.png")
    plotting = importlib.util.find_spec("matplotlib") is not None  # the optional extra: kvmem[plot]
    run = simulate("--socket", socket_path, *SMALL, "--num-pages", "65", "--json", *(["--plot", png] * plotting))
    assert run.returncode == 0, run.stdout + run.stderr
    if plotting:
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert f"no kvmem server answers at unix:{socket_path}: starting one for this run" in run.stderr
    assert "stopped the server simulate started (exit 0)" in run.stderr
    report = json.loads(run.stdout)
    assert report["server"]["started_by_simulate"] is True
    assert report["totals"]["done"] == 24
    assert not os.path.exists(report["server"]["target"].removeprefix("unix:"))  # its socket is gone
    # The same seed and options (and length cap) give the same workload on another server.
    assert report["config"]["workload"]["max_len"] == 256
    assert report["workload"]["digest"] == expected_digest(SMALL_SPEC, 2)


@pytest.mark.parametrize("api", ["compat", "client"])
def test_a_wrong_page_fails_the_run_naming_the_request_page_and_position(server: ServerProcess, api: str) -> None:
    run = simulate("--socket", server.socket_path, *SMALL, "--api", api, "--corrupt-one-value")
    assert run.returncode == 1, run.stdout + run.stderr
    failure = next(line for line in run.stderr.splitlines() if line.startswith("FAILURE: "))
    assert "worker 0: request w0-r" in failure and "reads wrong K/V at position" in failure, failure
    assert "page " in failure and "layer 0 K, element 0" in failure and "(1 wrong element(s)" in failure, failure


def test_baseline_prints_kvmem_and_the_reference_side_by_side(server: ServerProcess) -> None:
    if not os.path.isfile(reference_path()):
        pytest.skip(f"the reference allocator is not at {reference_path()}")
    run = simulate("--socket", server.socket_path, *SMALL, "--baseline", "--reference", reference_path())
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "kvmem (one shared pool)" in out and "reference (in-process)" in out, out
    assert "2 workers on the drop-in KVAllocator, one iteration block each (--api compat)" in out, out  # the default
    for row in ("allocator time per iteration", "pages to provision (peak held)", "prompt tokens prefilled",
                "sharing saved"):  # fmt: skip
        assert row in out, out


def test_missing_prerequisites_are_one_line_and_exit_2(tmpdir_short: str) -> None:
    nowhere = os.path.join(tmpdir_short, "nobody.sock")
    run = simulate("--socket", nowhere, "--baseline", "--reference", os.path.join(tmpdir_short, "absent.py"))
    assert run.returncode == 2, run.stdout + run.stderr
    assert "--baseline needs the reference allocator" in run.stderr and "--reference" in run.stderr
    assert not os.path.exists(nowhere)  # said before anything was started
    if importlib.util.find_spec("matplotlib") is None:
        run = simulate("--socket", nowhere, "--plot", os.path.join(tmpdir_short, "p.png"))
        assert run.returncode == 2 and "pip install 'kvmem[plot]'" in run.stderr, run.stderr


def test_tier_multi_turn_histories_leave_the_pool_and_come_back_from_the_host_tier(tmpdir_short: str) -> None:
    """--workload multi-turn on a pool too small for every conversation, with a host
    tier: later turns match their history from the host (every request's K/V read back
    before its release: all as written), and the report gives each turn's TTFT."""
    socket_path = os.path.join(tmpdir_short, "nobody.sock")
    args = [
        "--socket", socket_path, "--workload", "multi-turn", "--turns", "3", "--workers", "1", "--requests", "24",
        "--prompt-len", "24", "--output-len", "12", "--system-prompts", "1", "--system-prompt-len", "32",
        "--arrival-rate", "0.5", "--max-running", "4", "--num-pages", "48", "--json",
    ]  # fmt: skip
    run = simulate(*args, "--host-memory", "8MiB")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert "--host-memory 8MiB" in run.stderr
    t, tier = report["totals"], report["host_tier"]
    assert t["done"] == 24 and t["verified_requests"] >= 24, t
    assert tier["demoted"] > 0 and tier["loaded"] > 0 and tier["hit_tokens"] > 0, tier
    assert [row["turn"] for row in report["turns"]] == [1, 2, 3]
    assert sum(row["requests"] for row in report["turns"]) == 24
    # The same workload without the tier prefills more (its histories are gone).
    plain = json.loads(simulate(*args).stdout)
    assert plain["host_tier"] is None
    assert plain["totals"]["prefill_tokens"] > t["prefill_tokens"], (plain["totals"], t)
