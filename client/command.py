"""``kvmem health`` and ``kvmem stats``: the client side's subcommands of the ``kvmem``
command (:mod:`kvmem.cli`), their options and their runs.

They import grpc and the rest of the client library only when run, so ``--help`` stays
instant.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import threading
import time
from typing import Any

from kvmem.cli.options import DEFAULT_SOCKET, address, integer, option, positive_float

HELP = {
    "health": "check a server's health (exit 0 when serving; for a Docker HEALTHCHECK)",
    "stats": "print pool and per-session usage",
}


def add_parser(sub: Any, name: str) -> None:
    """Register ``health`` or ``stats`` on the ``kvmem`` command's subparsers."""
    text = HELP[name]
    p = sub.add_parser(name, help=text, description=text)
    option(p, "--socket", DEFAULT_SOCKET, "unix socket of the server")
    option(p, "--tcp", None, "HOST:PORT of the server instead of the socket", address)
    option(p, "--auth-token", None, "bearer token for TCP")
    option(p, "--tls-ca", None, "with --tcp: TLS, checking the server's certificate against the CA(s) in this PEM file")
    option(
        p,
        "--tls-server-name",
        None,
        "with --tls-ca: the name the server's certificate must have, when it is not --tcp's host",
    )
    option(
        p, "--tls-client-cert", None, "with --tls-ca: this client's PEM certificate, for a server with --tls-client-ca"
    )
    option(p, "--tls-client-key", None, "the PEM private key of --tls-client-cert")
    p.add_argument("--timeout", type=positive_float, default=3.0, help="seconds to wait for an answer (default: 3)")
    if name == "health":
        p.add_argument(
            "--service",
            default="kvmem.v1.KVMemory",
            help="health service to check: 'kvmem.v1.KVMemory' = readiness (default), '' = liveness",
        )
    else:
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.add_argument("--audit", action="store_true", help="also run the full pool audit (O(pool))")
        p.add_argument(
            "--watch",
            nargs="?",
            const=2.0,
            type=positive_float,
            metavar="SECONDS",
            help="refresh every SECONDS (default: 2) until Ctrl-C: redrawn in place on a terminal, "
            "one block after another otherwise (--json: one JSON object a line)",
        )
        p.add_argument("--count", type=integer(1), help="stop after this many refreshes (implies --watch)")


def run(args: argparse.Namespace) -> int:
    """Run ``kvmem health`` or ``kvmem stats`` with the parsed options."""
    return health(args) if args.command == "health" else stats(args)


def _target(args: argparse.Namespace) -> str:
    if args.tcp:
        return args.tcp
    return f"unix:{args.socket}"


def _tls(args: argparse.Namespace) -> dict[str, Any]:
    """The client's TLS arguments from --tls-ca, --tls-server-name, --tls-client-cert and
    --tls-client-key (TCP only: the unix socket is plaintext)."""
    return {
        "tls_ca": args.tls_ca,
        "tls_server_name": args.tls_server_name,
        "tls_cert": args.tls_client_cert,
        "tls_key": args.tls_client_key,
    }


def _transport(args: argparse.Namespace, command: str) -> Any:
    """The client's Transport for the target, or None after a one-line error on stderr
    (a TLS option without --tcp, a file that cannot be read)."""
    from kvmem.client.channel import transport

    options = ("--tls-ca", "--tls-server-name", "--tls-client-cert", "--tls-client-key")
    given = [o for o in options if getattr(args, o[2:].replace("-", "_")) is not None]
    if given and not args.tcp:
        print(f"kvmem {command}: {given[0]} needs --tcp HOST:PORT (the unix socket is plaintext)", file=sys.stderr)
        return None
    try:
        return transport(_target(args), **_tls(args))
    except ValueError as exc:  # named by the library's parameters: say the options instead
        text = re.sub(r"\btls_(ca|server_name|cert|key)\b", lambda m: _OPTION_OF[m.group(0)], str(exc))
        print(f"kvmem {command}: {text}", file=sys.stderr)
        return None


_OPTION_OF = {
    "tls_ca": "--tls-ca",
    "tls_server_name": "--tls-server-name",
    "tls_cert": "--tls-client-cert",
    "tls_key": "--tls-client-key",
}


def health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    how = _transport(args, "health")
    if how is None:
        return 2
    with how.channel() as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as err:
            details = how.explain(err.details() or "", first=True) or err.details()
            print(f"kvmem health: {_target(args)}: {err.code().name}: {details}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    what = "readiness" if args.service else "liveness"
    print(f"{what} ({args.service or '<server>'}): {status}")
    if args.service and resp.status == health_pb2.HealthCheckResponse.SERVING:
        _store_detail(args)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _store_detail(args: argparse.Namespace) -> None:
    """A ready server with a store (``kvmem serve --store``): one more line saying
    whether the store answers. Never changes the exit status: a store that is down only
    makes matches miss. Nothing when Stats cannot be read (e.g. a token is needed)."""
    from kvmem.client.admin import stats as fetch_stats
    from kvmem.client.errors import KVMemError

    try:
        s = fetch_stats(_target(args), timeout=args.timeout, auth_token=getattr(args, "auth_token", None), **_tls(args))
    except KVMemError:
        return
    if not s.HasField("store"):
        return
    st = s.store
    state = "reachable" if st.reachable else f"UNREACHABLE ({st.last_error}; reconnecting with backoff)"
    print(f"store ({st.kind} {st.url}): {state}; matches miss it while it is down, the server stays ready")


def stats(args: argparse.Namespace) -> int:
    """``kvmem stats``: once, or with ``--watch``/``--count`` refreshed until Ctrl-C (exit 0)
    or the count is reached (the exit status of the last refresh)."""
    if _transport(args, "stats") is None:
        return 2
    if args.watch is None and args.count is None:
        out, code, reached = _snapshot(args, compact=False)
        print(out, file=sys.stdout if reached else sys.stderr)
        return code
    interval = 2.0 if args.watch is None else args.watch
    # Ctrl-C is how a watch ends (exit 0). It sets a flag rather than raising
    # KeyboardInterrupt wherever the process is: raised inside gRPC's channel code (a
    # refresh opens and closes a channel), it could leave the process hanging at its exit.
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda _signum, _frame: interrupted.set())
    try:
        return _watch(args, interval, args.count, sys.stdout.isatty(), interrupted)
    finally:
        signal.signal(signal.SIGINT, previous)


_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def _watch(
    args: argparse.Namespace, interval: float, count: int | None, tty: bool, interrupted: threading.Event
) -> int:
    """Refresh every ``interval`` seconds: on a terminal, clear and redraw one screen; else
    one block after another, each under a ``# <UTC time>`` line (``--json``: one JSON
    object a line, nothing else), errors on stderr. A server that does not answer is
    reported and asked again at the next refresh. Once ``interrupted`` is set (Ctrl-C),
    the refresh under way is printed and the watch ends: 0."""
    done, code = 0, 0
    while count is None or done < count:
        if done and interrupted.wait(interval):
            return 0
        out, code, reached = _snapshot(args, compact=not tty)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if tty:
            sys.stdout.write(f"{_CLEAR}kvmem stats {_target(args)}   every {interval:g}s   {stamp}\n\n{out}\n")
        elif not reached:
            print(f"{stamp} {out}", file=sys.stderr, flush=True)
        elif args.json:
            sys.stdout.write(out + "\n")
        else:
            sys.stdout.write(f"# {stamp}\n{out}\n\n")
        sys.stdout.flush()
        done += 1
        if interrupted.is_set():
            return 0
    return code


def _snapshot(args: argparse.Namespace, *, compact: bool) -> tuple[str, int, bool]:
    """One Stats call, printed: the text, the exit status (1 when the audit ran and
    failed) and whether the server answered (if not: the text is the error, status 1)."""
    from kvmem.client.admin import stats as fetch_stats
    from kvmem.client.errors import KVMemError

    try:
        s = fetch_stats(_target(args), audit=args.audit, timeout=args.timeout, auth_token=args.auth_token, **_tls(args))
    except KVMemError as err:
        return f"kvmem stats: {_target(args)}: {err}", 1, False
    code = 0 if (not s.audit.ran or s.audit.ok) else 1
    if args.json:
        from google.protobuf import json_format

        d = json_format.MessageToDict(s, always_print_fields_with_no_presence=True)
        return json.dumps(d, indent=None if compact else 2), code, True
    return _table(s), code, True


def _table(s: Any) -> str:
    """A StatsResponse for people: the pool, the prefix cache, then a row per session."""
    g = s.geometry
    used = s.num_used_pages
    total = max(s.num_pages_total, 1)
    lines = [
        f"kvmem {s.version or '(version not reported)'}   epoch {s.epoch}   uptime {s.uptime_ms / 1000:.1f}s   "
        f"steps {s.num_steps}   memory {s.memory_backend}",
        f"pool  {s.num_pages_total} pages x {g.page_size} tokens; max {g.max_requests} requests, "
        f"{g.max_context_len} tokens each",
        f"pages used {used} ({100 * used / total:.1f}%)   cached {s.num_cached_pages}   free {s.num_free_pages}"
        f"   quarantined {s.num_quarantined_pages} (of {s.num_quarantined_sessions} lapsed sessions)",
        f"request slots open {s.num_open_requests}   free {s.num_free_request_slots}",
        f"hand-offs open {s.num_handoff_tickets} ({s.num_handoff_pages} pages, counted in used)   since start: "
        f"handed off {s.num_handed_off}, adopted {s.num_adopted}, expired {s.num_handoffs_expired}, released with "
        f"their giver {s.num_handoffs_given_up}",
        _prefix_line(s),
        *_host_line(s),
        *_store_lines(s),
        _origin_line(s.origin),
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
    return "\n".join(lines)


DEFAULT_NAMESPACE = "(default)"  # how the table shows the shared default namespace, ""


def _origin_line(o: Any) -> str:
    """Where the run's state came from (kvmem serve --keep-state), in one line."""
    if o.kind == "adopted":
        repaired = "; ".join(o.repaired) if o.repaired else "nothing"
        return (
            f"state adopted from the last run in {o.adopt_ms:.0f} ms: {o.owners} owners, {o.requests} requests "
            f"({o.pages_in_rows} pages), {o.cached_pages} cached pages, {o.quarantined_pages} quarantined; "
            f"repaired: {repaired}{'; ' + o.undone if o.undone else ''}; sessions: {o.resumed} of {o.sessions} "
            f"resumed, {o.waiting} waiting, {o.not_resumed} ended unresumed"
        )
    if o.kind == "new":
        return "state kept for the next run (--keep-state): new in this run"
    return "state not kept (a restart starts empty; kvmem serve --keep-state keeps it)"


def _host_line(s: Any) -> list[str]:
    """The host-memory tier in one line (none without one)."""
    if not s.HasField("host_tier"):
        return []
    h = s.host_tier
    moved = (h.num_demoted + h.num_loaded) * h.page_bytes
    loads = (
        f"   loads: p50 {h.load_ms_p50:.2f} ms, p99 {h.load_ms_p99:.2f} ms, {h.load_gib_per_s:.1f} GiB/s"
        if h.num_loaded
        else ""
    )
    return [
        f"host tier {h.num_pages} pages   cached {h.num_cached_pages}   free {h.num_free_pages}   in copy "
        f"{h.num_loading_pages}   since start: demoted {h.num_demoted}, loaded {h.num_loaded} ({h.hit_tokens} "
        f"tokens matched from it), evicted {h.num_evicted}, dropped {h.num_dropped}; {moved / 2**20:.1f} MiB "
        f"moved{loads}"
    ]


def _store_lines(s: Any) -> list[str]:
    """The cluster tier (kvmem serve --store) in two lines (none without one): the store
    (its URL comes redacted), whether it answers and the model its keys are for; then its
    pages and bytes each way, values rejected (the reasons with any), writes pending and
    the fetches' latency. A store that is down only makes matches miss it: the server
    stays ready."""
    if not s.HasField("store"):
        return []
    t = s.store
    calls = f"connects {t.connects}, failed calls {t.failures}"
    if t.reachable:
        state = f"reachable ({calls})"
    elif not t.connects and not t.failures:
        state = "connecting (first try)"
    else:
        when = "since start: never connected" if not t.connects else "since its last error"
        state = (
            f"UNREACHABLE {when} ({t.last_error or 'no error text'}; {calls}): matches miss it and writes are "
            "dropped, reconnecting with backoff"
        )
    model = f"model {t.model_id}" if t.model_id else (
        "no model id yet: nothing written or fetched until an engine attaches with one"
    )  # fmt: skip
    rejected = ", ".join(f"{reason} {n}" for reason, n in sorted(t.rejected.items()) if n) or "none"
    latency = f"   fetches: p50 {t.fetch_ms_p50:.2f} ms, p99 {t.fetch_ms_p99:.2f} ms" if t.fetch_ms_p99 else ""
    return [
        f"store {t.kind} {t.url}   {state}   {model}",
        f"store since start: written {t.pages_written} pages (dropped {t.write_dropped}, failed {t.write_failed}), "
        f"fetched {t.fetches} (found {t.pages_found}, read {t.pages_read}, no room {t.no_room}), rejected "
        f"{rejected}; {_size(t.bytes_written)} written, {_size(t.bytes_read)} read; writes pending "
        f"{t.writes_pending}{latency}",
    ]


def _size(n: int) -> str:
    """Bytes for people: B, then KiB, MiB or GiB with one decimal."""
    if n < 1024:
        return f"{n} B"
    amount, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB"):
        if amount < 1024:
            break
        amount, unit = amount / 1024, bigger
    return f"{amount:.1f} {unit}"


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
