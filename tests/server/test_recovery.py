"""Coming back after a crash: a server whose memory is still held by a crashed
predecessor's allocation (clients keep mapping it) waits for it, live but not ready,
instead of exiting; clients that follow the recovery recipe (drop the views when
``SessionLost.views_stale``, re-attach, re-map, re-open) let it go and come back.

The shm variant runs on a small tmpfs mounted for the test (root with CAP_SYS_ADMIN,
as on these machines; skipped elsewhere), so that two pools cannot both fit. The cuda
variant of the same story needs a GPU (bench/gpu_check.sh)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import READINESS, LineProcess, ServerProcess, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# 300 pages of 16 tokens at 1 KiB a token: a 4.7 MiB pool on an 8 MiB tmpfs.
POOL = ("--num-pages", "300", "--max-requests", "8", "--max-context", "512", "--lease-ms", "1000")

# Follows the recipe: drops its views when told they are stale, re-attaches (retrying
# while the new server is not ready), re-maps and re-opens.
FOLLOWER = r"""
import gc, sys, time
from kvmem.client import KVMemClient, SessionLost, Unavailable
target = sys.argv[1]
views = {}
def on_stale(err):
    views.clear()  # every tensor taken from the client
    print("STALE", err.views_stale, flush=True)
def attach():
    deadline = time.monotonic() + 60
    while True:
        try:
            return KVMemClient(target, name="follower", on_views_stale=on_stale)
        except Unavailable:
            assert time.monotonic() < deadline
            time.sleep(0.1)
def start(kv):
    views["k"], views["v"] = kv.kv_cache()[0]
    slots = kv.open(["r"])
    r = kv.alloc(slots, [32])
    views["k"][r.kv_loc.long()] = 1.0
    return slots
kv = attach()
slots = start(kv)
print("READY", kv.epoch, flush=True)
while True:
    try:
        kv.alloc(slots, [1])
        kv.truncate(slots, [32])
        time.sleep(0.05)
    except (SessionLost, Unavailable) as err:
        views.clear()
        kv.close()
        gc.collect()
        print("LOST", type(err).__name__, getattr(err, "views_stale", None), flush=True)
        kv = attach()
        slots = start(kv)
        print("RECOVERED", kv.epoch, flush=True)
        break
sys.stdin.readline()
"""

# Does not: keeps its views (and so the crashed server's memory) whatever happens.
HOLDER = r"""
import sys
from kvmem.client import KVMemClient
kv = KVMemClient(sys.argv[1], name="holder")
k, v = kv.kv_cache()[0]
mem = kv.memory
print("READY", flush=True)
sys.stdin.readline()
"""


@pytest.fixture
def small_tmpfs(tmpdir_short: str) -> Iterator[str]:
    path = os.path.join(tmpdir_short, "shm")
    os.mkdir(path)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8M,mode=0700", "tmpfs", path], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def health(server: ServerProcess, service: str) -> int:
    with grpc.insecure_channel(server.target) as channel:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        )


def wait_log(server: ServerProcess, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in server.log():
        assert server.proc.poll() is None, f"server exited {server.proc.returncode}:\n{server.log()}"
        assert time.monotonic() < deadline, f"no {text!r} in the log within {timeout}s:\n{server.log()}"
        time.sleep(0.05)


def test_a_restarted_server_waits_for_memory_that_clients_still_map(tmpdir_short: str, small_tmpfs: str) -> None:
    first = start_server(tmpdir_short, *POOL, "--shm-dir", small_tmpfs)
    follower = LineProcess("follower", FOLLOWER, first.target)
    holder = LineProcess("holder", HOLDER, first.target)
    second = None
    try:
        first_epoch = follower.expect("READY")
        holder.expect("READY")
        first.stop(signal.SIGKILL)  # a crash: its files stay until the next start, its memory while mapped
        assert follower.expect("STALE") == "True"  # told once: by the keep-alive, or by its close
        second = start_server(tmpdir_short, *POOL, "--shm-dir", small_tmpfs, "--start-timeout-ms", "60000", wait=False)
        wait_log(second, "waiting for the pool's memory", timeout=30)
        assert health(second, "") == SERVING and health(second, READINESS) == NOT_SERVING  # live, not ready
        time.sleep(1.5)  # the holder still pins the old pool: the server keeps waiting
        assert health(second, READINESS) == NOT_SERVING and second.proc.poll() is None
        holder.kill()  # the client that kept its views exits: the memory comes back
        wait_log(second, "the pool's memory is free now", timeout=10)
        deadline = time.monotonic() + 10
        while health(second, READINESS) != SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        second_epoch = follower.expect("RECOVERED", timeout=30)
        assert second_epoch != first_epoch.split()[0]
        follower.send("done")
        assert second.stop() == 0, second.log()
        assert not os.listdir(small_tmpfs), os.listdir(small_tmpfs)
    finally:
        for proc in (follower, holder):
            proc.kill()
        if second is not None:
            second.stop(signal.SIGKILL)


def test_a_server_that_waits_too_long_gives_up_cleanly(tmpdir_short: str, small_tmpfs: str) -> None:
    first = start_server(tmpdir_short, *POOL, "--shm-dir", small_tmpfs)
    holder = LineProcess("holder", HOLDER, first.target)
    try:
        holder.expect("READY")
        first.stop(signal.SIGKILL)
        second = start_server(tmpdir_short, *POOL, "--shm-dir", small_tmpfs, "--start-timeout-ms", "1500", wait=False)
        assert second.proc.wait(timeout=30) == 2, second.log()
        assert "cannot start" in second.log() and "--start-timeout-ms" in second.log()
        assert not os.path.exists(second.socket_path)
    finally:
        holder.kill()


def _cuda_free_bytes() -> int | None:
    """Free memory of cuda:0 as a child process sees it, or None without a GPU (asked in
    a child, so this test process never initialises CUDA)."""
    probe = subprocess.run(
        [sys.executable, "-c",
         "import torch; print(torch.cuda.mem_get_info(0)[0] if torch.cuda.is_available() else -1)"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if probe.returncode != 0:
        return None
    free = int(probe.stdout.strip().splitlines()[-1])
    return free if free > 0 else None


def test_the_cuda_variant_waits_for_device_memory_clients_still_map(tmpdir_short: str) -> None:
    """The same story on a GPU (CUDA IPC): a pool of 60% of the free device memory, so two
    cannot both fit; the crashed server's allocation stays while a client maps it."""
    free = _cuda_free_bytes()
    if free is None:
        pytest.skip("needs a CUDA device")
    pool = ("--device", "cuda:0", "--memory", str(int(free * 0.6)), "--max-requests", "8", "--max-context", "512",
            "--lease-ms", "1000")  # fmt: skip
    first = start_server(tmpdir_short, *pool)
    follower = LineProcess("follower", FOLLOWER, first.target)
    holder = LineProcess("holder", HOLDER, first.target)
    second = None
    try:
        follower.expect("READY", timeout=120)
        holder.expect("READY", timeout=120)
        first.stop(signal.SIGKILL)
        assert follower.expect("STALE") == "True"
        second = start_server(tmpdir_short, *pool, "--start-timeout-ms", "120000", wait=False)
        wait_log(second, "waiting for the pool's memory", timeout=120)
        assert health(second, "") == SERVING and health(second, READINESS) == NOT_SERVING
        holder.kill()
        wait_log(second, "the pool's memory is free now", timeout=60)
        follower.expect("RECOVERED", timeout=120)
        follower.send("done")
        assert second.stop() == 0, second.log()
    finally:
        for proc in (follower, holder):
            proc.kill()
        if second is not None:
            second.stop(signal.SIGKILL)
