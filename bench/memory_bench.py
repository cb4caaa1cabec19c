#!/usr/bin/env python3
"""Benchmark what the KV memory costs a client: attaching to and mapping a large shm
pool, and the Step round trip while the server keeps a shared block table current.

Scenarios (every figure is compared with a baseline measured in this same run):

a. attach_map -- ``KVMemClient(...)`` plus the first ``kv_cache()`` (which maps the KV
                  file and the block table and builds the per-layer views), in this
                  process after import, against a ``kvmem serve --memory 1GiB`` with the
                  shm backend (mha, 32 layers x 8 KV heads x 128, bfloat16, pages of 16:
                  2 MiB per page, about 510 pages). Baseline: the same client
                  constructor against a server with the same geometry and
                  ``--device none`` (no memory, nothing to map). Informational, no
                  target: mapping must do no per-page work, so it costs milliseconds,
                  whatever the pool's size. The two servers alternate, one client per
                  repetition, closed (untimed) before the next.
b. step_shm    -- one ``KVMemClient.step`` allocating 1 token to each of 256 open
                  requests of one session (pages of 16; request i holds 100 + i % 16
                  tokens, so 1 in 16 takes a new page each step, as in a decode batch;
                  ``bench/rpc_bench.py``'s DecodeSession) against a server with the shm
                  backend, whose block table clients map; against the same Step to a
                  ``--device none`` server (no KV memory, no block table to keep
                  current). Target: <= 1.2x.
c. step_cuda   -- the same Step against ``--device cuda:0`` (the server copies changed
                  block-table rows to the GPU and waits for the copy before it
                  answers) against the same ``--device none`` server. Target: <= 1.3x.
                  Skipped with a note where torch.cuda is unavailable.

Steps of b and c run interleaved in blocks (``rpc_bench.measure``: blocks of 32
repetitions, order alternating per repetition, one untimed call of each server before
every block, the garbage collector off while timing); the figures are medians. Before
timing, each memory server's first step is checked against the block table a client
maps (shm: the shared host table; cuda: the device copy), and scenario a checks that
a value one client writes through its map is read by the next client's.

All servers are started together as subprocesses (``python -m kvmem.cli serve``,
KVMEM_* variables unset) with their shm files in a private directory (under
``--shm-dir``), and stopped with SIGTERM when the benchmark ends, fails or is
interrupted. Exit status: 0 (a measurement, not a test) unless ``--strict`` and a
target is missed (1); 2 if a check or a server fails.

Examples::

    python bench/memory_bench.py                 # a, b and (with a GPU) c
    python bench/memory_bench.py --json out.json # the table, plus the figures as JSON
    python bench/memory_bench.py --gpu-only      # c only (what bench/gpu_check.sh runs)
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

BENCH_DIR = pathlib.Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
import rpc_bench as rb  # noqa: E402  (shared helpers: DecodeSession, measure, summary, ...)
from rpc_bench import BenchFailed, Contender, DecodeSession, check, gc_off, measure, summary  # noqa: E402
from _table import render  # noqa: E402

KVMEM_SERVICE = "kvmem.v1.KVMemory"
# Scenario a: a realistic model's KV geometry (2 MiB pages), the pool set by --memory.
MAP_GEOMETRY = ["--format", "mha", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16",
                "--page-size", "16", "--max-requests", "64", "--max-context", "4096"]  # fmt: skip
MAP_LAYERS = 32
# Scenarios b and c: rpc_bench's pool (8192 pages of 16, 256 request slots), small KV.
STEP_POOL = ["--num-pages", str(rb.NUM_PAGES), "--page-size", str(rb.PAGE_SIZE), "--max-requests",
             str(rb.MAX_REQUESTS), "--max-context", str(rb.MAX_CONTEXT_LEN), "--layers", "2", "--kv-heads", "2",
             "--head-dim", "64", "--dtype", "bfloat16"]  # fmt: skip

TARGETS: dict[str, tuple[str, float | None, str]] = {
    # key: (comparison, value, meaning); value None = informational
    "attach_map": ("", None, "attach + map of the shm pool / attach to a --device none server"),
    "step_shm": ("<=", 1.2, "Step round trip, shm backend / --device none"),
    "step_cuda": ("<=", 1.3, "Step round trip, --device cuda:0 / --device none"),
}


# ------------------------------------------------------------------------ servers


class Fleet(rb.ServerProcesses):
    """Named ``kvmem serve`` subprocesses on short socket paths under /tmp, their shm
    files in one private directory. ``stop()`` is safe to call more than once and counts
    the shm files the servers left (there should be none)."""

    stop_grace_s = 20.0

    def __init__(self, shm_parent: str) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="kvmb", dir="/tmp"))
        self.shm_dir = tempfile.mkdtemp(prefix="kvmem-bench-", dir=shm_parent)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, pathlib.Path] = {}
        self.started: dict[str, float] = {}
        self.ready_s: dict[str, float] = {}

    def socket(self, name: str) -> str:
        return str(self.dir / f"{name}.sock")

    def target(self, name: str) -> str:
        return f"unix:{self.socket(name)}"

    def start(self, name: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}  # KVMEM_DEBUG et al. unset
        cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--socket", self.socket(name),
               "--shm-dir", self.shm_dir, "--log-level", "warning", *args]  # fmt: skip
        log = self.dir / f"{name}.log"
        self.logs[name] = log
        with open(log, "wb") as out:
            self.started[name] = time.monotonic()
            self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        """Poll every server's readiness in turn until all serve; records how long each
        took from its start (``ready_s``)."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        channels = {name: grpc.insecure_channel(self.target(name)) for name in self.procs}
        try:
            waiting = set(self.procs)
            while waiting:
                for name in sorted(waiting):
                    proc = self.procs[name]
                    if proc.poll() is not None:
                        raise BenchFailed(
                            f"server {name} exited with {proc.returncode} at start:\n{self.log_tail(name)}"
                        )
                    stub = health_pb2_grpc.HealthStub(channels[name])
                    try:
                        resp = stub.Check(health_pb2.HealthCheckRequest(service=KVMEM_SERVICE), timeout=0.5)
                    except grpc.RpcError:
                        continue
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        self.ready_s[name] = time.monotonic() - self.started[name]
                        waiting.discard(name)
                if waiting and time.monotonic() > deadline:
                    name = sorted(waiting)[0]
                    raise BenchFailed(f"server {name} not ready after {timeout_s:g} s:\n{self.log_tail(name)}")
                time.sleep(0.05)
        finally:
            for channel in channels.values():
                channel.close()

    def stop(self) -> dict[str, int | None]:
        codes = super().stop()
        left = sorted(os.listdir(self.shm_dir)) if os.path.isdir(self.shm_dir) else []
        codes["shm_files_left"] = len(left) or None
        shutil.rmtree(self.shm_dir, ignore_errors=True)
        return codes


def free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


# ------------------------------------------------------------------- scenario a


def scenario_attach(fleet: Fleet, reps: int, warmup: int, say: Callable[..., None]) -> dict[str, Any]:
    """Alternate: a client of the shm server (attach, then the first kv_cache(): the
    map), a client of the --device none server (attach only). Closed untimed."""
    import torch

    from kvmem.client import KVMemClient

    clock = time.perf_counter_ns
    times: dict[str, list[float]] = {"attach_shm": [], "map_shm": [], "attach_map_shm": [], "attach_none": []}
    marker: tuple[list[int], float] | None = None
    geometry = None
    with gc_off():
        for rep in range(warmup + reps):
            keep = rep >= warmup
            for which in ("shm", "none") if rep % 2 == 0 else ("none", "shm"):
                if which == "none":
                    t0 = clock()
                    client = KVMemClient(fleet.target("map-none"), name=f"none-{rep}")
                    t1 = clock()
                    check(not client.memory_handles and not client.geometry.HasField("layout"),
                          "the --device none server sent memory handles")  # fmt: skip
                    client.close()
                    if keep:
                        times["attach_none"].append((t1 - t0) / 1e6)
                    continue
                t0 = clock()
                client = KVMemClient(fleet.target("map"), name=f"map-{rep}")
                t1 = clock()
                layers = client.kv_cache()
                t2 = clock()
                geometry = client.geometry
                k, v = layers[MAP_LAYERS - 1]
                num_tokens = geometry.num_pages * geometry.page_size
                check(len(layers) == MAP_LAYERS and k.shape[0] == num_tokens, "unexpected KV views")
                if marker is None:  # write through this map; the next client must read it
                    (slot,) = client.open(["marker"]).tolist()
                    res = client.alloc([slot], [geometry.page_size])
                    check(res.ok, "marker alloc failed")
                    locs = res.kv_loc.long()
                    check(client.block_table[slot, 0].item() == res.new_pages[0].item(), "block table not shared")
                    v[locs] = 3.25
                    marker = (locs.tolist(), 3.25)
                else:
                    locs = torch.tensor(marker[0])
                    check(bool((v[locs] == marker[1]).all()), "a later client does not see an earlier one's write")
                del layers, k, v
                client.close()
                if keep:
                    times["attach_shm"].append((t1 - t0) / 1e6)
                    times["map_shm"].append((t2 - t1) / 1e6)
                    times["attach_map_shm"].append((t2 - t0) / 1e6)
    assert geometry is not None
    lay = geometry.layout
    pool_bytes = geometry.num_pages * geometry.page_size * lay.bytes_per_token
    say(f"  attach+map of {pool_bytes / 2**30:.2f} GiB: median {summary(times['attach_map_shm'])['median']:.2f} ms")
    return {
        "times_ms": {k: summary(v) for k, v in times.items()},
        "pool": {
            "num_pages": geometry.num_pages,
            "page_size": geometry.page_size,
            "bytes_per_token": lay.bytes_per_token,
            "kv_bytes": pool_bytes,
            "layers": lay.num_layers,
        },  # fmt: skip
        "server_ready_s": {
            "shm": round(fleet.ready_s.get("map", 0.0), 2),
            "none": round(fleet.ready_s.get("map-none", 0.0), 2),
        },  # fmt: skip
        "checked": "views per layer of the whole pool; a value written through one client's map is read by the next's",
    }


# -------------------------------------------------------------- scenarios b and c


def check_first_step(sess: DecodeSession, backend: str) -> str:
    """One step on the fresh pool; the block table this client maps must hold each new
    page at its request's last column."""
    import torch

    res = sess.step()
    check(res.ok and res.kv_loc.numel() == sess.n, f"{backend}: first step not OK")
    mem = sess.client.memory
    check(mem.backend == backend, f"expected the {backend} backend, the client mapped {mem.backend}")
    table = sess.client.block_table
    check(table.is_cuda == (backend == "cuda"), f"{backend}: block table on {table.device}")
    table = table.cpu()
    lens = torch.from_numpy(rb.decode_lens(sess.n)) + 1
    grew = torch.nonzero(torch.diff(res.new_page_offsets.long()) > 0).flatten()
    check(grew.numel() == res.new_pages.numel() == sess.n // rb.PAGE_SIZE, f"{backend}: new pages")
    slots = sess.slots.long()[grew]
    cols = (lens[grew] - 1) // rb.PAGE_SIZE
    check(torch.equal(table[slots, cols], res.new_pages), f"{backend}: mapped block table != the step's new pages")
    full = table[sess.slots.long()]
    check(torch.equal((full != 0).sum(dim=1), (lens + rb.PAGE_SIZE - 1) // rb.PAGE_SIZE),
          f"{backend}: rows hold the wrong number of pages")  # fmt: skip
    sess.after(res)
    return f"{backend}: first step's {res.new_pages.numel()} new pages in the mapped block table, row lengths"


def scenario_steps(
    fleet: Fleet, names: list[str], reps: int, warmup: int, budget_s: float, truncate_every: int,
    say: Callable[..., None],
) -> dict[str, Any]:  # fmt: skip
    backends = {"step-shm": "shm", "step-cuda": "cuda", "step-none": "none"}
    sessions = {n: DecodeSession(fleet.target(n), rb.NUM_REQUESTS, truncate_every, n) for n in names}
    try:
        checked = []
        for n, sess in sessions.items():
            s = sess.client.stats()
            check(s.memory_backend == backends[n], f"{n}: server memory backend is {s.memory_backend}")
            if backends[n] != "none":
                checked.append(check_first_step(sess, backends[n]))
        contenders = [Contender(n, sess.step, sess.after) for n, sess in sessions.items()]
        calls_before = {n: s.num_calls for n, s in sessions.items()}
        cpu_before = fleet.cpu_s()
        kept = measure(contenders, [], reps, 1, warmup, budget_s, fleet)
        cpu_after = fleet.cpu_s()
        say(f"  {kept} interleaved repetitions")
        # DecodeSession counts every Step it makes (timed, untimed, truncates).
        cpu = {n: rb.cpu_per_call_us(cpu_before, cpu_after, n, sessions[n].num_calls - calls_before[n]) for n in names}
        return {"times_us": {c.name: summary(c.times_us) for c in contenders}, "reps": kept, "checked": checked,
                "server_cpu_us_per_call": cpu}  # fmt: skip
    finally:
        for sess in sessions.values():
            sess.close()


# ------------------------------------------------------------------- reporting


def verdict(key: str, ratio: float | None) -> str:
    op, target, _ = TARGETS[key]
    if ratio is None:
        return "SKIP"
    if target is None:
        return "info"
    return "PASS" if (ratio >= target if op == ">=" else ratio <= target) else "MISS"


def build_rows(att: dict[str, Any] | None, steps: dict[str, Any] | None, notes: dict[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def row(key: str, title: str, value: float | None, baseline_name: str, baseline: float | None, unit: str,
            extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        op, target, meaning = TARGETS[key]
        ratio = None if value is None or baseline is None else value / baseline
        rows.append({"scenario": key, "title": title, "unit": unit, "value": value, "baseline": baseline_name,
                     "baseline_value": baseline, "ratio": ratio,
                     "target": None if target is None else {"op": op, "value": target, "ratio_is": meaning},
                     "result": verdict(key, ratio), "note": notes.get(key), **(extra or {})})  # fmt: skip

    if att is not None:
        t = att["times_ms"]
        gib = att["pool"]["kv_bytes"] / 2**30
        row("attach_map", f"attach + map, {gib:.2f} GiB shm pool", t["attach_map_shm"]["median"],
            "attach, --device none", t["attach_none"]["median"], "ms",
            {"map_only_ms": t["map_shm"]["median"], "attach_shm_ms": t["attach_shm"]["median"]})  # fmt: skip
    else:
        row("attach_map", "attach + map, shm pool", None, "attach, --device none", None, "ms")
    t = steps["times_us"] if steps is not None else {}
    none = t.get("step-none", {}).get("median")
    for key, name, title in (("step_shm", "step-shm", "Step 256 decode allocs, shm backend"),
                             ("step_cuda", "step-cuda", "Step 256 decode allocs, cuda:0")):  # fmt: skip
        value = t.get(name, {}).get("median")
        extra = {} if value is None else {"ratio_of_min": t[name]["min"] / t["step-none"]["min"]}
        row(key, title, value, "same Step, --device none", none if value is not None else None, "µs", extra)
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("scenario", "value", "baseline", "ratio", "target", "result")
    lines = []
    for r in rows:
        unit = r["unit"]
        fmt_v = (lambda x: f"{x:,.2f} ms") if unit == "ms" else (lambda x: f"{x:,.1f} µs")
        v = "n/a" if r["value"] is None else fmt_v(r["value"])
        b = "n/a" if r["baseline_value"] is None else fmt_v(r["baseline_value"])
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        target = "—" if r["target"] is None else f"≤ {r['target']['value']:g}x"
        lines.append((r["title"], v, b, ratio, target, r["result"]))
    return render(header, lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="memory_bench.py",
        description=(
            "Time (a) a client's attach and map of a --memory 1GiB shm pool against attaching to a "
            "--device none server; (b) the Step round trip (256 decode allocs of 1 token, pages of 16, "
            "one session) against a server with the shm backend vs a --device none server; (c) with a "
            "GPU, the same Step against --device cuda:0 vs --device none. Starts and stops the servers "
            "itself; ratios compare figures measured in this same run (medians, interleaved)."
        ),
        epilog=(
            "Targets: (a) none (informational); (b) <= 1.2x; (c) <= 1.3x. Exit status 0 even on MISS "
            "(a measurement, not a test) unless --strict; 2 if a check or a server fails."
        ),
    )
    parser.add_argument("--reps", type=int, default=3000, metavar="N",
                        help="timed Step repetitions per server, after the warm-up (default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=50, metavar="N",
                        help="untimed Step repetitions first (default: %(default)s)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=20.0, metavar="S",
                        help=f"stop the Step timing after about S seconds even if fewer than --reps ran (at least "
                        f"{rb.MIN_REPS} always run) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--truncate-every", type=int, default=32, metavar="K",
                        help="truncate the requests back to their starting lengths every K steps, untimed "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--attach-reps", type=int, default=20, metavar="N",
                        help="timed attach(+map) repetitions per server in scenario a (default: %(default)s)")  # fmt: skip
    parser.add_argument("--memory", default="1GiB", metavar="SIZE",
                        help="the shm pool of scenario a, as kvmem serve --memory takes it (default: %(default)s)")  # fmt: skip
    parser.add_argument("--shm-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir(),
                        metavar="DIR", help="where the servers' private shm directory is made (default: "
                        "%(default)s)")  # fmt: skip
    parser.add_argument("--gpu-only", action="store_true",
                        help="run scenario c only (cuda:0 vs --device none); skips with a note without a GPU")  # fmt: skip
    parser.add_argument("--no-gpu", action="store_true", help="skip scenario c even where a GPU is available")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="emit the figures and machine info as one JSON object: on stdout instead of "
                        "the table, or into PATH with the table still printed")  # fmt: skip
    parser.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.truncate_every < 1 or args.attach_reps < 1 or args.budget <= 0:
        parser.error("--reps, --attach-reps and --truncate-every must be >= 1, --warmup >= 0, --budget > 0")
    if args.gpu_only and args.no_gpu:
        parser.error("--gpu-only and --no-gpu exclude each other")
    if not os.path.isdir(args.shm_dir):
        parser.error(f"--shm-dir {args.shm_dir!r} is not a directory")
    to_stdout = args.json == "-"
    t_start = time.monotonic()

    def say(*a: Any) -> None:
        print(f"[{time.monotonic() - t_start:5.1f}s]", *a, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, rb._raise_interrupt)  # so the servers are stopped on SIGTERM too
    import torch

    from kvmem.server.memory import parse_size

    notes: dict[str, str] = {}
    gpu = torch.cuda.is_available() and not args.no_gpu
    if not gpu:
        notes["step_cuda"] = ("skipped: --no-gpu" if args.no_gpu else
                              f"skipped: torch.cuda is unavailable (torch {torch.__version__})")  # fmt: skip
    run_attach = not args.gpu_only
    if args.gpu_only:
        notes["attach_map"] = notes["step_shm"] = "skipped: --gpu-only"
    if run_attach:
        need = parse_size(args.memory) + 2**24
        if free_bytes(args.shm_dir) < need:
            run_attach = False
            notes["attach_map"] = (f"skipped: {args.shm_dir} has {free_bytes(args.shm_dir)} bytes free, "
                                   f"the pool needs about {need}")  # fmt: skip

    started = time.perf_counter()
    fleet = Fleet(args.shm_dir)
    step_names = (["step-shm"] if not args.gpu_only else []) + (["step-cuda"] if gpu else [])
    att = steps = None
    try:
        if step_names:
            step_names.append("step-none")
        if not step_names and not run_attach:
            say("nothing to run here (see the notes)")
        else:
            say(
                f"starting {len(step_names) + 2 * run_attach} servers under {fleet.dir} (shm files in {fleet.shm_dir}) ..."
            )
        if run_attach:
            fleet.start("map", "--memory", args.memory, *MAP_GEOMETRY)
            fleet.start("map-none", "--memory", args.memory, *MAP_GEOMETRY, "--device", "none")
        devices = {"step-shm": "cpu", "step-cuda": "cuda:0", "step-none": "none"}
        for n in step_names:
            fleet.start(n, *STEP_POOL, "--device", devices[n])
        fleet.wait_ready()
        if run_attach:
            say(f"scenario a: attach + map of a --memory {args.memory} shm pool vs attach to --device none")
            att = scenario_attach(fleet, args.attach_reps, 2, say)
        if step_names:
            which = " and ".join(x for x, on in (("b", "step-shm" in step_names), ("c", gpu)) if on)
            say(f"scenario {which}: Step against {', '.join(step_names)}, interleaved")
            steps = scenario_steps(fleet, step_names, args.reps, args.warmup, args.budget, args.truncate_every, say)
        fleet.check_alive()
    except BenchFailed as exc:
        say(f"FAILED: {exc}")
        fleet.stop()
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        fleet.stop()
        return 130
    say("stopping the servers (SIGTERM) ...")
    codes = fleet.stop()
    left = codes.pop("shm_files_left")
    if any(c not in (0, None) for c in codes.values()) or left:
        say(f"FAILED: server exit codes on SIGTERM {codes}, shm files left behind: {left or 0}")
        return 2
    elapsed = time.perf_counter() - started

    rows = build_rows(att, steps, notes)
    info = rb.machine_info()
    report = {
        "benchmark": "kvmem memory_bench",
        "statistic": "medians of interleaved repetitions; ratio = median / median (ratio_of_min uses minima)",
        "config": {
            "attach": {"memory": args.memory, "geometry": MAP_GEOMETRY, "reps": args.attach_reps},
            "step": {
                "pool": STEP_POOL,
                "num_requests": rb.NUM_REQUESTS,
                "page_size": rb.PAGE_SIZE,
                "decode_lens": f"{rb.DECODE_BASE_LEN} + i % {rb.PAGE_SIZE}",
                "reps_asked": args.reps,
                "warmup": args.warmup,
                "budget_s": args.budget,
                "truncate_every": args.truncate_every,
            },
        },  # fmt: skip
        "attach": att,
        "steps": steps,
        "machine": info,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "elapsed_s": round(elapsed, 1),
        "scenarios": rows,
        "all_pass": all(r["result"] != "MISS" for r in rows),
    }
    if to_stdout:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(
            f"kvmem memory benchmark -- python {info['python']}, torch {info['torch']}, grpc {info['grpc']}, "
            f"{info['cpus_usable']}/{info['cpu_count']} cpus, load average {info['load_average_1m']}, "
            f"GPU {report['gpu'] or 'none'}"
        )
        print()
        print(format_table(rows))
        print()
        for r in rows:
            if r["note"]:
                print(f"{r['scenario']}: {r['note']}")
        if att is not None:
            t, p = att["times_ms"], att["pool"]
            print(
                f"attach+map: pool of {p['num_pages']} pages x {p['page_size']} tokens x {p['bytes_per_token']} B "
                f"({p['kv_bytes'] / 2**30:.2f} GiB, {p['layers']} layers); medians of {t['attach_none']['n']}: "
                f"attach {t['attach_shm']['median']:.2f} ms + map {t['map_shm']['median']:.2f} ms "
                f"(attach to --device none {t['attach_none']['median']:.2f} ms); server ready in "
                f"{att['server_ready_s']['shm']:.1f} s (shm, reserving the pool) vs {att['server_ready_s']['none']:.1f} s"
            )
        if steps is not None:
            print(f"Step: medians of {steps['reps']} interleaved reps")
            for name, s in steps["times_us"].items():
                cpu = steps["server_cpu_us_per_call"].get(name)
                cpu_text = "" if cpu is None else f"   server CPU {cpu:6.0f} µs/call"
                print(f"  {name:>9}: median {s['median']:8.1f} µs   min {s['min']:8.1f}   p10 {s['p10']:8.1f}   "
                      f"p90 {s['p90']:8.1f}{cpu_text}")  # fmt: skip
            for c in steps["checked"]:
                print(f"checked: {c}")
        if att is not None:
            print(f"checked: {att['checked']}")
        print(f"total {elapsed:.1f} s")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"JSON written to {args.json}")
    if args.strict and not report["all_pass"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
