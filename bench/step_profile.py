#!/usr/bin/env python3
"""Where a kvmem server's CPU goes per Step: the profile behind docs/PERFORMANCE.md.

Starts a kvmem server (``--device none`` geometry as rpc_bench's: 8,192 pages of 16,
512 request slots) and the bare echo server of ``bench/_echo_server.py``, then drives
each contender alone for ``--seconds`` over the unix socket with pre-serialised bytes
(no kvmem client code on the path, so the client side is the same for all):

- ``echo stream``: a ping-pong of a Step's bytes on the echo's stream (the reply the
  size of a decode Step's response);
- ``empty step (stream)``: a Step with no items on StepStream: what a message costs
  the server before any work (parse, session, batch, core, response);
- ``decode (stream)`` / ``decode (unary)``: 256 decode allocs of one token (a truncate
  back every 32nd step), on StepStream and as unary Step calls, columns as int32 bytes;
- ``decode, varint columns (stream)``: the same with the repeated (varint) columns.

For each: the round trip's median, and the server's and this process's CPU per call
(user + system from /proc). With ``--breakdown`` the kvmem server runs under a wrapper
that times the handler's phases in the server (the request's columns into a batch, the
core's step and its decode path, the response) and prints their medians at the end: the
costs as the server pays them, with its caches cold between steps.

Run: ``python bench/step_profile.py [--seconds 3] [--breakdown]``. Absolute figures
drift with the machine's load; compare rows of one run.
"""

from __future__ import annotations

import argparse
import gc
import os
import pathlib
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from _echo_server import STREAM_METHOD as ECHO_STREAM  # noqa: E402
from _echo_server import payload  # noqa: E402

NUM_REQUESTS = 256
STEP_STREAM = "/kvmem.v1.KVMemory/StepStream"
STEP_UNARY = "/kvmem.v1.KVMemory/Step"

# Run as the server under --breakdown: time the handler's phases, print medians on SIGUSR1.
_BREAKDOWN_SERVER = r"""
import os, signal, statistics, sys, time
from kvmem.server.edge import service
from kvmem.server.core import alloc, kvcore
times = {}
def timed(owner, name, label):
    f = getattr(owner, name)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            times.setdefault(label, []).append(time.perf_counter() - t)
    setattr(owner, name, wrapper)
timed(service.KVMemoryService, "_step", "handler, whole")
timed(service, "step_batch", "  request columns -> batch")
timed(kvcore.KVCore, "step", "  core step")
timed(alloc.Allocator, "decode", "    of which the decode path")
timed(service, "step_response", "  response message")
ORDER = ["handler, whole", "  request columns -> batch", "  core step", "    of which the decode path",
         "  response message"]
def report(*_):
    for label in ORDER:
        v = times.get(label) or [0.0]
        print(f"BREAKDOWN {label:32s} {statistics.median(v) * 1e6:7.1f} us  (n={len(v)})", flush=True)
    os._exit(0)
signal.signal(signal.SIGUSR1, report)
signal.signal(signal.SIGUSR2, lambda *_: times.clear())
from kvmem.cli import main
sys.exit(main())
"""


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_socket(path: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"server for {path} did not start (exit {proc.poll()})")
        time.sleep(0.05)
    time.sleep(0.3)


def ping_pong(channel: Any, method: str, requests: list[bytes]) -> Callable[[], bytes]:
    """One long-lived stream: each call sends the next request (cycling) and reads one reply."""
    q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    call = channel.stream_stream(method, _registered_method=True)(iter(q.get, None))
    i = [0]

    def one() -> bytes:
        q.put(requests[i[0] % len(requests)])
        i[0] += 1
        return next(call)

    return one


def unary(channel: Any, method: str, requests: list[bytes]) -> Callable[[], bytes]:
    rpc = channel.unary_unary(method, _registered_method=True)
    i = [0]

    def one() -> bytes:
        i[0] += 1
        return rpc(requests[(i[0] - 1) % len(requests)], timeout=10)

    return one


def measure(fn: Callable[[], bytes], pid: int, seconds: float) -> tuple[float, float, float]:
    for _ in range(300):
        fn()
    times = []
    server0, client0 = proc_cpu_s(pid), sum(os.times()[:2])
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    n = len(times)
    return statistics.median(times), (proc_cpu_s(pid) - server0) / n, (sum(os.times()[:2]) - client0) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="each contender alone this long (default 3)")
    parser.add_argument("--breakdown", action="store_true", help="time the handler's phases inside the server")
    args = parser.parse_args(argv)

    import grpc
    import numpy as np

    from kvmem.client import KVMemClient

    tmp = tempfile.mkdtemp(prefix="kvmem-prof-", dir="/tmp")
    kv_sock, echo_sock = os.path.join(tmp, "kv.sock"), os.path.join(tmp, "echo.sock")
    env = {k: v for k, v in os.environ.items() if k != "KVMEM_DEBUG"}
    serve = ["serve", "--socket", kv_sock, "--device", "none", "--num-pages", "8192", "--max-requests", "512"]
    cmd = [sys.executable, "-c", _BREAKDOWN_SERVER, *serve] if args.breakdown else [
        sys.executable, "-m", "kvmem.cli", *serve]  # fmt: skip
    kv = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    echo = subprocess.Popen([sys.executable, str(BENCH_DIR / "_echo_server.py"), "--socket", echo_sock])
    client = None
    try:
        wait_socket(kv_sock, kv)
        wait_socket(echo_sock, echo)
        client = KVMemClient(kv_sock, name="profile", keepalive=False)
        slots = client.open([f"r{i}" for i in range(NUM_REQUESTS)]).numpy()
        base = np.array([100 + i % 16 for i in range(NUM_REQUESTS)], dtype="<i4")
        ones = np.ones(NUM_REQUESTS, dtype="<i4")
        assert client.step(alloc_slots=slots, alloc_needs=base).ok
        sid = client.session_id
        from kvmem.v1 import kvmem_pb2

        def req(**columns: Any) -> bytes:
            return kvmem_pb2.StepRequest(session_id=sid, **columns).SerializeToString()

        s32, b32 = slots.astype("<i4").tobytes(), base.tobytes()
        decode = [req(alloc_slots_i32=s32, alloc_needs_i32=ones.tobytes())] * 31
        decode.append(req(truncate_slots_i32=s32, truncate_lens_i32=b32))
        varint = [req(alloc_slots=slots.tolist(), alloc_needs=ones.tolist())] * 31
        varint.append(req(truncate_slots=slots.tolist(), truncate_lens=base.tolist()))
        reply = kvmem_pb2.StepResponse.FromString(
            unary(grpc.insecure_channel(f"unix:{kv_sock}"), STEP_UNARY, decode[:1])()
        ).ByteSize()
        kv_ch, echo_ch = grpc.insecure_channel(f"unix:{kv_sock}"), grpc.insecure_channel(f"unix:{echo_sock}")
        contenders = [  # the last one is the one --breakdown times inside the server
            ("echo stream", echo.pid, ping_pong(echo_ch, ECHO_STREAM, [payload(len(decode[0]), reply)])),
            ("empty step (stream)", kv.pid, ping_pong(kv_ch, STEP_STREAM, [req()])),
            ("decode, varint columns (stream)", kv.pid, ping_pong(kv_ch, STEP_STREAM, varint)),
            ("decode (unary)", kv.pid, unary(kv_ch, STEP_UNARY, decode)),
            ("decode (stream)", kv.pid, ping_pong(kv_ch, STEP_STREAM, decode)),
        ]
        print(f"request {len(decode[0])} B (varint columns: {len(varint[0])} B), response {reply} B; "
              f"{args.seconds:g} s each, alone")  # fmt: skip
        print(f"{'contender':34s} {'round trip':>11s} {'server CPU':>11s} {'client CPU':>11s}")
        gc.disable()
        for i, (name, pid, fn) in enumerate(contenders):
            if args.breakdown and i == len(contenders) - 1:
                fn()  # its stream is open: the server's timings from here on are this contender's
                kv.send_signal(signal.SIGUSR2)
            wall, server, mine = measure(fn, pid, args.seconds)
            print(f"{name:34s} {wall * 1e6:8.0f} µs {server * 1e6:8.0f} µs {mine * 1e6:8.0f} µs", flush=True)
        gc.enable()
    finally:
        if client is not None:
            client.close()
        if args.breakdown and kv.poll() is None:
            kv.send_signal(signal.SIGUSR1)
            out, _ = kv.communicate(timeout=30)
            print(f"inside the server, per step of {contenders[-1][0]} (medians; 1 in 32 is the truncate back):")
            for line in out.decode().splitlines():
                if line.startswith("BREAKDOWN "):
                    print("  " + line[len("BREAKDOWN ") :])
        for proc in (kv, echo):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
