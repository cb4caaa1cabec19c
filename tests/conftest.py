"""Shared fixtures: a real `kvmem serve` process on a temporary unix socket, and the
line-protocol child processes the multi-process tests drive; and the hypothesis
profiles of the property tests (``quick``, the default, and ``thorough``)."""

from __future__ import annotations

import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import settings

READINESS = "kvmem.v1.KVMemory"

# Hypothesis profiles. "quick", the default, runs a handful of examples of each property
# test, so that `pytest tests/core` is the one-second loop of development; "thorough"
# (`--hypothesis-profile=thorough`, what .ci/run selects) runs each at its full strength.
# A test names its full numbers to `capped`, which gives it at most the profile's. Both
# keep the rest of hypothesis's settings as they are (its "ci" profile where CI is set).
settings.register_profile("quick", parent=settings.default, max_examples=10, stateful_step_count=10)
settings.register_profile("thorough", parent=settings.default, max_examples=500, stateful_step_count=50)
settings.load_profile("quick")  # the pytest option --hypothesis-profile, read later, overrides it


def capped(max_examples: int, stateful_step_count: int | None = None, **others: object) -> settings:
    """The settings of a property test whose full strength is ``max_examples`` examples
    (of ``stateful_step_count`` steps, a stateful one): no more than the profile's."""
    profile = settings.default
    assert profile is not None
    if stateful_step_count is not None:
        others["stateful_step_count"] = min(stateful_step_count, profile.stateful_step_count)
    return settings(max_examples=min(max_examples, profile.max_examples), **others)  # type: ignore[arg-type]


class LineProcess:
    """A Python child process running ``code`` with ``args``, driven line by line: its
    stdout (and stderr) lines arrive on a queue, and are kept for failure messages."""

    def __init__(self, name: str, code: str, *args: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        )  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.transcript: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, word: str, timeout: float = 60.0) -> str:
        """The rest of the next line that starts with ``word``; other lines (warnings)
        are kept for the failure message."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {word!r} within {timeout}s:\n" + "\n".join(self.transcript)
                ) from None
            if line is None:
                self.proc.wait()
                raise AssertionError(
                    f"{self.name} exited {self.proc.returncode} before {word!r}:\n" + "\n".join(self.transcript)
                )
            self.transcript.append(line[:1000])
            if line == word or line.startswith(word + " "):
                return line[len(word) + 1 :]

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@dataclasses.dataclass
class ServerProcess:
    """A `kvmem serve` child process. ``target`` is what clients connect to."""

    proc: subprocess.Popen[bytes]
    socket_path: str
    log_path: str
    args: list[str]

    @property
    def target(self) -> str:
        return f"unix:{self.socket_path}"

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def health(self, service: str = READINESS, timeout: float = 2.0) -> int:
        with grpc.insecure_channel(self.target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        return resp.status

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal the server and wait; returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout}s after signal {sig}:\n{self.log()}") from None


def keepalive_answered_since(kv: object, since: float) -> bool:
    """Whether a keep-alive answer came to client ``kv`` after its lease was known to
    hold until ``since`` (``kv.lease_valid_until`` then): with no call in between, only
    a keep-alive answer moves it."""
    return kv.lease_valid_until > since  # type: ignore[attr-defined]


def wait_keepalive_answered(kv: object, timeout: float = 30.0) -> None:
    """Block until a keep-alive message of ``kv`` (a sync client) has been answered
    (make no call meanwhile): proof that the stream works, with whatever the channel
    carries (a token, TLS)."""
    since = kv.lease_valid_until  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    while not keepalive_answered_since(kv, since):
        assert time.monotonic() < deadline, f"no keep-alive answer within {timeout}s"
        time.sleep(0.02)


def short_tmpdir() -> str:
    """A short directory: unix socket paths are limited to ~107 bytes."""
    return tempfile.mkdtemp(prefix="kvmem-", dir="/tmp")


def refused_at_start(*extra: str) -> subprocess.CompletedProcess[str]:
    """``kvmem serve`` with ``extra`` options that it must refuse at start: the run, after
    checking it exited non-zero and left no socket behind (nothing was created)."""
    directory = short_tmpdir()
    socket_path = os.path.join(directory, "s")
    run = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "serve", "--socket", socket_path, *extra],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode != 0, run.stdout + run.stderr
    assert not os.path.exists(socket_path), "refused after creating its socket"
    shutil.rmtree(directory, ignore_errors=True)
    return run


def start_server(
    directory: str, *extra: str, socket_name: str = "kvmem.sock", env: dict[str, str] | None = None,
    wait: bool = True, launcher: tuple[str, ...] = ("-m", "kvmem.cli"),
) -> ServerProcess:  # fmt: skip
    """``kvmem serve`` on ``directory``/``socket_name`` with ``extra`` options; ``launcher``
    is what follows the Python executable (a ``-c`` script that patches the server for a
    test, then calls ``kvmem.cli.main``)."""
    socket_path = os.path.join(directory, socket_name)
    log_path = os.path.join(directory, f"{socket_name}.log")
    args = [sys.executable, *launcher, "serve", "--socket", socket_path, *extra]
    full_env = dict(os.environ)
    full_env.setdefault("KVMEM_DEBUG", "1")  # audit after every step in tests
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=full_env)
    server = ServerProcess(proc, socket_path, log_path, args)
    if wait:
        wait_serving(server)
    return server


def wait_serving(server: ServerProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        if os.path.exists(server.socket_path):
            try:
                if server.health(timeout=0.5) == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"server not serving within {timeout}s:\n{server.log()}")


@pytest.fixture
def tmpdir_short() -> Iterator[str]:
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def server(tmpdir_short: str) -> Iterator[ServerProcess]:
    """A server with a small pool and a short lease; stopped with SIGTERM afterwards,
    which must exit 0."""
    srv = start_server(
        tmpdir_short, "--num-pages", "257", "--page-size", "4", "--max-requests", "16", "--max-context", "256",
        "--lease-ms", "1500",
    )  # fmt: skip
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited {code} after SIGTERM:\n{srv.log()}"
