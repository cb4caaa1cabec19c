#!/usr/bin/env python3
"""Benchmark kvmem's Step over gRPC against a bare gRPC echo and the reference allocator.

Scenarios (pages of 16 tokens; decode requests hold 100 + i % 16 tokens, so 1 in 16
crosses a page boundary and takes a new page each step, as in a real decode batch):

1. step      -- one ``KVMemClient.step`` allocating 1 token to each of 256 open requests
                of one session, over the unix socket, against a kvmem server started
                as a subprocess (``python -m kvmem.server.cli serve``, KVMEM_DEBUG
                unset). Timed: the whole client call (request building, the round
                trip, the server's work, the response views).
   baseline  -- a bare gRPC echo through a server set up the same way
                (``bench/_echo_server.py``: grpc.aio on uvloop, one loop, unix socket,
                the same server and channel options), bytes in and bytes out: the
                request the size of the serialised StepRequest, the reply the size of
                the StepResponse. Target: step <= 1.5x echo.
2. reference -- the reference allocator in-process for the same work: 256
                ``alloc(req, 1, alloced_len)``. Target: kvmem's step round trip <= 0.25x.
3. clients   -- N client processes (default 8; forked from a fresh forkserver, or spawned
                with ``--start-method spawn``), each with its own session of
                256 / N requests (the server's 256 request slots are shared by all
                sessions), stepping 1 token per request for ``--duration`` seconds after a
                barrier; against the same N processes calling the echo (sized like their
                own step) for as long. Windows run in blocks of kvmem, echo, echo, kvmem
                (``--blocks`` of them, default 3), so that drift within a block hits both
                alike; the ratio is the median over blocks of the block's ratio, so that
                one block disturbed by a neighbour on a shared machine does not decide it.
                Target: aggregate steps/s >= 0.7x echo calls/s.

Scenarios 1 and 2 run interleaved with the garbage collector off: blocks of 32
back-to-back repetitions of Step and echo (order alternating), each block opened by one
untimed call of each (so neither pays a server's wake-up after the in-process work) and
followed by a few repetitions of the reference. Ratios are of medians measured in this
same run (the machine's cores are shared and noisy: absolute times drift, ratios much
less). Every ``--truncate-every`` steps (default 32) the kvmem requests are truncated
back to their starting lengths outside the timed region, so the pool never runs out;
the reference gives back the page each boundary-crosser took after every repetition,
untimed. Before timing, the first step's ``kv_loc`` is checked against the reference's
for the same work on a fresh pool (same page ids). The server processes' CPU time per
call (from /proc) is reported beside the round trips: on a shared machine it tells
where the time goes more steadily than wall time does.

The reference runs on the CPU (its ``pin_memory=True`` is patched out at construction,
see ``bench/_reference.py``); on a GPU it would also pay a ``.item()`` sync and a
host-to-device copy per call.

Both servers are stopped with SIGTERM when the benchmark ends, fails or is interrupted.
Exit status: 0 (a measurement, not a test) unless ``--strict`` and a target is missed
(1), or a correctness check or a server fails (2).
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
from _echo_server import payload as echo_payload  # noqa: E402
from _reference import Reference, default_reference_path, load_reference  # noqa: E402
from _table import render  # noqa: E402

PAGE_SIZE = 16
NUM_REQUESTS = 256
MAX_REQUESTS = 256  # the server's request slots, shared by every session
MAX_CONTEXT_LEN = 4096
NUM_PAGES = 8192  # 256 requests x at most (115 + truncate_every) tokens fit many times over
DECODE_BASE_LEN = 100  # request i holds 100 + i % 16 tokens
CALL_TIMEOUT_S = 10.0  # the client's default per-call deadline, used for the echo too
KVMEM_SERVICE = "kvmem.v1.KVMemory"

TARGETS = {
    # key: (comparison, value, meaning)
    "step_vs_echo": ("<=", 1.5, "kvmem Step round trip / bare gRPC echo round trip"),
    "step_vs_reference": ("<=", 0.25, "kvmem Step round trip / reference in-process"),
    "clients_vs_echo": (">=", 0.7, "kvmem aggregate steps/s / echo aggregate calls/s"),
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

    def __init__(self, num_pages: int) -> None:
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix="kvb", dir="/tmp"))
        self.kv_socket = str(self.dir / "kv.sock")
        self.echo_socket = str(self.dir / "echo.sock")
        self.num_pages = num_pages
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, pathlib.Path] = {}

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}  # KVMEM_DEBUG et al. unset
        kv_cmd = [
            sys.executable, "-m", "kvmem.server.cli", "serve",
            "--socket", self.kv_socket,
            "--num-pages", str(self.num_pages),
            "--page-size", str(PAGE_SIZE),
            "--max-requests", str(MAX_REQUESTS),
            "--max-context", str(MAX_CONTEXT_LEN),
            "--log-level", "warning",
        ]  # fmt: skip
        echo_cmd = [sys.executable, str(BENCH_DIR / "_echo_server.py"), "--socket", self.echo_socket]
        for name, cmd in (("kvmem", kv_cmd), ("echo", echo_cmd)):
            log = self.dir / f"{name}.log"
            self.logs[name] = log
            with open(log, "wb") as out:
                self.procs[name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)
        self._wait_ready("kvmem", self.kv_socket, KVMEM_SERVICE)
        self._wait_ready("echo", self.echo_socket, ECHO_SERVICE)

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


def echo_callable(target: str) -> tuple[Any, Callable[[bytes], bytes]]:
    """A channel to the echo server with the kvmem client's channel options, and a
    unary call on it made the way the kvmem client makes its calls."""
    import grpc

    from kvmem.client.channel import CHANNEL_OPTIONS

    channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    rpc = channel.unary_unary(ECHO_METHOD, _registered_method=True)  # no (de)serialiser: bytes

    def call(data: bytes) -> bytes:
        return rpc(data, timeout=CALL_TIMEOUT_S, metadata=None)

    return channel, call


def step_sizes(client: Any, res: Any, alloc_slots: Any, alloc_needs: Any) -> tuple[int, int]:
    """Serialised sizes of the StepRequest the client sends for this step and of the
    StepResponse it got (rebuilt exactly from the result's views)."""
    from kvmem.client.step import as_ints
    from kvmem.v1 import kvmem_pb2

    req = kvmem_pb2.StepRequest(
        session_id=client.session_id, alloc_slots=as_ints(alloc_slots), alloc_needs=as_ints(alloc_needs)
    )
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
    """A kvmem session with ``n`` open requests at their decode lengths. ``step()`` is
    the timed call; ``after()`` (untimed) checks the result and truncates back every
    ``truncate_every`` steps."""

    def __init__(self, target: str, n: int, truncate_every: int, name: str) -> None:
        import torch

        from kvmem.client import KVMemClient

        self.client = KVMemClient(target, name=name)
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
    back."""

    def __init__(self, name: str, run: Callable[[], Any], after: Callable[[Any], None]) -> None:
        self.name = name
        self.run = run
        self.after = after
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
    say: Callable[..., None],
) -> dict[str, Any]:  # fmt: skip
    import torch

    sess = DecodeSession(f"unix:{servers.kv_socket}", NUM_REQUESTS, truncate_every, "bench")
    echo_channel = None
    try:
        slots = sess.slots.tolist()
        lens = decode_lens(NUM_REQUESTS).tolist()

        # Check the first step on the fresh pool against the reference, and size the echo.
        res = sess.step()
        check(res.ok and res.kv_loc.numel() == NUM_REQUESTS, "first step: not every alloc OK")
        check(torch.equal(res.kv_loc_offsets, torch.arange(NUM_REQUESTS + 1, dtype=torch.int32)), "first step: offsets")
        check(res.new_pages.numel() == NUM_REQUESTS // PAGE_SIZE, "first step: wrong number of new pages")
        checked = "first step: all OK, offsets, one new page per 16 requests"
        if ref.available:
            ra = ref.allocator(num_pages=servers.num_pages, page_size=PAGE_SIZE, max_batch_size=MAX_REQUESTS + 1,
                               max_context_len=MAX_CONTEXT_LEN)  # fmt: skip
            for r, n in zip(slots, lens):
                check(ra.alloc(r, n, 0) is not None, "reference setup alloc failed")
            ref_kv = torch.cat([ra.alloc(r, 1, n) for r, n in zip(slots, lens)])
            check(
                torch.equal(ref_kv.to(torch.int32), res.kv_loc), "first step: kvmem kv_loc differs from the reference's"
            )
            checked += "; kv_loc identical to the reference's"
        req_bytes, resp_bytes = step_sizes(sess.client, res, sess.slots, sess.ones)
        sess.after(res)
        memory_backend = sess.client.stats().memory_backend

        echo_channel, echo = echo_callable(f"unix:{servers.echo_socket}")
        data = echo_payload(req_bytes, resp_bytes)
        check(len(echo(data)) == resp_bytes, "echo: wrong reply size")

        echo_calls_made = [0]

        def echo_after(out: bytes) -> None:
            check(len(out) == resp_bytes, "echo: wrong reply size")
            echo_calls_made[0] += 1

        contenders = [
            Contender("step", sess.step, sess.after),
            Contender("echo", lambda: echo(data), echo_after),
        ]
        local: list[Contender] = []
        if ref.available:
            ra = ref.allocator(num_pages=servers.num_pages, page_size=PAGE_SIZE, max_batch_size=MAX_REQUESTS + 1,
                               max_context_len=MAX_CONTEXT_LEN)  # fmt: skip
            for r, n in zip(slots, lens):
                check(ra.alloc(r, n, 0) is not None, "reference setup alloc failed")
            free_before = len(ra.free_slots)
            crossers = [(r, n) for r, n in zip(slots, lens) if n % PAGE_SIZE == 0]

            def ref_run() -> Any:
                alloc = ra.alloc
                return [alloc(r, 1, n) for r, n in zip(slots, lens)]

            def ref_after(out: Any) -> None:
                check(len(out) == NUM_REQUESTS and all(t is not None for t in out), "reference: an alloc failed")
                for r, n in crossers:  # give back the page each boundary-crosser took
                    ra.free_extra_pages_not_cached(r, n, n + 1)
                ra.free_group_end()

            local.append(Contender("reference", ref_run, ref_after))
        say(f"  timing up to {reps} reps (+{warmup} warm-up, budget {budget_s:g} s) of: "
            f"{', '.join(c.name for c in contenders + local)}")  # fmt: skip
        calls0 = sess.num_calls
        echo0 = echo_calls_made[0]
        cpu0 = servers.cpu_s()
        kept = measure(contenders, local, reps, ref_every, warmup, budget_s, servers)
        cpu1 = servers.cpu_s()
        step_calls = sess.num_calls - calls0
        echo_calls = echo_calls_made[0] - echo0
        if ref.available:
            check(len(ra.free_slots) == free_before, "reference leaked pages while timing")
        return {
            "reps": kept,
            "memory_backend": memory_backend,
            "server_cpu_us_per_call": {
                "kvmem_step": cpu_per_call_us(cpu0, cpu1, "kvmem", step_calls),
                "echo": cpu_per_call_us(cpu0, cpu1, "echo", echo_calls),
                "note": "server process CPU (user+system, /proc) over the timed loop / calls; the kvmem "
                f"figure counts the untimed truncate Steps too (1 per {truncate_every})",
            },
            "times": {c.name: summary(c.times_us) for c in contenders + local},
            "request_bytes": req_bytes,
            "response_bytes": resp_bytes,
            "checked": checked,
        }
    finally:
        if echo_channel is not None:
            echo_channel.close()
        sess.close()  # frees the 256 request slots for scenario 3


# ----------------------------------------------------------------------- scenario 3

WINDOWS = ("kvmem", "echo", "echo", "kvmem")  # one block of throughput windows


def _worker(
    idx: int, kv_target: str, echo_target: str, n: int, duration: float, truncate_every: int,
    phases: tuple[str, ...], go: Any, barrier: Any, results: Any,
) -> None:  # fmt: skip
    """One client process: its own session of ``n`` requests and its own echo channel.
    It imports what it needs, reports, and waits for ``go`` (the parent times scenarios
    1-2 meanwhile, with the request slots all taken). Then per phase: wait on the
    barrier, call for ``duration`` seconds, report the count."""
    sess = None
    echo_channel = None
    try:
        import torch  # noqa: F401 - the slow imports, done before the parent starts timing

        import kvmem.client.sync  # noqa: F401

        results.put(("imported", idx))
        if not go.wait(timeout=600):
            return
        sess = DecodeSession(kv_target, n, truncate_every, f"w{idx}")
        res = sess.step_folding_truncate()
        check(res.ok, f"worker {idx}: first step failed")
        req_bytes, resp_bytes = step_sizes(sess.client, res, sess.slots, sess.ones)
        echo_channel, echo = echo_callable(echo_target)
        data = echo_payload(req_bytes, resp_bytes)
        for _ in range(30):  # warm both channels up
            check(sess.step_folding_truncate().ok, f"worker {idx}: warm-up step failed")
            echo(data)
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
                while clock() < end:
                    echo(data)
                    count += 1
            elapsed = clock() - t0
            results.put(("phase", idx, phase, count, elapsed, time.process_time() - c0))
            gc.collect()
        barrier.wait(timeout=120)
    except BaseException:  # noqa: BLE001 - reported to the parent, which aborts
        with contextlib.suppress(Exception):
            barrier.abort()
        results.put(("error", idx, traceback.format_exc()))
    finally:
        if echo_channel is not None:
            with contextlib.suppress(Exception):
                echo_channel.close()
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
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(i, f"unix:{servers.kv_socket}", f"unix:{servers.echo_socket}", self.n, duration,
                      truncate_every, self.phases, self.go, self.barrier, self.results),
                daemon=True,
            )  # fmt: skip
            for i in range(clients)
        ]
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
    server_name = {"kvmem": "kvmem", "echo": "echo"}
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
            "server_cpu_us_per_call": cpu_per_call_us(cpu0, cpu1, server_name[phase], calls),
            "client_cpu_us_per_call": sum(m[5] for m in got) / calls * 1e6 if calls else None,
        })  # fmt: skip
        say(f"    {phase:>5}: {rate:,.0f}/s")
    workers.barrier.wait(timeout=60)
    for p in workers.procs:
        p.join(timeout=30)
    def mean_of(name: str, key: str) -> float | None:
        vals = [ph[key] for ph in per_phase if ph["phase"] == name and ph[key] is not None]
        return statistics.mean(vals) if vals else None

    rates = {name: mean_of(name, "per_s") for name in ("kvmem", "echo")}
    # Per block: mean kvmem rate / mean echo rate of its four windows (seconds apart);
    # the median over blocks is the figure of record.
    size = len(WINDOWS)
    block_ratios = []
    for b in range(0, len(per_phase), size):
        block = per_phase[b : b + size]
        kv = statistics.mean(w["per_s"] for w in block if w["phase"] == "kvmem")
        echo = statistics.mean(w["per_s"] for w in block if w["phase"] == "echo")
        block_ratios.append(kv / echo)
    return {
        "clients": clients,
        "start_method": workers.start_method,
        "requests_per_client": n,
        "duration_s_per_window": duration,
        "windows": per_phase,
        "block_ratios": block_ratios,
        "ratio": statistics.median(block_ratios),
        "kvmem_steps_per_s": rates["kvmem"],
        "kvmem_allocs_per_s": rates["kvmem"] * n,
        "echo_calls_per_s": rates["echo"],
        "server_cpu_us_per_call": {name: mean_of(name, "server_cpu_us_per_call") for name in ("kvmem", "echo")},
        "client_cpu_us_per_call": {name: mean_of(name, "client_cpu_us_per_call") for name in ("kvmem", "echo")},
        "request_bytes": sizes[0]["request_bytes"],
        "response_bytes": sizes[0]["response_bytes"],
    }


# --------------------------------------------------------------------------- report


def verdict(key: str, ratio: float | None) -> str:
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
        commit = subprocess.run(
            ["git", "-C", str(BENCH_DIR.parent), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
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
    t = lat["times"]
    step, echo = t["step"], t["echo"]
    rows: list[dict[str, Any]] = []

    def row(key: str, title: str, value: Any, baseline_name: str, baseline: Any, ratio: float | None,
            unit: str, note: str | None = None, **extra: Any) -> None:  # fmt: skip
        op, target, meaning = TARGETS[key]
        rows.append({
            "scenario": key, "title": title, "unit": unit, "value": value, "baseline": baseline_name,
            "baseline_value": baseline, "ratio": ratio, "target": {"op": op, "value": target, "ratio_is": meaning},
            "result": verdict(key, ratio), "note": note, **extra,
        })  # fmt: skip

    row("step_vs_echo", f"Step, {NUM_REQUESTS} decode allocs, vs gRPC echo", step, "bare gRPC echo", echo,
        step["median"] / echo["median"], "µs round trip", ratio_of_min=step["min"] / echo["min"])  # fmt: skip
    if "reference" in t:
        rf = t["reference"]
        row("step_vs_reference", f"Step vs reference, {NUM_REQUESTS} alloc() in-process", step, "reference allocator",
            rf, step["median"] / rf["median"], "µs", ratio_of_min=step["min"] / rf["min"])  # fmt: skip
    else:
        row("step_vs_reference", f"Step vs reference, {NUM_REQUESTS} alloc() in-process", step, "reference allocator",
            None, None, "µs", note=f"skipped: {ref.note}")  # fmt: skip
    if thr is not None:
        row("clients_vs_echo", f"{thr['clients']} clients x {thr['requests_per_client']} req, aggregate",
            thr["kvmem_steps_per_s"], "echo calls/s, same processes", thr["echo_calls_per_s"],
            thr["ratio"], "per s")  # fmt: skip
    else:
        row("clients_vs_echo", "N clients, aggregate", None, "echo calls/s", None, None, "per s",
            note="skipped: --duration 0")  # fmt: skip
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
        op = "≥" if r["target"]["op"] == ">=" else "≤"
        lines.append((r["title"], v, b, ratio, f"{op} {r['target']['value']:g}x", r["result"]))
    return render(header, lines)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rpc_bench.py",
        description=(
            "Time kvmem's Step (256 decode allocs, one session) over the unix socket against a bare "
            "gRPC echo of the same sizes through a server set up the same way, and against the "
            "reference allocator's 256 alloc() calls in-process; then N client processes stepping "
            "against N processes calling the echo. Starts and stops both servers itself. Ratios "
            "compare figures measured in this same run (medians, interleaved)."
        ),
        epilog=(
            "Targets: Step <= 1.5x the echo round trip; Step <= 0.25x the reference's in-process "
            "time; N clients' aggregate steps/s >= 0.7x the echo's calls/s. Exit status 0 even on "
            "MISS (a measurement, not a test) unless --strict; 2 if a check, a server or a client "
            "process fails."
        ),
    )
    parser.add_argument("--reps", type=int, default=3000, metavar="N",
                        help="timed repetitions of scenarios 1-2, each contender, after the warm-up "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=50, metavar="N",
                        help="untimed repetitions first (default: %(default)s)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=25.0, metavar="S",
                        help=f"stop scenarios 1-2 after about S seconds even if fewer than --reps ran (at least "
                        f"{MIN_REPS} always run) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--ref-every", type=int, default=2, metavar="K",
                        help="time the reference 1 time per K round-trip repetitions (it is the slowest "
                        "contender) (default: %(default)s)")  # fmt: skip
    parser.add_argument("--duration", type=float, default=2.0, metavar="S",
                        help="seconds per throughput window; 0 skips the throughput scenario "
                        "(default: %(default)s)")  # fmt: skip
    parser.add_argument("--blocks", type=int, default=3, metavar="K",
                        help="blocks of 4 throughput windows (kvmem, echo, echo, kvmem); the ratio is the "
                        "median over blocks of each block's ratio (default: %(default)s)")  # fmt: skip
    parser.add_argument("--clients", type=int, default=8, metavar="N",
                        help=f"client processes in the throughput scenario; each session opens {NUM_REQUESTS}/N "
                        f"requests, since the server's {MAX_REQUESTS} request slots are shared "
                        "(default: %(default)s)")  # fmt: skip
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
    args = parser.parse_args(argv)
    if (args.reps < 1 or args.warmup < 0 or args.duration < 0 or args.truncate_every < 1 or args.ref_every < 1
            or args.blocks < 1):  # fmt: skip
        parser.error("--reps, --ref-every, --truncate-every and --blocks must be >= 1, --warmup and --duration >= 0")
    if args.budget <= 0:
        parser.error("--budget must be > 0")
    if not 1 <= args.clients <= NUM_REQUESTS:
        parser.error(f"--clients must be in [1, {NUM_REQUESTS}]")
    to_stdout = args.json == "-"

    t_start = time.monotonic()

    def say(*a: Any) -> None:
        print(f"[{time.monotonic() - t_start:5.1f}s]", *a, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, _raise_interrupt)  # so the servers are stopped on SIGTERM too
    ref = load_reference(args.reference)
    if not ref.available:
        say(f"NOTE: {ref.note}; the reference comparison is skipped (pass --reference PATH).")
    if os.environ.get("KVMEM_DEBUG", "") not in ("", "0"):
        say("NOTE: KVMEM_DEBUG is set here; the benchmark's servers run without it.")

    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    servers = Servers(NUM_PAGES)
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
        say("scenarios 1-2: Step vs echo vs reference, interleaved")
        lat = scenario_latency(servers, ref, args.reps, args.warmup, args.budget, args.ref_every,
                               args.truncate_every, say)  # fmt: skip
        if workers is not None:
            say(f"scenario 3: {args.clients} clients vs {args.clients} echo callers, {args.blocks} blocks of 4 "
                f"windows of {args.duration:g} s")  # fmt: skip
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
        "(ratio_of_min uses minima); throughput row: rates are means over windows of the summed per-process "
        "rates, the ratio the median over blocks (kvmem, echo, echo, kvmem) of the block's mean ratio",
        "config": {
            "page_size": PAGE_SIZE,
            "num_requests": NUM_REQUESTS,
            "server": {"num_pages": NUM_PAGES, "max_requests": MAX_REQUESTS, "max_context_len": MAX_CONTEXT_LEN,
                       "kvmem_debug": False, "memory_backend": lat["memory_backend"]},  # fmt: skip
            "decode_lens": f"{DECODE_BASE_LEN} + i % {PAGE_SIZE} (1 in {PAGE_SIZE} takes a new page per step)",
            "reps_asked": args.reps,
            "reps_run": lat["reps"],
            "reference_every": args.ref_every,
            "budget_s": args.budget,
            "warmup": args.warmup,
            "truncate_every": args.truncate_every,
            "step_request_bytes": lat["request_bytes"],
            "step_response_bytes": lat["response_bytes"],
        },
        "reference": {
            "path": str(ref.path),
            "available": ref.available,
            "note": ref.note if not ref.available else "CPU, pin_memory patched out at construction",
        },
        "checked": lat["checked"],
        "throughput": thr,
        "machine": info,
        "elapsed_s": round(elapsed, 1),
        "scenarios": rows,
        "all_pass": all(r["result"] != "MISS" for r in rows),
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
            f"Step request {lat['request_bytes']} B, response {lat['response_bytes']} B; "
            "the echo sends and returns as many."
        )
        for name, s in t.items():
            print(
                f"  {name:>9}: median {s['median']:8.1f} µs   min {s['min']:8.1f}   "
                f"p10 {s['p10']:8.1f}   p90 {s['p90']:8.1f}"
            )
        sc = lat["server_cpu_us_per_call"]
        if sc["kvmem_step"] is not None and sc["echo"] is not None:
            print(
                f"server CPU per call: Step {sc['kvmem_step']:.0f} µs, echo {sc['echo']:.0f} µs "
                "(/proc, whole timed loop)"
            )
        if thr is not None:
            wins = ", ".join(f"{w['phase']} {w['per_s']:,.0f}/s" for w in thr["windows"])
            print(
                f"throughput: {thr['clients']} client processes ({thr['start_method']}), each with its own "
                f"session of {thr['requests_per_client']} requests "
                f"({MAX_REQUESTS} slots shared), Step request {thr['request_bytes']} B / response "
                f"{thr['response_bytes']} B; windows of {thr['duration_s_per_window']:g} s: {wins}; "
                f"{thr['kvmem_allocs_per_s']:,.0f} allocs/s"
            )
            print(
                "  ratio per block (kvmem / echo): "
                + ", ".join(f"{r:.2f}" for r in thr["block_ratios"])
                + f"; median {thr['ratio']:.2f}"
            )
            scpu, ccpu = thr["server_cpu_us_per_call"], thr["client_cpu_us_per_call"]
            if None not in (scpu["kvmem"], scpu["echo"], ccpu["kvmem"], ccpu["echo"]):
                print(
                    f"  CPU per call: server Step {scpu['kvmem']:.0f} µs vs echo {scpu['echo']:.0f} µs; "
                    f"client Step {ccpu['kvmem']:.0f} µs vs echo {ccpu['echo']:.0f} µs"
                )
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
