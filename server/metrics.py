"""Prometheus metrics over HTTP, served from the server's own event loop.

A scrape of ``GET /metrics`` shows (names under ``kvmem_``):

- the pool: pages by state, usable pages, request slots by state, the geometry;
- the sessions: how many, and per session (its name and server index, never its id)
  the requests and pages it holds, its quota, and its prefix-cache query and hit
  tokens and evictions;
- the prefix cache: whether it is on (and its key recipe), cache entries, and totals of
  query and hit tokens (hit rate = hit / query), pages inserted and pages evicted;
- totals since start: steps, pages allocated and released, alloc items by status
  (``OUT_OF_PAGES`` is memory pressure), sessions ended and why;
- per RPC method: calls by gRPC code, errors by kvmem reason, and a histogram of the
  handler's time in the server (validation, the core, building the response message;
  not the transport);
- the process (CPU seconds, resident memory, open files) from prometheus_client.

The gauges are read from the sessions layer when a scrape arrives, so the hot path pays
nothing for them; the totals are integer additions made by the sessions layer and the service.

The endpoint is a small HTTP/1.1 server on the gRPC event loop (asyncio streams), not
prometheus_client's server thread: a scrape then runs between two calls and reads one
consistent state, never a step half-applied, and needs no lock on the hot path.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmem.server.core import AllocStatus

if TYPE_CHECKING:
    from kvmem.server.sessions import ServerStats, Sessions

log = logging.getLogger("kvmem.metrics")

# Handler time buckets, seconds: a decode step of 256 items takes ~0.1-0.3 ms in the
# handler, a prefill of 131k tokens a few ms, an audited Stats of a large pool more.
HANDLER_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)

# The classic text format, which every Prometheus version reads (generate_latest writes it).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TEXT = "text/plain; charset=utf-8"  # the error answers
_MAX_REQUEST_HEAD = 8192  # bytes of request line and headers a scrape may send
_READ_TIMEOUT_S = 10.0


class RpcStats:
    """Per method: calls by gRPC code, errors by kvmem reason, and the handler-time
    histogram. O(1) per call (dictionary additions and one bisect over 13 bounds)."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], int] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.time_counts: dict[str, list[int]] = {}  # per bucket, not cumulative; +Inf last
        self.time_sum: dict[str, float] = {}

    def record(self, method: str, code: str, reason: str | None, seconds: float) -> None:
        key = (method, code)
        self.calls[key] = self.calls.get(key, 0) + 1
        if reason is not None:
            err = (method, reason)
            self.errors[err] = self.errors.get(err, 0) + 1
        counts = self.time_counts.get(method)
        if counts is None:
            counts = self.time_counts[method] = [0] * (len(HANDLER_BUCKETS) + 1)
            self.time_sum[method] = 0.0
        counts[bisect.bisect_left(HANDLER_BUCKETS, seconds)] += 1
        self.time_sum[method] += seconds


class KVMemCollector(Collector):
    """Builds every ``kvmem_`` metric from the sessions layer and the RPC stats at scrape time."""

    def __init__(self, sessions: Sessions, rpc: RpcStats, memory_backend: str) -> None:
        self.sessions = sessions
        self.rpc = rpc
        self.memory_backend = memory_backend

    def collect(self) -> Iterator[Metric]:
        stats = self.sessions.stats(audit=False)
        yield from self._pool(stats)
        yield from self._per_session(stats)
        yield from self._totals(stats)
        yield from self._rpc()

    def _pool(self, stats: ServerStats) -> Iterator[Metric]:
        sessions = self.sessions
        pool = stats.pool
        cfg = sessions.core.config
        info = GaugeMetricFamily(
            "kvmem_info", "This server: its epoch (changes at every start) and memory backend; always 1.",
            labels=["epoch", "memory_backend"],
        )  # fmt: skip
        info.add_metric([sessions.epoch, self.memory_backend], 1)
        yield info
        geometry = GaugeMetricFamily("kvmem_pool_config", "The pool's geometry, as configured.", labels=["setting"])
        for setting, value in (
            ("page_size_tokens", cfg.page_size),
            ("max_requests", cfg.max_requests),
            ("max_context_tokens", cfg.max_context_len),
        ):
            geometry.add_metric([setting], value)
        yield geometry
        yield GaugeMetricFamily(
            "kvmem_pages_total", "Usable pages in the pool (page 0 is padding).", pool.num_pages_total
        )
        pages = GaugeMetricFamily(
            "kvmem_pages", "Pages by state; free + used + cached + quarantined = kvmem_pages_total.", labels=["state"]
        )
        pages.add_metric(["free"], pool.num_free_pages)
        pages.add_metric(["used"], pool.num_used_pages)
        pages.add_metric(["cached"], pool.num_cached_pages)
        pages.add_metric(["quarantined"], pool.num_quarantined_pages)
        yield pages
        slots = GaugeMetricFamily("kvmem_request_slots", "Request slots by state.", labels=["state"])
        slots.add_metric(["open"], pool.num_open_requests)
        slots.add_metric(["free"], pool.num_free_request_slots)
        yield slots
        yield GaugeMetricFamily("kvmem_sessions", "Attached sessions (scheduler workers).", len(stats.sessions))
        prefix = GaugeMetricFamily(
            "kvmem_prefix_cache_enabled", "1 when the prefix cache is on; its page-key recipe.", labels=["hash"]
        )
        prefix.add_metric([stats.prefix_hash], int(stats.prefix_cache_enabled))
        yield prefix
        yield GaugeMetricFamily(
            "kvmem_prefix_cache_entries",
            'Pages with a key in the prefix cache, held by requests or not (kvmem_pages{state="cached"}: not).',
            pool.num_cache_entries,
        )

    def _per_session(self, stats: ServerStats) -> Iterator[Metric]:
        labels = ["session", "index"]
        held = GaugeMetricFamily("kvmem_session_pages", "Pages a session's open requests hold.", labels=labels)
        reqs = GaugeMetricFamily("kvmem_session_requests", "A session's open requests.", labels=labels)
        quota = GaugeMetricFamily(
            "kvmem_session_quota_pages", "A session's page quota (sessions with one).", labels=labels
        )
        query = CounterMetricFamily(
            "kvmem_session_prefix_query_tokens", "Tokens a session's match items asked the prefix cache for.",
            labels=labels,
        )  # fmt: skip
        hit = CounterMetricFamily(
            "kvmem_session_prefix_hit_tokens", "Tokens a session's match items found in the prefix cache.",
            labels=labels,
        )  # fmt: skip
        evicted = CounterMetricFamily(
            "kvmem_session_prefix_evictions", "Cached pages a session's allocs evicted.", labels=labels
        )
        for row in stats.sessions:
            session = row.session
            key = [session.name, str(session.owner)]
            held.add_metric(key, row.num_pages_held)
            reqs.add_metric(key, row.num_requests)
            if session.quota_pages is not None:
                quota.add_metric(key, session.quota_pages)
            query.add_metric(key, row.prefix_query_tokens)
            hit.add_metric(key, row.prefix_hit_tokens)
            evicted.add_metric(key, row.num_evictions)
        yield from (held, reqs, quota, query, hit, evicted)

    def _totals(self, stats: ServerStats) -> Iterator[Metric]:
        sessions = self.sessions
        yield GaugeMetricFamily("kvmem_uptime_seconds", "Seconds since the server started.", stats.uptime_s)
        yield CounterMetricFamily("kvmem_steps", "Steps applied (valid Step calls).", stats.num_steps)
        yield CounterMetricFamily("kvmem_pages_allocated", "Pages handed out by steps.", sessions.num_pages_allocated)
        yield CounterMetricFamily(
            "kvmem_pages_released",
            "References dropped: by steps' releases and truncates, and by sessions that ended.",
            sessions.num_pages_released,
        )
        items = CounterMetricFamily("kvmem_alloc_items", "Alloc items of steps, by per-item status.", labels=["status"])
        for status in AllocStatus:
            items.add_metric([status.name], sessions.alloc_items[status])
        yield items
        pool = stats.pool
        yield CounterMetricFamily(
            "kvmem_prefix_query_tokens", "Tokens match items asked the prefix cache for.", pool.prefix_query_tokens
        )
        yield CounterMetricFamily(
            "kvmem_prefix_hit_tokens",
            "Tokens match items found in the prefix cache (hit rate: this / kvmem_prefix_query_tokens).",
            pool.prefix_hit_tokens,
        )
        yield CounterMetricFamily(
            "kvmem_prefix_pages_cached", "Pages steps inserted into the prefix cache.", sessions.num_pages_cached
        )
        yield CounterMetricFamily(
            "kvmem_prefix_evictions", "Cached pages evicted (least recently used first) for allocs.", pool.num_evictions
        )
        ended = CounterMetricFamily("kvmem_sessions_ended", "Sessions ended, by why.", labels=["why"])
        for why, n in sorted(sessions.sessions_ended.items()):
            ended.add_metric([why], n)
        yield ended

    def _rpc(self) -> Iterator[Metric]:
        rpc = self.rpc
        calls = CounterMetricFamily(
            "kvmem_rpc_calls", "Unary calls handled, by method and gRPC code.", labels=["method", "code"]
        )
        for (method, code), n in sorted(rpc.calls.items()):
            calls.add_metric([method, code], n)
        yield calls
        errors = CounterMetricFamily(
            "kvmem_rpc_errors",
            "Calls refused, by method and kvmem reason (ErrorInfo.reason).",
            labels=["method", "reason"],
        )
        for (method, reason), n in sorted(rpc.errors.items()):
            errors.add_metric([method, reason], n)
        yield errors
        handler = HistogramMetricFamily(
            "kvmem_rpc_handler_seconds",
            "Time in a unary handler (validation, the core, building the response; not the transport).",
            labels=["method"],
        )
        for method, counts in sorted(rpc.time_counts.items()):
            cumulative, buckets = 0, []
            for bound, n in zip((*HANDLER_BUCKETS, float("inf")), counts, strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            handler.add_metric([method], buckets, rpc.time_sum[method])
        yield handler


def build_registry(sessions: Sessions, rpc: RpcStats, memory_backend: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KVMemCollector(sessions, rpc, memory_backend))
    ProcessCollector(registry=registry)
    return registry


class MetricsServer:
    """``GET /metrics`` over HTTP/1.1 on the running event loop; one response per
    connection (``Connection: close``). Any other path is 404, any other method 405."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._server: asyncio.base_events.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host.strip("[]"), port, limit=_MAX_REQUEST_HEAD)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) == 3 else ("", "")
            if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                status, body, ctype = "400 Bad Request", b"bad request line\n", _TEXT
            elif path != "/metrics":
                status, body, ctype = "404 Not Found", b"kvmem serves GET /metrics only\n", _TEXT
            elif method not in ("GET", "HEAD"):
                status, body, ctype = "405 Method Not Allowed", b"use GET /metrics\n", _TEXT
            else:
                status, body, ctype = "200 OK", generate_latest(self.registry), CONTENT_TYPE
            # HEAD: the headers a GET would have, without the body.
            writer.write(_head(status, ctype, len(body)) + (b"" if method == "HEAD" else body))
            await writer.drain()
        except ConnectionError:
            pass
        except Exception:  # a scrape must never take the server down; say why once
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _head(status: str, content_type: str, length: int) -> bytes:
    allow = "Allow: GET, HEAD\r\n" if status.startswith("405") else ""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n"
        f"{allow}Connection: close\r\n\r\n"
    ).encode("latin-1")
