"""``kvmem health`` and ``kvmem stats``: the client commands of :mod:`kvmem.server.cli`.

They import grpc and the client library only when run (``kvmem serve`` needs neither).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _target(args: argparse.Namespace) -> str:
    if args.tcp:
        return args.tcp
    return f"unix:{args.socket}"


def health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(_target(args)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"kvmem health: {_target(args)}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    what = "readiness" if args.service else "liveness"
    print(f"{what} ({args.service or '<server>'}): {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def stats(args: argparse.Namespace) -> int:
    from kvmem.client.admin import stats as fetch_stats
    from kvmem.client.errors import KVMemError

    try:
        s = fetch_stats(_target(args), audit=args.audit, timeout=args.timeout, auth_token=args.auth_token)
    except KVMemError as err:
        print(f"kvmem stats: {_target(args)}: {err}", file=sys.stderr)
        return 1
    from google.protobuf import json_format

    if args.json:
        print(json.dumps(json_format.MessageToDict(s, always_print_fields_with_no_presence=True), indent=2))
        return 0
    g = s.geometry
    used = s.num_used_pages
    total = max(s.num_pages_total, 1)
    lines = [
        f"epoch {s.epoch}   uptime {s.uptime_ms / 1000:.1f}s   steps {s.num_steps}   memory {s.memory_backend}",
        f"pool  {s.num_pages_total} pages x {g.page_size} tokens; max {g.max_requests} requests, "
        f"{g.max_context_len} tokens each",
        f"pages used {used} ({100 * used / total:.1f}%)   cached {s.num_cached_pages}   free {s.num_free_pages}"
        f"   quarantined {s.num_quarantined_pages} (of {s.num_quarantined_sessions} lapsed sessions)",
        f"request slots open {s.num_open_requests}   free {s.num_free_request_slots}",
        _prefix_line(s),
    ]
    if s.audit.ran:
        lines.append("audit OK" if s.audit.ok else "audit FAILED: " + "; ".join(s.audit.problems))
    lines.append("")
    lines.append(
        f"{'#':>4}  {'session':<24} {'requests':>8} {'pages':>8} {'quota':>8} {'idle':>8}  {'namespace':<16} "
        f"{'hit/query':>15} {'evicted':>8}"
    )
    for u in s.sessions:
        quota = str(u.quota_pages) if u.HasField("quota_pages") else "-"
        namespace = u.cache_namespace[:16] if u.cache_namespace else DEFAULT_NAMESPACE
        hits = f"{u.prefix_hit_tokens}/{u.prefix_query_tokens}"
        lines.append(
            f"{u.index:>4}  {u.name[:24]:<24} {u.num_requests:>8} {u.num_pages_held:>8} {quota:>8} "
            f"{u.idle_ms / 1000:>7.1f}s  {namespace:<16} {hits:>15} {u.num_evictions:>8}"
        )
    if not s.sessions:
        lines.append("      (no sessions)")
    print("\n".join(lines))
    return 0 if (not s.audit.ran or s.audit.ok) else 1


DEFAULT_NAMESPACE = "(default)"  # how the table shows the shared default namespace, ""


def _prefix_line(s: Any) -> str:
    """The prefix cache in one line: on or off, its key recipe, its size, and the hit
    rate with its denominator (hit tokens of query tokens)."""
    if not s.prefix_cache_enabled:
        return f"prefix cache off (--no-prefix-cache)   hash {s.prefix_hash}"
    query, hit = s.prefix_query_tokens, s.prefix_hit_tokens
    rate = f"{100 * hit / query:.1f}%" if query else "-"
    return (
        f"prefix cache on   hash {s.prefix_hash}   entries {s.num_cache_entries}   hit rate {rate} "
        f"({hit} of {query} query tokens)   evictions {s.num_evictions}"
    )
