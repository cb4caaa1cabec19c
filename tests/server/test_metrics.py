"""Prometheus metrics: a real server with ``--metrics``, scraped over real HTTP.

The scrape must agree with what the calls did and with Stats, count refused calls by
code and kvmem reason, time every unary handler, and answer anything but
``GET``/``HEAD /metrics`` with a plain HTTP error. The body is prometheus_client's: the
text format 0.0.4 by default, OpenMetrics when the scrape's Accept asks for it, gzip when
accepted; every name follows Prometheus' conventions (counters ``_total``, gauges not).
A port in use or a malformed address stops the start with the option named.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, start_server
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families

from kvmem.client import AllocStatus, KVMemClient
from kvmem.client.errors import InvalidArgument

PAGE = 4
TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
# What Prometheus 3 sends by default: OpenMetrics first, the text formats as fallbacks.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
    "text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)


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


def fetch(url: str, **headers: str) -> tuple[dict[str, str], bytes]:
    req = urllib.request.Request(url, headers={k.replace("_", "-"): v for k, v in headers.items()})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
        return dict(resp.headers), resp.read()


def families(url: str) -> list[Metric]:
    """A plain scrape (no Accept): the text format 0.0.4."""
    headers, body = fetch(url)
    assert headers["Content-Type"] == TEXT_0_0_4
    return list(text_string_to_metric_families(body.decode()))


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in families(url) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_scrape_agrees_with_the_calls_and_with_stats(metrics_server, step_stream: bool) -> None:
    """Each step is one call of its method: ``StepStream`` (a message on the stream) or
    ``Step`` (a unary call)."""
    srv, url = metrics_server
    step = "StepStream" if step_stream else "Step"
    m = scrape(url)
    assert value(m, "kvmem_pages", state="free") == 64 and value(m, "kvmem_pages", state="used") == 0
    assert value(m, "kvmem_pool_pages") == 64
    assert value(m, "kvmem_sessions") == 0
    assert value(m, "kvmem_request_slots", state="free") == 8
    assert value(m, "kvmem_pool_config", setting="page_size_tokens") == PAGE

    with KVMemClient(srv.target, name="worker-0", quota_pages=6, step_stream=step_stream) as kv:
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

        assert value(m, "kvmem_rpc_calls_total", method=step, code="OK") == 4
        assert value(m, "kvmem_rpc_calls_total", method=step, code="INVALID_ARGUMENT") == 1
        assert value(m, "kvmem_rpc_errors_total", method=step, reason="DUPLICATE_SLOT") == 1
        assert value(m, "kvmem_rpc_calls_total", method="Attach", code="OK") == 1
        assert value(m, "kvmem_rpc_calls_total", method="Open", code="OK") == 1
        # Every Step call is timed; the buckets are cumulative and end at +Inf.
        assert value(m, "kvmem_rpc_handler_seconds_count", method=step) == 5
        assert value(m, "kvmem_rpc_handler_seconds_bucket", method=step, le="+Inf") == 5
        buckets = sorted(
            (float(dict(labels)["le"]), v)
            for (name, labels), v in m.items()
            if name == "kvmem_rpc_handler_seconds_bucket" and dict(labels)["method"] == step
        )
        counts = [v for _, v in buckets]
        assert counts == sorted(counts)
        assert 0 < value(m, "kvmem_rpc_handler_seconds_sum", method=step) < 5
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
    assert status == 200 and b"kvmem_pool_pages" in body
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
            [sys.executable, "-m", "kvmem.cli", "serve", "--socket", path, "--metrics", f"127.0.0.1:{port}",
             "--shm-dir", tmpdir_short],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")},
        )  # fmt: skip
    assert run.returncode == 2, run.stderr
    assert f"--metrics 127.0.0.1:{port}: cannot listen" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr
    assert not os.path.exists(path)  # gRPC never listened
    assert os.listdir(tmpdir_short) == []  # the shm files the pool had made are gone


def test_prefix_cache_metrics_follow_the_live_cache(metrics_server) -> None:
    srv, url = metrics_server
    m = scrape(url)
    assert value(m, "kvmem_prefix_cache_enabled", hash="xxh3-128") == 1
    assert value(m, "kvmem_prefix_cache_entries") == 0 and value(m, "kvmem_prefix_query_tokens_total") == 0

    prompt = list(range(10))  # two full pages of 4, and a partial one (never cached)
    w0, w1 = {"session": "worker-0", "index": "1"}, {"session": "worker-1", "index": "2"}
    with KVMemClient(srv.target, name="worker-0") as A, KVMemClient(srv.target, name="worker-1") as B:
        [a] = A.open(["a"]).tolist()
        A.alloc([a], [10])
        A.release([a], [prompt])  # cache: 2 pages, held by no request; the partial third is freed
        m = scrape(url)
        assert value(m, "kvmem_prefix_pages_cached_total") == 2
        assert value(m, "kvmem_prefix_cache_entries") == 2
        assert value(m, "kvmem_pages", state="cached") == 2 and value(m, "kvmem_pages", state="used") == 0
        assert value(m, "kvmem_pages", state="free") == 62

        [b] = B.open(["b"]).tolist()
        assert B.match(b, prompt) == 8  # from a second session: b now holds the two cached pages
        stats = B.stats()
        m = scrape(url)
        assert value(m, "kvmem_prefix_query_tokens_total") == stats.prefix_query_tokens == 10
        assert value(m, "kvmem_prefix_hit_tokens_total") == stats.prefix_hit_tokens == 8
        assert value(m, "kvmem_session_prefix_query_tokens_total", **w1) == 10
        assert value(m, "kvmem_session_prefix_hit_tokens_total", **w1) == 8
        assert value(m, "kvmem_session_prefix_query_tokens_total", **w0) == 0
        assert value(m, "kvmem_prefix_cache_entries") == stats.num_cache_entries == 2  # held or not
        assert value(m, "kvmem_pages", state="cached") == stats.num_cached_pages == 0  # held: not evictable
        assert value(m, "kvmem_pages", state="used") == stats.num_used_pages == 2
        assert value(m, "kvmem_session_pages", **w1) == 2

        B.release([b])
        m = scrape(url)
        assert value(m, "kvmem_pages", state="cached") == 2 and value(m, "kvmem_prefix_cache_entries") == 2
        assert value(m, "kvmem_prefix_evictions_total") == 0

        many = A.open([f"big-{i}" for i in range(4)]).tolist()
        assert A.alloc(many, [64] * 4).num_pages_evicted == 2  # 4 x 16 pages = all 64: the cached two go
        stats = A.stats()
        m = scrape(url)
        assert value(m, "kvmem_prefix_evictions_total") == stats.num_evictions == 2
        assert value(m, "kvmem_session_prefix_evictions_total", **w0) == 2
        assert value(m, "kvmem_session_prefix_evictions_total", **w1) == 0
        assert value(m, "kvmem_prefix_cache_entries") == stats.num_cache_entries == 0
        assert value(m, "kvmem_pages", state="cached") == stats.num_cached_pages == 0
        assert value(m, "kvmem_prefix_pages_cached_total") == 2  # a total: evictions do not lower it


def check_names(found: list[Metric]) -> None:
    """Prometheus' conventions: a counter's samples end in _total, no gauge's does, an info
    metric's sample ends in _info."""
    for family in found:
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == family.name + "_total", sample
            elif family.type == "info":
                assert sample.name == family.name + "_info", sample
            else:
                assert not sample.name.endswith("_total"), (family.type, sample)


def test_exposition_is_prometheus_clients_negotiated_and_conventionally_named(metrics_server) -> None:
    srv, url = metrics_server
    with KVMemClient(srv.target, name="worker-0") as kv:  # every family with samples: a session, calls
        [a] = kv.open(["a"]).tolist()
        kv.alloc([a], [10])
        with pytest.raises(InvalidArgument):
            kv.step(alloc_slots=[a, a], alloc_needs=[1, 1])
        kv.release([a], [list(range(10))])

        text = families(url)  # no Accept: the text format 0.0.4
        types = {f.name: f.type for f in text}
        check_names(text)
        assert types["kvmem_steps"] == types["kvmem_rpc_errors"] == types["kvmem_sessions_ended"] == "counter"
        assert types["kvmem_pool_pages"] == types["kvmem_pages"] == types["kvmem_build_info"] == "gauge"
        assert "kvmem_pages_total" not in types  # the old name of the pool's size, a gauge
        [build] = next(f for f in text if f.name == "kvmem_build_info").samples
        assert build.value == 1
        assert build.labels == {
            "version": importlib.metadata.version("kvmem"), "python": platform.python_version(),
            "grpc": grpc.__version__, "numpy": np.__version__, "prefix_hash": "xxh3-128",
        }  # fmt: skip

        for accept in ("application/openmetrics-text", PROMETHEUS_ACCEPT):
            headers, body = fetch(url, Accept=accept)
            assert headers["Content-Type"].startswith("application/openmetrics-text; version=1.0.0;")
            assert headers["Vary"] == "Accept, Accept-Encoding"
            assert body.endswith(b"# EOF\n")
            om = list(openmetrics_families(body.decode()))
            check_names(om)
            om_types = {f.name: f.type for f in om}
            assert om_types["kvmem_build"] == om_types["kvmem"] == "info"  # kvmem_build_info, kvmem_info
            assert om_types["kvmem_steps"] == "counter" and om_types["kvmem_rpc_handler_seconds"] == "histogram"
            assert om_types["kvmem_pool_pages"] == "gauge"
            # The same families in both formats (info metrics are gauges in the text format).
            assert {n + "_info" if t == "info" else n for n, t in om_types.items()} == set(types)

        headers, body = fetch(url, Accept="text/plain", Accept_Encoding="gzip")
        assert headers["Content-Type"] == TEXT_0_0_4 and headers["Content-Encoding"] == "gzip"
        assert {f.name for f in text_string_to_metric_families(gzip.decompress(body).decode())} == set(types)
        headers, body = fetch(url, Accept=PROMETHEUS_ACCEPT, Accept_Encoding="deflate, gzip;q=0.9")
        assert headers["Content-Encoding"] == "gzip" and gzip.decompress(body).endswith(b"# EOF\n")
        headers, _ = fetch(url, Accept_Encoding="identity")
        assert "Content-Encoding" not in headers
