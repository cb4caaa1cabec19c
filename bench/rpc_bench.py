#!/usr/bin/env python3
"""Benchmark kvmem's Step over gRPC against bare gRPC echoes and the reference allocator.

Scenarios (pages of 16 tokens; decode requests hold 100 + i % 16 tokens, so 1 in 16
crosses a page boundary and takes a new page each step, as in a real decode batch):

1. Round trips over unix sockets, to servers started as subprocesses: kvmem
   (``python -m kvmem.cli serve``, KVMEM_DEBUG unset) and a bare echo
   (``bench/_echo_server.py``: grpc.aio on uvloop, one loop, the same server and channel
   options), each contender timed as the whole client call:

   step         -- ``KVMemClient.step`` allocating 1 token to each of 256 open requests
                   of one session, with the client's default ``step_stream=True``: the
                   Step goes as one message each way on the session's long-lived
                   StepStream (timed: the request building, the round trip, the
                   server's work, the response views).
   step_unary   -- the same on a second session of 256 requests,
                   ``KVMemClient(..., step_stream=False)``: the unary Step call. Both
                   sessions are open at once, so that all four contenders are timed
                   interleaved; the server runs with ``--max-requests 512`` for it (the
                   default 256 slots would hold one session). The second session's
                   slots are 257-512, two-byte varints where 1-127 of the first's take
                   one: its StepRequest is 127 B longer than the first's, by which the
                   echoes are sized.
   echo         -- the unary ``/kvmem.bench.Echo/Echo``: bytes in, bytes out, the request
                   the size of the serialised StepRequest, the reply the size of the
                   StepResponse, called the way the client makes a unary call.
   echo_stream  -- the same bytes as a ping-pong on one long-lived bidirectional stream,
                   ``/kvmem.bench.Echo/EchoStream``, through gRPC's sync API as the
                   client's step stream does: ``channel.stream_stream(...)`` fed from a
                   ``queue.SimpleQueue`` (gRPC's sending thread takes the requests),
                   one request put, one reply read with ``next()``.

   Targets: step <= 0.9x echo (the headline: the stream has to win back what kvmem
   costs over a bare call, and more); step_unary <= 1.2x echo. Info rows, no target:
   step / echo_stream (what kvmem costs on top of a bare stream) and echo_stream / echo
   (what a stream saves a bare call).
2. reference -- the reference allocator in-process for the same work: 256
                ``alloc(req, 1, alloced_len)``. Target: kvmem's step (streamed, the
                client's default) <= 0.25x.
3. clients   -- N client processes (default 8; forked from a fresh forkserver, or spawned
                with ``--start-method spawn``), each with its own session of 256 / N
                requests stepping over its step stream (the client's default), 1 token
                per request, for ``--duration`` seconds after a barrier; against the same
                N processes calling the unary echo, then the streamed echo (one stream
                per process), sized like their own step, for as long. Windows run in
                blocks of kvmem, echo, echo_stream, echo, kvmem (``--blocks`` of them,
                default 3): a palindrome, so that drift within a block hits the three
                alike; a block's ratio is the mean rate of its kvmem windows over the
                mean rate of its echo windows (of its echo_stream window), and the
                figure is the median over blocks, so that one block disturbed by a
                neighbour on a shared machine does not decide it. Target: aggregate
                steps/s >= 0.8x unary echo calls/s. Info: the same against the streamed
                echo's calls/s.

Scenarios 1 and 2 run interleaved with the garbage collector off: blocks of 32
back-to-back repetitions of the four round trips (their order reversed every other
repetition), each block opened by one untimed call of each (so none pays a server's
wake-up after the in-process work) and followed by a few repetitions of the reference.
Ratios are of medians measured in this same run (the machine's cores are shared and
noisy: absolute times drift, ratios much less). Every ``--truncate-every`` steps
(default 32) each kvmem session's requests are truncated back to their starting lengths
outside the timed region, so the pool never runs out; the reference gives back the page
each boundary-crosser took after every repetition, untimed. Before timing, the first
step's ``kv_loc`` is checked against the reference's for the same work on a fresh pool
(same page ids), and the unary session's first step is checked too.

CPU per call, beside the round trips (on a shared machine it tells where the time goes
more steadily than wall time does): after the timed loop each round-trip contender runs
alone, back to back, for ``--cpu-window`` seconds (default 0.5); its server's CPU time
(the process's user + system, /proc, 10 ms ticks) and this process's
(``time.process_time``: the caller, gRPC's threads, the stream's sending thread and the
untimed checks) over that window are divided by the calls the server answered (the
kvmem figures count the untimed truncate calls, 1 per ``--truncate-every`` steps). In
scenario 3 every window is one contender alone: the server's CPU over the window, and
the client processes' own process time, per call.

The reference runs on the CPU (its ``pin_memory=True`` is patched out at construction,
see ``bench/_reference.py``); on a GPU it would also pay a ``.item()`` sync and a
host-to-device copy per call.

Runtime: about 55 s by default on a 2-core machine (scenarios 1-2 about 17 s for 3,000
repetitions, the CPU windows 2 s, scenario 3 15 windows of 2 s), less with more cores.
Shorter: ``--reps``/``--budget`` bound scenarios 1-2, ``--cpu-window`` the CPU windows
(0 skips them), ``--duration`` and ``--blocks`` scenario 3 (``--duration 0`` skips it);
``bench/gpu_check.sh`` runs ``--budget 10 --blocks 2``.

Both servers are stopped with SIGTERM when the benchmark ends, fails or is interrupted.
Exit status: 0 (a measurement, not a test) unless ``--strict`` and a target is missed
(1; info rows have no target), or a correctness check or a server fails (2).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import pathlib
import platform
import queue as queue_mod
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

BENCH_DIR = pathlib.Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))
from _echo_server import METHOD as ECHO_METHOD  # noqa: E402
from _echo_server import SERVICE as ECHO_SERVICE  # noqa: E402
from _echo_server import STREAM_METHOD as ECHO_STREAM_METHOD  # noqa: E402
from _echo_server import payload as echo_payload  # noqa: E402
from _reference import Reference, default_reference_path, load_reference  # noqa: E402
from _table import render  # noqa: E402

PAGE_SIZE = 16
NUM_REQUESTS = 256  # per session in scenario 1; shared by the N sessions of scenario 3
MAX_REQUESTS = 256  # the server's default request slots (memory_bench.py's servers take this)
RPC_MAX_REQUESTS = 2 * NUM_REQUESTS  # this benchmark's server (--max-requests): scenario 1 holds two sessions
MAX_CONTEXT_LEN = 4096
NUM_PAGES = 8192  # 512 requests x at most (115 + truncate_every) tokens fit many times over
DECODE_BASE_LEN = 100  # request i holds 100 + i % 16 tokens
CALL_TIMEOUT_S = 10.0  # the client's default per-call deadline, used for the unary echo too
KVMEM_SERVICE = "kvmem.v1.KVMemory"

TARGETS = {
    # key: (comparison, value, meaning)
    "stream_step_vs_echo": (
        "<=",
        0.9,
        "kvmem Step over the step stream (the client's default) / unary gRPC echo, round trip",
    ),
    "unary_step_vs_echo": ("<=", 1.2, "kvmem unary Step (step_stream=False) / unary gRPC echo, round trip"),
    "step_vs_reference": ("<=", 0.25, "kvmem Step round trip (streamed, the default) / reference in-process"),
    "clients_vs_echo": (">=", 0.8, "N kvmem clients' aggregate steps/s (streamed) / N unary echo callers' calls/s"),
}
INFO = {
    # key: meaning (rows without a target: both baselines in sight)
    "stream_step_vs_stream_echo": "kvmem Step over the step stream / streamed echo (ping-pong on one stream)",
    "stream_echo_vs_echo": "streamed echo / unary echo, round trip",
    "clients_vs_stream_echo": "N kvmem clients' aggregate steps/s (streamed) / N streamed-echo callers' calls/s",
}


class BenchFailed(RuntimeError):
    """A correctness check, a server or a worker failed: the figures mean nothing."""


def check(cond: bool, what: str) -> None:
    if not cond:
        raise BenchFailed(what)


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_per_call_us(
    before: dict[str, float | None], after: dict[str, float | None], name: str, calls: int
) -> float | None:
    b, a = before.get(name), after.get(name)
    return None if a is None or b is None or calls <= 0 else (a - b) / calls * 1e6


def decode_lens(n: int) -> np.ndarray:
    return DECODE_BASE_LEN + (np.arange(n, dtype=np.int64) % PAGE_SIZE)


# ------------------------------------------------------------------------ servers


class ServerProcesses:
    """Named server subprocesses with logs under ``self.dir``. ``stop()`` sends SIGTERM
    (then SIGKILL after a grace), removes ``self.dir`` and is safe to call more than
    once. Subclasses set ``dir``, ``procs``, ``logs`` and start the processes."""

    dir: pathlib.Path
    procs: dict[str, subprocess.Popen[bytes]]
    logs: dict[str, pathlib.Path]
    stop_grace_s = 10.0

    def cpu_s(self) -> dict[str, float | None]:
        return {name: proc_cpu_s(proc.pid) for name, proc in self.procs.items()}

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise BenchFailed(f"the {name} server died (exit {proc.returncode}):\n{self.log_tail(name)}")

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            lines = self.logs[name].read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:]) or "(empty log)"

    def stop(self) -> dict[str, int | None]:
        codes: dict[str, int | None] = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        return codes


class Servers(ServerProcesses):
    """The kvmem server and the echo server, as subprocesses on short socket paths
    under /tmp."""

    def __init__(self, num_pages: int, keep_state: bool = False) -> None:
        self.keep_state = keep_state
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.kv_socket = str(self.dir / "kv.sock")
        self.echo_socket = str(self.dir / "echo.sock")
        self.num_pages = num_pages
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, pathlib.Path] = {}

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}  # KVMEM_DEBUG et al. unset
        kv_cmd = [
            sys.executable, "-m", "kvmem.cli", "serve",
            "--socket", self.kv_socket,
            "--num-pages", str(self.num_pages),
            "--page-size", str(PAGE_SIZE),
            "--max-requests", str(RPC_MAX_REQUESTS),
            "--max-context", str(MAX_CONTEXT_LEN),
            "--log-level", "warning",
            *(["--keep-state"] if self.keep_state else []),
        ]  # fmt: skip
        echo_cmd = [sys.executable, str(BENCH_DIR / "_echo_server.py"), "--socket", self.echo_socket]
        for name, cmd in (("kvmem", kv_cmd), ("echo", echo_cmd)):
            log = self.dir / f"{name}.log"
            self.logs[name] = log
            with open(log, "wb") as out:
                self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
        self._wait_ready("kvmem", self.kv_socket, KVMEM_SERVICE)
        self._wait_ready("echo", self.echo_socket, ECHO_SERVICE)

    def stop(self) -> dict[str, int | None]:
        codes = super().stop()
        if self.keep_state:  # the kept state of this run's socket: removed, it is of no use to anyone
            from kvmem.server.memory.shm import kept_key

            for path in pathlib.Path("/dev/shm").glob(f"kvmem-0-{kept_key(self.kv_socket, None)}.*"):
                path.unlink(missing_ok=True)
        return codes

    def _wait_ready(self, name: str, socket_path: str, service: str, timeout_s: float = 60.0) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                proc = self.procs[name]
                if proc.poll() is not None:
                    raise BenchFailed(
                        f"the {name} server exited with {proc.returncode} at start:\n{self.log_tail(name)}"
                    )
                try:
                    resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise BenchFailed(f"the {name} server was not ready after {timeout_s:g} s:\n{self.log_tail(name)}")
                time.sleep(0.05)


# ------------------------------------------------------------------ client side


class EchoStream:
    """A ping-pong on one long-lived bidirectional stream through gRPC's sync API, as
    the kvmem client's step stream: gRPC's sending thread takes the requests from a
    queue; ``call()`` puts one request and reads its reply with ``next()``. No
    per-call deadline (a stream has one for its whole life, and this one has none)."""

    def __init__(self, channel: Any) -> None:
        self._queue: queue_mod.SimpleQueue[bytes | None] = queue_mod.SimpleQueue()
        rpc = channel.stream_stream(ECHO_STREAM_METHOD, _registered_method=True)  # no (de)serialiser: bytes
        self._call = rpc(iter(self._queue.get, None), metadata=None)

    def call(self, data: bytes) -> bytes:
        self._queue.put(data)
        return next(self._call)

    def close(self) -> None:
        """End the requests (the sending thread returns) and cancel the call; idempotent."""
        self._queue.put(None)
        self._call.cancel()


class EchoClient:
    """A channel to the echo server with the kvmem client's channel options, a unary
    call on it made the way the kvmem client makes its unary calls (``call``), and a
    ping-pong stream on the same channel (``stream.call``)."""

    def __init__(self, target: str) -> None:
        import grpc

        from kvmem.client.channel import CHANNEL_OPTIONS

        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._rpc = self.channel.unary_unary(ECHO_METHOD, _registered_method=True)  # no (de)serialiser: bytes
        self.stream = EchoStream(self.channel)

    def call(self, data: bytes) -> bytes:
        return self._rpc(data, timeout=CALL_TIMEOUT_S, metadata=None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stream.close()
        self.channel.close()


def step_sizes(client: Any, res: Any, alloc_slots: Any, alloc_needs: Any) -> tuple[int, int]:
    """Serialised sizes of the StepRequest the client sends for this step (its columns
    encoded as the client encodes them: tensors as int32 bytes) and of the StepResponse
    it got (rebuilt exactly from the result's views)."""
    from kvmem.client.step import add_column
    from kvmem.v1 import kvmem_pb2

    columns: dict[str, Any] = {}
    add_column(columns, "alloc_slots", alloc_slots)
    add_column(columns, "alloc_needs", alloc_needs)
    req = kvmem_pb2.StepRequest(session_id=client.session_id, **columns)
    resp = kvmem_pb2.StepResponse(
        epoch=client.epoch,
        alloc_status=res.status.numpy().tobytes(),
        kv_loc=res.kv_loc.numpy().tobytes(),
        kv_loc_offsets=res.kv_loc_offsets.numpy().tobytes(),
        new_pages=res.new_pages.numpy().tobytes(),
        new_page_offsets=res.new_page_offsets.numpy().tobytes(),
        num_pages_released=res.num_pages_released,
        num_free_pages=res.num_free_pages,
    )
    return req.ByteSize(), resp.ByteSize()


class DecodeSession:
    """A kvmem session with ``n`` open requests at their decode lengths, its Steps on
    the session's step stream (``step_stream=True``, the client's default) or unary
    calls. ``step()`` is the timed call; ``after()`` (untimed) checks the result and
    truncates back every ``truncate_every`` steps."""

    def __init__(self, target: str, n: int, truncate_every: int, name: str, step_stream: bool = True) -> None:
        import torch

        from kvmem.client import KVMemClient

        self.client = KVMemClient(target, name=name, step_stream=step_stream)
        self.step_stream = step_stream
        self.n = n
        self.truncate_every = truncate_every
        self.slots = self.client.open([f"{name}-req-{i}" for i in range(n)])  # int32 tensor
        self.base = torch.from_numpy(decode_lens(n))
        self.ones = torch.ones(n, dtype=torch.int32)
        res = self.client.step(alloc_slots=self.slots, alloc_needs=self.base)
        check(res.ok, f"{name}: setup alloc failed: {res.status.tolist()[:8]}...")
        self.since_reset = 0
        self.num_calls = 0  # Step calls made by step()/after(), for the server CPU per call

    def step(self) -> Any:
        return self.client.step(alloc_slots=self.slots, alloc_needs=self.ones)

    def step_folding_truncate(self) -> Any:
        """For throughput runs, where nothing is untimed: every ``truncate_every``
        steps the truncate back rides in the same Step (truncates apply before allocs)."""
        if self.since_reset >= self.truncate_every:
            self.since_reset = 0
            res = self.client.step(
                truncate_slots=self.slots, truncate_lens=self.base, alloc_slots=self.slots, alloc_needs=self.ones
            )
        else:
            res = self.client.step(alloc_slots=self.slots, alloc_needs=self.ones)
        self.since_reset += 1
        return res

    def after(self, res: Any) -> None:
        check(res.kv_loc.numel() == self.n and res.ok, "kvmem step: not every alloc OK")
        self.since_reset += 1
        self.num_calls += 1
        if self.since_reset >= self.truncate_every:
            self.client.truncate(self.slots, self.base)
            self.since_reset = 0
            self.num_calls += 1

    def close(self) -> None:
        self.client.close()


# --------------------------------------------------------------------------- timing


class Contender:
    """``run()`` is timed; ``after(result)`` (untimed) checks it and puts the state
    back. ``server`` names the server that answers it, ``calls()`` counts the calls
    that server answered so far (the kvmem sessions' untimed truncates included)."""

    def __init__(
        self, name: str, run: Callable[[], Any], after: Callable[[Any], None], server: str | None = None,
        calls: Callable[[], int] | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.run = run
        self.after = after
        self.server = server
        self.calls = calls
        self.times_us: list[float] = []

    def once(self, clock: Callable[[], int], keep: bool) -> None:
        t0 = clock()
        out = self.run()
        t1 = clock()
        self.after(out)
        if keep:
            self.times_us.append((t1 - t0) / 1e3)


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


MIN_REPS = 200
BLOCK = 32  # round-trip repetitions per block


def measure(
    rpc: list[Contender], local: list[Contender], reps: int, local_every: int, warmup: int, budget_s: float,
    servers: Servers,
) -> int:  # fmt: skip
    """Time round trips warm and back to back, the in-process contenders in between.

    Blocks of BLOCK repetitions of the ``rpc`` contenders (order alternating per
    repetition), each block followed by BLOCK / ``local_every`` repetitions of the
    ``local`` ones. A round trip right after milliseconds of in-process work finds the
    servers asleep and pays their wake-up, which would hide the difference between
    Step and the echo; so every block starts with one untimed call of each ``rpc``
    contender. Keeps up to ``reps`` round-trip repetitions after ``warmup``, fewer if
    ``budget_s`` runs out first (never fewer than MIN_REPS). Returns how many were kept."""
    clock = time.perf_counter_ns
    deadline = time.monotonic() + budget_s
    kept = 0
    rep = 0
    with gc_off():
        while kept < reps:
            for c in rpc:
                c.once(clock, keep=False)
            for _ in range(BLOCK):
                timed = rep >= warmup
                for c in rpc if rep % 2 == 0 else rpc[::-1]:
                    c.once(clock, keep=timed)
                rep += 1
                kept += timed
                if kept >= reps:
                    break
            for i in range(max(1, BLOCK // local_every)):
                for c in local if i % 2 == 0 else local[::-1]:
                    c.once(clock, keep=rep > warmup)
            servers.check_alive()
            gc.collect()  # untimed, between blocks
            if kept >= MIN_REPS and time.monotonic() > deadline:
                break
    return kept


def cpu_windows(contenders: list[Contender], window_s: float, servers: Servers) -> dict[str, dict[str, Any]]:
    """Each contender alone, back to back, for ``window_s`` seconds (untimed calls,
    the garbage collector off): its server's CPU and this process's CPU over the
    window, per call its server answered."""
    out: dict[str, dict[str, Any]] = {}
    clock = time.perf_counter_ns
    with gc_off():
        for c in contenders:
            assert c.server is not None and c.calls is not None
            for _ in range(3):  # settle: the previous contender's server goes quiet
                c.once(clock, keep=False)
            calls0, cpu0, own0 = c.calls(), servers.cpu_s(), time.process_time()
            t0 = time.monotonic()
            end = t0 + window_s
            while time.monotonic() < end:
                c.once(clock, keep=False)
            own1, cpu1, calls1 = time.process_time(), servers.cpu_s(), c.calls()
            calls = calls1 - calls0
            out[c.name] = {
                "server": c.server,
                "calls": calls,
                "window_s": round(time.monotonic() - t0, 3),
                "server_cpu_us_per_call": cpu_per_call_us(cpu0, cpu1, c.server, calls),
                "client_cpu_us_per_call": (own1 - own0) / calls * 1e6 if calls else None,
            }
            servers.check_alive()
            gc.collect()
    return out


def summary(times_us: list[float]) -> dict[str, float]:
    s = sorted(times_us)
    return {
        "median": statistics.median(s),
        "min": s[0],
        "p10": s[int(0.1 * (len(s) - 1))],
        "p90": s[int(0.9 * (len(s) - 1))],
        "n": len(s),
    }


# --------------------------------------------------------------- scenarios 1 and 2


def scenario_latency(
    servers: Servers, ref: Reference, reps: int, warmup: int, budget_s: float, ref_every: int, truncate_every: int,
    cpu_window_s: float, say: Callable[..., None],
) -> dict[str, Any]:  # fmt: skip
    import torch

    target = f"unix:{servers.kv_socket}"
    sess = DecodeSession(target, NUM_REQUESTS, truncate_every, "bench", step_stream=True)
    usess = None
    echo = None
    try:
        slots = sess.slots.tolist()
        lens = decode_lens(NUM_REQUESTS).tolist()
        ref_batch = max(slots) + 1  # the reference's request indices are kvmem's slots

        # Check the first step on the fresh pool against the reference, and size the echo.
        res = sess.step()
        check(res.ok and res.kv_loc.numel() == NUM_REQUESTS, "first step: not every alloc OK")
        check(torch.equal(res.kv_loc_offsets, torch.arange(NUM_REQUESTS + 1, dtype=torch.int32)), "first step: offsets")
        check(res.new_pages.numel() == NUM_REQUESTS // PAGE_SIZE, "first step: wrong number of new pages")
        checked = "first step (streamed): all OK, offsets, one new page per 16 requests"
        if ref.available:
            ra = ref.allocator(num_pages=servers.num_pages, page_size=PAGE_SIZE, max_batch_size=ref_batch,
                               max_context_len=MAX_CONTEXT_LEN)  # fmt: skip
            for r, n in zip(slots, lens, strict=True):
                check(ra.alloc(r, n, 0) is not None, "reference setup alloc failed")
            ref_kv = torch.cat([ra.alloc(r, 1, n) for r, n in zip(slots, lens, strict=True)])
            check(
                torch.equal(ref_kv.to(torch.int32), res.kv_loc), "first step: kvmem kv_loc differs from the reference's"
            )
            checked += "; kv_loc identical to the reference's"
        req_bytes, resp_bytes = step_sizes(sess.client, res, sess.slots, sess.ones)
        sess.after(res)
        memory_backend = sess.client.stats().memory_backend

        # The unary session, opened once the streamed one's first step was checked.
        usess = DecodeSession(target, NUM_REQUESTS, truncate_every, "bench-unary", step_stream=False)
        ures = usess.step()
        check(ures.ok and ures.kv_loc.numel() == NUM_REQUESTS, "unary session, first step: not every alloc OK")
        check(ures.new_pages.numel() == NUM_REQUESTS // PAGE_SIZE, "unary session, first step: wrong new pages")
        checked += "; first step (unary session): all OK, one new page per 16 requests"
        ureq_bytes, uresp_bytes = step_sizes(usess.client, ures, usess.slots, usess.ones)
        usess.after(ures)

        echo = EchoClient(f"unix:{servers.echo_socket}")
        data = echo_payload(req_bytes, resp_bytes)
        check(len(echo.call(data)) == resp_bytes, "echo: wrong reply size")
        check(len(echo.stream.call(data)) == resp_bytes, "echo stream: wrong reply size")

        echo_calls = {"echo": 0, "echo_stream": 0}

        def echo_after(name: str) -> Callable[[bytes], None]:
            def after(out: bytes) -> None:
                check(len(out) == resp_bytes, f"{name}: wrong reply size")
                echo_calls[name] += 1

            return after

        unary_echo, stream_echo = echo.call, echo.stream.call
        contenders = [
            Contender("step", sess.step, sess.after, "kvmem", lambda: sess.num_calls),
            Contender("step_unary", usess.step, usess.after, "kvmem", lambda: usess.num_calls),
            Contender("echo", lambda: unary_echo(data), echo_after("echo"), "echo", lambda: echo_calls["echo"]),
            Contender("echo_stream", lambda: stream_echo(data), echo_after("echo_stream"), "echo",
                      lambda: echo_calls["echo_stream"]),
        ]  # fmt: skip
        local: list[Contender] = []
        if ref.available:
            ra = ref.allocator(num_pages=servers.num_pages, page_size=PAGE_SIZE, max_batch_size=ref_batch,
                               max_context_len=MAX_CONTEXT_LEN)  # fmt: skip
            for r, n in zip(slots, lens, strict=True):
                check(ra.alloc(r, n, 0) is not None, "reference setup alloc failed")
            free_before = len(ra.free_slots)
            crossers = [(r, n) for r, n in zip(slots, lens, strict=True) if n % PAGE_SIZE == 0]

            def ref_run() -> Any:
                alloc = ra.alloc
                return [alloc(r, 1, n) for r, n in zip(slots, lens, strict=True)]

            def ref_after(out: Any) -> None:
                check(len(out) == NUM_REQUESTS and all(t is not None for t in out), "reference: an alloc failed")
                for r, n in crossers:  # give back the page each boundary-crosser took
                    ra.free_extra_pages_not_cached(r, n, n + 1)
                ra.free_group_end()

            local.append(Contender("reference", ref_run, ref_after))
        say(f"  timing up to {reps} reps (+{warmup} warm-up, budget {budget_s:g} s) of: "
            f"{', '.join(c.name for c in contenders + local)}")  # fmt: skip
        kept = measure(contenders, local, reps, ref_every, warmup, budget_s, servers)
        if ref.available:
            check(len(ra.free_slots) == free_before, "reference leaked pages while timing")
        cpu: dict[str, dict[str, Any]] = {}
        if cpu_window_s > 0:
            say(f"  CPU per call: each round trip alone for {cpu_window_s:g} s")
            cpu = cpu_windows(contenders, cpu_window_s, servers)
        return {
            "reps": kept,
            "memory_backend": memory_backend,
            "cpu_per_call": cpu,
            "cpu_note": "each round trip alone for cpu_window_s after the timed loop: its server's CPU "
            "(user+system, /proc) and this process's (time.process_time: the caller, gRPC's threads, the "
            "untimed checks) over the window / the calls its server answered; the kvmem figures count the "
            f"untimed truncate calls too (1 per {truncate_every} steps)",
            "cpu_window_s": cpu_window_s,
            "times": {c.name: summary(c.times_us) for c in contenders + local},
            "request_bytes": req_bytes,
            "response_bytes": resp_bytes,
            "unary_request_bytes": ureq_bytes,
            "unary_response_bytes": uresp_bytes,
            "checked": checked,
        }
    finally:
        if echo is not None:
            echo.close()
        if usess is not None:
            usess.close()
        sess.close()  # frees the request slots for scenario 3


# ----------------------------------------------------------------------- scenario 3

# One block of throughput windows: a palindrome, so that a drift within the block hits
# the three alike; the target's ratio (kvmem / echo) has two windows of each per block.
WINDOWS = ("kvmem", "echo", "echo_stream", "echo", "kvmem")
PHASE_SERVER = {"kvmem": "kvmem", "echo": "echo", "echo_stream": "echo"}  # who answers each window


def _worker(
    idx: int, kv_target: str, echo_target: str, n: int, duration: float, truncate_every: int,
    phases: tuple[str, ...], go: Any, barrier: Any, results: Any,
) -> None:  # fmt: skip
    """One client process: its own session of ``n`` requests (Steps on its step stream,
    the client's default) and its own echo channel (unary calls, and one ping-pong
    stream). It imports what it needs, reports, and waits for ``go`` (the parent times
    scenarios 1-2 meanwhile, with the request slots all taken). Then per phase: wait on
    the barrier, call for ``duration`` seconds, report the count."""
    sess = None
    echo = None
    try:
        import torch  # noqa: F401 - the slow imports, done before the parent starts timing

        import kvmem.client.sync  # noqa: F401

        results.put(("imported", idx))
        if not go.wait(timeout=600):
            return
        sess = DecodeSession(kv_target, n, truncate_every, f"w{idx}", step_stream=True)
        res = sess.step_folding_truncate()
        check(res.ok, f"worker {idx}: first step failed")
        req_bytes, resp_bytes = step_sizes(sess.client, res, sess.slots, sess.ones)
        echo = EchoClient(echo_target)
        data = echo_payload(req_bytes, resp_bytes)
        for _ in range(30):  # warm the channels and streams up
            check(sess.step_folding_truncate().ok, f"worker {idx}: warm-up step failed")
            check(len(echo.call(data)) == resp_bytes, f"worker {idx}: echo: wrong reply size")
            check(len(echo.stream.call(data)) == resp_bytes, f"worker {idx}: echo stream: wrong reply size")
        results.put(("ready", idx, {"request_bytes": req_bytes, "response_bytes": resp_bytes}))
        clock = time.perf_counter
        gc.disable()
        for phase in phases:
            barrier.wait(timeout=120)
            count = 0
            c0 = time.process_time()
            t0 = clock()
            end = t0 + duration
            if phase == "kvmem":
                step = sess.step_folding_truncate
                while clock() < end:
                    res = step()
                    if not res.ok:
                        raise BenchFailed(f"worker {idx}: step failed: {res.status.tolist()}")
                    count += 1
            else:
                call = echo.call if phase == "echo" else echo.stream.call
                while clock() < end:
                    call(data)
                    count += 1
            elapsed = clock() - t0
            results.put(("phase", idx, phase, count, elapsed, time.process_time() - c0))
            gc.collect()
        barrier.wait(timeout=120)
    except BaseException:  # reported to the parent, which aborts
        with contextlib.suppress(Exception):
            barrier.abort()
        results.put(("error", idx, traceback.format_exc()))
    finally:
        if echo is not None:
            with contextlib.suppress(Exception):
                echo.close()
        if sess is not None:
            with contextlib.suppress(Exception):
                sess.close()


class Workers:
    """The client processes of scenario 3, spawned early so that their imports overlap
    the servers' start-up rather than anything timed. ``stop()`` terminates whichever
    are still alive (by their own Process objects) and is safe to call more than once."""

    def __init__(
        self, servers: Servers, clients: int, duration: float, blocks: int, truncate_every: int, start_method: str
    ) -> None:
        self.servers = servers
        self.phases = WINDOWS * blocks
        self.clients = clients
        self.n = NUM_REQUESTS // clients
        self.duration = duration
        self.start_method = start_method
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # One fresh interpreter (no gRPC channel, no thread of ours) imports torch and the
            # client once; each worker is forked from it, so 8 workers cost one import.
            ctx.set_forkserver_preload(["torch", "numpy", "grpc", "kvmem.client", "kvmem.v1.kvmem_pb2"])
        self.go = ctx.Event()
        self.barrier = ctx.Barrier(clients + 1)
        self.results = ctx.Queue()
        targets = (f"unix:{servers.kv_socket}", f"unix:{servers.echo_socket}")
        shared = (self.n, duration, truncate_every, self.phases, self.go, self.barrier, self.results)
        self.procs = [ctx.Process(target=_worker, args=(i, *targets, *shared), daemon=True) for i in range(clients)]
        for p in self.procs:
            p.start()

    def get(self, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=0.5)
            except queue_mod.Empty:
                self.servers.check_alive()
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    raise BenchFailed(f"a client process died (exit {dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise BenchFailed("client processes did not answer in time") from None
                continue
            if msg[0] == "error":
                raise BenchFailed(f"client process {msg[1]} failed:\n{msg[2]}")
            return msg

    def wait_imported(self) -> None:
        for _ in range(self.clients):
            msg = self.get(300)
            check(msg[0] == "imported", f"unexpected message from a client process: {msg[:2]}")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.barrier.abort()
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)


def scenario_clients(workers: Workers, say: Callable[..., None]) -> dict[str, Any]:
    clients, n, duration = workers.clients, workers.n, workers.duration
    per_phase: list[dict[str, Any]] = []
    sizes: dict[int, dict[str, int]] = {}
    workers.go.set()
    while len(sizes) < clients:
        msg = workers.get(180)
        check(msg[0] == "ready", f"unexpected message from a client process: {msg[:2]}")
        sizes[msg[1]] = msg[2]
    for phase in workers.phases:
        workers.barrier.wait(timeout=60)
        cpu0 = workers.servers.cpu_s()
        got = [workers.get(duration + 60) for _ in range(clients)]
        cpu1 = workers.servers.cpu_s()
        check(all(m[0] == "phase" and m[2] == phase for m in got), "client processes out of step")
        rate = sum(m[3] / m[4] for m in got)
        calls = sum(m[3] for m in got)
        per_phase.append({
            "phase": phase, "per_s": rate, "calls": calls,
            "server_cpu_us_per_call": cpu_per_call_us(cpu0, cpu1, PHASE_SERVER[phase], calls),
            "client_cpu_us_per_call": sum(m[5] for m in got) / calls * 1e6 if calls else None,
        })  # fmt: skip
        say(f"    {phase:>11}: {rate:,.0f}/s")
    workers.barrier.wait(timeout=60)
    for p in workers.procs:
        p.join(timeout=30)

    def mean_of(name: str, key: str) -> float | None:
        vals = [ph[key] for ph in per_phase if ph["phase"] == name and ph[key] is not None]
        return statistics.mean(vals) if vals else None

    names = tuple(PHASE_SERVER)
    rates = {name: mean_of(name, "per_s") for name in names}
    # Per block: mean kvmem rate / mean baseline rate of its windows (seconds apart);
    # the median over blocks is the figure of record.
    size = len(WINDOWS)
    block_ratios: dict[str, list[float]] = {"echo": [], "echo_stream": []}
    for b in range(0, len(per_phase), size):
        block = per_phase[b : b + size]
        kv = statistics.mean(w["per_s"] for w in block if w["phase"] == "kvmem")
        for base, ratios in block_ratios.items():
            ratios.append(kv / statistics.mean(w["per_s"] for w in block if w["phase"] == base))
    return {
        "clients": clients,
        "start_method": workers.start_method,
        "requests_per_client": n,
        "kvmem_step_stream": True,
        "duration_s_per_window": duration,
        "windows": per_phase,
        "block_ratios": block_ratios["echo"],
        "ratio": statistics.median(block_ratios["echo"]),
        "block_ratios_vs_echo_stream": block_ratios["echo_stream"],
        "ratio_vs_echo_stream": statistics.median(block_ratios["echo_stream"]),
        "kvmem_steps_per_s": rates["kvmem"],
        "kvmem_allocs_per_s": rates["kvmem"] * n if rates["kvmem"] is not None else None,
        "echo_calls_per_s": rates["echo"],
        "echo_stream_calls_per_s": rates["echo_stream"],
        "server_cpu_us_per_call": {name: mean_of(name, "server_cpu_us_per_call") for name in names},
        "client_cpu_us_per_call": {name: mean_of(name, "client_cpu_us_per_call") for name in names},
        "request_bytes": sizes[0]["request_bytes"],
        "response_bytes": sizes[0]["response_bytes"],
    }


# --------------------------------------------------------------------------- report


def verdict(key: str, ratio: float | None) -> str:
    if key in INFO:
        return "info"
    if ratio is None:
        return "SKIP"
    op, target, _ = TARGETS[key]
    return "PASS" if (ratio >= target if op == ">=" else ratio <= target) else "MISS"


def machine_info() -> dict[str, Any]:
    import google.protobuf
    import grpc
    import torch
    import uvloop
    from google.protobuf.internal import api_implementation

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    try:
        head = subprocess.run(
            ["git", "-C", str(BENCH_DIR.parent), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
        commit = head.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "protobuf": f"{google.protobuf.__version__} ({api_implementation.Type()})",
        "numpy": np.__version__,
        "torch": torch.__version__,
        "uvloop": uvloop.__version__,
        "cpu_count": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "cpus_usable": usable,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "kvmem_commit": commit,
    }


def build_rows(lat: dict[str, Any], thr: dict[str, Any] | None, ref: Reference) -> list[dict[str, Any]]:
    """One row per figure: the targets, and info rows (no target) that put both
    baselines, the unary and the streamed echo, in sight."""
    t = lat["times"]
    step, step_unary, echo, echo_stream = t["step"], t["step_unary"], t["echo"], t["echo_stream"]
    rows: list[dict[str, Any]] = []

    def row(key: str, title: str, value: Any, baseline_name: str, baseline: Any, ratio: float | None,
            unit: str, note: str | None = None, **extra: Any) -> None:  # fmt: skip
        target: dict[str, Any] | None = None
        if key in INFO:
            meaning = INFO[key]
        else:
            op, limit, meaning = TARGETS[key]
            target = {"op": op, "value": limit, "ratio_is": meaning}
        rows.append({
            "scenario": key, "title": title, "unit": unit, "value": value, "baseline": baseline_name,
            "baseline_value": baseline, "ratio": ratio, "ratio_is": meaning, "target": target,
            "result": verdict(key, ratio), "note": note, **extra,
        })  # fmt: skip

    def rt(key: str, title: str, a: dict[str, float], a_name: str, b: dict[str, float], b_name: str) -> None:
        row(key, title, a, b_name, b, a["median"] / b["median"], "µs round trip", contender=a_name,
            ratio_of_min=a["min"] / b["min"])  # fmt: skip

    rt("stream_step_vs_echo", f"Step over stream, {NUM_REQUESTS} decode allocs, vs unary echo", step, "step",
       echo, "unary gRPC echo")  # fmt: skip
    rt("unary_step_vs_echo", f"Step over unary call, {NUM_REQUESTS} decode allocs, vs unary echo", step_unary,
       "step_unary", echo, "unary gRPC echo")  # fmt: skip
    rt("stream_step_vs_stream_echo", "  Step over stream vs streamed echo", step, "step", echo_stream,
       "streamed gRPC echo (ping-pong on one stream)")  # fmt: skip
    rt("stream_echo_vs_echo", "  streamed echo vs unary echo", echo_stream, "echo_stream", echo, "unary gRPC echo")
    ref_title = f"Step vs reference, {NUM_REQUESTS} alloc() in-process"
    if "reference" in t:
        rf = t["reference"]
        row("step_vs_reference", ref_title, step, "reference allocator", rf, step["median"] / rf["median"], "µs",
            contender="step", ratio_of_min=step["min"] / rf["min"])  # fmt: skip
    else:
        row("step_vs_reference", ref_title, step, "reference allocator", None, None, "µs",
            note=f"skipped: {ref.note}", contender="step")  # fmt: skip
    if thr is not None:
        title = f"{thr['clients']} clients x {thr['requests_per_client']} req (streamed), aggregate"
        row("clients_vs_echo", f"{title}, vs unary echo", thr["kvmem_steps_per_s"],
            "unary echo calls/s, same processes", thr["echo_calls_per_s"], thr["ratio"], "per s",
            block_ratios=thr["block_ratios"])  # fmt: skip
        row("clients_vs_stream_echo", "  same clients vs streamed-echo callers", thr["kvmem_steps_per_s"],
            "streamed echo calls/s, same processes", thr["echo_stream_calls_per_s"], thr["ratio_vs_echo_stream"],
            "per s", block_ratios=thr["block_ratios_vs_echo_stream"])  # fmt: skip
    else:
        for key, title in (("clients_vs_echo", "N clients, aggregate, vs unary echo"),
                           ("clients_vs_stream_echo", "  same clients vs streamed-echo callers")):  # fmt: skip
            row(key, title, None, "echo calls/s", None, None, "per s", note="skipped: --duration 0")
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("scenario", "value", "baseline", "ratio", "target", "result")
    lines = []
    for r in rows:
        if r["unit"] == "per s":
            v = "n/a" if r["value"] is None else f"{r['value']:,.0f} steps/s"
            b = "n/a" if r["baseline_value"] is None else f"{r['baseline_value']:,.0f} calls/s"
        else:
            v = f"{r['value']['median']:,.1f} µs"
            b = "n/a" if r["baseline_value"] is None else f"{r['baseline_value']['median']:,.1f} µs"
        ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        if r["target"] is None:
            target = "-"
        else:
            target = f"{'≥' if r['target']['op'] == '>=' else '≤'} {r['target']['value']:g}x"
        lines.append((r["title"], v, b, ratio, target, r["result"]))
    return render(header, lines)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rpc_bench.py",
        description=(
            "Time kvmem's Step (256 decode allocs, one session) over the unix socket, on the client's "
            "step stream (the default) and as a unary call, against a bare gRPC echo of the same sizes "
            "through a server set up the same way, unary and streamed (a ping-pong on one stream), and "
            "against the reference allocator's 256 alloc() calls in-process; then N client processes "
            "stepping (streamed) against the same processes calling the unary and the streamed echo. "
            "Starts and stops both servers itself. Ratios compare figures measured in this same run "
            "(medians, interleaved)."
        ),
        epilog=(
            "Targets: the streamed Step <= 0.9x the unary echo round trip; the unary Step <= 1.2x the "
            "unary echo; the streamed Step <= 0.25x the reference's in-process time; N clients' aggregate "
            "steps/s >= 0.8x the unary echo's calls/s. Info rows (no target): the streamed Step vs the "
            "streamed echo, the streamed echo vs the unary echo, N clients vs N streamed-echo callers. "
            "Exit status 0 even on MISS (a measurement, not a test) unless --strict; 2 if a check, a "
            "server or a client process fails."
        ),
    )
    parser.add_argument("--reps", type=int, default=3000, metavar="N",
                        help="timed repetitions of scenarios 1-2 (each of the four round trips; the reference "
                        "1 per --ref-every), after the warm-up "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=50, metavar="N",
                        help="untimed repetitions first (default: %(default)s)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=25.0, metavar="S",
                        help=f"stop scenarios 1-2 after about S seconds even if fewer than --reps ran (at least "
                        f"{MIN_REPS} always run) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--ref-every", type=int, default=2, metavar="K",
                        help="time the reference 1 time per K round-trip repetitions (it is the slowest "
                        "contender) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--cpu-window", type=float, default=0.5, metavar="S",
                        help="after the timed loop, each round trip alone for S seconds to measure CPU per call "
                        "(server and this process); 0 skips it (default: %(default)s)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=2.0, metavar="S",
                        help="seconds per throughput window; 0 skips the throughput scenario "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--blocks", type=int, default=3, metavar="K",
                        help=f"blocks of {len(WINDOWS)} throughput windows ({', '.join(WINDOWS)}); a ratio is the "
                        "median over blocks of each block's ratio (default: %(default)s)")  # fmt: skip
    parser.add_argument("--clients", type=int, default=8, metavar="N",
                        help=f"client processes in the throughput scenario; each session opens {NUM_REQUESTS}/N "
                        "requests (default: %(default)s)")  # fmt: skip
    parser.add_argument("--start-method", choices=("forkserver", "spawn"), default="forkserver",
                        help="how the client processes start: 'forkserver' forks them from one fresh interpreter "
                        "that imported torch and the client once (no gRPC channel exists there before the fork); "
                        "'spawn' starts each as a fresh interpreter, slower to start on a loaded machine "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--truncate-every", type=int, default=32, metavar="K",
                        help="truncate the requests back to their starting lengths every K steps "
                        "(untimed in scenario 1; folded into the K-th Step in scenario 3) "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--reference", metavar="PATH", default=None,
                        help=f"the reference allocator file (default: {default_reference_path()}); when absent, "
                        "the reference comparison is skipped with a note")  # fmt: skip
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="emit the figures and machine info as one JSON object: on stdout instead of "
                        "the table, or into PATH with the table still printed")  # fmt: skip
    parser.add_argument("--strict", action="store_true", help="exit 1 if any target is missed")
    parser.add_argument(
        "--keep-state",
        action="store_true",
        help="run the kvmem server with --keep-state (its kept state in /dev/shm, removed at the end)",
    )
    args = parser.parse_args(argv)
    if (args.reps < 1 or args.warmup < 0 or args.duration < 0 or args.truncate_every < 1 or args.ref_every < 1
            or args.blocks < 1):  # fmt: skip
        parser.error("--reps, --ref-every, --truncate-every and --blocks must be >= 1, --warmup and --duration >= 0")
    if args.budget <= 0 or args.cpu_window < 0:
        parser.error("--budget must be > 0, --cpu-window >= 0")
    if not 1 <= args.clients <= NUM_REQUESTS:
        parser.error(f"--clients must be in [1, {NUM_REQUESTS}]")
    to_stdout = args.json == "-"

    t_start = time.monotonic()

    def say(*a: Any) -> None:
        # Never raises: a closed stderr (``... 2>&1 | head``) must not skip stopping the servers.
        with contextlib.suppress(OSError, ValueError):
            print(f"[{time.monotonic() - t_start:5.1f}s]", *a, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, _raise_interrupt)  # so the servers are stopped on SIGTERM too
    ref = load_reference(args.reference)
    if not ref.available:
        say(f"NOTE: {ref.note}; the reference comparison is skipped (pass --reference PATH).")
    if os.environ.get("KVMEM_DEBUG", "") not in ("", "0"):
        say("NOTE: KVMEM_DEBUG is set here; the benchmark's servers run without it.")

    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    servers = Servers(NUM_PAGES, keep_state=args.keep_state)
    workers = None
    thr = None
    try:
        say(f"starting the kvmem and echo servers under {servers.dir} ...")
        if args.duration > 0:
            say(f"spawning {args.clients} client processes ({NUM_REQUESTS // args.clients} requests each) ...")
            workers = Workers(servers, args.clients, args.duration, args.blocks, args.truncate_every,
                              args.start_method)  # fmt: skip
        servers.start()
        if workers is not None:
            workers.wait_imported()  # nothing of theirs runs while scenarios 1-2 are timed
        say("scenarios 1-2: Step (streamed, unary) vs echo (unary, streamed) vs reference, interleaved")
        lat = scenario_latency(servers, ref, args.reps, args.warmup, args.budget, args.ref_every,
                               args.truncate_every, args.cpu_window, say)  # fmt: skip
        if workers is not None:
            say(f"scenario 3: {args.clients} clients vs {args.clients} echo callers (unary, streamed), "
                f"{args.blocks} blocks of {len(WINDOWS)} windows of {args.duration:g} s")  # fmt: skip
            thr = scenario_clients(workers, say)
        servers.check_alive()
    except BenchFailed as exc:
        say(f"FAILED: {exc}")
        return 2
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    finally:
        if workers is not None:
            workers.stop()
        say("stopping the servers (SIGTERM) ...")
        codes = servers.stop()
        say("stopped")
        if any(c not in (0, None) for c in codes.values()):
            say(f"NOTE: server exit codes on SIGTERM: {codes}")
    elapsed = time.perf_counter() - started

    rows = build_rows(lat, thr, ref)
    info = machine_info()
    info["load_average_1m_at_start"] = None if load_before is None else round(load_before, 2)
    report = {
        "benchmark": "kvmem rpc_bench",
        "statistic": "latency rows: medians (µs) of interleaved repetitions, ratio = median / median "
        "(ratio_of_min uses minima); throughput rows: rates are means over windows of the summed per-process "
        f"rates, the ratio the median over blocks ({', '.join(WINDOWS)}) of the block's ratio of mean rates",
        "config": {
            "page_size": PAGE_SIZE,
            "num_requests": NUM_REQUESTS,
            "server": {
                "num_pages": NUM_PAGES,
                "max_requests": RPC_MAX_REQUESTS,
                "max_context_len": MAX_CONTEXT_LEN,
                "kvmem_debug": False,
                "memory_backend": lat["memory_backend"],
            },
            "contenders": {
                "step": "KVMemClient(step_stream=True), the default: Steps on one long-lived StepStream",
                "step_unary": "KVMemClient(step_stream=False): the unary Step call, a second session",
                "echo": f"unary {ECHO_METHOD}, bytes sized as the step's",
                "echo_stream": f"{ECHO_STREAM_METHOD}: one message each way per call on one long-lived stream",
            },
            "decode_lens": f"{DECODE_BASE_LEN} + i % {PAGE_SIZE} (1 in {PAGE_SIZE} takes a new page per step)",
            "reps_asked": args.reps,
            "reps_run": lat["reps"],
            "reference_every": args.ref_every,
            "budget_s": args.budget,
            "warmup": args.warmup,
            "truncate_every": args.truncate_every,
            "cpu_window_s": args.cpu_window,
            "step_request_bytes": lat["request_bytes"],
            "step_response_bytes": lat["response_bytes"],
            "unary_step_request_bytes": lat["unary_request_bytes"],
            "unary_step_response_bytes": lat["unary_response_bytes"],
        },
        "reference": {
            "path": str(ref.path),
            "available": ref.available,
            "note": ref.note if not ref.available else "CPU, pin_memory patched out at construction",
        },
        "checked": lat["checked"],
        "cpu_per_call": {"round_trips": lat["cpu_per_call"], "note": lat["cpu_note"]},
        "throughput": thr,
        "machine": info,
        "elapsed_s": round(elapsed, 1),
        "scenarios": rows,
        "all_pass": all(r["result"] != "MISS" for r in rows),  # info rows have no target
    }

    if to_stdout:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        t = lat["times"]
        print(
            f"kvmem rpc benchmark -- python {info['python']}, grpc {info['grpc']}, protobuf {info['protobuf']}, "
            f"numpy {info['numpy']}, {info['cpus_usable']}/{info['cpu_count']} cpus; medians of {lat['reps']} "
            f"interleaved reps (the reference 1 per {args.ref_every}); load average {info['load_average_1m_at_start']} "
            f"at start, {info['load_average_1m']} at end; server memory backend {lat['memory_backend']}"
        )
        print()
        print(format_table(rows))
        print()
        print(
            f"Step request {lat['request_bytes']} B, response {lat['response_bytes']} B (the unary session's "
            f"{lat['unary_request_bytes']} B / {lat['unary_response_bytes']} B); both echoes send and return "
            f"{lat['request_bytes']} B / {lat['response_bytes']} B."
        )
        cpu = lat["cpu_per_call"]
        for name, s in t.items():
            line = (
                f"  {name:>11}: median {s['median']:8.1f} µs   min {s['min']:8.1f}   "
                f"p10 {s['p10']:8.1f}   p90 {s['p90']:8.1f}"
            )
            c = cpu.get(name)
            if c is not None and None not in (c["server_cpu_us_per_call"], c["client_cpu_us_per_call"]):
                line += (
                    f"   CPU per call: {c['server']} server {c['server_cpu_us_per_call']:4.0f} µs, "
                    f"client {c['client_cpu_us_per_call']:4.0f} µs"
                )
            print(line)
        if cpu:
            print(f"  (CPU: each round trip alone for {args.cpu_window:g} s after the timed loop; /proc, process time)")
        if thr is not None:
            wins = ", ".join(f"{w['phase']} {w['per_s']:,.0f}/s" for w in thr["windows"])
            print(
                f"throughput: {thr['clients']} client processes ({thr['start_method']}), each with its own "
                f"session of {thr['requests_per_client']} requests stepping on its step stream, Step request "
                f"{thr['request_bytes']} B / response {thr['response_bytes']} B; windows of "
                f"{thr['duration_s_per_window']:g} s: {wins}; {thr['kvmem_allocs_per_s']:,.0f} allocs/s"
            )
            print(
                "  ratio per block, kvmem / unary echo: "
                + ", ".join(f"{r:.2f}" for r in thr["block_ratios"])
                + f"; median {thr['ratio']:.2f}. kvmem / streamed echo: "
                + ", ".join(f"{r:.2f}" for r in thr["block_ratios_vs_echo_stream"])
                + f"; median {thr['ratio_vs_echo_stream']:.2f}"
            )
            scpu, ccpu = thr["server_cpu_us_per_call"], thr["client_cpu_us_per_call"]
            labels = {"kvmem": "Step (streamed)", "echo": "unary echo", "echo_stream": "streamed echo"}
            parts = [
                f"{label} server {scpu[name]:.0f} µs / client {ccpu[name]:.0f} µs"
                for name, label in labels.items()
                if scpu[name] is not None and ccpu[name] is not None
            ]
            if parts:
                print("  CPU per call: " + "; ".join(parts))
        if ref.available:
            print(f"reference: {ref.path} (CPU, pin_memory patched out; on a GPU it would cost more).")
        print(f"checked: {lat['checked']}")
        print(f"total {elapsed:.1f} s")
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
            print(f"JSON written to {args.json}")
    if args.strict and not report["all_pass"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
