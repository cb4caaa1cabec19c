#!/usr/bin/env python3
"""A scheduler's decode iteration through the drop-in (``kvmem.client.compat``) against
the reference allocator's per-request calls in-process.

One iteration: 256 running requests each get one more token, written the way a
scheduler written against the reference does it, then their ``kv_loc`` concatenated::

    with allocator.iteration():                                   # kvmem: the one added line
        locs = [allocator.alloc(r, 1, lens[r]) for r in range(256)]
    out_cache_loc = torch.cat(locs)

kvmem's figure is the wall-clock time of that block and the concatenation, round trip
to a real ``kvmem serve`` over its unix socket included; the baseline is the same loop
and concatenation on the reference allocator in this process (CPU, ``pin_memory``
patched out; on a GPU it would also sync and copy per call). Both run the same trace:
requests of 100 + i % 16 tokens growing by one token per iteration (1 in 16 opens a new
page). The contenders take turns in rounds of 5 iterations; a ratio is the median of
the rounds' ratios. Target (issue 13): <= 0.5x.

    .venv/bin/python bench/compat_bench.py [--repeat 200] [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

import torch

BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _reference import load_reference  # noqa: E402
from _table import render  # noqa: E402
from rpc_bench import ServerProcesses  # noqa: E402

NUM_REQ = 256
PAGE_SIZE = 16
MAX_CONTEXT = 8192
TARGET = 0.5


class KVServer(ServerProcesses):
    """One ``kvmem serve`` (shm, a small KV geometry) on a short socket path."""

    def __init__(self, num_pages: int) -> None:
        import subprocess
        import tempfile

        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="kvc", dir="/tmp"))
        self.socket = str(self.dir / "kv.sock")
        self.logs = {"kvmem": self.dir / "kvmem.log"}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
        cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--socket", self.socket,
               "--shm-dir", str(self.dir), "--num-pages", str(num_pages), "--page-size", str(PAGE_SIZE),
               "--max-requests", str(NUM_REQ), "--max-context", str(MAX_CONTEXT), "--log-level", "warning"]  # fmt: skip
        with open(self.logs["kvmem"], "wb") as out:
            self.procs = {"kvmem": subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)}
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket) or not self._ready():
            self.check_alive()
            if time.monotonic() > deadline:
                raise SystemExit(f"kvmem serve did not become ready:\n{self.log_tail('kvmem')}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            try:
                resp = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service="kvmem.v1.KVMemory"), timeout=1
                )
            except grpc.RpcError:
                return False
        return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200, help="timed iterations of each (default 200; rounds of 5)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed iterations of each first (default 10)")
    parser.add_argument("--reference", default=None, help="path of seed_kv_allocator.py (default: ../shared/reference)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--quick", action="store_true", help="a few iterations (for the CI test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat, args.warmup = 10, 2
    torch.set_num_threads(1)
    ref_mod = load_reference(args.reference)
    if not ref_mod.available:
        print(f"compat_bench: {ref_mod.note}; the baseline needs it", file=sys.stderr)
        return 2
    from kvmem.client.compat import KVAllocator

    iterations = args.warmup + args.repeat + 8
    num_pages = NUM_REQ * ((100 + 15 + iterations) // PAGE_SIZE + 2) + 64
    lens0 = [100 + i % 16 for i in range(NUM_REQ)]
    server = KVServer(num_pages)
    try:
        kv = KVAllocator(server.socket, max_batch_size=NUM_REQ, name="compat-bench")
        ref = ref_mod.allocator(num_pages=num_pages, page_size=PAGE_SIZE, max_batch_size=NUM_REQ,
                                max_context_len=MAX_CONTEXT)  # fmt: skip
        with kv.iteration():
            for r, n in enumerate(lens0):
                kv.alloc(r, n, 0)
        for r, n in enumerate(lens0):
            ref.alloc(r, n, 0)
        state = {"kv": list(lens0), "ref": list(lens0)}

        def kv_iter() -> torch.Tensor:
            lens = state["kv"]
            with kv.iteration():
                locs = [kv.alloc(r, 1, lens[r]) for r in range(NUM_REQ)]
            out = torch.cat(locs)
            state["kv"] = [n + 1 for n in lens]
            return out

        def ref_iter() -> torch.Tensor:
            lens = state["ref"]
            out = torch.cat([ref.alloc(r, 1, lens[r]) for r in range(NUM_REQ)])
            state["ref"] = [n + 1 for n in lens]
            return out

        checked = 0
        for _ in range(args.warmup):
            a, b = kv_iter(), ref_iter()
            checked += _check(kv, ref, a, b, state)
        times: dict[str, list[float]] = {"kv": [], "ref": []}
        ratios: list[float] = []
        for _ in range(max(1, args.repeat // 5)):
            rnd: dict[str, list[float]] = {"kv": [], "ref": []}
            for name, fn in (("kv", kv_iter), ("ref", ref_iter)) * 5:
                t = time.perf_counter()
                fn()
                rnd[name].append(time.perf_counter() - t)
            for name in rnd:
                times[name] += rnd[name]
            ratios.append(statistics.median(rnd["kv"]) / statistics.median(rnd["ref"]))
        a, b = kv_iter(), ref_iter()
        checked += _check(kv, ref, a, b, state)
        steps = kv.num_steps
        kv.close()
    finally:
        server.stop()
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    ratio = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio, ratio, ratio]
    result = {
        "scenario": f"decode iteration, {NUM_REQ} requests x 1 token",
        "kvmem_us": med["kv"],
        "reference_us": med["ref"],
        "ratio": ratio,
        "ratio_iqr": [q[0], q[2]],
        "target": TARGET,
        "pass": ratio <= TARGET,
        "iterations_checked": checked,
        "steps": steps,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}",
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"kvmem drop-in benchmark -- {result['machine']}; load average {os.getloadavg()[0]:.2f}")
    print(render(
        ["scenario", "kvmem µs", "reference µs", "ratio", "spread (IQR)", "target", "result"],
        [[result["scenario"] + " (drop-in block vs per-request calls)", f"{med['kv']:.1f}", f"{med['ref']:.1f}",
          f"{ratio:.2f}x", f"{q[0]:.2f}-{q[2]:.2f}", f"≤ {TARGET}x", "PASS" if ratio <= TARGET else "MISS"]],
    ))  # fmt: skip
    print(
        f"kvmem: one Step per iteration over the unix socket, wall clock ({steps} Steps in all); reference: "
        f"{ref_mod.path} in-process (CPU). Checked {checked} iterations: kv_loc identical to the "
        "reference's, one distinct token slot per request."
    )
    return 0


def _check(kv: Any, ref: Any, a: torch.Tensor, b: torch.Tensor, state: dict[str, list[int]]) -> int:
    """Both contenders answered one distinct token slot per request, and the same ones:
    the two pools hand out pages alike until the first free, and this trace frees
    nothing."""
    if a.numel() != NUM_REQ or torch.unique(a).numel() != NUM_REQ:
        raise SystemExit("compat_bench: an iteration did not return one distinct token slot per request")
    if not torch.equal(a.long(), b.long()) or state["kv"] != state["ref"]:
        raise SystemExit("compat_bench: kv_loc differs from the reference's")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
