"""Prometheus metrics over HTTP, served from the server's own event loop.

A scrape of ``GET /metrics`` shows (names under ``kvmem_``):

- the build (``kvmem_build_info``: kvmem, Python, gRPC and numpy versions, the page-key
  recipe) and this server (``kvmem_info``: its epoch and memory backend);
- the pool: pages by state, usable pages, request slots by state, the geometry;
- the sessions: how many, and per session (its name and server index, never its id)
  the requests and pages it holds, its quota, and its prefix-cache query and hit
  tokens and evictions;
- the prefix cache: whether it is on (and its key recipe), cache entries, and totals of
  query and hit tokens (hit rate = hit / query), pages inserted and pages evicted;
- the host-memory tier (``--host-memory``): its pages by state, pages and bytes moved
  each way, pages evicted and dropped, prompt tokens matched from it;
- the cluster tier (``--store URL``): the store's kind and model id, whether it is up (a
  store that is down never makes the server unready: matches only miss it), connects and
  failed calls, pages written, found and read, dropped and failed writes, values
  rejected by reason, bytes each way, fetches and their latency, writes pending; never
  its URL (the password stays out of the scrape whatever the URL holds);
- totals since start: steps, pages allocated and released, alloc items by status
  (``OUT_OF_PAGES`` is memory pressure), sessions ended and why;
- per RPC method: calls by gRPC code, errors by kvmem reason, and a histogram of the
  handler's time in the server (validation, the core, building the response message;
  not the transport); each message of a StepStream is one call of ``StepStream``;
- the process (CPU seconds, resident memory, open files) from prometheus_client.

The gauges are read from the sessions layer when a scrape arrives, so the hot path pays
nothing for them; the totals are integer additions made by the sessions layer and the service.
Names follow Prometheus' conventions: counters end in ``_total`` (prometheus_client adds it
to the family names below), gauges never do, info metrics end in ``_info``.

prometheus_client writes the body and chooses its format from the scrape's ``Accept``
header: OpenMetrics 1.0 (ending ``# EOF``) when asked for ``application/openmetrics-text``,
as Prometheus does by default, otherwise the text format 0.0.4; gzip when the scrape
accepts it.

The endpoint is a small HTTP/1.1 server on the gRPC event loop (asyncio streams), not
prometheus_client's server thread: a scrape then runs between two calls and reads one
consistent state, never a step half-applied, and needs no lock on the hot path. Only the
request parsing is ours; the body, its content type and its compression are prometheus_client's.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import functools
import gzip
import logging
import platform
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.registry import Collector

from kvmem.cli.version import version
from kvmem.server.core import AllocStatus
from kvmem.server.core.config import HostTierStats

if TYPE_CHECKING:
    from kvmem.server.sessions import ServerStats, Sessions

log = logging.getLogger("kvmem.metrics")

# Handler time buckets, seconds: a decode step of 256 items takes ~0.1-0.3 ms in the
# handler, a prefill of 131k tokens a few ms, an audited Stats of a large pool more.
HANDLER_BUCKETS = (50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0)

_TEXT = "text/plain; charset=utf-8"  # the error answers
_MAX_REQUEST_HEAD = 8192  # bytes of request line and headers a scrape may send
_READ_TIMEOUT_S = 10.0
# gzip runs on the event loop: level 1, the fastest (a 10 KB scrape: 4.5x smaller in ~70 us).
_GZIP_LEVEL = 1


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


@functools.cache
def build_versions() -> dict[str, str]:
    """The versions ``kvmem_build_info`` shows; kvmem's is :func:`kvmem.cli.version.version`,
    the one ``kvmem --version``, the first log line and Stats show."""
    return {
        "version": version(),
        "python": platform.python_version(),
        "grpc": grpc.__version__,
        "numpy": np.__version__,
    }


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
        # Info metrics: the sample is the name + "_info", always 1 (a gauge in the text format).
        yield InfoMetricFamily(
            "kvmem_build",
            "This build: kvmem, Python, gRPC and numpy versions, and the prefix cache's page-key recipe.",
            {**build_versions(), "prefix_hash": stats.prefix_hash},
        )
        yield InfoMetricFamily(
            "kvmem",
            "This server: its epoch (changes at every start) and memory backend.",
            {"epoch": sessions.epoch, "memory_backend": self.memory_backend},
        )
        geometry = GaugeMetricFamily("kvmem_pool_config", "The pool's geometry, as configured.", labels=["setting"])
        for setting, value in (
            ("page_size_tokens", cfg.page_size),
            ("max_requests", cfg.max_requests),
            ("max_context_tokens", cfg.max_context_len),
        ):
            geometry.add_metric([setting], value)
        yield geometry
        yield GaugeMetricFamily(
            "kvmem_pool_pages", "Usable pages in the pool (page 0 is padding).", pool.num_pages_total
        )
        pages = GaugeMetricFamily(
            "kvmem_pages", "Pages by state; free + used + cached + quarantined = kvmem_pool_pages.", labels=["state"]
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
        yield GaugeMetricFamily(
            "kvmem_handoff_tickets",
            "Hand-off tickets open (requests handed off, not adopted yet; their slots "
            "are open in kvmem_request_slots).",
            pool.num_handoff_tickets,
        )
        yield GaugeMetricFamily(
            "kvmem_handoff_pages",
            'Page references the open hand-off tickets\' requests hold (counted in kvmem_pages{state="used"}).',
            pool.num_handoff_pages,
        )
        handoffs = CounterMetricFamily(
            "kvmem_handoffs",
            "Requests handed off, by outcome so far: adopted, expired (not adopted within "
            "--handoff-ms), given_up (released with the giver's session), or handed_off (all of them).",
            labels=["outcome"],
        )
        for outcome, n in zip(("handed_off", "adopted", "expired", "given_up"), stats.handoffs, strict=True):
            handoffs.add_metric([outcome], n)
        yield handoffs
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
        yield from _host_tier(pool.host)
        yield from _store(pool.store)

    def _per_session(self, stats: ServerStats) -> Iterator[Metric]:
        labels = ["session", "index"]
        held = GaugeMetricFamily("kvmem_session_pages", "Pages a session's open requests hold.", labels=labels)
        reqs = GaugeMetricFamily("kvmem_session_requests", "A session's open requests.", labels=labels)
        quota = GaugeMetricFamily(
            "kvmem_session_quota_pages", "A session's page quota (sessions with one).", labels=labels
        )
        query = CounterMetricFamily(
            "kvmem_session_prefix_query_tokens",
            "Tokens a session's match items asked the prefix cache for.",
            labels=labels,
        )
        hit = CounterMetricFamily(
            "kvmem_session_prefix_hit_tokens",
            "Tokens a session's match items found in the prefix cache.",
            labels=labels,
        )
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
        origin = GaugeMetricFamily(
            "kvmem_state_origin",
            "Where this run's state came from (1 for its kind: fresh, new or adopted).",
            labels=["kind"],
        )
        kind = stats.origin.kind if stats.origin is not None else "fresh"
        for name in ("fresh", "new", "adopted"):
            origin.add_metric([name], float(name == kind))
        yield origin
        restored = stats.origin.restoration if stats.origin is not None else None
        yield GaugeMetricFamily(
            "kvmem_state_adopted_requests",
            "Open requests adopted from the last run's kept state.",
            0 if restored is None else restored.requests,
        )
        yield GaugeMetricFamily(
            "kvmem_state_repairs",
            "Repairs adoption made to the last run's kept state (kinds of repair).",
            0 if restored is None else len(restored.repaired),
        )
        yield GaugeMetricFamily(
            "kvmem_state_step_undone",
            "1 when adoption undid a Step the last run's crash cut, else 0.",
            float(restored is not None and bool(restored.undone)),
        )
        resumes = GaugeMetricFamily(
            "kvmem_state_sessions",
            "The last run's sessions, by fate: resumed, waiting (within --resume-ms) or ended (not resumed in time).",
            labels=["fate"],
        )
        for fate, n in (
            ("resumed", stats.num_resumed),
            ("waiting", stats.num_dormant),
            ("ended", stats.num_not_resumed),
        ):
            resumes.add_metric([fate], float(n))
        yield resumes
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
            "Tokens match items found in the prefix cache (hit rate: this / kvmem_prefix_query_tokens_total).",
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
            "kvmem_rpc_calls",
            "Calls handled, by method and gRPC code (each message on a StepStream is one call of StepStream).",
            labels=["method", "code"],
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
    connection (``Connection: close``). Any other path is 404, any other method 405.
    Query strings are ignored."""

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

    def respond(self, head: bytes) -> tuple[bytes, bytes]:
        """The response's status line and headers, and its body, for a request head
        (request line and headers, as read up to the blank line)."""
        request_line, _, header_block = head.decode("latin-1").partition("\r\n")
        parts = request_line.split(" ")
        method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) == 3 else ("", "")
        extra: list[tuple[str, str]] = []
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            status, body, ctype = "400 Bad Request", b"bad request line\n", _TEXT
        elif path != "/metrics":
            status, body, ctype = "404 Not Found", b"kvmem serves GET /metrics only\n", _TEXT
        elif method not in ("GET", "HEAD"):
            status, body, ctype = "405 Method Not Allowed", b"use GET /metrics\n", _TEXT
            extra.append(("Allow", "GET, HEAD"))
        else:
            headers = _headers(header_block)
            encoder, ctype = choose_encoder(headers.get("accept", ""))
            status, body = "200 OK", encoder(self.registry)
            extra.append(("Vary", "Accept, Accept-Encoding"))
            if gzip_accepted(headers.get("accept-encoding", "")):
                body = gzip.compress(body, compresslevel=_GZIP_LEVEL, mtime=0)
                extra.append(("Content-Encoding", "gzip"))
        lines = [f"HTTP/1.1 {status}", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in extra]
        lines += ["Connection: close", "", ""]
        # HEAD: the headers a GET would have, without the body.
        return "\r\n".join(lines).encode("latin-1"), b"" if method == "HEAD" else body

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            response_head, body = self.respond(head)
            writer.write(response_head + body)
            await writer.drain()
        except ConnectionError:
            pass
        except Exception:  # a scrape must never take the server down; say why once
            log.exception("metrics request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


def _headers(block: str) -> dict[str, str]:
    """Header names (lower case) to values; a header sent more than once: its values
    joined by commas, as HTTP allows for lists such as Accept."""
    found: dict[str, str] = {}
    for line in block.split("\r\n"):
        name, sep, val = line.partition(":")
        if sep:
            key, val = name.strip().lower(), val.strip()
            found[key] = f"{found[key]}, {val}" if key in found else val
    return found


def _host_tier(host: HostTierStats | None) -> Iterator[Any]:
    """The host-memory tier (kvmem serve --host-memory), when there is one: its pages by
    state and in copy, pages moved each way, evicted and dropped, the tokens matches took
    from it, and its loads' latency and bandwidth."""
    if host is None:
        return
    pages = GaugeMetricFamily(
        "kvmem_host_tier_pages", "Host-tier pages by state; free + cached = the tier's pages.", labels=["state"]
    )
    pages.add_metric(["free"], host.num_free_pages)
    pages.add_metric(["cached"], host.num_cached_pages)
    yield pages
    yield GaugeMetricFamily(
        "kvmem_host_tier_pages_in_copy", "Host-tier pages being copied into pool pages now (cached, pinned).",
        host.num_loading_pages,
    )  # fmt: skip
    latency = GaugeMetricFamily(
        "kvmem_host_tier_load_seconds",
        "A load's time from its Step to its last layer copied, over the last 1024 loads.",
        labels=["quantile"],
    )
    latency.add_metric(["0.5"], host.load_ms_p50 / 1e3)
    latency.add_metric(["0.99"], host.load_ms_p99 / 1e3)
    yield latency
    yield GaugeMetricFamily(
        "kvmem_host_tier_load_bytes_per_second", "The copy thread's bandwidth over the last 1024 loads.",
        host.load_gib_per_s * 2**30,
    )  # fmt: skip
    moved = CounterMetricFamily(
        "kvmem_host_tier_pages_moved",
        "Pages copied between the tiers: to the host as the pool evicted them (demoted), back for a match (loaded).",
        labels=["direction"],
    )
    moved.add_metric(["demoted"], host.num_demoted)
    moved.add_metric(["loaded"], host.num_loaded)
    yield moved
    yield CounterMetricFamily(
        "kvmem_host_tier_bytes_moved", "Bytes copied between the tiers, both ways.",
        (host.num_demoted + host.num_loaded) * host.page_bytes,
    )  # fmt: skip
    lost = CounterMetricFamily(
        "kvmem_host_tier_pages_gone",
        "Host-tier pages evicted to make room (evicted), and pool pages it could not take (dropped).",
        labels=["reason"],
    )
    lost.add_metric(["evicted"], host.num_evicted)
    lost.add_metric(["dropped"], host.num_dropped)
    yield lost
    yield CounterMetricFamily(
        "kvmem_host_tier_hit_tokens", "Prompt tokens matches loaded from the host tier.", host.hit_tokens
    )


def _store(store: Mapping[str, Any] | None) -> Iterator[Any]:
    """The cluster tier (kvmem serve --store URL), when there is one, from the store
    link's snapshot (proto ``StoreStats``' fields): up or not, connects and failed calls,
    pages written, found and read, writes dropped and failed, values rejected by reason,
    bytes each way, fetches and their latency, writes pending. The URL is left out: no
    other metric carries one, and a label is no place for a store's address."""
    if store is None:
        return
    yield InfoMetricFamily(
        "kvmem_store",
        "The store: its kind, and the model id its keys are made for (empty until an engine attaches with one).",
        {"kind": str(store["kind"]), "model_id": str(store["model_id"])},
    )
    # 0 while the store is down: matches miss it and writes are dropped, the server stays
    # ready and healthy (readiness never depends on the store) and reconnects with backoff.
    yield GaugeMetricFamily(
        "kvmem_store_up", "1 when the store's last call succeeded, 0 while it is down (reconnecting with backoff).",
        int(bool(store["reachable"])),
    )  # fmt: skip
    yield CounterMetricFamily(
        "kvmem_store_connects", "Successful connects to the store (1 + reconnects).", store["connects"]
    )
    yield CounterMetricFamily(
        "kvmem_store_failures", "Store calls that failed (down, timed out, refused).", store["failures"]
    )
    pages = CounterMetricFamily(
        "kvmem_store_pages",
        "Pages written to the store, found in it by fetches, and read back from it (checked, into the host tier).",
        labels=["direction"],
    )
    pages.add_metric(["written"], store["pages_written"])
    pages.add_metric(["found"], store["pages_found"])
    pages.add_metric(["read"], store["pages_read"])
    yield pages
    yield CounterMetricFamily(
        "kvmem_store_pages_dropped",
        "Pages not written: the write queue was full, the store was down, or no model id was set yet.",
        store["write_dropped"],
    )
    yield CounterMetricFamily(
        "kvmem_store_write_failed", "Pages whose write the store refused or failed.", store["write_failed"]
    )
    yield CounterMetricFamily(
        "kvmem_store_pages_no_room", "Pages found in the store that the host tier had no room for.", store["no_room"]
    )
    rejected = CounterMetricFamily(
        "kvmem_store_rejected",
        "Values read from the store and refused (a miss, never loaded), by reason.",
        labels=["reason"],
    )
    for reason, n in sorted(store["rejected"].items()):
        rejected.add_metric([reason], n)
    yield rejected
    moved = CounterMetricFamily(
        "kvmem_store_bytes", "Bytes written to and read from the store (headers included).", labels=["direction"]
    )
    moved.add_metric(["written"], store["bytes_written"])
    moved.add_metric(["read"], store["bytes_read"])
    yield moved
    yield CounterMetricFamily("kvmem_store_fetches", "Matches' continuations asked of the store.", store["fetches"])
    latency = GaugeMetricFamily(
        "kvmem_store_fetch_seconds",
        "A fetch's time from its match to its pages checked, over the last 1024 fetches.",
        labels=["quantile"],
    )
    latency.add_metric(["0.5"], store["fetch_ms_p50"] / 1e3)
    latency.add_metric(["0.99"], store["fetch_ms_p99"] / 1e3)
    yield latency
    yield GaugeMetricFamily(
        "kvmem_store_writes_pending", "Host pages waiting for their write to the store now (pinned until written).",
        store["writes_pending"],
    )  # fmt: skip
