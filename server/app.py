"""Running the server: grpc.aio on uvloop, the unix socket, health, reflection, leases,
signals. ``kvmem serve`` calls :func:`serve`; tests call :func:`run_server` in a child
process the same way."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import logging
import os
import signal
import socket
import stat
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmem.server.core import CoreConfig
from kvmem.server.memory import (
    CudaBackend,
    GeometryError,
    KVGeometry,
    MemoryBackend,
    PoolSpec,
    ShmBackend,
    format_size,
    pages_for_budget,
    parse_size,
)
from kvmem.server.metrics import MetricsServer, RpcStats, build_registry
from kvmem.server.service import KVMemoryService, geometry_to_proto, handle_to_proto
from kvmem.server.sessions import Sessions
from kvmem.server.tuning import keep_freed_memory
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

log = logging.getLogger("kvmem.server")

SERVICE_NAME = kvmem_pb2.DESCRIPTOR.services_by_name["KVMemory"].full_name  # readiness
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class StartupError(Exception):
    """The server cannot start; the message says why and with which value."""


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    socket_path: str | None = "/tmp/kvmem.sock"
    tcp: str | None = None  # "HOST:PORT"
    metrics: str | None = None  # "HOST:PORT" of the Prometheus endpoint; None: off
    auth_token: str | None = None
    lease_s: float = 10.0
    shutdown_grace_s: float = 5.0
    page_size: int = 16
    num_pages: int = 4096
    memory: str | None = None  # a budget ("40GiB") that sets num_pages instead
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

    def geometry(self) -> KVGeometry:
        return KVGeometry(
            self.kv_format, self.num_layers, self.num_kv_heads, self.head_dim, self.kv_lora_rank, self.rope_dim,
            self.dtype, self.page_size,
        )  # fmt: skip

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
    try:
        geometry = cfg.geometry()
        num_pages = cfg.num_pages
        if cfg.memory is not None:
            num_pages = pages_for_budget(parse_size(cfg.memory), geometry, cfg.max_requests, cfg.max_context_len)
        pool = PoolSpec(geometry, num_pages, cfg.max_requests, cfg.max_context_len)
        core = CoreConfig(pool.num_pages, pool.geometry.page_size, pool.max_requests, pool.max_context_len)
        devices = cfg.cuda_devices()
        backend: MemoryBackend | None
        if cfg.device == "none" and not devices:
            backend = None
        elif devices:
            option = f"--devices {','.join(map(str, cfg.devices))}" if cfg.devices else f"--device {cfg.device}"
            try:
                backend = CudaBackend(pool, devices)
            except RuntimeError as exc:  # no CUDA, a CUDA error: name the option that asked for it
                raise StartupError(f"{option}: {exc}") from None
        else:
            try:
                backend = ShmBackend(pool, cfg.shm_dir)
            except OSError as exc:  # a missing or unwritable directory (a full one is a GeometryError)
                raise StartupError(f"--shm-dir {cfg.shm_dir}: {exc}") from None
    except (GeometryError, ValueError, RuntimeError, OSError) as exc:
        raise StartupError(str(exc)) from None
    return core, backend, geometry


def _check_socket_path(path: str) -> None:
    """Refuse a path another live server listens on; remove a dead server's socket.
    gRPC would otherwise silently unlink and steal the path of a live server."""
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


def _check_tcp(address: str, auth_token: str | None) -> None:
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


class KVMemServer:
    """A started server: the gRPC server, the sessions, the health servicer."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.sessions: Sessions | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.service: KVMemoryService | None = None
        self.memory: MemoryBackend | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self.metrics_server: MetricsServer | None = None

    async def start(self) -> None:
        cfg = self.config
        if cfg.socket_path is None and cfg.tcp is None:
            raise StartupError("nothing to listen on: give --socket PATH and/or --tcp HOST:PORT")
        if cfg.lease_s <= 0:
            raise StartupError(f"--lease-ms must be > 0, got {cfg.lease_s * 1000:g}")
        if cfg.socket_path is not None:
            _check_socket_path(cfg.socket_path)
        if cfg.tcp is not None:
            _check_tcp(cfg.tcp, cfg.auth_token)
        metrics_at = None if cfg.metrics is None else _host_port("--metrics", cfg.metrics)
        core_cfg, self.memory, kv_geometry = build_pool(cfg)
        try:
            await self._start_grpc(core_cfg, kv_geometry, metrics_at)
        except BaseException:
            if self.metrics_server is not None:
                await self.metrics_server.stop()
            if self.memory is not None:
                self.memory.close()
            raise
        kv_bytes = 0 if self.memory is None else kv_geometry.bytes_per_token * self.memory.num_tokens
        log.info(
            "pool: %d pages x %d tokens = %d tokens, %d bytes per token (%s %s, %d layers), KV %s on %s",
            core_cfg.num_pages, core_cfg.page_size, (core_cfg.num_pages - 1) * core_cfg.page_size,
            kv_geometry.bytes_per_token, kv_geometry.format, kv_geometry.dtype, kv_geometry.num_layers,
            format_size(kv_bytes), "no memory" if self.memory is None else self.memory.name,
        )  # fmt: skip
        assert self.sessions is not None
        log.info(
            "serving socket=%s tcp=%s max_requests=%d max_context=%d lease_ms=%d audit_every_step=%s epoch=%s",
            cfg.socket_path, cfg.tcp, core_cfg.max_requests, core_cfg.max_context_len, int(cfg.lease_s * 1000),
            cfg.audit_every_step, self.sessions.epoch,
        )  # fmt: skip

    async def _start_grpc(
        self, core_cfg: CoreConfig, kv_geometry: KVGeometry, metrics_at: tuple[str, int] | None
    ) -> None:
        cfg = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )

        self.sessions = Sessions(core_cfg, cfg.lease_s, self.memory, audit_every_step=cfg.audit_every_step)
        geometry = geometry_to_proto(core_cfg, None if self.memory is None else kv_geometry)
        handles = [] if self.memory is None else [handle_to_proto(h) for h in self.memory.handles()]
        backend_name = "none" if self.memory is None else self.memory.name
        self.service = KVMemoryService(self.sessions, geometry, handles, backend_name, cfg.auth_token)
        kvmem_pb2_grpc.add_KVMemoryServicer_to_server(self.service, server)
        if metrics_at is not None:  # before gRPC listens: a port in use stops the start cleanly
            await self._start_metrics(*metrics_at)

        if cfg.socket_path is not None:
            old_umask = os.umask(0o177)  # the socket is born 0600
            try:
                server.add_insecure_port(f"unix:{cfg.socket_path}")
            finally:
                os.umask(old_umask)
        if cfg.tcp is not None:
            try:
                server.add_insecure_port(cfg.tcp)
            except RuntimeError as exc:
                raise StartupError(f"--tcp {cfg.tcp}: cannot listen ({exc})") from None
        old_umask = os.umask(0o177)
        try:
            await server.start()
        finally:
            os.umask(old_umask)
        if cfg.socket_path is not None:
            os.chmod(cfg.socket_path, 0o600)
        self.grpc_server = server
        self._reaper = asyncio.create_task(self._reap_leases())
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    async def _start_metrics(self, host: str, port: int) -> None:
        assert self.sessions is not None and self.service is not None
        self.service.rpc_stats = RpcStats()
        registry = build_registry(self.sessions, self.service.rpc_stats, self.service.memory_backend)
        server = MetricsServer(registry)
        try:
            await server.start(host, port)
        except OSError as exc:
            raise StartupError(f"--metrics {self.config.metrics}: cannot listen ({exc})") from None
        self.metrics_server = server
        log.info("metrics on http://%s:%d/metrics", host if ":" not in host else f"[{host}]", server.port)

    async def _reap_leases(self) -> None:
        assert self.sessions is not None
        interval = min(self.sessions.lease_s / 4, 0.25)
        while True:
            await asyncio.sleep(interval)
            self.sessions.expire()

    async def stop(self) -> None:
        """Readiness NOT_SERVING, refuse new sessions, let in-flight calls finish, end
        keep-alive streams, free everything, remove the socket."""
        if self.grpc_server is None or self._stopped.is_set():
            return
        self._stopped.set()
        log.info("shutting down: readiness NOT_SERVING, no new sessions")
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert self.sessions is not None and self.service is not None
        self.sessions.accepting = False
        self.service.stopping.set()
        for task in list(self.service.keepalive_tasks):
            task.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
        await self.grpc_server.stop(self.config.shutdown_grace_s)
        for session_id in list(self.sessions.by_id):
            self.sessions.end(session_id, "server shutdown")
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        if self.memory is not None:
            self.memory.close()  # shm: the files are removed; cuda: the memory is released
        if self.config.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        log.info("stopped")

    async def wait(self) -> None:
        assert self.grpc_server is not None
        await self.grpc_server.wait_for_termination()


async def _serve(config: ServerConfig) -> None:
    server = KVMemServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT; 0 on a clean stop, 2 when the server cannot start."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep running without it
        runner: Any = asyncio.run
    else:
        runner = uvloop.run
    keep_freed_memory()
    try:
        runner(_serve(config))
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 2
    return 0
