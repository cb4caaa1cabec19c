"""What ``kvmem serve`` checks and plans before it creates anything: the configuration,
the listen addresses, the socket path, the pool. A refusal here leaves nothing behind;
:mod:`kvmem.server.process.app` then creates (and, on a later failure, undoes) what was planned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import grp
import importlib.util
import ipaddress
import logging
import os
import socket
import stat
from typing import TYPE_CHECKING

from kvmem.server.core import CoreConfig
from kvmem.server.core.hashing import PageKeys, make_keys
from kvmem.server.memory import (
    GeometryError,
    KVGeometry,
    MemoryBackend,
    MemoryUnavailable,
    PoolSpec,
    ShmBackend,
    format_size,
    pages_for_budget,
    parse_size,
)
from kvmem.server.memory.shm import CounterFile, kept_key
from kvmem.server.process.tls import ServerTLS, TLSConfigError
from kvmem.server.process.tls import load as load_tls

if TYPE_CHECKING:
    from kvmem.server.memory import CudaBackend

log = logging.getLogger("kvmem.server")

_MAX_UNIX_PATH = 107  # bytes of sockaddr_un.sun_path, less the terminating NUL


class MemoryNotYet(Exception):
    """The pool's memory is not free yet (see :class:`MemoryUnavailable`): the server
    waits for it, up to --start-timeout-ms."""


class StartupError(Exception):
    """The server cannot start; the message says why and with which value."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    socket_path: str | None = "/tmp/kvmem.sock"
    # Who may connect and map: the socket and the shm files get this mode (0600: the
    # server's user; 0660: also its group) and, with access_group, that group.
    socket_mode: int = 0o600
    access_group: str | None = None  # a group name or number; None: the server's own
    tcp: str | None = None  # "HOST:PORT"
    metrics: str | None = None  # "HOST:PORT" of the Prometheus endpoint; None: off
    health_port: int | None = None  # a TCP port with grpc.health.v1 only (kubelet's gRPC probes); None: off
    auth_token: str | None = None
    tls_cert: str | None = None  # PEM certificate (chain) of the TCP port: TLS there (kvmem.server.process.tls)
    tls_key: str | None = None  # its private key
    tls_client_ca: str | None = None  # PEM CA(s) that TCP clients' certificates must chain to (mutual TLS)
    lease_s: float = 10.0
    max_sessions: int = 1024  # sessions attached at once (Sessions' limit)
    quarantine_s: float | None = None  # a lapsed session's pages stay out of use; None: six leases
    drain_s: float = 1.0  # after SIGTERM, how long attached sessions may go on
    shutdown_grace_s: float = 0.5  # after the drain, how long calls in flight may still run
    start_timeout_s: float = 120.0  # how long to wait for the pool's memory to be free
    page_size: int = 16
    num_pages: int = 4096
    memory: str | None = None  # a budget ("40GiB") that sets num_pages instead
    host_memory: str | None = None  # the host tier's size per rank ("16GiB"); None: no host tier
    host_min_load_tokens: int = 1  # a load from the host tier shorter than this is computed (1: any page)
    host_write_policy: str = "write-back"  # or "write-through": when cached pages are copied to the host tier
    # The cluster tier (kvmem.server.store): an existing store's URL (no password in it); None: none.
    store: str | None = None
    store_password_file: str | None = None  # its first line; else KVMEM_STORE_PASSWORD; else none
    store_key_file: str | None = None  # the HMAC key every value carries (None: a checksum only)
    store_timeout_s: float = 0.2  # the bound of one store call
    store_write_queue: int = 1024  # host pages pinned for their write at once
    max_requests: int = 256
    max_context_len: int = 8192
    # KV memory: "cpu" = the shm backend, "cuda:N" = one GPU, "none" = no KV memory.
    device: str = "cpu"
    devices: tuple[int, ...] = ()  # tensor-parallel GPUs; overrides device
    shm_dir: str = "/dev/shm"
    kv_format: str = "mha"
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    dtype: str = "bfloat16"
    audit_every_step: bool = False  # the full audit after every step (tests, debugging)
    keep_state: bool = False  # keep the KV memory and the core's state across restarts (shm)
    discard_state: bool = False  # with keep_state: drop a kept state instead of restoring it
    resume_s: float | None = None  # with keep_state: how long the last run's sessions may resume; None: 3 leases
    handoff_s: float = 30.0  # how long a hand-off ticket waits to be adopted
    # The prefix cache and its events.
    prefix_cache: bool = True
    prefix_hash: str = "xxh3-128"  # the page-key recipe (kvmem.server.core.hashing.RECIPES)
    prefix_hash_seed: str | None = None  # vllm-sha256-cbor only: vLLM's PYTHONHASHSEED
    kv_events_buffer: int = 4096  # event batches kept for replay (WatchEvents, and the ZMQ replay socket)
    kv_events_zmq: str | None = None  # a ZMQ endpoint to publish vLLM-format KV events on; None: off
    kv_events_replay: str | None = None  # the ZMQ ROUTER endpoint that replays them; None: off
    kv_events_topic: str = ""  # the ZMQ topic of the published events

    @property
    def resume_window_s(self) -> float:
        """How long the last run's sessions may resume (--resume-ms; default three leases)."""
        return 3 * self.lease_s if self.resume_s is None else self.resume_s

    def geometry(self) -> KVGeometry:
        return KVGeometry(
            self.kv_format,
            self.num_layers,
            self.num_kv_heads,
            self.head_dim,
            self.kv_lora_rank,
            self.rope_dim,
            self.dtype,
            self.page_size,
        )

    def cuda_devices(self) -> tuple[int, ...]:
        """The GPUs of the cuda backend; () for shm or no memory."""
        if self.devices:
            return self.devices
        if self.device in ("cpu", "none"):
            return ()
        kind, _, index = self.device.partition(":")
        if kind != "cuda" or not (index or "0").isdigit():
            raise StartupError(f"--device must be cpu, none or cuda:N, got {self.device!r}")
        return (int(index or "0"),)


def build_pool(cfg: ServerConfig) -> tuple[CoreConfig, MemoryBackend | None, KVGeometry]:
    """Validate the geometry, size the pool, allocate the KV memory. Every refusal is a
    StartupError naming the option and its value."""
    core, pool, devices = _plan_pool(cfg)
    return core, allocate(cfg, pool, devices), pool.geometry


def _plan_pool(cfg: ServerConfig) -> tuple[CoreConfig, PoolSpec, tuple[int, ...]]:
    """Validate the geometry and the device, and size the pool; allocates nothing."""
    try:
        geometry = cfg.geometry()
        num_pages = cfg.num_pages
        if cfg.memory is not None:
            num_pages = pages_for_budget(parse_size(cfg.memory), geometry, cfg.max_requests, cfg.max_context_len)
        pool = PoolSpec(geometry, num_pages, cfg.max_requests, cfg.max_context_len)
        core = CoreConfig(pool.num_pages, pool.geometry.page_size, pool.max_requests, pool.max_context_len)
    except (GeometryError, ValueError) as exc:
        raise StartupError(str(exc)) from None
    return core, pool, cfg.cuda_devices()


def _device_option(cfg: ServerConfig) -> str:
    """The option that chose the GPUs, as given (for messages)."""
    return f"--devices {','.join(map(str, cfg.devices))}" if cfg.devices else f"--device {cfg.device}"


def cuda_backend(cfg: ServerConfig) -> type[CudaBackend]:
    """The cuda backend's class. Importing it imports torch, which only this backend needs
    (the shm backend and --device none run without it): a StartupError naming the option
    and torch when torch cannot be imported."""
    try:
        from kvmem.server.memory.cuda import CudaBackend
    except (ImportError, OSError) as exc:  # not installed, or a broken install (a missing CUDA library)
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise StartupError(
            f"{_device_option(cfg)} needs torch (the cuda backend allocates and shares the KV cache through it), "
            f"but importing torch failed ({reason}): install torch, or serve with --device cpu or none"
        ) from None
    return CudaBackend


def allocate(
    cfg: ServerConfig, pool: PoolSpec, devices: tuple[int, ...], state_bytes: int = 0, log_bytes: int = 0
) -> MemoryBackend | None:
    """The KV memory of a planned pool (shm files or GPU allocations), or None for --device none;
    with --keep-state, the kept state's files (``state_bytes``: the core's state image;
    ``log_bytes``: the step log)."""
    if cfg.device == "none" and not devices:
        return None
    try:
        if devices:
            backend = cuda_backend(cfg)
            # --host-memory: the tier's load counters, in a small shm file clients map.
            counters = None
            if cfg.host_memory is not None:
                counters = CounterFile(pool.num_pages, cfg.shm_dir, mode=cfg.socket_mode, gid=access_gid(cfg))
            try:
                return backend(pool, devices, counters)
            except BaseException as exc:
                if counters is not None:
                    counters.close()
                if isinstance(exc, RuntimeError):  # no CUDA, a CUDA error: name the option that asked for it
                    raise StartupError(f"{_device_option(cfg)}: {exc}") from None
                raise
        keep = kept_key(cfg.socket_path, cfg.tcp) if cfg.keep_state else None
        try:
            return ShmBackend(
                pool,
                cfg.shm_dir,
                mode=cfg.socket_mode,
                gid=access_gid(cfg),
                keep=keep,
                discard=cfg.discard_state,
                state_bytes=state_bytes,
                log_bytes=log_bytes,
                load_counters=cfg.host_memory is not None,
                host_bytes=host_tier_pages(cfg, pool) * pool.geometry.page_bytes if cfg.keep_state else 0,
            )
        except OSError as exc:  # a missing or unwritable directory (a full one is a GeometryError)
            raise StartupError(f"--shm-dir {cfg.shm_dir}: {exc}") from None
    except MemoryUnavailable as exc:
        raise MemoryNotYet(str(exc)) from None
    except (GeometryError, ValueError, RuntimeError, OSError) as exc:
        raise StartupError(str(exc)) from None


def access_gid(cfg: ServerConfig) -> int | None:
    """The group id the socket and shm files are given (None: leave the server's), after
    checking ``--socket-mode`` and ``--group``: the mode is 0600 or 0660 (owner read and
    write, the group at most the same, others nothing: every session can map the whole
    KV memory: docs/DESIGN.md, Transport and security), and the server can hand its files to the group."""
    mode = cfg.socket_mode
    if mode not in (0o600, 0o660):
        raise StartupError(f"--socket-mode must be 0600 or 0660 (others never get access), got {mode:04o}")
    if cfg.access_group is None:
        return None
    if mode != 0o660:
        raise StartupError(f"--group {cfg.access_group} gives its members nothing with --socket-mode 0600: use 0660")
    try:
        gid = int(cfg.access_group) if cfg.access_group.isdigit() else grp.getgrnam(cfg.access_group).gr_gid
    except KeyError:
        raise StartupError(f"--group {cfg.access_group}: no such group") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise StartupError(
            f"--group {cfg.access_group}: this server's user is not a member, so it cannot give its files to that group"
        )
    return gid


def _check_socket_path(path: str) -> None:
    """Refuse a path another live server listens on; remove a dead server's socket.
    gRPC would otherwise silently unlink and steal the path of a live server. Also refuse
    a path that cannot be bound (no such directory, no permission, too long)."""
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        raise StartupError(f"--socket {path}: no such directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StartupError(f"--socket {path}: no permission to create a socket in {directory}")
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise StartupError(
            f"--socket {path}: {len(os.fsencode(path))} bytes long, a unix socket path is at most {_MAX_UNIX_PATH}"
        )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StartupError(f"--socket {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            log.warning("removing stale socket %s left by a server that is gone", path)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        raise StartupError(f"--socket {path}: cannot probe it ({exc})") from None
    else:
        raise StartupError(f"--socket {path} is in use by a live server; refusing to start")
    finally:
        probe.close()


def _host_port(option: str, address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host or int(port) > 65535:
        raise StartupError(f"{option} must be HOST:PORT (port 0-65535), got {address!r}")
    return host.strip("[]"), int(port)


def _check_tcp(address: str, auth_token: str | None, tls: bool = False) -> None:
    """Beyond loopback a bearer token is required, with TLS or without (TLS keeps it
    private on the wire; it does not replace it); without TLS there, a warning."""
    host, _ = _host_port("--tcp", address)
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not auth_token:
        raise StartupError(
            f"--tcp {address} listens beyond loopback: "
            "set --auth-token (or KVMEM_AUTH_TOKEN) so clients must present it"
        )
    if not loopback and not tls:
        log.warning(
            "--tcp %s listens beyond loopback without TLS: the bearer token and every call cross the network in "
            "plaintext; set --tls-cert and --tls-key",
            address,
        )


def plan_tls(cfg: ServerConfig) -> ServerTLS | None:
    """The --tcp port's TLS (--tls-cert, --tls-key, --tls-client-ca), its files read and
    checked; None: plaintext. A StartupError naming the option otherwise."""
    try:
        return load_tls(cfg)
    except TLSConfigError as exc:
        raise StartupError(str(exc)) from None


def _probe_listen(option: str, address: str, host: str, port: int, *, every: bool) -> None:
    """Refuse a TCP address this server could not listen on (port in use, not a local
    address) before anything is created: bind a socket to each address ``host`` resolves
    to, as the listener will (SO_REUSEADDR), and close it. ``every``: the listener needs
    all of them (the metrics server), else one is enough (gRPC). Port 0 always works. A
    port taken between this probe and the real bind still fails the start, cleanly."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"{option} {address}: cannot resolve {host!r} ({exc.strerror})") from None
    errors: list[str] = []
    probes: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in infos:
            try:
                probe = socket.socket(family, kind, proto)
                probes.append(probe)
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(sockaddr)
            except OSError as exc:
                errors.append(f"{sockaddr[0]} port {port}: {exc.strerror or exc}")
    finally:
        for probe in probes:
            probe.close()
    if errors and (every or len(errors) == len(infos)):
        raise StartupError(f"{option} {address}: cannot listen ({errors[0]})")


def plan_prefix(cfg: ServerConfig) -> PageKeys:
    """The prefix cache's page-key recipe, and the KV-event options checked: a StartupError
    names the option and its value."""
    try:
        keys = make_keys(cfg.prefix_hash, cfg.prefix_hash_seed)
    except ValueError as exc:
        option = "--prefix-hash-seed" if cfg.prefix_hash_seed is not None else "--prefix-hash"
        raise StartupError(f"{option}: {exc}") from None
    if cfg.kv_events_buffer < 1:
        raise StartupError(f"--kv-events-buffer must be >= 1, got {cfg.kv_events_buffer}")
    if cfg.kv_events_replay is not None and cfg.kv_events_zmq is None:
        raise StartupError(f"--kv-events-replay {cfg.kv_events_replay} needs --kv-events-zmq (the events it replays)")
    for option, endpoint in (("--kv-events-zmq", cfg.kv_events_zmq), ("--kv-events-replay", cfg.kv_events_replay)):
        if endpoint is not None and "://" not in endpoint:
            raise StartupError(f"{option} must be a ZMQ endpoint such as tcp://*:5557, got {endpoint!r}")
    if cfg.kv_events_zmq is not None:
        missing = [pip for module, pip in (("zmq", "pyzmq"), ("msgspec", "msgspec")) if not _importable(module)]
        if missing:
            raise StartupError(
                f"--kv-events-zmq {cfg.kv_events_zmq} needs pyzmq and msgspec ({' and '.join(missing)} not "
                "installed): pip install 'kvmem[events]'"
            )
    return keys


def _importable(module: str) -> bool:
    """Whether ``module`` is installed (found without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_config(
    cfg: ServerConfig,
) -> tuple[CoreConfig, PoolSpec, tuple[int, ...], tuple[str, int] | None, PageKeys]:
    """Every check that needs nothing created, before anything is: a refusal here leaves
    nothing behind (at most a dead server's socket is removed). Returns the planned pool,
    its GPUs, the metrics address and the prefix cache's page-key recipe."""
    if cfg.socket_path is None and cfg.tcp is None:
        raise StartupError("nothing to listen on: give --socket PATH and/or --tcp HOST:PORT")
    if cfg.lease_s <= 0:
        raise StartupError(f"--lease-ms must be > 0, got {cfg.lease_s * 1000:g}")
    if cfg.shutdown_grace_s < 0:
        raise StartupError(f"--shutdown-grace-ms must be >= 0, got {cfg.shutdown_grace_s * 1000:g}")
    if cfg.handoff_s <= 0:
        raise StartupError(f"--handoff-ms must be >= 1, got {cfg.handoff_s * 1000:g}")
    if cfg.drain_s < 0:
        raise StartupError(f"--drain-ms must be >= 0, got {cfg.drain_s * 1000:g}")
    if cfg.start_timeout_s < 0:
        raise StartupError(f"--start-timeout-ms must be >= 0, got {cfg.start_timeout_s * 1000:g}")
    if cfg.resume_s is not None and cfg.resume_s < 0:
        raise StartupError(f"--resume-ms must be >= 0, got {cfg.resume_s * 1000:g}")
    if cfg.resume_s is not None and not cfg.keep_state:
        raise StartupError("--resume-ms is the window for sessions kept by --keep-state: give --keep-state too")
    if cfg.quarantine_s is not None and cfg.quarantine_s < 0:
        raise StartupError(f"--quarantine-ms must be >= 0, got {cfg.quarantine_s * 1000:g}")
    if cfg.max_sessions < 1:
        raise StartupError(f"--max-sessions must be >= 1, got {cfg.max_sessions}")
    tls = plan_tls(cfg)
    if cfg.tcp is not None:
        _check_tcp(cfg.tcp, cfg.auth_token, tls=tls is not None)
    metrics_at = None if cfg.metrics is None else _host_port("--metrics", cfg.metrics)
    page_keys = plan_prefix(cfg)
    core_cfg, pool, devices = _plan_pool(cfg)
    if devices:
        cuda_backend(cfg)  # torch importable: refused here, before anything is created
    if cfg.discard_state and not cfg.keep_state:
        raise StartupError("--discard-state drops a state --keep-state kept: give both, or neither")
    if cfg.keep_state and (devices or cfg.device != "cpu"):
        raise StartupError(
            f"--keep-state keeps the KV memory in --shm-dir (--device cpu); {_device_option(cfg)}'s memory cannot "
            "outlive the process (a CUDA allocation dies with the process that made it: docs/DESIGN.md, Shutdown)"
        )
    _check_host_memory(cfg, pool, devices)
    _check_store(cfg)
    if (cfg.device == "cpu" and not devices) or cfg.host_memory is not None:  # a CUDA pool's tier: its counters
        if not os.path.isdir(cfg.shm_dir):
            raise StartupError(f"--shm-dir {cfg.shm_dir}: no such directory")
        if not os.access(cfg.shm_dir, os.W_OK | os.X_OK):
            raise StartupError(f"--shm-dir {cfg.shm_dir}: no permission to create files there")
    if cfg.socket_path is not None:
        _check_socket_path(cfg.socket_path)
    access_gid(cfg)
    if cfg.tcp is not None:
        _probe_listen("--tcp", cfg.tcp, *_host_port("--tcp", cfg.tcp), every=False)
    if cfg.metrics is not None and metrics_at is not None:
        _probe_listen("--metrics", cfg.metrics, *metrics_at, every=True)
    if cfg.health_port is not None:
        if not 0 < cfg.health_port < 65536:
            raise StartupError(f"--health-port must be in [1, 65535], got {cfg.health_port}")
        _probe_listen("--health-port", f"0.0.0.0:{cfg.health_port}", "0.0.0.0", cfg.health_port, every=False)
    return core_cfg, pool, devices, metrics_at, page_keys


def grpc_reason(exc: RuntimeError) -> str:
    """gRPC's bind error without its advice to set GRPC_VERBOSITY."""
    return str(exc).split("; set GRPC_VERBOSITY", 1)[0]


def _check_host_memory(cfg: ServerConfig, pool: PoolSpec, devices: tuple[int, ...]) -> None:
    """``--host-memory``: what it cannot be used with, and a size this host can give."""
    if cfg.host_memory is None:
        return
    from kvmem.server.memory.geometry import parse_size
    from kvmem.server.memory.host import check_host_memory

    if cfg.device == "none":
        raise StartupError("--host-memory keeps evicted KV in host memory: --device none has no KV memory to keep")
    if not cfg.prefix_cache:
        raise StartupError("--host-memory keeps pages the prefix cache evicts: it needs the prefix cache on")
    if cfg.host_min_load_tokens < 1:
        raise StartupError(f"--host-min-load-tokens must be >= 1, got {cfg.host_min_load_tokens}")
    try:
        num_ranks = max(1, len(devices))  # a tier per rank, each of --host-memory
        pages = check_host_memory(
            parse_size(cfg.host_memory, "--host-memory"), pool.geometry, num_ranks, cfg.host_memory
        )
    except GeometryError as exc:
        raise StartupError(str(exc)) from None
    if cfg.keep_state and os.path.isdir(cfg.shm_dir):  # kept: the tier's pages are a file there, beside the pool
        st = os.statvfs(cfg.shm_dir)
        need, total = pages * pool.geometry.page_bytes + pool.kv_bytes, st.f_blocks * st.f_frsize
        if need > total:
            raise StartupError(
                f"--host-memory {cfg.host_memory} with --keep-state keeps the tier's pages in --shm-dir "
                f"{cfg.shm_dir}: the pool and the tier need {format_size(need)}, it holds {format_size(total)} in all "
                "(docker run --shm-size)"
            )


def _check_store(cfg: ServerConfig) -> None:
    """``--store``: what it needs, a URL an adapter takes, its client installed, the
    password and key files readable. The store itself may be down: the server starts
    and connects when it can."""
    if cfg.store is None:
        for given, name in (
            (cfg.store_password_file, "--store-password-file"),
            (cfg.store_key_file, "--store-key-file"),
        ):
            if given is not None:
                raise StartupError(f"{name} is for --store: give the store's URL too")
        return
    if cfg.host_memory is None:
        raise StartupError(
            "--store needs --host-memory: pages fetched from the store arrive in the host tier, and pages go to "
            "the store from it"
        )
    store_secrets(cfg)
    from kvmem.server.store.base import StoreURLError, open_store

    try:
        open_store(cfg.store, None, cfg.store_timeout_s)
    except StoreURLError as exc:
        raise StartupError(str(exc)) from None
    except ImportError as exc:
        raise StartupError(f"--store {cfg.store}: {exc}") from None


def store_secrets(cfg: ServerConfig) -> tuple[str | None, bytes | None]:
    """The store's password (``--store-password-file``'s first line, else
    ``KVMEM_STORE_PASSWORD``, else None) and the HMAC key (``--store-key-file``'s
    bytes, else None); a StartupError naming the file that cannot be used."""
    password = os.environ.get("KVMEM_STORE_PASSWORD") or None
    if cfg.store_password_file is not None:
        try:
            with open(cfg.store_password_file, encoding="utf-8") as f:
                password = f.readline().rstrip("\r\n") or None
        except OSError as exc:
            raise StartupError(f"--store-password-file {cfg.store_password_file}: {exc.strerror}") from None
        if password is None:
            raise StartupError(f"--store-password-file {cfg.store_password_file}: its first line is empty")
    key = None
    if cfg.store_key_file is not None:
        try:
            with open(cfg.store_key_file, "rb") as f:
                key = f.read().strip()
        except OSError as exc:
            raise StartupError(f"--store-key-file {cfg.store_key_file}: {exc.strerror}") from None
        if len(key) < 16:
            raise StartupError(
                f"--store-key-file {cfg.store_key_file}: {len(key)} bytes; a key needs at least 16 (e.g. "
                "head -c 32 /dev/urandom | base64)"
            )
    return password, key


def host_tier_pages(cfg: ServerConfig, pool: PoolSpec) -> int:
    """The host tier's pages per rank (0: none): ``--host-memory`` over a page's bytes."""
    if cfg.host_memory is None:
        return 0
    from kvmem.server.memory.host import pages_for

    return pages_for(parse_size(cfg.host_memory, "--host-memory"), pool.geometry)
