"""Garbage on the health port: malformed bodies to grpc.health.v1.Health/Check, and what
the server answers and logs.

Starts one ``kvmem serve`` (shm, a unix socket, ``--health-port`` on a free port), sends
``--calls`` (10,000) request bodies that do not parse as a HealthCheckRequest to
``Health/Check`` on the health port (``--on tcp``: on a ``--tcp`` port; ``socket``: on the
unix socket) from ``--threads`` (4) threads, as fast as they can, then stops the server
(SIGTERM) and reads its log. Every call must be INVALID_ARGUMENT naming the method and the
message type; the log must hold no traceback and no line per call: the refusals appear as
a first line per kind and summaries (``kvmem.server.edge.refusals``). It prints the answers by
code, the log's lines and bytes, and the calls per second.

Exit status 0 when every call got INVALID_ARGUMENT, the log holds no traceback and no ERROR
line, and it holds fewer than 1 line per 100 calls; 1 otherwise; 2 if the server would not
start.

    .venv/bin/python bench/health_flood.py
    .venv/bin/python bench/health_flood.py --calls 1000 --on socket --json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc

BODIES = [b"\xff\xff\xff", b"\x08", b"\x0a\x05ab", b"garbage!", b"\x0a\x02\xff\xfe"]  # the last: bad UTF-8
EXPECTED = "grpc.health.v1.Health/Check: the request body"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000, help="malformed calls (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=4, help="calling threads (default: %(default)s)")
    parser.add_argument("--on", choices=("health-port", "tcp", "socket"), default="health-port",
                        help="where to send them (default: %(default)s)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of the lines")
    args = parser.parse_args()
    if args.calls < 1 or args.threads < 1:
        parser.error(f"--calls and --threads must be at least 1 (got {args.calls}, {args.threads})")
    directory = tempfile.mkdtemp(prefix="kvmem-flood-", dir="/tmp")
    socket_path, log_path = os.path.join(directory, "kvmem.sock"), os.path.join(directory, "server.log")
    health_port, tcp_port = free_port(), free_port()
    command = [
        sys.executable, "-m", "kvmem.cli", "serve", "--socket", socket_path, "--num-pages", "65",
        "--page-size", "16", "--max-context", "256", "--shm-dir", directory,
        "--health-port", str(health_port), "--tcp", f"127.0.0.1:{tcp_port}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    with open(log_path, "wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    targets = {"health-port": f"127.0.0.1:{health_port}", "tcp": f"127.0.0.1:{tcp_port}"}
    target = targets.get(args.on, f"unix:{socket_path}")
    try:
        with grpc.insecure_channel(target) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=60)
            except grpc.FutureTimeoutError:
                print(f"health_flood: the server did not listen on {target} within 60 s", file=sys.stderr)
                return 2
            check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                        response_deserializer=None)  # fmt: skip
            codes: collections.Counter[str] = collections.Counter()
            named = [0]
            lock = threading.Lock()

            def flood(part: int) -> None:
                mine: collections.Counter[str] = collections.Counter()
                ok = 0
                for i in range(part, args.calls, args.threads):
                    try:
                        check(BODIES[i % len(BODIES)], timeout=10)
                        mine["OK"] += 1
                    except grpc.RpcError as err:
                        mine[err.code().name] += 1
                        ok += EXPECTED in (err.details() or "")
                with lock:
                    codes.update(mine)
                    named[0] += ok

            t0 = time.perf_counter()
            threads = [threading.Thread(target=flood, args=(i,)) for i in range(args.threads)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            took = time.perf_counter() - t0
    finally:
        server.send_signal(signal.SIGTERM)
        exit_code = server.wait(timeout=30)
        with open(log_path, encoding="utf-8", errors="replace") as f:
            log_text = f.read()
        shutil.rmtree(directory, ignore_errors=True)
    lines = log_text.splitlines()
    refusal_lines = [line for line in lines if "kvmem.refusals" in line]
    figures = {
        "calls": args.calls, "on": args.on, "codes": dict(codes), "named_method_and_type": named[0],
        "calls_per_s": args.calls / took, "log_lines": len(lines), "log_bytes": len(log_text.encode()),
        "refusal_lines": len(refusal_lines), "tracebacks": log_text.count("Traceback"),
        "error_lines": sum(" ERROR " in line for line in lines), "server_exit": exit_code,
    }  # fmt: skip
    ok = (
        codes == {"INVALID_ARGUMENT": args.calls}
        and named[0] == args.calls
        and figures["tracebacks"] == 0
        and figures["error_lines"] == 0
        and len(lines) < max(args.calls / 100, 20)
        and exit_code == 0
    )
    figures["ok"] = ok
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        rate = figures["calls_per_s"]
        print(f"{args.calls:,} malformed Health/Check bodies on {args.on} ({target}) in {took:.1f} s ({rate:,.0f}/s): "
              f"{dict(codes)}; {named[0]:,} named the method and the type")  # fmt: skip
        print(
            f"server log: {len(lines)} lines, {figures['log_bytes']:,} bytes; {len(refusal_lines)} refusal lines, "
            f"{figures['tracebacks']} tracebacks, {figures['error_lines']} ERROR lines; exit {exit_code}"
        )
        for line in refusal_lines:
            print("  " + line[:240])
        print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
