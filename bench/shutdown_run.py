"""Loaded shutdowns: what stepping clients see when their server gets SIGTERM, run after run.

Per run: one ``kvmem serve`` (shm, a unix socket, ``--drain-ms`` 1000 and
``--shutdown-grace-ms`` 500 by default, as ``kvmem serve``'s own), ``--clients`` (6)
stepping client processes and one more that attaches, allocates and is SIGSTOPped before
the SIGTERM (it is resumed after the server's exit). The stepping clients alternate
between the step stream and unary Steps. Each steps its requests (an alloc, then a
truncate back) as fast as it can, and after any failure records the error's class, gRPC
code and kvmem reason, then starts again (Attach, Open, Step) until the server's socket is
gone: calls keep arriving through the drain, at its end and while gRPC stops, which is
where the race of a bare CANCELLED was. The client processes live across runs (each run
gets a new server on the same socket).

It prints, over all runs, what the clients saw by class / code / reason, and the time
from SIGTERM to the server's exit against drain + grace + 0.5 s. Exit status 0 when no
client saw CANCELLED, UNKNOWN or INTERNAL, every server exited 0 within that bound, and
every run's clients stepped before the SIGTERM; 1 otherwise; 2 if a run could not be
carried out.

    .venv/bin/python bench/shutdown_run.py              # 10 runs
    .venv/bin/python bench/shutdown_run.py --runs 3 --json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

CLIENT = r"""
import json, os, sys, time
from kvmem.client import KVMemClient, KVMemError

target, socket_path, stream = sys.argv[1], sys.argv[2], sys.argv[3] == "stream"
say = lambda **kw: print(json.dumps(kw), flush=True)
for line in sys.stdin:
    command = line.split()
    if command[0] == "hold":  # attach, allocate, say so; the driver stops this process
        kv = KVMemClient(target, name="held", timeout=30)
        kv.alloc(kv.open(["h"]), [8])
        say(event="held")
        sys.stdin.readline()  # resumed and told to go on: let go of the old server's session
        try:
            kv.close()
        except Exception:
            pass
        say(event="released")
        continue
    seen, steps, kv = [], 0, None
    started = time.monotonic()
    while time.monotonic() - started < 60:
        try:
            if kv is None:
                kv = KVMemClient(target, name="stepper", step_stream=stream, timeout=5,
                                 wait_for_ready=steps == 0)
                slots = kv.open(["a", "b", "c", "d"])
            kv.alloc(slots, [1, 1, 1, 1])
            kv.truncate(slots, [0, 0, 0, 0])
            steps += 2
            if steps == 2:
                say(event="stepping")
        except KVMemError as err:
            seen.append([type(err).__name__, err.code.name, str(err.reason), err.message[:200]])
            try:
                kv is not None and kv.close()
            except Exception:
                pass
            kv = None
            if steps and not os.path.exists(socket_path):
                break
    say(event="done", steps=steps, seen=seen)
"""

BAD_CODES = {"CANCELLED", "UNKNOWN", "INTERNAL"}


class Client:
    """A client process driven by lines on its stdin, answering JSON lines."""

    def __init__(self, target: str, socket_path: str, mode: str) -> None:
        self.mode = mode
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CLIENT, target, socket_path, mode],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            env={**os.environ, "GRPC_VERBOSITY": "ERROR"},  # not gRPC's INFO lines of a GOAWAY
        )  # fmt: skip

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = json.loads(line)
            if message["event"] == event:
                return message
        raise RuntimeError(f"a {self.mode} client exited {self.proc.wait()} before {event!r}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_server(directory: str, socket_path: str, args: argparse.Namespace, run: int) -> subprocess.Popen[bytes]:
    command = [
        sys.executable, "-m", "kvmem.cli", "serve", "--socket", socket_path, "--num-pages", "257",
        "--page-size", "16", "--max-context", "512", "--lease-ms", "3000", "--shm-dir", directory,
        "--drain-ms", str(args.drain_ms), "--shutdown-grace-ms", str(args.grace_ms),
    ]  # fmt: skip
    with open(os.path.join(directory, f"server-{run}.log"), "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while not os.path.exists(socket_path):
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start (exit {server.poll()})")
        time.sleep(0.02)
    return server


def one_run(run: int, directory: str, socket_path: str, steppers: list[Client], held: Client, args: Any) -> dict:
    server = start_server(directory, socket_path, args, run)
    try:
        for client in steppers:
            client.send("go")
        held.send("hold")
        for client in steppers:
            client.expect("stepping")
        held.expect("held")
        held.proc.send_signal(signal.SIGSTOP)
        time.sleep(args.before_s)  # steps under load before the signal
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=60)
        exit_s = time.monotonic() - t0
        outcomes = [client.expect("done") for client in steppers]
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        held.proc.send_signal(signal.SIGCONT)
    held.send("release")
    held.expect("released")
    return {"run": run, "exit_code": code, "exit_s": exit_s, "clients": outcomes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="shutdowns (default: %(default)s)")
    parser.add_argument("--clients", type=int, default=6, help="stepping client processes (default: %(default)s)")
    parser.add_argument("--drain-ms", type=int, default=1000, help="the server's drain (default: %(default)s)")
    parser.add_argument("--grace-ms", type=int, default=500, help="its shutdown grace (default: %(default)s)")
    parser.add_argument("--before-s", type=float, default=0.5, help="stepping before SIGTERM (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of the table")
    args = parser.parse_args()
    if args.runs < 1 or args.clients < 1:
        parser.error(f"--runs and --clients must be at least 1 (got {args.runs}, {args.clients})")
    directory = tempfile.mkdtemp(prefix="kvmem-shutdown-", dir="/tmp")
    socket_path = os.path.join(directory, "kvmem.sock")
    target = f"unix:{socket_path}"
    modes = ["stream" if i % 2 == 0 else "unary" for i in range(args.clients)]
    steppers = [Client(target, socket_path, mode) for mode in modes]
    held = Client(target, socket_path, "stream")
    runs = []
    try:
        for run in range(args.runs):
            runs.append(one_run(run, directory, socket_path, steppers, held, args))
            last = runs[-1]
            print(
                f"run {run + 1}/{args.runs}: exit {last['exit_code']} in {last['exit_s']:.2f}s, "
                f"{sum(c['steps'] for c in last['clients']):,} steps",
                file=sys.stderr,
            )
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"shutdown_run: could not carry out run {len(runs) + 1}: {exc}", file=sys.stderr)
        return 2
    finally:
        for client in [*steppers, held]:
            client.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return report(runs, modes, args)


def report(runs: list[dict], modes: list[str], args: Any) -> int:
    seen: collections.Counter[tuple[str, str, str, str]] = collections.Counter()
    example: dict[tuple[str, str, str, str], str] = {}
    mapped = 0  # CANCELLED calls that gRPC cancelled as its shutdown began, read as SHUTTING_DOWN
    for r in runs:
        for mode, client in zip(modes, r["clients"], strict=True):
            for cls, code, reason, message in client["seen"]:
                seen[(mode, cls, code, reason)] += 1
                example.setdefault((mode, cls, code, reason), message)
                mapped += message.startswith("the server cancelled the call")
    bound = (args.drain_ms + args.grace_ms) / 1000 + 0.5
    exits = [r["exit_s"] for r in runs]
    bad = sum(n for (_m, _c, code, _r), n in seen.items() if code in BAD_CODES)
    ok = bad == 0 and all(r["exit_code"] == 0 for r in runs) and max(exits) <= bound
    figures = {
        "runs": len(runs), "clients": len(modes), "drain_ms": args.drain_ms, "grace_ms": args.grace_ms,
        "seen": [{"mode": m, "class": c, "code": code, "reason": r, "count": n, "example": example[(m, c, code, r)]}
                 for (m, c, code, r), n in sorted(seen.items())],
        "cancelled_unknown_internal": bad, "cancelled_by_grpc_read_as_shutting_down": mapped,
        "exit_s": {"min": min(exits), "max": max(exits), "bound": bound},
        "exit_codes": sorted({r["exit_code"] for r in runs}),
        "steps": sum(c["steps"] for r in runs for c in r["clients"]),
        "ok": ok,
    }  # fmt: skip
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0 if ok else 1
    print(f"{len(runs)} shutdowns of a server with {len(modes)} stepping clients and 1 stopped one")
    print(f"{'mode':8} {'class':14} {'code':20} {'reason':14} {'count':>7}")
    for key, n in sorted(seen.items()):
        mode, cls, code, reason = key
        print(f"{mode:8} {cls:14} {code:20} {reason:14} {n:>7,}  e.g. {example[key][:90]}")
    print(
        f"CANCELLED / UNKNOWN / INTERNAL: {bad} (calls gRPC cancelled as its shutdown began, read as "
        f"SHUTTING_DOWN by the clients: {mapped})"
    )
    print(
        f"SIGTERM to exit: {min(exits):.2f}-{max(exits):.2f} s (bound: drain {args.drain_ms} ms + grace "
        f"{args.grace_ms} ms + 0.5 s = {bound:.2f} s); exit codes {figures['exit_codes']}; {figures['steps']:,} steps"
    )
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
