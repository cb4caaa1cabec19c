"""Finding the server ``kvmem simulate`` and ``kvmem generate`` run against, or starting
one for the run (:func:`server_for`): a ``kvmem serve`` child in a session of its own (a
Ctrl-C of the run does not reach it), on a private socket, with a pool sized for the
workload; stopped when the run ends."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

READINESS = "kvmem.v1.KVMemory"
OWN_PAGE_SIZE = 16


class UsageError(Exception):
    """A missing prerequisite or an unusable server: one line, exit status 2."""


def probe(target: str) -> str:
    """``serving``, ``not-ready`` (a server answers but is not ready) or ``none``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=READINESS), timeout=2
            )
        except grpc.RpcError as err:
            return "none" if err.code() == grpc.StatusCode.UNAVAILABLE else "not-ready"
    return "serving" if resp.status == health_pb2.HealthCheckResponse.SERVING else "not-ready"


@contextlib.contextmanager
def server_for(
    target: str, command: str, own_argv: Callable[[], list[str]], info: IO[str]
) -> Iterator[tuple[str, OwnServer | None]]:
    """The server a run of ``kvmem COMMAND`` uses, as ``(target, own)``: the one serving at
    ``target`` (one that answers but is not ready yet is given 30 s), or, when none
    answers, a ``kvmem serve`` started for the run with ``own_argv()`` (said on
    ``info``), ready before the run and stopped after it (``own`` is that server, else
    None). :class:`UsageError` when the server at ``target`` never becomes ready."""
    state = probe(target)
    if state == "not-ready":  # starting, or waiting for its memory: give it a while
        print(f"the server at {target} is not ready yet: waiting up to 30 s", file=info, flush=True)
        deadline = time.monotonic() + 30
        while state == "not-ready" and time.monotonic() < deadline:
            time.sleep(0.2)
            state = probe(target)
        if state != "serving":
            raise UsageError(f"the server at {target} did not become ready: see its log, or kvmem health")
    if state != "none":
        yield target, None
        return
    argv = own_argv()
    print(
        f"no kvmem server answers at {target}: starting one for this run ({' '.join(['kvmem', *argv])}); "
        "it stops at the end",
        file=info,
        flush=True,
    )
    own = OwnServer(argv, tempfile.mkdtemp(prefix=f"kvmem-{command}-", dir="/tmp"))
    try:
        own.wait_ready()
        yield own.target, own
    finally:
        print(f"stopped the server {command} started (exit {own.stop()})", file=info)


class OwnServer:
    """The ``kvmem serve`` this run started (a new session: Ctrl-C does not reach it)."""

    def __init__(self, argv: list[str], directory: str) -> None:
        self.directory = directory
        self.socket_path = os.path.join(directory, "kvmem.sock")
        self.log_path = os.path.join(directory, "serve.log")
        self.argv = [*argv, "--socket", self.socket_path]
        env = {
            k: v for k, v in os.environ.items() if not k.startswith("KVMEM_") or k in ("KVMEM_DEBUG", "KVMEM_SHM_DIR")
        }
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvmem.cli", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.target = f"unix:{self.socket_path}"

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise UsageError(f"the server simulate started exited with {self.proc.returncode}:\n{self.log_tail()}")
            if os.path.exists(self.socket_path) and probe(self.target) == "serving":
                return
            time.sleep(0.05)
        raise UsageError(f"the server simulate started was not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-20:]).rstrip()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)
        return code


def own_server_argv(args: argparse.Namespace) -> list[str]:
    """``kvmem serve`` options for a pool sized for the workload: its longest request fits
    the context, and the pool holds about half of what all workers' running requests
    would hold without sharing (the system prompts are shared: it fits; without, it
    would not)."""
    ps = OWN_PAGE_SIZE
    mean = args.shared * args.system_prompt_len + args.prompt_len + args.output_len
    longest = 1.5 * args.system_prompt_len + 4 * (args.prompt_len + args.output_len)
    if getattr(args, "workload", "default") == "multi-turn":  # a request is a conversation so far
        turn = args.prompt_len + args.output_len
        mean = args.system_prompt_len + (args.turns + 1) / 2 * turn
        longest = 1.5 * args.system_prompt_len + 2 * args.turns * turn
    max_context = min(max(1024, ps * math.ceil(longest / ps)), 65536)
    demand = args.workers * args.max_running * mean / ps
    num_pages = args.num_pages or max(4 * max_context // ps, math.ceil(0.5 * demand)) + 1
    max_context = min(max_context, (num_pages - 1) * ps)  # a small --num-pages: the context it holds
    max_requests = args.workers * args.max_running + 16
    sizes = f"--page-size {ps} --num-pages {num_pages} --max-requests {max_requests} --max-context {max_context}"
    store = getattr(args, "store", None)
    host = getattr(args, "host_memory", None) or ("64MiB" if store else None)
    tier = ["--host-memory", host] if host else []
    if tier and getattr(args, "host_write_policy", "write-back") != "write-back":
        tier += ["--host-write-policy", args.host_write_policy]
    tier += ["--store", store] if store else []
    return ["serve", "--device", args.device, *sizes.split(), *tier, "--log-level", "warning"]


def store_summary(stats: Any) -> dict[str, Any] | None:
    """A server's store (``kvmem serve --store``) from its StatsResponse, for a report
    (None: it has none): kind, reachable, pages written, fetches, pages found and read,
    values refused, fetch p50."""
    if not stats.HasField("store"):
        return None
    st = stats.store
    return {
        "kind": st.kind,
        "reachable": bool(st.reachable),
        "pages_written": int(st.pages_written),
        "fetches": int(st.fetches),
        "pages_found": int(st.pages_found),
        "pages_read": int(st.pages_read),
        "rejected": int(sum(st.rejected.values())),
        "fetch_ms_p50": round(st.fetch_ms_p50, 3),
    }
