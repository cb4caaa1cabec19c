"""``kvmem serve``: its options and the run (the ``kvmem`` dispatcher, :mod:`kvmem.cli`,
imports this module only for ``serve``).

Every option can also come from a ``KVMEM_*`` environment variable (the option's name in
upper case, dashes as underscores: ``--page-size`` is ``KVMEM_PAGE_SIZE``); a
command-line value wins over the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvmem.cli.logs import LOG_FORMATS
from kvmem.cli.options import (
    DEFAULT_SOCKET,
    ENV_SPEC,
    address,
    device,
    integer,
    octal,
    one_of,
    option,
    switch,
)
from kvmem.cli.version import VersionAction


def add_parser(sub: Any, name: str = "serve") -> None:
    """Register ``serve`` on the ``kvmem`` command's subparsers."""
    serve = sub.add_parser(
        "serve",
        help="run the server (until SIGTERM/SIGINT)",
        description="Run the kvmem server. It listens on a unix socket (mode 0600) and, if asked, on TCP; "
        "health is grpc.health.v1 (service '' = liveness, 'kvmem.v1.KVMemory' = readiness). "
        "Every option can also be set from its KVMEM_* environment variable.",
    )
    serve.add_argument("--version", action=VersionAction)
    listen = serve.add_argument_group("listening")
    option(listen, "--socket", DEFAULT_SOCKET, "unix socket path to listen on; 'none' to disable")
    option(
        listen,
        "--socket-mode",
        "0600",
        "who may connect and map the KV memory: 0600 (the server's user) or 0660 "
        "(also its group); the socket and the shm files alike",
        octal,
    )
    option(
        listen,
        "--group",
        None,
        "with --socket-mode 0660: the group (name or number) given the socket and the shm "
        "files, so an engine running as another user of that group can attach",
    )
    option(listen, "--tcp", None, "also listen on TCP HOST:PORT (loopback unless --auth-token is set)", address)
    option(
        listen,
        "--auth-token",
        None,
        "bearer token TCP clients must send (required beyond loopback, with TLS or without)",
    )
    option(
        listen,
        "--tls-cert",
        None,
        "PEM certificate (chain) of the --tcp port: TLS on it, with --tls-key; the "
        "unix socket stays plaintext (mode 0600)",
    )
    option(listen, "--tls-key", None, "PEM private key (unencrypted) of --tls-cert")
    option(
        listen,
        "--tls-client-ca",
        None,
        "with --tls-cert: require TCP clients to present a certificate signed by "
        "a CA in this PEM file (mutual TLS; the bearer token is still required beyond loopback)",
    )
    option(
        listen,
        "--metrics",
        None,
        "serve Prometheus metrics at http://HOST:PORT/metrics (e.g. 0.0.0.0:9400; "
        "port 0 picks a free one and logs it); no authentication, so pick the interface",
        address,
    )
    option(
        listen,
        "--health-port",
        None,
        "also serve grpc.health.v1, and only it, on this TCP port of every interface "
        "(no token: for kubelet's gRPC probes; kvmem's service stays on the socket)",
        integer(1),
    )
    pool = serve.add_argument_group("pool geometry")
    option(pool, "--page-size", 16, "tokens per page", integer(1))
    option(
        pool,
        "--num-pages",
        4096,
        "pages in the pool, including the padding page 0",
        integer(2, why=" (page 0 is padding)"),
    )
    option(
        pool,
        "--memory",
        None,
        "KV memory budget per device (e.g. 40GiB, 512MiB): the largest page count "
        "that fits, after the block table; replaces --num-pages",
        _size,
    )
    option(
        pool,
        "--host-memory",
        None,
        "a host-memory tier of this size per device (e.g. 16GiB): cached pages the pool evicts are copied "
        "there (write-back) and a match that reaches them loads them back instead of prefilling them again; "
        "one index over both tiers, shared by every session. Size it at 2-4x the device pool (--memory) for "
        "multi-turn chat; each page costs its KV bytes (kvmem serve logs the page size). With --keep-state the "
        "tier's pages are a file in --shm-dir, kept with the pool. On a GPU (--device cuda:N, --devices) the "
        "tier is pinned memory, one of this size per device, copied on the sidecar's own CUDA stream. Off by "
        "default; needs the prefix cache on",
        _size,
    )
    option(
        pool,
        "--host-min-load-tokens",
        1,
        "with --host-memory: a match's continuation on the host tier shorter than this is not loaded (its "
        "tokens are computed instead). Copying a page beat computing its tokens at every length measured "
        "(SmolLM2-135M in fp32 on a CPU: a 720 KiB page in ~0.1 ms, its 16 tokens' prefill 140-200 ms; "
        "bench/tier_bench.py), so the default, 1, loads any whole page",
        integer(1),
    )
    option(
        pool,
        "--host-write-policy",
        "write-back",
        "with --host-memory: when a cached page is copied to the host tier: write-back, as the pool evicts it "
        "(only pages that leave are copied); write-through, as soon as it is cached (every cached page is "
        "copied once; an eviction then copies nothing)",
        one_of("write-back", "write-through"),
    )
    option(pool, "--max-requests", 256, "request slots (concurrently open requests)", integer(1))
    option(pool, "--max-context", 8192, "longest request, in tokens", integer(1))
    mem = serve.add_argument_group("KV memory (the model's KV geometry and where the KV cache lives)")
    option(
        mem, "--device", "cpu", "cpu (POSIX shared memory), cuda:N (one GPU, CUDA IPC) or none (no KV memory)", device
    )
    option(
        mem,
        "--devices",
        None,
        "comma-separated GPU indices for tensor-parallel ranks (e.g. 0,1): one KV "
        "allocation per GPU, one page-id space; implies cuda",
        _devices,
    )
    option(mem, "--shm-dir", "/dev/shm", "directory of the shared-memory files (cpu device)")
    option(mem, "--format", "mha", "mha (K and V per layer) or mla (one latent vector per token)", _format)
    option(mem, "--layers", 2, "transformer layers", integer(1))
    option(mem, "--kv-heads", 2, "KV heads per layer (mha)", integer(1))
    option(mem, "--head-dim", 64, "head dimension (mha)", integer(1))
    option(mem, "--kv-lora-rank", 512, "latent rank (mla)", integer(1))
    option(mem, "--rope-dim", 64, "rotary dimension stored beside the latent (mla)", integer(0))
    option(mem, "--dtype", "bfloat16", "KV element type: bfloat16, float16, float32 or float8_e4m3fn", _dtype)
    sessions = serve.add_argument_group("sessions")
    option(
        sessions,
        "--max-sessions",
        1024,
        "sessions attached at once; one more is refused (RESOURCE_EXHAUSTED, TOO_MANY_SESSIONS)",
        integer(1),
    )
    option(
        sessions,
        "--lease-ms",
        10000,
        "a session that makes no call or keep-alive for this long ends",
        integer(1, "milliseconds"),
    )
    option(
        sessions,
        "--quarantine-ms",
        None,
        "how long the pages of a session whose lease lapsed while it was still "
        "connected stay out of use, unless its connection closes first (a stopped process may wake up and write "
        "into them); none: six leases",
        integer(0, "milliseconds"),
    )
    keep = sessions.add_argument(
        "--keep-state",
        action="store_true",
        default=argparse.SUPPRESS,
        help="keep the pool's KV memory and its state (requests, the prefix cache, quarantines) in --shm-dir "
        "across restarts of this server (the same --socket and --tcp): a crashed or stopped server's state is "
        "adopted at start, checked and repaired, with its KV bytes; shm backend only (default: off; env "
        "KVMEM_KEEP_STATE)",
    )
    setattr(keep, ENV_SPEC, ("KVMEM_KEEP_STATE", False, switch))
    drop = sessions.add_argument(
        "--discard-state",
        action="store_true",
        default=argparse.SUPPRESS,
        help="with --keep-state: drop a kept state instead of adopting it, and start empty (default: off; env "
        "KVMEM_DISCARD_STATE)",
    )
    setattr(drop, ENV_SPEC, ("KVMEM_DISCARD_STATE", False, switch))
    option(
        sessions,
        "--resume-ms",
        None,
        "with --keep-state: how long after a restart the last run's sessions may "
        "resume (their clients re-attach by themselves, with their requests, rows and K/V as they were); one not "
        "resumed by then ends as a lapsed lease ends; none: three leases",
        integer(0, "milliseconds"),
    )
    option(
        sessions,
        "--handoff-ms",
        30000,
        "how long a request handed off (a Step's hand-off item) waits for a "
        "session to adopt its ticket; one not adopted by then is released as a release would release it",
        integer(1, "milliseconds"),
    )
    option(
        sessions,
        "--drain-ms",
        1000,
        "after SIGTERM (readiness NOT_SERVING, no new sessions), how long attached "
        "sessions may go on stepping before the server ends them; it stops sooner once all have detached",
        integer(0, "milliseconds"),
    )
    option(
        sessions,
        "--shutdown-grace-ms",
        500,
        "after the drain, how long calls still in flight may run before they are cancelled",
        integer(0, "milliseconds"),
    )
    option(
        pool,
        "--start-timeout-ms",
        120000,
        "while the pool's memory is held elsewhere (a crashed server's "
        "allocation that clients still map), how long to wait for it, live but not ready, before giving up",
        integer(0, "milliseconds"),
    )
    _add_prefix_options(serve)
    _add_store_options(serve)
    option(serve, "--log-level", "info", "debug, info, warning or error", one_of("debug", "info", "warning", "error"))
    option(
        serve,
        "--log-format",
        "text",
        "text (one line a record) or json (one JSON object a line: ts, level, logger, message, exception)",
        one_of(*LOG_FORMATS),
    )
    debug = serve.add_argument(
        "--debug-audit",
        action="store_true",
        default=argparse.SUPPRESS,
        help="run the full pool audit (O(pool)) after every step; a broken invariant fails the call as "
        "INTERNAL: for tests and debugging, not production (default: off; env KVMEM_DEBUG)",
    )
    setattr(debug, ENV_SPEC, ("KVMEM_DEBUG", False, switch))


PREFIX_HASHES = ("xxh3-128", "vllm-sha256-cbor")  # kvmem.server.core.hashing.RECIPES (not imported for --help)


def _add_prefix_options(serve: argparse.ArgumentParser) -> None:
    prefix = serve.add_argument_group(
        "prefix cache and KV events",
        "Full pages of released (and cached) requests stay in the pool, keyed by their tokens, until an alloc "
        "needs the pages; sessions of one cache namespace (Attach) share them. KV-aware routers follow what is "
        "cached through WatchEvents, or through the same events in vLLM's ZMQ format.",
    )
    off = prefix.add_argument(
        "--no-prefix-cache",
        action="store_true",
        default=argparse.SUPPRESS,
        help="turn the prefix cache off: release and cache items cache nothing, match items match nothing "
        "(default: the cache is on; env KVMEM_NO_PREFIX_CACHE)",
    )
    setattr(off, ENV_SPEC, ("KVMEM_NO_PREFIX_CACHE", False, switch))
    option(
        prefix,
        "--prefix-hash",
        "xxh3-128",
        "how a page's key is computed from its parent's key, its tokens and "
        "the namespace: xxh3-128 (fast) or vllm-sha256-cbor (vLLM's sha256_cbor block hashes, about 30x slower: "
        "use it when a router recomputes vLLM's keys from a request's tokens, e.g. llm-d)",
        one_of(*PREFIX_HASHES),
    )
    option(
        prefix,
        "--prefix-hash-seed",
        None,
        "vllm-sha256-cbor only: the PYTHONHASHSEED of the vLLM deployment "
        "whose keys to equal (vLLM seeds its first block's parent with it)",
    )
    option(
        prefix,
        "--kv-events-buffer",
        4096,
        "event batches (one per step that changed the cache) kept for replay: "
        "a watcher that falls further behind gets a snapshot instead; also the ZMQ replay buffer",
        integer(1, "batches"),
    )
    option(
        prefix,
        "--kv-events-zmq",
        None,
        "also publish the events in vLLM's KV-event format (msgpack batches "
        "of BlockStored, BlockRemoved, AllBlocksCleared) on this ZMQ PUB endpoint, e.g. tcp://*:5557, so routers "
        "that read vLLM's events (llm-d, Dynamo) need no change; needs pip install 'kvmem[events]'",
    )
    option(
        prefix,
        "--kv-events-replay",
        None,
        "with --kv-events-zmq: the ZMQ ROUTER endpoint that replays "
        "buffered batches from a sequence number, e.g. tcp://*:5558",
    )
    option(
        prefix,
        "--kv-events-topic",
        None,
        "with --kv-events-zmq: the topic of the published messages (the "
        "first frame of each; none: empty, which every subscriber receives)",
    )


def _add_store_options(serve: argparse.ArgumentParser) -> None:
    store = serve.add_argument_group(
        "cluster tier (a store every node shares)",
        "Pages the cache takes are written, under content keys (SHA-256 of the model, the KV layout, the "
        "namespace and the tokens), to an existing distributed store: a prefix one node computed is read on "
        "every other. Writes and reads run on a thread of their own: a Step never waits for the store, and a "
        "store that is down or slow only makes matches miss. Needs --host-memory (fetched pages arrive there; "
        "with a store, pages go there as they are cached). docs/DEPLOY.md: the store beside the sidecars.",
    )
    option(
        store,
        "--store",
        None,
        "the store's URL: mooncake://MASTER:PORT?protocol=tcp&metadata=P2PHANDSHAKE&local_hostname=HOST&"
        "segment=SIZE (Mooncake Store; pip install 'kvmem[mooncake-cpu]', or Mooncake's CUDA build on a GPU "
        "node), redis://HOST:PORT[/DB], rediss://HOST:PORT?ca=FILE (TLS), redis+cluster://H1:P1,H2:P2 (Redis "
        "Cluster), valkey://HOST:PORT (pip install 'kvmem[store]'). Never a password in it: "
        "--store-password-file or KVMEM_STORE_PASSWORD. Default: none",
    )
    option(
        store,
        "--store-password-file",
        None,
        "a file whose first line is the store's password (or set KVMEM_STORE_PASSWORD); never in the URL, "
        "which ps and the logs show",
    )
    option(
        store,
        "--store-key-file",
        None,
        "a file with a secret key (at least 16 bytes) shared by the nodes: every value carries an "
        "HMAC-SHA-256 under it, and a value without the right one is a miss. Without it a checksum catches "
        "corruption, not a writer: anyone who can write the store can plant K/V (docs/DEPLOY.md)",
    )
    option(
        store,
        "--store-timeout-ms",
        200,
        "the bound of one store call (connect, write, look up, read); a call past it counts as a failure, "
        "its pages as misses, and the store as unreachable until a reconnect (with backoff)",
        integer(1, "ms"),
    )
    option(
        store,
        "--store-write-queue",
        1024,
        "host pages that may wait for their write to the store at once (each pinned in the host tier until "
        "written); a page cached past it is not written (counted in kvmem stats), the Step never waits",
        integer(1, "pages"),
    )


def _size(raw: str) -> str:
    """``--memory``: a positive size such as 40GiB (kept as text; the server sizes the pool)."""
    from kvmem.server.memory.geometry import GeometryError, parse_size

    example = "a size such as 40GiB, 512MiB, 1.5G or 123 (bytes)"
    if raw.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must not be negative: {example}, got {raw!r}")
    try:
        value = parse_size(raw)
    except GeometryError:
        raise argparse.ArgumentTypeError(f"must be {example}, got {raw!r}") from None
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, got {raw!r}")
    return raw


def _devices(raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.split(",")]
    if not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated GPU indices such as 0,1, got {raw!r}")
    if len(set(parts)) != len(parts):
        raise argparse.ArgumentTypeError(f"lists a GPU twice: {raw!r}")
    return tuple(int(p) for p in parts)


def _format(raw: str) -> str:
    from kvmem.server.memory.geometry import FORMATS

    return one_of(*FORMATS)(raw)


def _dtype(raw: str) -> str:
    from kvmem.server.memory.geometry import DTYPES

    if raw not in DTYPES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(DTYPES)}, got {raw!r}")
    return raw


def run(args: argparse.Namespace) -> int:
    """Run ``kvmem serve`` with the parsed options; never returns (the process exits with
    the server's status)."""
    from kvmem.cli.version import runtime, version
    from kvmem.server.process.app import serve
    from kvmem.server.process.startup import ServerConfig

    logging.getLogger("kvmem.server").info("kvmem %s (%s)", version(), runtime())

    socket_path = None if args.socket in ("", "none") else args.socket
    config = ServerConfig(
        socket_path=socket_path,
        socket_mode=octal(args.socket_mode) if isinstance(args.socket_mode, str) else args.socket_mode,
        access_group=args.group,
        tcp=args.tcp,
        metrics=args.metrics,
        health_port=args.health_port,
        auth_token=args.auth_token,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        lease_s=args.lease_ms / 1000,
        max_sessions=args.max_sessions,
        quarantine_s=None if args.quarantine_ms is None else args.quarantine_ms / 1000,
        resume_s=None if args.resume_ms is None else args.resume_ms / 1000,
        handoff_s=args.handoff_ms / 1000,
        drain_s=args.drain_ms / 1000,
        shutdown_grace_s=args.shutdown_grace_ms / 1000,
        start_timeout_s=args.start_timeout_ms / 1000,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_requests=args.max_requests,
        max_context_len=args.max_context,
        memory=args.memory,
        host_memory=args.host_memory,
        host_min_load_tokens=args.host_min_load_tokens,
        host_write_policy=args.host_write_policy,
        store=args.store,
        store_password_file=args.store_password_file,
        store_key_file=args.store_key_file,
        store_timeout_s=args.store_timeout_ms / 1000,
        store_write_queue=args.store_write_queue,
        device=args.device,
        devices=args.devices or (),
        shm_dir=args.shm_dir,
        kv_format=args.format,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        kv_lora_rank=args.kv_lora_rank,
        rope_dim=args.rope_dim,
        dtype=args.dtype,
        audit_every_step=args.debug_audit,
        prefix_cache=not args.no_prefix_cache,
        keep_state=args.keep_state,
        discard_state=args.discard_state,
        prefix_hash=args.prefix_hash,
        prefix_hash_seed=args.prefix_hash_seed,
        kv_events_buffer=args.kv_events_buffer,
        kv_events_zmq=args.kv_events_zmq,
        kv_events_replay=args.kv_events_replay,
        kv_events_topic=args.kv_events_topic or "",
    )
    code = serve(config)
    # The server has stopped and freed everything; the interpreter's own teardown (torch's
    # above all) took seconds on a loaded host, past the exit a SIGTERM is promised. Skip
    # it: flush what was written, then leave.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
