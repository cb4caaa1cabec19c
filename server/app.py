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
from kvmem.server.engine import Engine
from kvmem.server.service import KVMemoryService
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
    auth_token: str | None = None
    lease_s: float = 10.0
    shutdown_grace_s: float = 5.0
    page_size: int = 16
    num_pages: int = 4096
    max_requests: int = 256
    max_context_len: int = 8192

    def core_config(self) -> CoreConfig:
        try:
            return CoreConfig(self.num_pages, self.page_size, self.max_requests, self.max_context_len)
        except ValueError as exc:
            raise StartupError(str(exc)) from None


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


def _check_tcp(address: str, auth_token: str | None) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise StartupError(f"--tcp must be HOST:PORT, got {address!r}")
    host = host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not auth_token:
        raise StartupError(
            f"--tcp {address} listens beyond loopback: set --auth-token (or KVMEM_AUTH_TOKEN) so clients must present it"
        )


class KVMemServer:
    """A started server: the gRPC server, the engine, the health servicer."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.engine: Engine | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.service: KVMemoryService | None = None
        self.tcp_port: int | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> None:
        cfg = self.config
        if cfg.socket_path is None and cfg.tcp is None:
            raise StartupError("nothing to listen on: give --socket PATH and/or --tcp HOST:PORT")
        core_cfg = cfg.core_config()
        if cfg.lease_s <= 0:
            raise StartupError(f"--lease-ms must be > 0, got {cfg.lease_s * 1000:g}")
        if cfg.socket_path is not None:
            _check_socket_path(cfg.socket_path)
        if cfg.tcp is not None:
            _check_tcp(cfg.tcp, cfg.auth_token)

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

        self.engine = Engine(core_cfg, cfg.lease_s)
        geometry = kvmem_pb2.PoolGeometry(
            num_pages=core_cfg.num_pages,
            page_size=core_cfg.page_size,
            max_requests=core_cfg.max_requests,
            max_context_len=core_cfg.max_context_len,
            max_pages_per_request=core_cfg.max_pages_per_request,
        )
        self.service = KVMemoryService(self.engine, geometry, [], "none", cfg.auth_token)
        kvmem_pb2_grpc.add_KVMemoryServicer_to_server(self.service, server)

        if cfg.socket_path is not None:
            old_umask = os.umask(0o177)  # the socket is born 0600
            try:
                server.add_insecure_port(f"unix:{cfg.socket_path}")
            finally:
                os.umask(old_umask)
        if cfg.tcp is not None:
            try:
                self.tcp_port = server.add_insecure_port(cfg.tcp)
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
        log.info(
            "serving socket=%s tcp=%s pages=%d page_size=%d tokens=%d max_requests=%d max_context=%d lease_ms=%d epoch=%s",
            cfg.socket_path, cfg.tcp, core_cfg.num_pages, core_cfg.page_size,
            (core_cfg.num_pages - 1) * core_cfg.page_size, core_cfg.max_requests, core_cfg.max_context_len,
            int(cfg.lease_s * 1000), self.engine.epoch,
        )  # fmt: skip

    async def _reap_leases(self) -> None:
        assert self.engine is not None
        interval = min(self.engine.lease_s / 4, 0.25)
        while True:
            await asyncio.sleep(interval)
            self.engine.expire()

    async def stop(self) -> None:
        """Readiness NOT_SERVING, refuse new sessions, let in-flight calls finish, end
        keep-alive streams, free everything, remove the socket."""
        if self.grpc_server is None or self._stopped.is_set():
            return
        self._stopped.set()
        log.info("shutting down: readiness NOT_SERVING, no new sessions")
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert self.engine is not None and self.service is not None
        self.engine.accepting = False
        self.service.stopping.set()
        for task in list(self.service.keepalive_tasks):
            task.cancel()
        if self._reaper is not None:
            self._reaper.cancel()
        await self.grpc_server.stop(self.config.shutdown_grace_s)
        for session_id in list(self.engine.sessions):
            self.engine.end_session(session_id, "server shutdown")
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
    try:
        runner(_serve(config))
    except StartupError as exc:
        log.error("cannot start: %s", exc)
        return 2
    return 0
