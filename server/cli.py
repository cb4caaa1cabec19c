"""``kvmem`` command line: ``serve``, ``health``, ``stats``.

Every ``serve`` option can also come from a ``KVMEM_*`` environment variable (the
option's name in upper case, dashes as underscores: ``--page-size`` is
``KVMEM_PAGE_SIZE``); a command-line value wins over the environment.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SOCKET = "/tmp/kvmem.sock"


def _env(name: str, default: Any, parse: Callable[[str], Any] = str) -> Any:
    raw = os.environ.get("KVMEM_" + name.upper().replace("-", "_"))
    if raw is None or raw == "":
        return default
    try:
        return parse(raw)
    except ValueError:
        env = "KVMEM_" + name.upper().replace("-", "_")
        raise SystemExit(f"kvmem: {env}={raw!r} is not a valid {parse.__name__}") from None


def switch(raw: str) -> bool:
    """An environment switch: 1/true/yes/on or 0/false/no/off."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _add(p: argparse._ActionsContainer, flag: str, default: Any, help: str, type: Callable[[str], Any] = str) -> None:
    name = flag.lstrip("-")
    env = "KVMEM_" + name.upper().replace("-", "_")
    shown = "none" if default is None else default
    p.add_argument(flag, type=type, default=_env(name, default, type), help=f"{help} (default: {shown}; env {env})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvmem",
        description="kvmem: a KV-cache memory manager for LLM inference. One server per GPU node owns the "
        "KV page pool and the block tables; scheduler workers attach over gRPC.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_serve(sub)
    _add_client_commands(sub)
    return parser


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser(
        "serve",
        help="run the server (until SIGTERM/SIGINT)",
        description="Run the kvmem server. It listens on a unix socket (mode 0600) and, if asked, on TCP; "
        "health is grpc.health.v1 (service '' = liveness, 'kvmem.v1.KVMemory' = readiness). "
        "Every option can also be set from its KVMEM_* environment variable.",
    )
    listen = serve.add_argument_group("listening")
    _add(listen, "--socket", DEFAULT_SOCKET, "unix socket path to listen on; 'none' to disable")
    _add(listen, "--tcp", None, "also listen on TCP HOST:PORT (loopback unless --auth-token is set)")
    _add(listen, "--auth-token", None, "bearer token TCP clients must send (required beyond loopback)")
    _add(
        listen,
        "--metrics",
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 0.0.0.0:9400; "
        "port 0 picks a free one and logs it); no authentication, so pick the interface",
    )
    pool = serve.add_argument_group("pool geometry")
    _add(pool, "--page-size", 16, "tokens per page", int)
    _add(pool, "--num-pages", 4096, "pages in the pool, including the padding page 0", int)
    _add(pool, "--memory", None, "KV memory budget per device (e.g. 40GiB, 512MiB): the largest page count "
         "that fits, after the block table; replaces --num-pages")  # fmt: skip
    _add(pool, "--max-requests", 256, "request slots (concurrently open requests)", int)
    _add(pool, "--max-context", 8192, "longest request, in tokens", int)
    mem = serve.add_argument_group("KV memory (the model's KV geometry and where the KV cache lives)")
    _add(mem, "--device", "cpu", "cpu (POSIX shared memory), cuda:N (one GPU, CUDA IPC) or none (no KV memory)")
    _add(mem, "--devices", None, "comma-separated GPU indices for tensor-parallel ranks (e.g. 0,1): one KV "
         "allocation per GPU, one page-id space; implies cuda")  # fmt: skip
    _add(mem, "--shm-dir", "/dev/shm", "directory of the shared-memory files (cpu device)")
    _add(mem, "--format", "mha", "mha (K and V per layer) or mla (one latent vector per token)")
    _add(mem, "--layers", 2, "transformer layers", int)
    _add(mem, "--kv-heads", 2, "KV heads per layer (mha)", int)
    _add(mem, "--head-dim", 64, "head dimension (mha)", int)
    _add(mem, "--kv-lora-rank", 512, "latent rank (mla)", int)
    _add(mem, "--rope-dim", 64, "rotary dimension stored beside the latent (mla)", int)
    _add(mem, "--dtype", "bfloat16", "KV element type: bfloat16, float16, float32 or float8_e4m3fn")
    sessions = serve.add_argument_group("sessions")
    _add(sessions, "--lease-ms", 10000, "a session that makes no call or keep-alive for this long ends", int)
    _add(sessions, "--shutdown-grace-ms", 5000, "how long in-flight calls may run after SIGTERM", int)
    _add(serve, "--log-level", "info", "debug, info, warning or error")
    serve.add_argument(
        "--debug-audit",
        action="store_true",
        default=_env("debug", False, switch),
        help="run the full pool audit (O(pool)) after every step; a broken invariant fails the call as "
        "INTERNAL: for tests and debugging, not production (default: off; env KVMEM_DEBUG)",
    )


def _add_client_commands(sub: Any) -> None:
    for name, text in (
        ("health", "check a server's health (exit 0 when serving; for a Docker HEALTHCHECK)"),
        ("stats", "print pool and per-session usage"),
    ):
        p = sub.add_parser(name, help=text, description=text)
        _add(p, "--socket", DEFAULT_SOCKET, "unix socket of the server")
        _add(p, "--tcp", None, "HOST:PORT of the server instead of the socket")
        _add(p, "--auth-token", None, "bearer token for TCP")
        p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer (default: 3)")
        if name == "health":
            p.add_argument(
                "--service",
                default="kvmem.v1.KVMemory",
                help="health service to check: 'kvmem.v1.KVMemory' = readiness (default), '' = liveness",
            )
        else:
            p.add_argument("--json", action="store_true", help="print JSON instead of a table")
            p.add_argument("--audit", action="store_true", help="also run the full pool audit (O(pool))")


def _target(args: argparse.Namespace) -> str:
    if args.tcp:
        return args.tcp
    return f"unix:{args.socket}"


def _serve(args: argparse.Namespace) -> int:
    from kvmem.server.app import ServerConfig, serve

    socket_path = None if args.socket in ("", "none") else args.socket
    config = ServerConfig(
        socket_path=socket_path,
        tcp=args.tcp,
        metrics=args.metrics,
        auth_token=args.auth_token,
        lease_s=args.lease_ms / 1000,
        shutdown_grace_s=args.shutdown_grace_ms / 1000,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_requests=args.max_requests,
        max_context_len=args.max_context,
        memory=args.memory,
        device=args.device,
        devices=_devices(args.devices),
        shm_dir=args.shm_dir,
        kv_format=args.format,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        kv_lora_rank=args.kv_lora_rank,
        rope_dim=args.rope_dim,
        dtype=args.dtype,
        audit_every_step=args.debug_audit,
    )
    return serve(config)


def _devices(raw: str | None) -> tuple[int, ...]:
    if not raw:
        return ()
    parts = [p.strip() for p in raw.split(",")]
    if not all(p.isdigit() for p in parts):
        raise SystemExit(f"kvmem serve: --devices must be comma-separated GPU indices such as 0,1, got {raw!r}")
    if len(set(parts)) != len(parts):
        raise SystemExit(f"kvmem serve: --devices lists a GPU twice: {raw!r}")
    return tuple(int(p) for p in parts)


def _health(args: argparse.Namespace) -> int:
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


def _stats(args: argparse.Namespace) -> int:
    from kvmem.client.admin import stats
    from kvmem.client.errors import KVMemError

    try:
        s = stats(_target(args), audit=args.audit, timeout=args.timeout, auth_token=args.auth_token)
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
        f"pages used {used} ({100 * used / total:.1f}%)   cached {s.num_cached_pages}   free {s.num_free_pages}",
        f"request slots open {s.num_open_requests}   free {s.num_free_request_slots}",
    ]
    if s.audit.ran:
        lines.append("audit OK" if s.audit.ok else "audit FAILED: " + "; ".join(s.audit.problems))
    lines.append("")
    lines.append(f"{'#':>4}  {'session':<24} {'requests':>8} {'pages':>8} {'quota':>8} {'idle':>8}")
    for u in s.sessions:
        quota = str(u.quota_pages) if u.HasField("quota_pages") else "-"
        lines.append(
            f"{u.index:>4}  {u.name[:24]:<24} {u.num_requests:>8} {u.num_pages_held:>8} {quota:>8} "
            f"{u.idle_ms / 1000:>7.1f}s"
        )
    if not s.sessions:
        lines.append("      (no sessions)")
    print("\n".join(lines))
    return 0 if (not s.audit.ran or s.audit.ok) else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.Formatter.converter = time.gmtime
    handler = {"serve": _serve, "health": _health, "stats": _stats}[args.command]
    try:
        return handler(args)
    except BrokenPipeError:  # `kvmem stats | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
