"""Prometheus metrics: a real server with ``--metrics``, scraped over real HTTP.

The scrape must agree with what the calls did and with Stats, count refused calls by
code and kvmem reason, time every unary handler, and answer anything but
``GET``/``HEAD /metrics`` with a plain HTTP error. A port in use or a malformed address
stops the start with the option named.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import ServerProcess, start_server
from prometheus_client.parser import text_string_to_metric_families

from kvmem.client import AllocStatus, KVMemClient
from kvmem.client.errors import InvalidArgument

PAGE = 4


@pytest.fixture
def metrics_server(tmpdir_short: str) -> Iterator[tuple[ServerProcess, str]]:
    srv = start_server(
        tmpdir_short, "--metrics", "127.0.0.1:0", "--num-pages", "65", "--page-size", str(PAGE),
        "--max-requests", "8", "--max-context", "64",
    )  # fmt: skip
    found = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", srv.log())
    assert found, srv.log()
    yield srv, found.group(1)
    assert srv.stop() == 0, srv.log()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_scrape_agrees_with_the_calls_and_with_stats(metrics_server) -> None:
    srv, url = metrics_server
    m = scrape(url)
    assert value(m, "kvmem_pages", state="free") == 64 and value(m, "kvmem_pages", state="used") == 0
    assert value(m, "kvmem_pages_total") == 64
    assert value(m, "kvmem_sessions") == 0
    assert value(m, "kvmem_request_slots", state="free") == 8
    assert value(m, "kvmem_pool_config", setting="page_size_tokens") == PAGE

    with KVMemClient(srv.target, name="worker-0", quota_pages=6) as kv:
        slots = kv.open(["a", "b"])
        r = kv.alloc(slots, [10, 5])  # 3 + 2 pages
        assert r.ok
        r = kv.alloc(slots, [2, 1])  # a: 12 tokens (no new page), b: 6 (no new page)
        assert r.ok
        r = kv.alloc(slots[:1], [20])  # 5 more pages: beyond the quota of 6
        assert r.status.tolist() == [AllocStatus.QUOTA_EXCEEDED]
        with pytest.raises(InvalidArgument):
            kv.step(alloc_slots=[int(slots[0]), int(slots[0])], alloc_needs=[1, 1])  # a slot twice
        kv.release(slots[1:])  # b's 2 pages
        stats = kv.stats()

        m = scrape(url)
        assert value(m, "kvmem_pages", state="used") == stats.num_used_pages == 3
        assert value(m, "kvmem_pages", state="free") == stats.num_free_pages == 61
        assert value(m, "kvmem_sessions") == 1
        who = {"session": "worker-0", "index": "1"}
        assert value(m, "kvmem_session_pages", **who) == 3
        assert value(m, "kvmem_session_requests", **who) == 1
        assert value(m, "kvmem_session_quota_pages", **who) == 6
        assert value(m, "kvmem_request_slots", state="open") == 1

        assert value(m, "kvmem_steps_total") == stats.num_steps == 4  # the refused step is not one
        assert value(m, "kvmem_pages_allocated_total") == 5
        assert value(m, "kvmem_pages_released_total") == 2
        assert value(m, "kvmem_alloc_items_total", status="OK") == 4
        assert value(m, "kvmem_alloc_items_total", status="QUOTA_EXCEEDED") == 1
        assert value(m, "kvmem_alloc_items_total", status="OUT_OF_PAGES") == 0

        assert value(m, "kvmem_rpc_calls_total", method="Step", code="OK") == 4
        assert value(m, "kvmem_rpc_calls_total", method="Step", code="INVALID_ARGUMENT") == 1
        assert value(m, "kvmem_rpc_errors_total", method="Step", reason="DUPLICATE_SLOT") == 1
        assert value(m, "kvmem_rpc_calls_total", method="Attach", code="OK") == 1
        assert value(m, "kvmem_rpc_calls_total", method="Open", code="OK") == 1
        # Every Step call is timed; the buckets are cumulative and end at +Inf.
        assert value(m, "kvmem_rpc_handler_seconds_count", method="Step") == 5
        assert value(m, "kvmem_rpc_handler_seconds_bucket", method="Step", le="+Inf") == 5
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (name, labels), v in m.items()
            if name == "kvmem_rpc_handler_seconds_bucket" and dict(labels)["method"] == "Step"
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts)
        assert 0 < value(m, "kvmem_rpc_handler_seconds_sum", method="Step") < 5
        assert value(m, "process_cpu_seconds_total") > 0

    m = scrape(url)  # the client detached on leaving the block, releasing a's 3 pages
    assert value(m, "kvmem_sessions") == 0
    assert value(m, "kvmem_sessions_ended_total", why="detached") == 1
    assert value(m, "kvmem_pages", state="used") == 0
    assert value(m, "kvmem_pages_released_total") == value(m, "kvmem_pages_allocated_total") == 5
    assert value(m, "kvmem_rpc_calls_total", method="Stats", code="OK") == 1


def http(url: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_only_get_and_head_of_metrics_are_served(metrics_server) -> None:
    srv, url = metrics_server
    status, _, body = http(url.replace("/metrics", "/"))
    assert status == 404 and b"GET /metrics" in body
    status, _, _ = http(url + "/more")
    assert status == 404
    status, headers, _ = http(url, method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"
    status, headers, body = http(url, method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 1000
    status, _, body = http(url + "?name[]=x")  # query strings are ignored
    assert status == 200 and b"kvmem_pages_total" in body
    host, port = url.split("/")[2].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"nonsense\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400 ")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.close()  # a scraper that hangs up at once harms nothing
    assert srv.health() == 1  # SERVING
    assert http(url)[0] == 200


def test_metrics_are_off_unless_asked(server: ServerProcess) -> None:
    assert "metrics on" not in server.log()


def test_a_metrics_port_in_use_stops_the_start_naming_it(tmpdir_short: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        path = os.path.join(tmpdir_short, "m.sock")
        run = subprocess.run(
            [sys.executable, "-m", "kvmem.server.cli", "serve", "--socket", path, "--metrics", f"127.0.0.1:{port}",
             "--shm-dir", tmpdir_short],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")},
        )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"--metrics 127.0.0.1:{port}: cannot listen" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not os.path.exists(path)  # gRPC never listened
    assert os.listdir(tmpdir_short) == []  # the shm files the pool had made are gone


def test_prefix_cache_metrics_agree_with_stats(metrics_server) -> None:
    srv, url = metrics_server
    m = scrape(url)
    assert value(m, "kvmem_prefix_cache_enabled", hash="xxh3-128") == 1
    assert value(m, "kvmem_prefix_cache_entries") == 0 and value(m, "kvmem_prefix_query_tokens_total") == 0

    prompt = list(range(10))  # two full pages of 4, and a partial one (never cached)
    with KVMemClient(srv.target, name="worker-0") as A, KVMemClient(srv.target, name="worker-1") as B:
        [a] = A.open(["a"]).tolist()
        A.alloc([a], [10])
        A.release([a], [prompt])  # cache: 2 pages
        [b] = B.open(["b"]).tolist()
        assert B.match(b, prompt) == 8
        B.release([b])
        many = A.open([f"big-{i}" for i in range(4)]).tolist()
        assert A.alloc(many, [64] * 4).num_pages_evicted == 2  # 4 x 16 pages = all 64: the cached two go
        stats = A.stats()

        m = scrape(url)
        assert value(m, "kvmem_prefix_query_tokens_total") == stats.prefix_query_tokens == 10
        assert value(m, "kvmem_prefix_hit_tokens_total") == stats.prefix_hit_tokens == 8
        assert value(m, "kvmem_prefix_pages_cached_total") == 2
        assert value(m, "kvmem_prefix_evictions_total") == stats.num_evictions == 2
        assert value(m, "kvmem_prefix_cache_entries") == stats.num_cache_entries == 0
        assert value(m, "kvmem_pages", state="cached") == stats.num_cached_pages == 0
        w0, w1 = {"session": "worker-0", "index": "1"}, {"session": "worker-1", "index": "2"}
        assert value(m, "kvmem_session_prefix_query_tokens_total", **w1) == 10
        assert value(m, "kvmem_session_prefix_hit_tokens_total", **w1) == 8
        assert value(m, "kvmem_session_prefix_query_tokens_total", **w0) == 0
        assert value(m, "kvmem_session_prefix_evictions_total", **w0) == 2
