#!/usr/bin/env python3
"""The fault run: scheduler processes writing and verifying KV under kills, stops and
server restarts (issue 11, "The reliability record").

    .venv/bin/python bench/fault_run.py                 # the default run: about 7 minutes
    .venv/bin/python bench/fault_run.py --duration 60   # a short one

What it starts (all in temporary directories, all removed at the end, also on Ctrl-C):

- one ``kvmem serve`` (shm backend, a unix socket, ``KVMEM_DEBUG=1`` so that the server
  audits the whole pool after every step; a short lease, ``--lease-ms`` 1000, and a
  quarantine of a few leases, ``--quarantine-ms`` 5000; pages of 16 tokens, a pool small
  enough that the workers run out of pages now and then; a KV layout of float32 rows of 8
  so every token's pattern is exact);
- ``--workers`` (16) scheduler processes (``bench/_fault_worker.py``), each with its own
  session of ``--requests`` (4) requests: prefill and decode steps in batches, a
  speculative truncate now and then, requests released when done and new ones opened.
  For every token a Step hands over, a worker writes a pattern derived from its worker
  id, its process, the request and the token's position into K and V of every layer at
  the token's ``kv_loc`` -- right after checking that ``kv.lease_remaining()`` exceeds
  ``--margin-ms`` (the documented discipline; a failed check skips the write and drops
  those requests). Every few steps, and before releasing a request, it reads back all
  its written tokens: a difference seen while its lease is known to hold is a *foreign
  write* (someone wrote into a page it holds), reported with the page, the position and
  whose pattern was found there; it also checks that each request's block-table row
  (mapped read-only) lists the pages its ``kv_loc`` lie in. On SessionLost, Unavailable or a missed deadline it
  follows the recovery recipe: drop the views, attach again (a new session; retried while
  the server is away), map the memory again, open new requests.

What the driver does, on a random schedule (``--seed``), for ``--duration`` seconds:

- SIGKILLs a running worker (every ``--kill-every`` s on average) and starts a new one in
  its place; it polls Stats until that session is gone: the *reclaim latency*;
- SIGSTOPs a running worker (every ``--stop-every`` s on average) for ``--stop-min-ms``
  to ``--stop-max-ms`` -- past its lease (the server ends the session and quarantines
  its pages) but well within the quarantine -- then SIGCONTs it. What the resumed worker
  ran into is recorded: a Step answer withheld by the client (SessionLost: it arrived
  past the lease), a write skipped by the lease check, a write that landed just after the
  lease (stopped between the check and the write: the documented window, harmless while
  the quarantine holds), a read-back discarded, or SessionLost at its next call;
- restarts the server ``--restarts`` times, evenly spread: SIGKILL, then a new server
  on the same socket and shm directory (a new epoch); every worker must come back;
- runs Stats with the full audit every ``--audit-every`` s.

At the end: every stopped worker is resumed, every worker verifies and releases all its
requests and stays attached, idle; the driver waits for the quarantines to end, then
Stats(audit=True) must show every page free (*pages lost* = total - free) and the
audit ok. Then ``--stopped-at-sigterm`` (2) workers are stopped and the server gets
SIGTERM with every session still attached: the time to its exit is measured (its drain
period, 1 s by default, is part of it). The workers are told to exit and are reaped.

Exit status: 0 when no page was lost, no foreign write was seen, no block-table row
disagreed with its request's ``kv_loc``, every audit passed, no
worker failed in a way no fault explains, and the server exited 0 after SIGTERM; 1
otherwise; 2 if the run could not be carried out (the server would not start, ...);
130 when interrupted. ``--json`` prints the figures as JSON (on stdout instead of the
table, or into a file with the table still printed). Progress goes to stderr.

Timing on the 2-core development machine (shared: load average 8-35 during the runs):
10-20 s to start 16 workers (each imports torch), ``--duration`` (default 360 s) of
faults, a few seconds to drain, audit and SIGTERM: about 6.5 minutes in all. The
reclaim latency after a SIGKILL is given three ways: by polling Stats (every 5 ms, so it
includes a Stats round trip), by the server's own log line saying the session ended,
and from the moment the driver reaped the killed process (waitpid) to that log line --
the kernel tears a process down (unmaps its memory: torch's is large) before its socket
closes, which on this machine takes a few hundred ms of the first two figures.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import queue
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

BENCH_DIR = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
from _table import render  # noqa: E402

WORKER = BENCH_DIR / "_fault_worker.py"
READINESS = "kvmem.v1.KVMemory"
# What a SessionLost or Unavailable of a resumed worker says happened, best first.
OUTCOME_ORDER = ("withheld", "skip", "late_write", "verify_discarded", "lost")


class RunFailed(Exception):
    """The run could not be carried out (not a finding about kvmem)."""


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def adoptions(log_paths: list[str]) -> dict[str, Any]:
    """What the servers' ``--keep-state`` lines say: how many starts adopted a state,
    how many of those repaired something (and what), the longest adoption."""
    adopted, repaired, ms, what = 0, 0, [], []
    resumed = not_resumed = undone = 0
    for path in log_paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                resumed += "session resumed name=" in line
                not_resumed += "why=not resumed in time" in line
                if "--keep-state: adopted" not in line:
                    continue
                undone += "cut by the crash was undone" in line
                adopted += 1
                if "nothing to repair" not in line:
                    repaired += 1
                    what.append(line.split("repaired: ", 1)[-1].split(", in ")[0].strip())
                found = re.search(r", in (\d+) ms from", line)
                if found:
                    ms.append(int(found.group(1)))
    return {"adopted": adopted, "repaired": repaired, "ms_max": max(ms) if ms else None, "repairs": what,
            "sessions_resumed": resumed, "sessions_not_resumed": not_resumed, "steps_undone": undone}  # fmt: skip


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) by linear interpolation; None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def log_lines(path: str) -> list[tuple[float, str]]:
    """(wall-clock seconds, text) of each line of a server log (``kvmem serve`` stamps
    its lines in UTC, to the millisecond)."""
    out = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    stamp = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
                except ValueError:
                    continue
                out.append((stamp.replace(tzinfo=datetime.UTC).timestamp(), line[24:].rstrip("\n")))
    except OSError:
        pass
    return out


# ------------------------------------------------------------------- the server


class Server:
    """``kvmem serve`` on a fixed socket and shm directory; restartable. It runs under
    a two-line shim that asks the kernel to kill it if the driver dies (PR_SET_PDEATHSIG
    survives the exec)."""

    SHIM = (
        "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
        "os.getppid() == 1 and sys.exit(1); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )

    def __init__(self, args: argparse.Namespace, socket_path: str, shm_dir: str, log_dir: str) -> None:
        self.socket_path = socket_path
        self.target = f"unix:{socket_path}"
        self.log_dir = log_dir
        self.args_list = [
            "-m", "kvmem.cli", "serve", "--socket", socket_path, "--device", "cpu", "--shm-dir", shm_dir,
            "--page-size", str(args.page_size), "--num-pages", str(args.num_pages),
            "--max-requests", str(args.max_requests), "--max-context", str(args.max_context),
            "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--dtype", "float32",
            "--lease-ms", str(args.lease_ms), "--quarantine-ms", str(args.quarantine_ms),
            *(["--keep-state"] if args.keep_state else []),
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.log_path = ""
        self.log_paths: list[str] = []
        # Reconnect within 50-250 ms after a restart (gRPC's default backoff starts at 1 s).
        self.channel = grpc.insecure_channel(
            self.target,
            options=[
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.min_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 250),
            ],
        )
        self.stub = kvmem_pb2_grpc.KVMemoryStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def start(self, timeout: float = 60.0) -> float:
        """Start and wait until it is ready; returns the monotonic time it was."""
        self.runs += 1
        self.log_path = os.path.join(self.log_dir, f"server-{self.runs}.log")
        self.log_paths.append(self.log_path)
        env = dict(os.environ, KVMEM_DEBUG="1")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", self.SHIM, *self.args_list],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RunFailed(f"the server exited {self.proc.returncode} at start:\n{self.log_tail()}")
            try:
                status = self.health.Check(health_pb2.HealthCheckRequest(service=READINESS), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic()
            except grpc.RpcError:
                pass
            time.sleep(0.02)
        raise RunFailed(f"the server was not ready within {timeout:g} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stats(self, audit: bool = False, timeout: float = 5.0) -> kvmem_pb2.StatsResponse | None:
        """Stats, or None while the server cannot answer."""
        try:
            return self.stub.Stats(kvmem_pb2.StatsRequest(audit=audit), timeout=timeout)
        except grpc.RpcError:
            return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def close(self) -> None:
        self.kill()
        self.channel.close()


# ------------------------------------------------------------------ the workers


@dataclasses.dataclass
class StopRecord:
    wid: int
    pid: int
    t_stop: float
    planned_s: float
    t_cont: float | None = None
    session_ended: bool | None = None  # at SIGCONT, Stats no longer listed its session
    events: list[str] = dataclasses.field(default_factory=list)  # what it ran into after SIGCONT
    closed: bool = False  # it attached again (or exited): nothing more is attributed

    def outcome(self) -> str:
        for kind in OUTCOME_ORDER:
            if kind in self.events:
                return kind
        return "none seen"


@dataclasses.dataclass
class WorkerProc:
    wid: int
    incarnation: int
    proc: subprocess.Popen[str]
    started: float
    attached: bool = False
    name: str = ""
    epoch: str = ""
    stopped: StopRecord | None = None
    drained: bool = False
    final: dict[str, Any] | None = None
    killed_by_driver: bool = False
    told_to_exit: bool = False
    err_path: str = ""

    @property
    def pid(self) -> int:
        return self.proc.pid


class Run:
    """The driver's state; every event of every worker lands in :meth:`on_event`."""

    def __init__(self, args: argparse.Namespace, server: Server, log_dir: str, say: Callable[..., None]) -> None:
        self.args = args
        self.server = server
        self.log_dir = log_dir
        self.say = say
        self.rng = random.Random(args.seed)
        self.lock = threading.Lock()
        self.workers: dict[int, WorkerProc] = {}
        self.by_pid: dict[int, WorkerProc] = {}
        self.counts_by_pid: dict[int, dict[str, int]] = {}
        self.incarnations = 0
        self.stops: list[StopRecord] = []
        self.kills: list[dict[str, Any]] = []
        self.reclaim_s: list[float] = []
        self.reclaim_timeouts = 0
        self.restarts: list[dict[str, Any]] = []
        self.foreign: list[dict[str, Any]] = []
        self.table_mismatches: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.crashes: list[dict[str, Any]] = []
        self.fence_events_unattributed: dict[str, int] = {}
        self.restart_tokens_lost = 0  # tokens of requests a restart took from their workers
        self.no_fault_events: list[dict[str, Any]] = []
        self.t0 = time.monotonic()
        self.lost_kinds: dict[str, int] = {}
        self.attach_epochs: dict[str, dict[int, float]] = {}  # epoch -> wid -> first attach time
        self.audits = 0
        self.audit_failures: list[dict[str, Any]] = []
        self.server_crashes: list[str] = []
        self.skipped_faults = 0
        self.watchers: list[threading.Thread] = []
        self.events: queue.Queue[tuple[str, Any]] = queue.Queue()  # progress lines from reader threads

    # ---------------------------------------------------------- processes

    def spawn(self, wid: int) -> WorkerProc:
        self.incarnations += 1
        a = self.args
        err_path = os.path.join(self.log_dir, f"worker-{wid:02d}-{self.incarnations}.err")
        cmd = [
            sys.executable, str(WORKER), "--target", self.server.target, "--wid", str(wid),
            "--seed", str(self.rng.randrange(1 << 30)), "--requests", str(a.requests),
            "--margin-ms", str(a.margin_ms), "--verify-every", str(a.verify_every),
            "--max-seconds", str(a.duration + 900),
            "--rogue-every", str(a.rogue_every if wid == 0 else 0.0),
        ]  # fmt: skip
        with open(err_path, "ab") as err:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1,
                start_new_session=True,
            )  # fmt: skip
        w = WorkerProc(wid, self.incarnations, proc, time.monotonic(), err_path=err_path)
        with self.lock:
            self.workers[wid] = w
            self.by_pid[proc.pid] = w
        threading.Thread(target=self.read_worker, args=(w,), name=f"w{wid}", daemon=True).start()
        return w

    def read_worker(self, w: WorkerProc) -> None:
        assert w.proc.stdout is not None
        for line in w.proc.stdout:
            if line.startswith("EV "):
                try:
                    ev = json.loads(line[3:])
                except ValueError:
                    continue
                self.on_event(w, ev)

    def send(self, w: WorkerProc, command: str) -> None:
        try:
            assert w.proc.stdin is not None
            w.proc.stdin.write(command + "\n")
            w.proc.stdin.flush()
        except (OSError, ValueError):
            pass  # it is gone

    def on_event(self, w: WorkerProc, ev: dict[str, Any]) -> None:
        kind = ev.get("ev")
        t = float(ev.get("t", 0.0))
        with self.lock:
            if kind in ("stat", "final"):
                self.counts_by_pid[w.pid] = ev["counts"]
                if kind == "final":
                    w.final = ev
            elif kind == "attached":
                w.attached, w.name, w.epoch = True, ev["name"], ev["epoch"]
                self.attach_epochs.setdefault(ev["epoch"], {}).setdefault(w.wid, t)
                for rec in self.stops:
                    if rec.pid == w.pid and rec.t_cont is not None and not rec.closed and t >= rec.t_cont:
                        rec.closed = True
            elif kind == "drained":
                w.drained = True
            elif kind in ("lost", "skip", "late_write", "verify_discarded"):
                if kind == "lost":
                    w.attached = False
                    self.lost_kinds[ev["kind"]] = self.lost_kinds.get(ev["kind"], 0) + 1
                label = "withheld" if kind == "lost" and ev.get("kind") == "withheld" else kind
                rec = next(
                    (r for r in self.stops if r.pid == w.pid and r.t_cont is not None and not r.closed
                     and t >= r.t_cont),
                    None,
                )  # fmt: skip
                if rec is not None:
                    rec.events.append(label)
                else:
                    if kind == "lost" and self.in_restart(t):  # not a stopped worker's: the restart's
                        self.restart_tokens_lost += int(ev.get("tokens", 0))
                    key = label if kind != "lost" else f"lost ({ev['kind']})"
                    key = f"{'restart' if self.in_restart(t) else 'no fault'}: {key}"
                    self.fence_events_unattributed[key] = self.fence_events_unattributed.get(key, 0) + 1
                    if key.startswith("no fault") and len(self.no_fault_events) < 50:
                        self.no_fault_events.append(
                            {"t": round(t - self.t0, 3), "wid": w.wid, "pid": w.pid, "event": key,
                             "session": ev.get("name"), "message": ev.get("message", "")[:200]}
                        )  # fmt: skip
            elif kind == "foreign":
                self.foreign.append(ev)
            elif kind == "table_mismatch":
                self.table_mismatches.append(ev)
            elif kind in ("error", "fatal"):
                self.errors.append(ev)
        if kind == "foreign":
            self.events.put(("FOREIGN WRITE", ev))
        elif kind == "table_mismatch":
            self.events.put(("BLOCK TABLE MISMATCH", ev))
        elif kind in ("error", "fatal"):
            self.events.put((f"WORKER {kind.upper()}", ev))

    def totals(self) -> dict[str, int]:
        with self.lock:
            out: dict[str, int] = {}
            for counts in self.counts_by_pid.values():
                for k, v in counts.items():
                    out[k] = out.get(k, 0) + v
            return out

    def running(self) -> list[WorkerProc]:
        """Live workers, not stopped, attached: candidates for a fault."""
        with self.lock:
            return [
                w for w in self.workers.values()
                if w.stopped is None and w.attached and w.proc.poll() is None and not w.told_to_exit
            ]  # fmt: skip

    def check_workers(self) -> None:
        """A worker that exited on its own (no fault of ours explains it) is a finding:
        record it with its stderr's tail and start another in its place."""
        for w in list(self.workers.values()):
            code = w.proc.poll()
            if code is None or w.killed_by_driver or w.told_to_exit:
                continue
            tail = ""
            try:
                with open(w.err_path, encoding="utf-8", errors="replace") as f:
                    tail = "".join(f.readlines()[-15:])
            except OSError:
                pass
            self.crashes.append({"wid": w.wid, "pid": w.pid, "exit_code": code, "stderr_tail": tail})
            self.say(f"worker {w.wid} (pid {w.pid}) exited {code} by itself; starting another\n{tail}")
            self.spawn(w.wid)

    # -------------------------------------------------------------- faults

    def session_listed(self, s: kvmem_pb2.StatsResponse | None, pid: int, wid: int) -> bool | None:
        if s is None:
            return None
        prefix = f"w{wid:02d}-p{pid}-"
        return any(u.name.startswith(prefix) for u in s.sessions)

    def kill_one(self) -> None:
        cands = self.running()
        if not cands:
            self.skipped_faults += 1
            return
        w = self.rng.choice(cands)
        before = self.server.stats()
        listed = self.session_listed(before, w.pid, w.wid)
        held = next((u.num_pages_held for u in (before.sessions if before else []) if u.name == w.name), None)
        w.killed_by_driver = True
        wall = time.time()
        os.kill(w.pid, signal.SIGKILL)
        t0 = time.monotonic()
        record: dict[str, Any] = {
            "wid": w.wid, "pid": w.pid, "t": t0, "wall": wall, "listed": bool(listed), "pages_held": held,
            "reclaim_s": None, "reclaim_logged_s": None, "exit_s": None,
        }  # fmt: skip
        self.kills.append(record)
        if listed:
            th = threading.Thread(target=self.watch_reclaim, args=(record, t0), daemon=True)
            th.start()
            self.watchers.append(th)
        w.proc.wait()
        record["exit_s"] = time.monotonic() - t0  # the kernel's teardown of the process (its mappings, ...)
        self.say(f"SIGKILL worker {w.wid} (pid {w.pid}, {held if held is not None else '?'} pages); respawned")
        self.spawn(w.wid)

    def watch_reclaim(self, record: dict[str, Any], t0: float) -> None:
        """Poll Stats until the killed worker's session is gone (its pages back)."""
        deadline = t0 + 15.0
        while time.monotonic() < deadline:
            s = self.server.stats(timeout=2.0)
            if s is not None and not self.session_listed(s, record["pid"], record["wid"]):
                took = time.monotonic() - t0
                record["reclaim_s"] = took
                with self.lock:
                    self.reclaim_s.append(took)
                return
            time.sleep(0.005)
        with self.lock:
            self.reclaim_timeouts += 1

    def stop_one(self) -> None:
        if sum(1 for w in self.workers.values() if w.stopped is not None) >= self.args.max_stopped:
            self.skipped_faults += 1
            return
        cands = self.running()
        if not cands:
            self.skipped_faults += 1
            return
        w = self.rng.choice(cands)
        planned = self.rng.uniform(self.args.stop_min_ms, self.args.stop_max_ms) / 1000
        os.kill(w.pid, signal.SIGSTOP)
        rec = StopRecord(w.wid, w.pid, time.monotonic(), planned)
        with self.lock:
            self.stops.append(rec)
            w.stopped = rec
        self.say(f"SIGSTOP worker {w.wid} (pid {w.pid}) for {planned:.1f} s")

    def resume_due(self, now: float, everyone: bool = False) -> None:
        for w in list(self.workers.values()):
            rec = w.stopped
            if rec is None or not (everyone or now >= rec.t_stop + rec.planned_s):
                continue
            ended = self.session_listed(self.server.stats(), w.pid, w.wid)
            with self.lock:
                rec.session_ended = None if ended is None else not ended
                rec.t_cont = time.monotonic()
                w.stopped = None
            os.kill(w.pid, signal.SIGCONT)
            took = rec.t_cont - rec.t_stop
            state = {True: "session ended", False: "session still listed", None: "server away"}[rec.session_ended]
            self.say(f"SIGCONT worker {w.wid} (pid {w.pid}) after {took:.1f} s ({state})")

    def restart_server(self) -> None:
        old = self.server.stats()
        t0 = time.monotonic()
        record: dict[str, Any] = {
            "t": t0,
            "down_s": None,
            "old_epoch": old.epoch if old is not None else "",
            "epoch": "",
            "t_serving": None,
            "waiting_for": [],
            "all_back_s": None,
        }
        with self.lock:
            self.restarts.append(record)  # from now on, a worker's lost session is put down to the restart
        self.server.kill()
        self.say(f"SIGKILL server (run {self.server.runs}); starting a new one on the same socket")
        serving = self.server.start()
        s = self.server.stats()
        with self.lock:
            record["epoch"] = s.epoch if s is not None else ""
            record["t_serving"] = serving
            record["down_s"] = serving - t0
            record["waiting_for"] = sorted(w.wid for w in self.workers.values() if w.stopped is None)
        self.say(f"server {record['epoch'][:8]} ready after {serving - t0:.2f} s")

    def in_restart(self, t: float) -> bool:
        """Whether ``t`` falls in a restart's window: from its SIGKILL until 10 s after
        the new server was ready (a worker that was busy or starved notices late)."""
        return any(r["t"] <= t and (r["t_serving"] is None or t <= r["t_serving"] + 10.0) for r in self.restarts)

    def check_recovery(self) -> None:
        with self.lock:
            for rec in self.restarts:
                if rec["all_back_s"] is not None or not rec["epoch"] or rec["t_serving"] is None:
                    continue
                seen = self.attach_epochs.get(rec["epoch"], {})
                if all(wid in seen for wid in rec["waiting_for"]):
                    rec["all_back_s"] = (
                        max([seen[wid] for wid in rec["waiting_for"]] + [rec["t_serving"]]) - rec["t_serving"]
                    )

    def audit(self) -> kvmem_pb2.StatsResponse | None:
        s = self.server.stats(audit=True, timeout=10.0)
        if s is None:
            return None
        self.audits += 1
        total = s.num_free_pages + s.num_cached_pages + s.num_used_pages + s.num_quarantined_pages
        problems = list(s.audit.problems)
        if total != s.num_pages_total:
            problems.append(f"free + cached + used + quarantined = {total} != total {s.num_pages_total}")
        if not s.audit.ok or problems:
            self.audit_failures.append({"t": time.monotonic(), "epoch": s.epoch, "problems": problems[:20]})
            self.say(f"AUDIT FAILED: {problems[:5]}")
        return s


# ------------------------------------------------------------------ the phases


def drain_events(run: Run) -> None:
    while True:
        try:
            what, ev = run.events.get_nowait()
        except queue.Empty:
            return
        run.say(f"{what}: {json.dumps(ev)[:1500]}")


def wait_until(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def schedule(args: argparse.Namespace, rng: random.Random) -> list[tuple[float, str]]:
    """(seconds into the fault phase, action), sorted: Poisson kills and stops, evenly
    spread restarts; nothing in the first 5 s or the last ``lease * 2`` s."""
    start, end = 5.0, max(args.duration - 2 * args.lease_ms / 1000 - 3.0, 5.0)
    out: list[tuple[float, str]] = []
    for action, every in (("kill", args.kill_every), ("stop", args.stop_every)):
        if every <= 0:
            continue
        t = start + rng.expovariate(1 / every)
        while t < end:
            out.append((t, action))
            t += rng.expovariate(1 / every)
    for i in range(args.restarts):
        t = start + (end - start) * (i + 1) / (args.restarts + 1) + rng.uniform(-3, 3)
        out.append((min(max(t, start), end), "restart"))
    return sorted(out)


def fault_phase(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    plan = schedule(args, run.rng)
    run.say(
        f"fault phase: {args.duration:g} s, {sum(a == 'kill' for _, a in plan)} kills, "
        f"{sum(a == 'stop' for _, a in plan)} stops, {sum(a == 'restart' for _, a in plan)} restarts planned"
    )
    t_start = time.monotonic()
    before = run.totals()
    next_progress = t_start + args.progress_every
    next_audit = t_start + args.audit_every
    last_totals, last_t = before, t_start
    i = 0
    while True:
        now = time.monotonic()
        if now - t_start >= args.duration:
            break
        run.resume_due(now)
        while i < len(plan) and now - t_start >= plan[i][0]:
            action = plan[i][1]
            i += 1
            if action == "kill":
                run.kill_one()
            elif action == "stop":
                run.stop_one()
            else:
                run.restart_server()
        if not run.server.alive():
            code = run.server.proc.returncode if run.server.proc else None
            run.server_crashes.append(f"exit {code}:\n{run.server.log_tail()}")
            run.say(f"SERVER EXITED BY ITSELF ({code}); starting another:\n{run.server.log_tail()}")
            run.server.start()
        run.check_workers()
        run.check_recovery()
        drain_events(run)
        if now >= next_audit:
            run.audit()
            next_audit = now + args.audit_every
        if now >= next_progress:
            tot = run.totals()
            dt = now - last_t
            rate = (tot.get("steps", 0) - last_totals.get("steps", 0)) / dt if dt > 0 else 0.0
            s = run.server.stats()
            pool = (
                f"pool free {s.num_free_pages}/{s.num_pages_total}, used {s.num_used_pages}, "
                f"quarantined {s.num_quarantined_pages}, sessions {len(s.sessions)}"
                if s is not None
                else "server away"
            )
            stopped = sum(1 for w in run.workers.values() if w.stopped is not None)
            run.say(
                f"progress: {now - t_start:4.0f}/{args.duration:g} s | {rate:,.0f} steps/s | "
                f"kills {len(run.kills)} stops {len(run.stops)} ({stopped} now) restarts {len(run.restarts)} | "
                f"foreign {len(run.foreign)} | withheld {tot.get('lost_withheld', 0)} "
                f"skipped {tot.get('write_skipped', 0)} | audits {run.audits} ok, {len(run.audit_failures)} failed | "
                f"{pool}"
            )
            last_totals, last_t = tot, now
            next_progress = now + args.progress_every
        time.sleep(0.02)
    t_end = time.monotonic()
    after = run.totals()
    return {"seconds": t_end - t_start, "before": before, "after": after}


def end_phase(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    run.resume_due(time.monotonic(), everyone=True)
    run.check_workers()
    run.say("end: every worker verifies and releases all its requests, then idles attached")
    for w in list(run.workers.values()):
        run.send(w, "drain")
    all_drained = wait_until(
        lambda: all(w.drained or w.proc.poll() is not None for w in run.workers.values()), timeout=120
    )
    not_drained = [w.wid for w in run.workers.values() if not w.drained]
    out["not_drained"] = not_drained
    if not all_drained:
        run.say(f"workers {not_drained} did not drain within 120 s")
    drain_events(run)
    run.say("waiting for every page to be free (quarantines included)")
    settle = args.quarantine_ms / 1000 + 2 * args.lease_ms / 1000 + 10

    def settled() -> bool:
        s = run.server.stats()
        return s is not None and s.num_free_pages == s.num_pages_total and s.num_quarantined_sessions == 0

    t0 = time.monotonic()
    ok = wait_until(settled, timeout=settle, step=0.1)
    out["settle_s"] = time.monotonic() - t0
    s = run.audit()
    if s is None:
        raise RunFailed("the server did not answer the final Stats")
    out["final"] = {
        "settled": ok,
        "pages_total": s.num_pages_total,
        "pages_free": s.num_free_pages,
        "pages_used": s.num_used_pages,
        "pages_quarantined": s.num_quarantined_pages,
        "pages_cached": s.num_cached_pages,
        "pages_lost": s.num_pages_total - s.num_free_pages,
        "open_requests": s.num_open_requests,
        "sessions_attached": len(s.sessions),
        "pages_held_by_sessions": sum(u.num_pages_held for u in s.sessions),
        "audit_ran": s.audit.ran,
        "audit_ok": s.audit.ok and s.audit.ran,
        "audit_problems": list(s.audit.problems)[:20],
        "server_steps": s.num_steps,
    }
    run.say(
        f"final audit: {'ok' if out['final']['audit_ok'] else 'FAILED'}, {s.num_free_pages}/{s.num_pages_total} "
        f"pages free, {s.num_used_pages} used, {s.num_quarantined_pages} quarantined, "
        f"{len(s.sessions)} sessions attached"
    )
    # SIGTERM with every session attached and some of them stopped.
    stopped = [w for w in run.workers.values() if w.proc.poll() is None][: args.stopped_at_sigterm]
    for w in stopped:
        os.kill(w.pid, signal.SIGSTOP)
    attached = len(s.sessions)
    proc = run.server.proc
    assert proc is not None
    wall0 = time.time()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
        run.server.kill()
    took = time.monotonic() - t0
    marks = {"shutting down": None, "drain over": None, "stopped": None}
    for ts, text in log_lines(run.server.log_path):
        for mark in marks:
            if ts >= wall0 - 0.01 and marks[mark] is None and f"kvmem.server {mark}" in text:
                marks[mark] = ts - wall0
    out["sigterm"] = {
        "exit_s": took,
        "exit_code": code,
        "sessions_attached": attached,
        "workers_stopped": len(stopped),
        "drain_ended_s": marks["drain over"],
        "stopped_logged_s": marks["stopped"],
        "after_stopped_s": None if marks["stopped"] is None else took - marks["stopped"],
    }
    run.say(
        f"SIGTERM -> exit {code} in {took:.2f} s ({attached} sessions attached, {len(stopped)} of their "
        f"processes stopped; the server logged 'stopped' at {ms(marks['stopped'])}, the process exited "
        f"{ms(out['sigterm']['after_stopped_s'])} later)"
    )
    for w in run.workers.values():
        w.told_to_exit = True
        run.send(w, "exit")
    for w in stopped:
        os.kill(w.pid, signal.SIGCONT)
    wait_until(lambda: all(w.proc.poll() is not None for w in run.workers.values()), timeout=30)
    stragglers = [w.wid for w in run.workers.values() if w.proc.poll() is None]
    out["stragglers"] = stragglers
    for w in run.workers.values():
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait()
    time.sleep(0.2)  # the reader threads take the last lines
    drain_events(run)
    return out


# ------------------------------------------------------------------ the report


def build_report(run: Run, args: argparse.Namespace, phase: dict[str, Any], end: dict[str, Any],
                 elapsed: float, info: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    tot = run.totals()
    secs = phase["seconds"]
    a, b = phase["after"], phase["before"]
    calls = a.get("calls", 0) - b.get("calls", 0)
    steps = a.get("steps", 0) - b.get("steps", 0)
    outcomes: dict[str, int] = {}
    for rec in run.stops:
        if rec.t_cont is not None:
            key = rec.outcome()
            outcomes[key] = outcomes.get(key, 0) + 1
    resumed = [r for r in run.stops if r.t_cont is not None]
    fenced = sum(1 for r in resumed if r.outcome() in ("withheld", "skip"))
    final = end["final"]
    crashes = run.crashes  # a worker's "fatal" event (it could not attach) ends in one of these too
    p50, p99 = percentile(run.reclaim_s, 0.5), percentile(run.reclaim_s, 0.99)
    logged = reclaim_from_logs(run)
    # The kernel's teardown of a killed process (its mappings: torch) comes first; what is left is kvmem's.
    after_reaped = [
        k["reclaim_logged_s"] - k["exit_s"]
        for k in run.kills
        if k["reclaim_logged_s"] is not None and k["exit_s"] is not None
    ]
    back = [r["all_back_s"] for r in run.restarts if r["all_back_s"] is not None]
    sig = end["sigterm"]
    failures = []
    if final["pages_lost"]:
        failures.append(f"{final['pages_lost']} pages lost")
    if not final["audit_ok"]:
        failures.append("the final audit failed")
    if run.audit_failures:
        failures.append(f"{len(run.audit_failures)} mid-run audits failed")
    if run.foreign:
        failures.append(f"{len(run.foreign)} foreign writes seen")
    if run.table_mismatches:
        failures.append(f"{len(run.table_mismatches)} block-table rows disagreed with their kv_loc")
    worker_errors = [e for e in run.errors if e.get("ev") == "error"]
    if worker_errors:
        failures.append(f"{len(worker_errors)} worker errors")
    if crashes:
        failures.append(f"{len(crashes)} workers exited by themselves")
    if run.server_crashes:
        failures.append(f"the server exited by itself {len(run.server_crashes)} times")
    if sig["exit_code"] != 0:
        failures.append(f"the server exited {sig['exit_code']} after SIGTERM")
    if args.keep_state and run.restart_tokens_lost:
        failures.append(f"{run.restart_tokens_lost} tokens lost with sessions a restart ended (they should resume)")
    if end["not_drained"]:
        failures.append(f"workers {end['not_drained']} did not drain")
    return {
        "benchmark": "kvmem fault_run",
        "pass": not failures,
        "failures": failures,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "elapsed_s": round(elapsed, 1),
        "fault_phase_s": round(secs, 1),
        "kills": len(run.kills),
        "stops": len(run.stops),
        "restarts": len(run.restarts),
        "adoptions": adoptions(run.server.log_paths),
        "restart_tokens_lost": run.restart_tokens_lost,
        "resumes": tot.get("resumes", 0),
        "skipped_faults": run.skipped_faults,
        "pages_lost": final["pages_lost"],
        "final": final,
        "mid_run_audits": run.audits,
        "audit_failures": run.audit_failures,
        "foreign_writes": len(run.foreign),
        "rogue_writes": tot.get("rogue_writes", 0),
        "table_mismatches": len(run.table_mismatches),
        "table_mismatch_reports": run.table_mismatches[:20],
        "foreign_write_reports": run.foreign[:20],
        "resumed_workers": len(resumed),
        "stops_that_ended_the_session": sum(1 for r in resumed if r.session_ended),
        "resumed_outcomes": outcomes,
        "resumed_fenced": fenced,
        "stop_records": [
            {
                "wid": r.wid,
                "pid": r.pid,
                "planned_s": round(r.planned_s, 3),
                "stopped_s": None if r.t_cont is None else round(r.t_cont - r.t_stop, 3),
                "session_ended": r.session_ended,
                "events": r.events,
                "outcome": r.outcome(),
            }
            for r in run.stops
        ],
        "fence_events_without_a_stop": run.fence_events_unattributed,
        "no_fault_events": run.no_fault_events,
        "sessions_lost_by_kind": run.lost_kinds,
        "reclaim_after_kill_s": {
            "n": len(run.reclaim_s),
            "p50": p50,
            "p99": p99,
            "max": max(run.reclaim_s) if run.reclaim_s else None,
            "timeouts": run.reclaim_timeouts,
            "logged_n": len(logged),
            "logged_p50": percentile(logged, 0.5),
            "logged_p99": percentile(logged, 0.99),
            "logged_max": max(logged) if logged else None,
            "process_exit_p50": percentile([k["exit_s"] for k in run.kills if k["exit_s"] is not None], 0.5),
            "after_reaped_p50": percentile(after_reaped, 0.5),
            "after_reaped_p99": percentile(after_reaped, 0.99),
        },
        "kill_records": [{k: v for k, v in rec.items() if k not in ("t", "wall")} for rec in run.kills],
        "restart_records": [
            {"down_s": r["down_s"], "all_back_s": r["all_back_s"], "workers": len(r["waiting_for"])}
            for r in run.restarts
        ],
        "restart_all_back_s": {"p50": percentile(back, 0.5), "max": max(back) if back else None},
        "sigterm": sig,
        "rates": {"calls_per_s": calls / secs if secs else 0.0, "steps_per_s": steps / secs if secs else 0.0},
        "totals": tot,
        "worker_errors": worker_errors[:10],
        "worker_crashes": crashes[:10],
        "worker_fatal_events": [e for e in run.errors if e.get("ev") == "fatal"][:10],
        "server_crashes": run.server_crashes,
        "end": {k: v for k, v in end.items() if k not in ("final", "sigterm")},
        "machine": info,
    }


def reclaim_from_logs(run: Run) -> list[float]:
    """Per kill of an attached worker: from the SIGKILL to the server's log line saying
    that session ended (or its quarantine did), by the server's own clock."""
    lines = [ln for path in run.server.log_paths for ln in log_lines(path)]
    out = []
    for k in run.kills:
        if not k["listed"]:
            continue
        names = (
            f"session ended name=w{k['wid']:02d}-p{k['pid']}-",
            f"quarantine ended name=w{k['wid']:02d}-p{k['pid']}-",
        )
        hit = next((ts for ts, text in lines if ts >= k["wall"] - 0.005 and any(n in text for n in names)), None)
        if hit is not None:
            k["reclaim_logged_s"] = max(hit - k["wall"], 0.0)
            out.append(k["reclaim_logged_s"])
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def print_report(r: dict[str, Any], out: TextIO) -> None:
    t = r["totals"]
    rc = r["reclaim_after_kill_s"]
    sig = r["sigterm"]
    oc = r["resumed_outcomes"]

    def res(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    rows = [
        ["pages lost (final audit: total - free)", f"{r['pages_lost']}", "0", res(r["pages_lost"] == 0)],
        ["final audit", "ok" if r["final"]["audit_ok"] else "FAILED", "ok", res(r["final"]["audit_ok"])],
        ["mid-run audits failed", f"{len(r['audit_failures'])} of {r['mid_run_audits']}", "0",
         res(not r["audit_failures"])],
        ["foreign-page writes seen", f"{r['foreign_writes']}", "0", res(r["foreign_writes"] == 0)],
        ["block-table rows not matching kv_loc", f"{r['table_mismatches']}", "0", res(r["table_mismatches"] == 0)],
        ["worker errors / exits no fault explains", f"{len(r['worker_errors'])} / {len(r['worker_crashes'])}",
         "0 / 0", res(not r["worker_errors"] and not r["worker_crashes"])],
        ["server exits no fault explains", f"{len(r['server_crashes'])}", "0", res(not r["server_crashes"])],
        ["SIGTERM -> exit (code)", f"{sig['exit_s']:.2f} s ({sig['exit_code']})", "exit 0",
         res(sig["exit_code"] == 0)],
        ["  of which after the server logged 'stopped'", ms(sig["after_stopped_s"]), "-", "info"],
        ["kills (SIGKILL, respawned)", f"{r['kills']}", "-", "info"],
        ["reclaim after SIGKILL p50 / p99 (Stats)", f"{ms(rc['p50'])} / {ms(rc['p99'])}", "-", "info"],
        ["  the same by the server's log", f"{ms(rc['logged_p50'])} / {ms(rc['logged_p99'])}", "-", "info"],
        ["  SIGKILL -> process reaped, p50", ms(rc["process_exit_p50"]), "-", "info"],
        ["  reaped -> session ended (log) p50 / p99", f"{ms(rc['after_reaped_p50'])} / {ms(rc['after_reaped_p99'])}",
         "-", "info"],
        ["stops past the lease (session ended)", f"{r['stops']} ({r['stops_that_ended_the_session']})", "-",
         "info"],
        ["  resumed: Step answer withheld", f"{oc.get('withheld', 0)}", "-", "info"],
        ["  resumed: write skipped by lease check", f"{oc.get('skip', 0)}", "-", "info"],
        ["  resumed: write just past the lease", f"{oc.get('late_write', 0)}", "-", "info"],
        ["  resumed: read-back discarded", f"{oc.get('verify_discarded', 0)}", "-", "info"],
        ["  resumed: SessionLost at next call", f"{oc.get('lost', 0)}", "-", "info"],
        ["  resumed: nothing seen", f"{oc.get('none seen', 0)}", "-", "info"],
        ["server restarts (all workers back p50/max)",
         f"{r['restarts']} ({ms(r['restart_all_back_s']['p50'])} / {ms(r['restart_all_back_s']['max'])})", "-",
         "info"],
        ["  adopted the killed server's state (--keep-state; repaired)",
         f"{r['adoptions']['adopted']} ({r['adoptions']['repaired']}; {r['adoptions']['ms_max']} ms at most)", "-",
         "info"],
        ["  sessions resumed / ended not resumed (server logs)",
         f"{r['adoptions']['sessions_resumed']} / {r['adoptions']['sessions_not_resumed']}", "-", "info"],
        ["  Steps cut by a kill and undone", f"{r['adoptions']['steps_undone']}", "-", "info"],
        ["  tokens prefilled again after a restart (requests lost with a session)",
         f"{r['restart_tokens_lost']:,}", "0 with --keep-state" if r["config"]["keep_state"] else "-",
         res(not r["config"]["keep_state"] or r["restart_tokens_lost"] == 0)],
        ["calls / steps per second", f"{r['rates']['calls_per_s']:,.0f} / {r['rates']['steps_per_s']:,.0f}", "-",
         "info"],
        ["tokens written / verified", f"{t.get('tokens_written', 0):,} / {t.get('tokens_verified', 0):,}", "-",
         "info"],
    ]  # fmt: skip
    print(
        f"kvmem fault run -- {r['config']['workers']} workers, {r['fault_phase_s']:.0f} s of faults "
        f"({r['elapsed_s']:.0f} s in all), lease {r['config']['lease_ms']} ms, quarantine "
        f"{r['config']['quarantine_ms']} ms, seed {r['config']['seed']}, load average "
        f"{r['machine']['load_average_1m']}",
        file=out,
    )
    print(file=out)
    print(render(["check", "value", "target", "result"], rows), file=out)
    print(file=out)
    print(
        f"sessions lost, by kind: {r['sessions_lost_by_kind']}; fence events with no stop behind them "
        f"(during a restart, or with no fault: a starved worker): {r['fence_events_without_a_stop']}; "
        f"out of pages {t.get('out_of_pages', 0):,}, "
        f"preempted {t.get('preempted', 0)}, requests done {t.get('requests_done', 0):,}; reclaim n={rc['n']}, "
        f"max {ms(rc['max'])}, timeouts {rc['timeouts']}; faults skipped (no candidate) {r['skipped_faults']}",
        file=out,
    )
    if r["rogue_writes"]:
        print(
            f"self-check: worker 0 wrote into another session's page {r['rogue_writes']} times (--rogue-every); "
            f"{r['foreign_writes']} foreign writes were seen",
            file=out,
        )
    for f in r["foreign_write_reports"][:5]:
        print(f"FOREIGN WRITE: {json.dumps(f)}", file=out)
    for m in r["table_mismatch_reports"][:5]:
        print(f"BLOCK TABLE MISMATCH: {json.dumps(m)}", file=out)
    for e in r["worker_errors"][:5]:
        print(f"WORKER ERROR: {e.get('type')}: {e.get('message')}\n{e.get('traceback', '')}", file=out)
    for c in r["worker_crashes"][:5]:
        print(f"WORKER EXIT: {json.dumps(c)[:2000]}", file=out)
    print("PASS" if r["pass"] else "FAIL: " + "; ".join(r["failures"]), file=out)


def machine_info() -> dict[str, Any]:
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = None
    return {
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        prog="fault_run.py",
        description=doc.split("\n\n")[0] + "\n\n" + "\n\n".join(doc.split("\n\n")[2:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("the run")
    g.add_argument(
        "--duration",
        type=float,
        default=360.0,
        metavar="S",
        help="seconds of faults (the whole run takes about 20-40 s more) (default: %(default)s)",
    )
    g.add_argument("--workers", type=int, default=16, metavar="N", help="worker processes (default: %(default)s)")
    g.add_argument(
        "--requests", type=int, default=4, metavar="N", help="requests each worker keeps open (default: %(default)s)"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the fault schedule and the workers' draws (default: random, printed)",
    )
    g.add_argument(
        "--margin-ms",
        type=float,
        default=250.0,
        metavar="MS",
        help="a worker writes only while kv.lease_remaining() exceeds this (default: %(default)s)",
    )
    g.add_argument(
        "--verify-every",
        type=int,
        default=4,
        metavar="K",
        help="a worker reads back all its written tokens every K steps (default: %(default)s)",
    )
    f = p.add_argument_group("faults")
    f.add_argument(
        "--kill-every",
        type=float,
        default=15.0,
        metavar="S",
        help="mean seconds between SIGKILLs of a worker; 0: none (default: %(default)s)",
    )
    f.add_argument(
        "--stop-every",
        type=float,
        default=8.0,
        metavar="S",
        help="mean seconds between SIGSTOPs of a worker; 0: none (default: %(default)s)",
    )
    f.add_argument(
        "--stop-min-ms",
        type=float,
        default=1600.0,
        metavar="MS",
        help="shortest stop; must exceed the lease by the reaper's period (default: %(default)s)",
    )
    f.add_argument(
        "--stop-max-ms",
        type=float,
        default=3000.0,
        metavar="MS",
        help="longest stop; must end well within the quarantine (default: %(default)s)",
    )
    f.add_argument(
        "--max-stopped", type=int, default=4, metavar="N", help="workers stopped at once at most (default: %(default)s)"
    )
    f.add_argument(
        "--restarts",
        type=int,
        default=3,
        metavar="N",
        help="server restarts (SIGKILL + start), evenly spread (default: %(default)s)",
    )
    f.add_argument(
        "--stopped-at-sigterm",
        type=int,
        default=2,
        metavar="N",
        help="workers stopped when the server gets its final SIGTERM (default: %(default)s)",
    )
    s = p.add_argument_group("the server")
    s.add_argument(
        "--keep-state",
        action="store_true",
        help="run the server with --keep-state: each restart adopts the killed server's state (checked, repaired, "
        "audited at start; the report counts the adoptions and repairs)",
    )
    s.add_argument("--lease-ms", type=int, default=1000, metavar="MS", help="the server's lease (default: %(default)s)")
    s.add_argument(
        "--quarantine-ms",
        type=int,
        default=5000,
        metavar="MS",
        help="how long a lapsed session's pages stay out of use while its process lives; must exceed "
        "--stop-max-ms + --lease-ms (default: %(default)s)",
    )
    s.add_argument("--page-size", type=int, default=16, help="tokens per page (default: %(default)s)")
    s.add_argument(
        "--num-pages",
        type=int,
        default=641,
        help="pages including page 0; 16 workers x 4 requests of 48-320 tokens hold about 550-600 pages "
        "on average, so they run out now and then (default: %(default)s)",
    )
    s.add_argument(
        "--max-context",
        type=int,
        default=512,
        help="longest request in tokens; the workers' stay at or below 320 (default: %(default)s)",
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="PATH",
        help="the figures as one JSON object: on stdout instead of the table, or into PATH with the "
        "table still printed",
    )
    o.add_argument(
        "--progress-every",
        type=float,
        default=15.0,
        metavar="S",
        help="seconds between progress lines on stderr (default: %(default)s)",
    )
    o.add_argument(
        "--audit-every",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between mid-run Stats(audit=True) (default: %(default)s)",
    )
    o.add_argument(
        "--log-dir",
        default=None,
        metavar="DIR",
        help="keep the server's and workers' logs in DIR (default: a temporary directory, removed)",
    )
    o.add_argument(
        "--rogue-every",
        type=float,
        default=0.0,
        metavar="S",
        help="self-check of the detector: worker 0 also writes into a page another session holds every S "
        "seconds, as a broken fence would; the run must then see foreign writes and fail (default: off)",
    )
    args = p.parse_args(argv)
    if args.duration <= 0 or args.workers < 1 or args.requests < 1 or args.verify_every < 1:
        p.error("--duration, --workers, --requests and --verify-every must be positive")
    if not args.lease_ms < args.stop_min_ms <= args.stop_max_ms:
        p.error("stops must outlast the lease: --lease-ms < --stop-min-ms <= --stop-max-ms")
    if args.stop_max_ms + args.lease_ms >= args.quarantine_ms:
        p.error(
            "--stop-max-ms + --lease-ms must stay below --quarantine-ms: a process stopped longer than its "
            "quarantine is the documented window, not a fault this run tests"
        )
    if args.margin_ms >= args.lease_ms:
        p.error("--margin-ms must be below --lease-ms")
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    args.max_requests = 2 * args.workers * args.requests + 16
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()

    def say(*a: Any) -> None:
        print(f"[{time.monotonic() - t_start:6.1f}s]", *a, file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, _raise_interrupt)
    tmp = tempfile.mkdtemp(prefix="kvmem-fault-", dir="/tmp")  # short: a unix socket path
    shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else tmp
    shm_dir = tempfile.mkdtemp(prefix="kvmem-fault-", dir=shm_root)
    log_dir = args.log_dir or os.path.join(tmp, "logs")
    os.makedirs(log_dir, exist_ok=True)
    server = Server(args, os.path.join(tmp, "kvmem.sock"), shm_dir, log_dir)
    run = Run(args, server, log_dir, say)
    info = machine_info()
    code = 2
    try:
        say(f"seed {args.seed}; server and workers under {tmp} (shm {shm_dir}); logs in {log_dir}")
        server.start()
        say(f"server ready; starting {args.workers} workers (each imports torch: slow on a loaded machine)")
        for wid in range(args.workers):
            run.spawn(wid)
        if not wait_until(lambda: len(run.running()) == args.workers, timeout=240, step=0.1):
            run.check_workers()
            drain_events(run)
            raise RunFailed(f"only {len(run.running())} of {args.workers} workers attached within 240 s")
        say(f"all {args.workers} workers attached and stepping")
        phase = fault_phase(run, args)
        end = end_phase(run, args)
        for th in run.watchers:
            th.join(timeout=5)
        report = build_report(run, args, phase, end, time.monotonic() - t_start, info)
        if args.json == "-":
            json.dump(report, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            print_report(report, sys.stdout)
            if args.json:
                pathlib.Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
                print(f"JSON written to {args.json}")
        code = 0 if report["pass"] else 1
    except RunFailed as exc:
        say(f"RUN FAILED: {exc}")
        code = 2
    except KeyboardInterrupt:
        say("interrupted: cleaning up")
        code = 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave processes behind
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for w in list(run.workers.values()):
            if w.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGCONT)
                w.proc.kill()
            w.proc.wait()
        server.close()
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)  # the logs too, unless --log-dir put them elsewhere
        say(f"cleaned up ({'logs kept in ' + log_dir if args.log_dir else 'temporary directories removed'})")
    return code


if __name__ == "__main__":
    sys.exit(main())
