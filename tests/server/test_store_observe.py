"""What the server shows of its store (``kvmem serve --store redis://...``): ``kvmem
stats``' store lines, the ``kvmem_store_*`` metrics and readiness, on a real
``redis-server`` started here on a free 127.0.0.1 port and stopped by its process id.

Node A writes a prompt's pages to the store as they are cached; node B, which never saw
the prompt, fetches them from it: both show it in their stats and metrics. Then the
store is killed: the server notices at its next store call, says UNREACHABLE (stats,
``kvmem_store_up`` 0, failed calls counted), stays ready and keeps answering Steps (its
matches just miss the store); the store comes back on the same port and the server
reconnects on its own (connects 2) and writes again.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import READINESS, ServerProcess, short_tmpdir, start_server
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

from kvmem.client import KVMemClient

PS, PAGES = 4, 9  # 8 usable pages of 4 tokens; 2 layers x K/V x 1 head of 2 float32: 128 bytes a page
FLAGS = ["--device", "cpu", "--page-size", str(PS), "--num-pages", str(PAGES), "--max-requests", "8",
         "--max-context", "32", "--layers", "2", "--kv-heads", "1", "--head-dim", "2", "--dtype", "float32",
         "--host-memory", "2KiB"]  # fmt: skip
MODEL = "org/model@rev"
PROMPT = list(range(100, 114))  # 3 full pages and 2 tokens: 3 pages cached, so 3 written
REASONS = ("checksum", "fingerprint", "header", "key", "mac", "size")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """A ``redis-server`` on 127.0.0.1:``port``, no persistence; stopped (SIGKILL) by its pid."""

    def __init__(self, binary: str, port: int, directory: str) -> None:
        self.binary, self.port, self.directory = binary, port, directory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.directory]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"redis-server exited with {self.proc.returncode}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"redis-server on port {self.port} did not answer PING in {timeout} s")

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server (the Debian package redis-server; .ci/run installs it)")
    directory = short_tmpdir()
    redis = RedisServer(binary, _free_port(), directory)
    redis.start()
    try:
        yield redis
    finally:
        redis.kill()
        shutil.rmtree(directory, ignore_errors=True)


def _serve(redis: RedisServer) -> ServerProcess:
    return start_server(short_tmpdir(), *FLAGS, "--store", redis.url, "--metrics", "127.0.0.1:0")


def write_prompt(kv: KVMemClient, tokens: list[int]) -> None:
    """One request: its K/V written through the client's mapping, then released with its
    tokens, so its full pages are cached (and, with a store, written to it)."""
    layers = kv.kv_cache(0)
    (slot,) = kv.open(["w"]).tolist()
    r = kv.step(alloc_slots=[slot], alloc_needs=[len(tokens)])
    assert r.ok
    for pos, loc in enumerate(r.kv_loc.tolist()):
        for layer, planes in enumerate(layers):
            for k in range(2):
                planes[k][loc] = float(tokens[pos] * 100 + layer * 2 + k)
    kv.step(release_slots=[slot], release_token_ids=[tokens])


def match(kv: KVMemClient, tokens: list[int]) -> tuple[int, int]:
    """A match item for ``tokens`` on a new slot, released at once: (matched, fetching) tokens."""
    (slot,) = kv.open(["m"]).tolist()
    r = kv.step(match=[(slot, tokens)])
    assert r.ok
    got = int(r.match_lens[0]), int(r.match_fetching[0]) if len(r.match_fetching) else 0
    kv.wait_loads(slot, got[0], int(r.match_loading[0]), timeout=30)
    kv.step(release_slots=[slot])
    return got


def wait_for(what: str, done: Callable[[], Any], timeout: float, trigger: Callable[[], None] | None = None) -> Any:
    """Poll ``done`` (calling ``trigger`` before each try) until it returns something
    true, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if trigger is not None:
            trigger()
        got = done()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


def store_when(
    kv: KVMemClient,
    what: str,
    ok: Callable[[Any], bool],
    timeout: float = 10,
    trigger: Callable[[], None] | None = None,
) -> Any:
    """The server's ``StatsResponse.store`` once ``ok`` says so (polled, at most ``timeout`` s)."""

    def done() -> Any:
        st = kv.stats().store
        return st if ok(st) else None

    return wait_for(what, done, timeout, trigger)


def kvmem_stats(server: ServerProcess) -> str:
    shown = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "stats", "--socket", server.socket_path], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


def scrape(server: ServerProcess) -> Samples:
    found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", server.log())
    assert found, server.log()
    with urllib.request.urlopen(found.group(1), timeout=10) as resp:
        body = resp.read().decode()
    assert "127.0.0.1:" not in body.replace(found.group(1), "")  # no store URL in the scrape
    return {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for family in text_string_to_metric_families(body)
        for x in family.samples
    }


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_store_redis_stats_and_metrics_show_pages_written_by_one_node_and_fetched_by_another(
    redis_server: RedisServer,
) -> None:
    node_a, node_b = _serve(redis_server), _serve(redis_server)
    try:
        with KVMemClient(node_b.target, name="idle") as kv:  # no model id yet: nothing written or fetched
            assert kv.stats().store.model_id == ""
            assert "no model id yet: nothing written or fetched until an engine attaches with one" in kvmem_stats(
                node_b
            )
        with KVMemClient(node_a.target, name="writer", model_id=MODEL) as kv:
            write_prompt(kv, PROMPT)
            # written by the thread, then handed back to the loop (no write pending)
            st = store_when(kv, "node A wrote 3 pages", lambda s: s.pages_written == 3 and not s.writes_pending)
            assert (st.reachable, st.connects, st.failures, st.write_dropped, st.write_failed) == (True, 1, 0, 0, 0)
            assert (st.kind, st.url, st.model_id, st.writes_pending) == ("redis", redis_server.url, MODEL, 0)
            assert st.bytes_written > 3 * 128  # the pages and their headers
        shown = kvmem_stats(node_a)
        assert f"store redis {redis_server.url}   reachable (connects 1, failed calls 0)   model {MODEL}" in shown
        assert "store since start: written 3 pages (dropped 0, failed 0), fetched 0 (found 0, read 0, no room 0), " \
            "rejected none; " in shown  # fmt: skip
        a = scrape(node_a)
        assert metric(a, "kvmem_store_up") == 1
        assert metric(a, "kvmem_store_info", kind="redis", model_id=MODEL) == 1
        assert metric(a, "kvmem_store_pages_total", direction="written") == 3
        assert metric(a, "kvmem_store_bytes_total", direction="written") == st.bytes_written
        assert metric(a, "kvmem_store_connects_total") == 1
        assert metric(a, "kvmem_store_failures_total") == 0
        assert metric(a, "kvmem_store_writes_pending") == 0

        # Node B never saw the prompt: its match misses, fetches the continuation from the
        # store into its host tier, and a match again takes it from there.
        with KVMemClient(node_b.target, name="reader", model_id=MODEL) as kv:
            assert match(kv, PROMPT) == (0, 12)
            # read and checked by the thread, then installed in the host tier by the loop
            wait_for("node B installed 3 pages", lambda: kv.stats().host_tier.num_cached_pages == 3, 10)
            st = kv.stats().store
            assert match(kv, PROMPT)[0] == 12
        assert (st.fetches, st.pages_found, st.pages_read, st.no_room) == (1, 3, 3, 0)
        assert st.bytes_read > 3 * 128 and all(st.rejected[r] == 0 for r in REASONS) and st.fetch_ms_p50 > 0
        shown = kvmem_stats(node_b)
        assert "fetched 1 (found 3, read 3, no room 0), rejected none; " in shown, shown
        assert re.search(r"writes pending \d+   fetches: p50 \d+\.\d\d ms, p99 \d+\.\d\d ms", shown), shown
        b = scrape(node_b)
        assert metric(b, "kvmem_store_pages_total", direction="found") == 3
        assert metric(b, "kvmem_store_pages_total", direction="read") == 3
        assert metric(b, "kvmem_store_bytes_total", direction="read") == st.bytes_read
        assert metric(b, "kvmem_store_fetches_total") == 1
        p50, p99 = (metric(b, "kvmem_store_fetch_seconds", quantile=q) for q in ("0.5", "0.99"))
        assert 0 < p50 <= p99 < 10
        assert {r: metric(b, "kvmem_store_rejected_total", reason=r) for r in REASONS} == dict.fromkeys(REASONS, 0)
    finally:
        for node in (node_a, node_b):
            assert node.stop() == 0, node.log()


def test_store_redis_killed_the_server_stays_ready_and_reconnects_when_it_is_back(
    redis_server: RedisServer,
) -> None:
    server = _serve(redis_server)
    fresh = iter(range(1000, 100_000, 16))  # each prompt's tokens new: its pages are cached, so written

    def new_prompt() -> list[int]:
        first = next(fresh)
        return list(range(first, first + 14))

    try:
        with KVMemClient(server.target, name="engine", model_id=MODEL) as kv:
            write_prompt(kv, PROMPT)
            store_when(kv, "3 pages written", lambda s: s.pages_written == 3 and not s.writes_pending)

            redis_server.kill()

            # The store thread notices at its next call: a release that caches new pages
            # (a write) and a match of an unknown prompt (a fetch) while polling.
            def store_calls() -> None:
                write_prompt(kv, new_prompt())
                match(kv, new_prompt())

            st = store_when(kv, "the store seen down", lambda s: not s.reachable, trigger=store_calls)
            assert st.failures > 0 and st.last_error and st.connects == 1, st
            assert server.health(READINESS) == health_pb2.HealthCheckResponse.SERVING  # never unready for its store
            # Steps go on: the prompt still matches from this node, an unknown one misses (nothing fetched).
            assert match(kv, PROMPT)[0] == 12
            assert match(kv, new_prompt()) == (0, 0)
            write_prompt(kv, new_prompt())  # dropped and counted, not an error
            assert kv.stats().store.write_dropped > 0
            shown = kvmem_stats(server)
            assert f"store redis {redis_server.url}   UNREACHABLE since its last error (" in shown, shown
            assert "reconnecting with backoff" in shown and f"model {MODEL}" in shown
            down = scrape(server)
            assert metric(down, "kvmem_store_up") == 0
            assert metric(down, "kvmem_store_failures_total") > 0
            assert metric(down, "kvmem_store_pages_dropped_total") > 0
            health = subprocess.run(
                [sys.executable, "-m", "kvmem.cli", "health", "--socket", server.socket_path], capture_output=True,
                text=True, timeout=60,
            )  # fmt: skip
            assert health.returncode == 0 and "SERVING" in health.stdout, health.stdout + health.stderr
            assert "): UNREACHABLE (" in health.stdout and "the server stays ready" in health.stdout, health.stdout

            redis_server.start()  # the same port: the thread reconnects on its own (backoff at most 5 s)
            st = store_when(kv, "reconnected", lambda s: s.reachable, timeout=15)
            assert st.connects == 2, st
            written = st.pages_written
            write_prompt(kv, new_prompt())
            store_when(kv, "written again", lambda s: s.pages_written > written)
            assert f"reachable (connects 2, failed calls {st.failures})" in kvmem_stats(server)
            audit = kv.stats(audit=True).audit
            assert audit.ok, audit.problems  # no host page pinned or unpinned twice by the failed calls
            up = scrape(server)
            assert metric(up, "kvmem_store_up") == 1
            assert metric(up, "kvmem_store_connects_total") == 2
    finally:
        assert server.stop() == 0, server.log()
