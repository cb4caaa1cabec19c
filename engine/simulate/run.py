"""``kvmem simulate``: scheduler worker processes against one server, a live view, a report.

The workers are clients (``kvmem.engine.simulate.worker``, started with multiprocessing's
spawn); this module finds or starts the server, sizes the workload to it, starts the
workers together, gathers their messages and the server's Stats, shows them, and ends
with the report (:mod:`kvmem.engine.simulate.report`). ``--baseline`` then runs the same
workload on the reference allocator (:mod:`kvmem.engine.simulate.reference`). Options
and help: :mod:`kvmem.engine.simulate.command`.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import multiprocessing
import os
import queue
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

from kvmem.client.errors import KVMemError

from ..process import join
from ..server_process import OwnServer, UsageError, own_server_argv, server_for, store_summary
from .reference import ReferenceMissing
from .report import (
    LiveView,
    RunState,
    comparison_lines,
    host_tier,
    plot,
    pool_line,
    pool_summary,
    summary_lines,
    totals,
    turn_rows,
    worker_rows,
    worker_table,
)
from .worker import WorkerConfig, worker_main
from .workload import WorkloadSpec, combined_digest

# The model id simulate's workers attach with to a server that has a store: the synthetic
# model's K/V is a function of the tokens alone, the same on every node.
SYNTHETIC_MODEL_ID = "kvmem-simulate/synthetic@v1"

SAMPLE_S = 0.1  # how often the pool is sampled from Stats
APIS = {  # --api: what the workers drive kvmem through
    "compat": "the drop-in KVAllocator, one iteration block each",
    "client": "the batched client, one Step each",
}


def _spec(args: argparse.Namespace, max_len: int) -> WorkloadSpec:
    return WorkloadSpec(
        seed=args.seed,
        requests=None if args.duration is not None else args.requests,
        arrival_rate=args.arrival_rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        system_prompts=args.system_prompts,
        system_prompt_len=args.system_prompt_len,
        shared=args.shared,
        spec=args.spec,
        spec_k=args.spec_k,
        accept=args.accept,
        max_len=max_len,
        turns=args.turns if args.workload == "multi-turn" else 1,
    )


def _server_info(stats: Any, target: str, own: OwnServer | None) -> dict[str, Any]:
    g = stats.geometry
    layout = g.layout
    return {
        "target": target,
        "started_by_simulate": own is not None,
        "memory_backend": stats.memory_backend,
        "num_pages_total": int(stats.num_pages_total),
        "page_size": int(g.page_size),
        "max_requests": int(g.max_requests),
        "max_context": int(g.max_context_len),
        "dtype": layout.dtype,
        "layers": int(layout.num_layers),
        "prefix_cache": bool(stats.prefix_cache_enabled),
        "cached_pages_at_start": int(stats.num_cache_entries),
    }


def _run(
    label: str,
    entry: Callable[..., None],
    configs: list[Any],
    view: LiveView,
    sample: Callable[[RunState], None],
    pool: Callable[[RunState], str],
) -> RunState:
    """Start one process per config, release them together, gather their messages until
    each has ended, sampling the pool and showing the live view meanwhile."""
    ctx = multiprocessing.get_context("spawn")
    messages: Any = ctx.Queue()
    go, stop = ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=entry, args=(c, messages, go, stop), name=f"kvmem-simulate-w{i}", daemon=True)
        for i, c in enumerate(configs)
    ]
    for proc in procs:
        proc.start()
    run = RunState(label, len(procs))
    ready: set[int] = set()
    dead_since: dict[int, float] = {}
    last_sample = 0.0
    try:
        while not run.finished:
            try:
                msg = messages.get(timeout=0.05)
            except queue.Empty:
                msg = {"kind": None}
            if msg["kind"] == "ready":
                ready.add(msg["worker"])
                if len(ready) == len(procs):
                    run.started = time.monotonic()
                    go.set()
            elif msg["kind"] is not None:
                run.update(msg)
                if msg["kind"] in ("failure", "error"):
                    stop.set()
                    go.set()
            now = time.monotonic()
            for w, proc in enumerate(procs):
                if w not in run.final and not proc.is_alive() and now - dead_since.setdefault(w, now) > 3:
                    run.update({"kind": "error", "worker": w, "message": f"exited ({proc.exitcode}) without a report"})
                    stop.set()
                    go.set()
            if go.is_set() and now - last_sample >= SAMPLE_S:
                sample(run)
                last_sample = now
            if go.is_set() and view.due():
                view.show(run, pool(run))
    finally:
        if not run.finished:  # interrupted: the workers stop (and detach) at their next iteration
            stop.set()
        go.set()
        join(procs, timeout=15)
    run.elapsed_s = max((m.get("elapsed_s", 0.0) for m in run.final.values()), default=0.0)
    sample(run)
    view.clear()
    return run


def simulate(args: argparse.Namespace) -> int:
    try:
        return _simulate(args)
    except (UsageError, ReferenceMissing) as err:
        print(f"kvmem simulate: error: {err}", file=sys.stderr)
        return 2
    except KVMemError as err:  # the server refused or went away before the workers started
        print(f"kvmem simulate: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvmem simulate: interrupted", file=sys.stderr)
        return 130


def _simulate(args: argparse.Namespace) -> int:
    info: IO[str] = sys.stderr if args.json else sys.stdout
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib, which is not installed: pip install 'kvmem[plot]'")
    reference = None
    if args.baseline:
        from .reference import default_reference_path, load_reference

        reference = os.path.abspath(args.reference or default_reference_path())
        load_reference(reference)  # ReferenceMissing: said now, before the run
    if args.nodes > 1:
        return _nodes(args, reference, info)
    with server_for(args.tcp or f"unix:{args.socket}", "simulate", lambda: own_server_argv(args), info) as (
        target,
        own,
    ):
        return _with_server(args, target, own, reference, info)


def _nodes(args: argparse.Namespace, reference: str | None, info: IO[str]) -> int:
    """``--nodes 2``: two servers on one store; the workload on node A, then the same on
    node B; each node's report, then the comparison (JSON: ``{"ok", "nodes": [...]}``)."""
    if args.nodes != 2:
        raise UsageError(f"--nodes {args.nodes}: two nodes are what this shows (node A computes, node B reads)")
    if not args.store:
        raise UsageError("--nodes 2 shares pages through a store: give --store URL (e.g. redis://127.0.0.1:6379)")
    if args.tcp or args.baseline:
        raise UsageError("--nodes 2 starts its own two servers: no --tcp or --baseline")
    if args.api == "compat":
        print(
            "note: --api compat (the drop-in) cannot hold a request while its prefix is fetched from the store: node "
            "B computes what is still in flight, and matches what has arrived (--api client holds, up to "
            "--store-wait-ms)",
            file=info,
        )
    results: list[dict[str, Any]] = []
    codes = []
    argv = own_server_argv(args)
    for name in ("A", "B"):
        own = OwnServer(argv, tempfile.mkdtemp(prefix=f"kvmem-simulate-node-{name.lower()}-", dir="/tmp"))
        print(f"node {name}: kvmem {' '.join(argv)}", file=info, flush=True)
        try:
            own.wait_ready()
            codes.append(_with_server(args, own.target, own, reference, info, node=name, collect=results))
        finally:
            print(f"node {name}: stopped its server (exit {own.stop()})", file=info)
    a, b = results
    ok = all(r["ok"] for r in results) and a["workload"]["digest"] == b["workload"]["digest"]
    if args.json:
        json.dump({"ok": ok, "nodes": results}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        read = (b.get("store") or {}).get("pages_read", 0)
        print(
            f"nodes: node A prefilled {a['totals']['prefill_tokens']:,} tokens, node B "
            f"{b['totals']['prefill_tokens']:,} ({read:,} pages read from the store, their K/V checked); prefix "
            f"hit rate node A {a['totals']['prefix_hit_rate']:.0%}, node B {b['totals']['prefix_hit_rate']:.0%}"
        )
    return max(codes) if ok else max(1, *codes)


def _with_server(
    args: argparse.Namespace,
    target: str,
    own: OwnServer | None,
    reference: str | None,
    info: IO[str],
    node: str = "",
    collect: list[dict[str, Any]] | None = None,
) -> int:
    from kvmem.client.admin import stats as fetch_stats

    def pool_stats() -> Any:
        return fetch_stats(target, auth_token=args.auth_token, timeout=5)

    stats = pool_stats()
    server = _server_info(stats, target, own)
    if not stats.geometry.HasField("layout") or not stats.geometry.layout.num_layers:
        raise UsageError(
            f"the server at {target} has no KV memory (--device none): simulate writes and checks K/V; "
            "use a server with --device cpu or cuda:N"
        )
    g = stats.geometry
    max_len = min(int(g.max_context_len), (int(g.num_pages) - 1) * int(g.page_size) // 4)
    if max_len < 2:
        raise UsageError(f"the server's pool ({g.num_pages} pages of {g.page_size}) is too small to simulate on")
    spec = _spec(args, max_len)
    common = {"target": target, "auth_token": args.auth_token, "spec": spec, "run_id": secrets.token_hex(3)}
    if stats.HasField("store"):  # the synthetic model's K/V, the same on every node for the same tokens
        common.update(model_id=SYNTHETIC_MODEL_ID, fetch_wait_s=args.store_wait_ms / 1000)
    configs = [
        WorkerConfig(
            **common,
            worker=w,
            max_running=args.max_running,
            chunk_tokens=args.chunk_tokens,
            duration_s=args.duration,
            forward_s=args.forward_ms / 1000,
            corrupt=args.corrupt_one_value and w == 0,
            api=args.api,
        )
        for w in range(args.workers)
    ]
    amount = f"for {args.duration:g} s" if args.duration is not None else f"{args.requests} requests each"
    print(
        f"kvmem simulate: {args.workers} workers on {APIS[args.api]} (--api {args.api}), {amount} (seed "
        f"{args.seed}), against {target} "
        f"({server['memory_backend']}, {server['num_pages_total']:,} pages of {server['page_size']} tokens, "
        f"{server['layers']} layers in {server['dtype']}; requests up to {max_len:,} tokens)",
        file=info,
        flush=True,
    )
    if stats.num_cache_entries:
        print(
            f"the prefix cache already holds {stats.num_cache_entries:,} pages: prompts an earlier run cached "
            "match at once",
            file=info,
        )
    view = LiveView(info, args.interval)

    def sample(run: RunState) -> None:
        try:
            s = pool_stats()
        except KVMemError:  # the workers say what went wrong; a sample is only a sample
            return
        run.sample(int(s.num_used_pages), int(s.num_cached_pages), int(s.num_free_pages))

    total = server["num_pages_total"]
    run = _run("kvmem", worker_main, configs, view, sample, lambda r: pool_line(r, total))
    result = _result(args, spec, server, run)
    try:
        last = pool_stats()
        result["host_tier"] = host_tier(last)
        result["store"] = store_summary(last)
    except KVMemError:
        result["host_tier"] = None
    if node:
        result["node"] = node
        print(f"node {node}:", file=info)
    if run.finished and not (run.failures or run.errors) and reference is not None:
        result["baseline"], base = _baseline(args, configs, server, reference, view, info)
        if base.failures or base.errors:
            result["errors"] += [f"baseline {e}" for e in base.failures + base.errors]
            result["ok"] = False
            return _report(args, run, result, info, collect)
        result["comparison"] = {
            "pages_saved": result["baseline"]["peak_pages_held"] - result["pool"].get("peak_used_pages", 0),
            "prefill_tokens_saved": base.total("prefill_tokens") - run.total("prefill_tokens"),
        }
    return _report(args, run, result, info, collect)


def _baseline(
    args: argparse.Namespace,
    configs: list[WorkerConfig],
    server: dict[str, Any],
    reference: str,
    view: LiveView,
    info: IO[str],
) -> tuple[dict[str, Any], RunState]:
    from .reference import BaselineConfig, baseline_main

    print(
        "baseline: the same workload on the reference allocator, in-process, one per worker...", file=info, flush=True
    )
    num_pages = server["num_pages_total"] + 1
    base_configs = [
        BaselineConfig(
            dataclasses.replace(c, corrupt=False, forward_s=0.0),
            reference,
            num_pages,
            server["page_size"],
            c.spec.max_len,
        )
        for c in configs
    ]

    def sample(run: RunState) -> None:
        held = int(run.total("pages_held"))
        run.sample(held, 0, 0)

    base = _run(
        "reference",
        baseline_main,
        base_configs,
        view,
        sample,
        lambda r: f"pages held in {len(configs)} pools: {r.total('pages_held'):,.0f}",
    )
    rows = worker_rows(base)
    return {
        "reference": reference,
        "totals": totals(base),
        "peak_pages_held": sum(int(r.get("peak_pages_held", 0)) for r in rows),
        "mean_pages_held": round(sum(float(r.get("mean_pages_held", 0.0)) for r in rows), 1),
        "pool_pages_per_worker": num_pages - 1,
        "workers": rows,
    }, base


def _result(args: argparse.Namespace, spec: WorkloadSpec, server: dict[str, Any], run: RunState) -> dict[str, Any]:
    rows = worker_rows(run)
    digests = [r["digest"] or "-" for r in rows]
    return {
        "ok": run.finished and not (run.failures or run.errors),
        "config": {
            "workers": args.workers,
            "api": args.api,
            "requests_per_worker": spec.requests,
            "duration_s": args.duration,
            "max_running": args.max_running,
            "chunk_tokens": args.chunk_tokens,
            "workload": dataclasses.asdict(spec),
        },
        "server": server,
        "workload": {"seed": spec.seed, "digest": combined_digest(digests), "per_worker": digests},
        "totals": totals(run),
        "pool": pool_summary(run),
        "workers": rows,
        "failures": run.failures,
        "errors": run.errors,
        "turns": turn_rows(run) if spec.turns > 1 else None,
        "host_tier": None,
        "baseline": None,
        "comparison": None,
        "series": [
            {"t_s": round(t, 3), "used": used, "cached": cached, "free": free, "hit_rate": round(rate, 4)}
            for t, used, cached, free, rate in run.samples
        ],
    }


def _report(
    args: argparse.Namespace,
    run: RunState,
    result: dict[str, Any],
    info: IO[str],
    collect: list[dict[str, Any]] | None = None,
) -> int:
    if collect is not None:  # --nodes 2: printed with the other node's
        collect.append(result)
    if args.json:
        if collect is None:
            json.dump(result, sys.stdout, indent=2)
            sys.stdout.write("\n")
    else:
        lines = [
            f"kvmem simulate: {result['server']['target']}, {args.workers} workers on {APIS[args.api]} "
            f"(--api {args.api})",
            *worker_table(run),
        ]
        lines += summary_lines(run, result)
        if result["baseline"] is not None:
            lines += ["", *comparison_lines(result)]
        print("\n".join(lines))
    for failure in run.failures:
        print(f"FAILURE: {failure}", file=sys.stderr)
    for error in result["errors"]:
        print(f"ERROR: {error}", file=sys.stderr)
    if not result["ok"]:
        return 1
    if args.plot:
        plot(args.plot, run, result["server"]["num_pages_total"])
        print(f"plot: {args.plot}", file=info)
    return 0
