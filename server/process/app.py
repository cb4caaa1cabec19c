"""Running the server: grpc.aio on uvloop, the unix socket, health, reflection, leases,
signals. ``kvmem serve`` calls :func:`serve`; tests call :func:`run_server` in a child
process the same way."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from kvmem.server.core import CoreConfig, KVCore
from kvmem.server.core.events import AllCleared, CacheEvent
from kvmem.server.core.hashing import PageKeys
from kvmem.server.core.image import CoreImage, ImageLayout, ImageMismatch
from kvmem.server.core.restore import Restoration, layout_for, restore
from kvmem.server.core.tier import HostTier
from kvmem.server.edge.guard import Guard
from kvmem.server.edge.handlers import add_guarded
from kvmem.server.edge.service import KVMemoryService, add_to_server, geometry_to_proto, handle_to_proto
from kvmem.server.memory import KVGeometry, MemoryBackend, PoolSpec, format_size
from kvmem.server.observe.events import EventLog
from kvmem.server.observe.metrics import MetricsServer, RpcStats, build_registry
from kvmem.server.process.startup import (
    MemoryNotYet,
    ServerConfig,
    StartupError,
    access_gid,
    allocate,
    check_config,
    grpc_reason,
    host_tier_pages,
    plan_tls,
)
from kvmem.server.process.tuning import keep_freed_memory
from kvmem.server.sessions import Sessions, StateOrigin
from kvmem.server.steplog import StepLog
from kvmem.v1 import kvmem_pb2

log = logging.getLogger("kvmem.server")

SERVICE_NAME = kvmem_pb2.DESCRIPTOR.services_by_name["KVMemory"].full_name  # readiness
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
REFLECTION = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


class KVMemServer:
    """A started server: the gRPC server, the sessions, the health servicer."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.sessions: Sessions | None = None
        self.grpc_server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.guard = Guard(config.auth_token)  # every call passes it: admission, refusals, metrics
        self.service: KVMemoryService | None = None
        self.memory: MemoryBackend | None = None
        self._mover: Any = None  # the host tier's HostPages (--host-memory): its copy thread
        self._link: Any = None  # the store's thread (--store): kvmem.server.store.link.StoreLink
        self._reaper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        self.metrics_server: MetricsServer | None = None
        self.health_server: grpc.aio.Server | None = None  # --health-port: grpc.health.v1 only
        self.events: EventLog | None = None  # the prefix cache's events: WatchEvents' replay buffer
        self.zmq_publisher: Any = None  # kv_events_zmq.ZmqEventPublisher with --kv-events-zmq
        self._starting: grpc.aio.Server | None = None  # the gRPC server until start() succeeds
        self._layout: ImageLayout | None = None  # the state image's, with --keep-state
        self.restoration: Restoration | None = None  # what was restored from the kept state
        self._restore_ms = 0.0
        self._socket_made = False  # start() may have created the unix socket file

    async def start(self) -> None:
        """Check everything that can be checked first (nothing is created before a
        refusal); listen (liveness SERVING, readiness NOT_SERVING, kvmem calls refused as
        NOT_READY); allocate the memory, waiting for it while it is held elsewhere (up to
        --start-timeout-ms); then serve (readiness SERVING). A failure undoes what was
        created (socket file, shm files, metrics listener) before raising."""
        cfg = self.config
        core_cfg, pool, devices, metrics_at, page_keys = check_config(cfg)
        host_pages = host_tier_pages(cfg, pool)
        self._layout = layout_for(core_cfg, page_keys, cfg.max_sessions, host_pages) if cfg.keep_state else None
        try:
            await self._listen()
            self.memory = await self._allocate_waiting(pool, devices)
            await self._open(core_cfg, pool.geometry, metrics_at, page_keys)
        except BaseException:
            await self._undo_start()
            raise
        kv_geometry = pool.geometry
        kv_bytes = 0 if self.memory is None else kv_geometry.bytes_per_token * self.memory.num_tokens
        log.info(
            "pool: %d pages x %d tokens = %d tokens, %d bytes per token (%s %s, %d layers), KV %s on %s",
            core_cfg.num_pages,
            core_cfg.page_size,
            (core_cfg.num_pages - 1) * core_cfg.page_size,
            kv_geometry.bytes_per_token,
            kv_geometry.format,
            kv_geometry.dtype,
            kv_geometry.num_layers,
            format_size(kv_bytes),
            "no memory" if self.memory is None else self.memory.name,
        )
        assert self.sessions is not None
        log.info(
            "serving socket=%s tcp=%s max_requests=%d max_context=%d lease_ms=%d audit_every_step=%s epoch=%s",
            cfg.socket_path,
            cfg.tcp,
            core_cfg.max_requests,
            core_cfg.max_context_len,
            int(cfg.lease_s * 1000),
            cfg.audit_every_step,
            self.sessions.epoch,
        )
        log.info(
            "prefix cache %s hash=%s; kv events: replay buffer %d batches, zmq=%s replay=%s",
            "on" if cfg.prefix_cache else "off (--no-prefix-cache)",
            page_keys.name,
            cfg.kv_events_buffer,
            cfg.kv_events_zmq,
            cfg.kv_events_replay,
        )

    async def _allocate_waiting(self, pool: PoolSpec, devices: tuple[int, ...]) -> MemoryBackend | None:
        """The pool's memory; while it is not free (held by a crashed predecessor's
        allocation that clients still map, say), retry every second with a log line of
        what it waits for, up to the start timeout."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.start_timeout_s
        waited = False
        while True:
            try:
                layout = self._layout
                memory = allocate(
                    cfg,
                    pool,
                    devices,
                    0 if layout is None else layout.size,
                    0 if layout is None else StepLog.size(layout.max_owners),
                )
            except MemoryNotYet as exc:
                left = deadline - loop.time()
                if left <= 0:
                    raise StartupError(f"{exc} (waited {cfg.start_timeout_s:g}s: --start-timeout-ms)") from None
                log.warning("waiting for the pool's memory (%.0fs more at most; readiness NOT_SERVING): %s", left, exc)
                waited = True
                await asyncio.sleep(min(1.0, left))
                continue
            if waited:
                log.info("the pool's memory is free now: allocated")
            return memory

    async def _listen(self) -> None:
        """The gRPC server with health (liveness SERVING, readiness NOT_SERVING),
        reflection and the kvmem service (not ready yet), listening."""
        cfg = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        self._starting = server
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service = KVMemoryService(self.guard)
        add_to_server(self.service, server)  # a body that does not parse: INVALID_ARGUMENT, not UNKNOWN
        add_guarded(self.health, HEALTH, server, self.guard)  # the stock services' malformed calls too
        names = (SERVICE_NAME, HEALTH.full_name, reflection.SERVICE_NAME)
        add_guarded(reflection.aio.ReflectionServicer(names), REFLECTION, server, self.guard)
        if cfg.socket_path is not None:
            old_umask = os.umask(0o177)  # the socket is born 0600
            self._socket_made = True  # checked free (or a dead server's) before: ours to remove on failure
            try:
                server.add_insecure_port(f"unix:{cfg.socket_path}")
            except RuntimeError as exc:
                raise StartupError(f"--socket {cfg.socket_path}: cannot listen ({grpc_reason(exc)})") from None
            finally:
                os.umask(old_umask)
        if cfg.tcp is not None:
            tls = plan_tls(cfg)  # checked by check_config already; read again for the credentials
            try:
                if tls is None:
                    server.add_insecure_port(cfg.tcp)
                else:
                    server.add_secure_port(cfg.tcp, tls.credentials())
            except RuntimeError as exc:
                raise StartupError(f"--tcp {cfg.tcp}: cannot listen ({grpc_reason(exc)})") from None
            if tls is not None:
                required = tls.client_ca is not None
                certs = "client certificates required: --tls-client-ca" if required else "no client certificates"
                log.info("--tcp %s: TLS (%s)", cfg.tcp, certs)
        old_umask = os.umask(0o177)
        try:
            await server.start()
        finally:
            os.umask(old_umask)
        if cfg.socket_path is not None:
            gid = access_gid(cfg)
            if gid is not None:
                os.chown(cfg.socket_path, -1, gid)
            os.chmod(cfg.socket_path, cfg.socket_mode)
        self.grpc_server = server
        if cfg.health_port is not None:
            await self._listen_health(cfg.health_port)

    async def _listen_health(self, port: int) -> None:
        """grpc.health.v1 alone on a TCP port of every interface, the same statuses as on
        the socket (one servicer): what kubelet's gRPC probes need, and nothing else."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_guarded(self.health, HEALTH, server, self.guard)
        try:
            server.add_insecure_port(f"0.0.0.0:{port}")
        except RuntimeError as exc:
            raise StartupError(f"--health-port {port}: cannot listen ({grpc_reason(exc)})") from None
        await server.start()
        self.health_server = server

    async def _open(
        self, core_cfg: CoreConfig, kv_geometry: KVGeometry, metrics_at: tuple[str, int] | None, page_keys: PageKeys
    ) -> None:
        """The memory exists: the core over it (writing its block table, its cache events
        into the event log and the ZMQ publisher), the sessions over the core, the
        service ready, the lease reaper, metrics, readiness SERVING."""
        cfg = self.config
        assert self.service is not None
        core = self._core(core_cfg, page_keys)
        log_buffer = getattr(self.memory, "step_log", None)
        steplog = None if log_buffer is None or self._layout is None else StepLog(log_buffer, self._layout.max_owners)
        self.sessions = Sessions(
            core,
            cfg.lease_s,
            self.memory,
            quarantine_s=cfg.quarantine_s,
            max_sessions=cfg.max_sessions,
            steplog=steplog,
            resume_s=cfg.resume_window_s,
            handoff_s=cfg.handoff_s,
        )
        if self.restoration is not None:  # the last run's sessions wait for their clients to resume them
            assert steplog is not None
            self.sessions.origin = StateOrigin("adopted", self.restoration, self._restore_ms)
            self.sessions.restore_sessions(self.restoration, steplog.answers())
        self.events = EventLog(
            self.sessions.epoch,
            core_cfg.page_size,
            capacity=cfg.kv_events_buffer,
            snapshot=self.sessions.core.snapshot_events,
        )
        if cfg.kv_events_zmq is not None:
            self._start_zmq(cfg.kv_events_zmq, self.events)
        geometry = geometry_to_proto(core_cfg, None if self.memory is None else kv_geometry)
        handles = [] if self.memory is None else [handle_to_proto(h) for h in self.memory.handles()]
        backend = "none" if self.memory is None else self.memory.name
        self.service.ready(self.sessions, geometry, handles, backend, self.events)
        if metrics_at is not None:
            await self._start_metrics(*metrics_at)
        self._reaper = asyncio.create_task(self._reap_leases())
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    def _core(self, core_cfg: CoreConfig, page_keys: PageKeys) -> KVCore:
        """The core over the memory's block table; with --keep-state, over the kept
        state image: the last run's restored (checked, repaired, logged) when there is
        one, else a fresh one."""
        cfg = self.config
        block_table = None if self.memory is None else self.memory.block_table
        options: dict[str, Any] = {
            "prefix_cache": cfg.prefix_cache,
            "page_keys": page_keys,
            "audit_every_step": cfg.audit_every_step,
            "event_sink": self._publish_events,
        }
        if cfg.host_memory is not None:  # checked at start: the CPU pool, no kept state
            options["host_tier"], options["page_bytes"] = self._host_tier(core_cfg)
        state = getattr(self.memory, "state", None)
        if state is None or self._layout is None:
            return KVCore(core_cfg, block_table, **options)
        assert block_table is not None and self.memory is not None
        if not getattr(self.memory, "reopened", False):
            log.info("--keep-state: a new state in %s", self.memory.state_path)  # type: ignore[attr-defined]
            return KVCore(core_cfg, block_table, image=CoreImage.create(state, self._layout), **options)
        started = time.monotonic()
        try:
            core, self.restoration = restore(
                core_cfg, block_table, state, max_owners=self._layout.max_owners, **options
            )
        except ImageMismatch as exc:
            raise StartupError(f"--keep-state: {exc} (--discard-state drops it)") from None
        self._restore_ms = 1000 * (time.monotonic() - started)
        log.info(
            "--keep-state: %s, in %.0f ms from %s",
            self.restoration.describe(),
            self._restore_ms,
            self.memory.state_path,  # type: ignore[attr-defined]
        )
        return core

    def _host_tier(self, core_cfg: CoreConfig) -> tuple[HostTier, int]:
        """``--host-memory``: the host tier behind the pool (per rank on a CUDA pool), and
        a page's bytes (all ranks)."""
        from kvmem.server.memory.geometry import parse_size
        from kvmem.server.memory.host import HostPages, PageCopier, check_host_memory

        memory = self.memory
        assert memory is not None and self.config.host_memory is not None
        geometry = memory.geometry
        text = self.config.host_memory
        num_pages = check_host_memory(parse_size(text, "--host-memory"), geometry, memory.num_ranks, text)
        # In a file clients map: the block table's (shm), a small one of their own (cuda).
        counters = getattr(memory, "load_counters", None)
        mover: PageCopier
        if memory.name == "cuda":  # pinned pages and a copy stream per rank (torch: the cuda backend has it)
            from kvmem.server.memory.host_torch import TorchHostPages

            kv = [memory.kv(rank) for rank in range(memory.num_ranks)]
            mover = TorchHostPages(kv, geometry, core_cfg.num_pages, num_pages, counters)
        else:
            raw = [memory.kv_raw(rank) for rank in range(memory.num_ranks)]  # type: ignore[attr-defined]
            kept = getattr(memory, "host_raw", None)  # --keep-state: the tier's pages in a kept file
            reopened = kept is not None and bool(getattr(memory, "reopened", False))
            mover = HostPages(
                raw, geometry, core_cfg.num_pages, num_pages, counters, None if kept is None else [kept], reopened
            )
        # The copy thread says when a load has ended; the loop drops its references (the core is the loop's).
        loop = asyncio.get_running_loop()

        def notify() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is gone with its pages
                loop.call_soon_threadsafe(self._loads_finished)

        mover.notify = notify
        self._mover = mover
        log.info(
            "host tier: %d pages (%s of host memory per rank, %s a page), %s",
            num_pages,
            format_size(num_pages * geometry.page_bytes),
            format_size(geometry.page_bytes),
            "write-through (--store)" if self.config.store is not None else self.config.host_write_policy,
        )
        min_pages = -(-self.config.host_min_load_tokens // core_cfg.page_size)
        # With a store, pages go to the host tier as they are cached: the store is written from there.
        through = self.config.host_write_policy == "write-through" or self.config.store is not None
        tier = HostTier(num_pages, core_cfg.page_size, mover, min_pages, write_through=through)
        if self.config.store is not None:
            tier.link = self._store_link(mover, memory.num_ranks, num_pages, geometry, notify)
        return tier, geometry.page_bytes * memory.num_ranks

    def _store_link(self, mover: Any, ranks: int, host_pages: int, geometry: Any, notify: Any) -> Any:
        """``--store``: the store's thread, between the host tier and the store (it
        connects on its own, and again after a failure)."""
        from kvmem.server.process.startup import store_secrets
        from kvmem.server.store.base import open_store
        from kvmem.server.store.link import StoreLink

        cfg = self.config
        assert cfg.store is not None
        password, key = store_secrets(cfg)
        store = open_store(cfg.store, password, cfg.store_timeout_s)
        link = StoreLink(
            store,
            mover.page,
            mover.buffers(),
            geometry,
            ranks,
            cfg.prefix_hash,
            cfg.prefix_hash_seed,
            key,
            max_writes=min(cfg.store_write_queue, max(1, host_pages // 2)),
            max_fetch_pages=max(1, min(512, host_pages // 4)),
        )
        link.notify = notify
        link.start()
        self._link = link
        log.info(
            "store: %s (%s), writes from the host tier (at most %d pages waiting), fetches of up to %d pages",
            store.describe(),
            "values under an HMAC key" if key is not None else "values checksummed, no key: docs/DEPLOY.md",
            link.max_writes,
            link.max_fetch_pages,
        )
        return link

    def _loads_finished(self) -> None:
        """On the loop, after the copy thread ended a load: the core takes it back."""
        if self.sessions is not None:
            self.sessions.core.finish_loads()

    def _stop_copies(self) -> None:
        """The store's thread and the host tier's copy thread end before the memory they copy goes."""
        link, self._link = self._link, None
        if link is not None:
            link.close()
        mover, self._mover = self._mover, None
        if mover is not None:
            mover.close()

    def _publish_events(self, events: list[CacheEvent]) -> None:
        """The core's event sink: one mutating call's cache events into the event log
        (which exists from right after the core: nothing is cached before it)."""
        if self.events is not None:
            self.events.publish(events)

    def _start_zmq(self, endpoint: str, events: EventLog) -> None:
        """Publish the events in vLLM's format (ZMQ PUB of msgpack batches, and a replay
        socket with --kv-events-replay), for routers that read vLLM's KV events."""
        from kvmem.server.observe.events_zmq import ZmqEventPublisher  # pyzmq and msgspec: kvmem[events]

        cfg = self.config
        try:
            publisher = ZmqEventPublisher(
                endpoint,
                replay_endpoint=cfg.kv_events_replay,
                topic=cfg.kv_events_topic,
                buffer_steps=cfg.kv_events_buffer,
            )
        except Exception as exc:  # zmq.ZMQError and the like: a bad or busy endpoint
            where = endpoint if cfg.kv_events_replay is None else f"{endpoint} (replay {cfg.kv_events_replay})"
            raise StartupError(f"--kv-events-zmq {where}: cannot publish ({type(exc).__name__}: {exc})") from None
        self.zmq_publisher = publisher
        events.add_listener(publisher.listener)
        # Routers that knew this node from an earlier run drop what it held then (the
        # event log's own first batch, "all cleared", was recorded before this listener).
        publisher.listener(0, time.time(), [AllCleared()])
        log.info(
            "kv events in vLLM's format on %s (replay %s)", publisher.bound_endpoint, publisher.bound_replay_endpoint
        )

    def _close_events(self) -> None:
        """End the watch streams (the log) and the ZMQ publisher; each whatever the other does."""
        events, self.events = self.events, None
        publisher, self.zmq_publisher = self.zmq_publisher, None
        try:
            if events is not None:
                events.close()
        finally:
            if publisher is not None:
                publisher.close()

    async def _undo_start(self) -> None:
        """After a failed start: remove what it created, in reverse, each step whatever
        the others do."""
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        with contextlib.suppress(Exception):
            self._close_events()
        server, self._starting, self.grpc_server = self._starting, None, None
        if server is not None:
            with contextlib.suppress(Exception):
                await server.stop(None)
        if self._socket_made and self.config.socket_path is not None:
            self._socket_made = False
            with contextlib.suppress(OSError):
                os.unlink(self.config.socket_path)
        if self.metrics_server is not None:
            with contextlib.suppress(Exception):
                await self.metrics_server.stop()
            self.metrics_server = None
        health, self.health_server = self.health_server, None
        if health is not None:
            with contextlib.suppress(Exception):
                await health.stop(None)
        self._stop_copies()
        if self.memory is not None:
            with contextlib.suppress(Exception):
                self.memory.close()
            self.memory = None

    async def _start_metrics(self, host: str, port: int) -> None:
        assert self.sessions is not None and self.service is not None
        self.guard.rpc_stats = stats = RpcStats()
        registry = build_registry(self.sessions, stats, self.service.memory_backend)
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
        """Readiness NOT_SERVING and no new sessions at once; attached sessions may go on
        stepping until they detach or the drain period ends; then every later call gets
        UNAVAILABLE (SHUTTING_DOWN), the server ends the keep-alive streams and the
        sessions, gives calls still in flight the grace period, frees the memory and
        removes the socket. Nothing a client does (or fails to do: a stopped process)
        holds the exit back beyond drain + grace."""
        if self.grpc_server is None or self._stopped.is_set():
            return
        self._stopped.set()
        assert self.sessions is not None and self.service is not None
        cfg = self.config
        log.info("shutting down: readiness NOT_SERVING, no new sessions; draining for up to %.1fs", cfg.drain_s)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.sessions.accepting = False
        if cfg.keep_state:  # the sessions stay, to resume on the next run: nothing to drain
            log.info("--keep-state: %d session(s) kept for the next run to resume", len(self.sessions.by_id))
        else:
            await self._drain(cfg.drain_s)
        self.guard.stop()  # from here every call is refused (UNAVAILABLE); session streams waiting end now
        self._close_events()  # watch streams end now (UNAVAILABLE), not after the grace period
        if self._reaper is not None:
            self._reaper.cancel()
        for session_id in [] if cfg.keep_state else list(self.sessions.by_id):
            self.sessions.end(session_id, "server shutdown")
        await self.grpc_server.stop(cfg.shutdown_grace_s)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        self._stop_copies()
        if self.memory is not None:
            self.memory.close()  # shm: the files are removed; cuda: the memory is released
        if self.config.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.socket_path)
        if self.health_server is not None:  # last: the probes see NOT_SERVING until the end
            await self.health_server.stop(0)
        self.guard.refusals.flush()  # the last summary of refused calls
        log.info("stopped")

    async def _drain(self, seconds: float) -> None:
        """Until every session has detached (or ended) or ``seconds`` have passed."""
        assert self.sessions is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.sessions.by_id and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if self.sessions.by_id:
            log.info("drain over: %d session(s) still attached end now", len(self.sessions.by_id))

    async def wait(self) -> None:
        assert self.grpc_server is not None
        await self.grpc_server.wait_for_termination()


async def _serve(config: ServerConfig) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before start: a signal during it stops right after
        loop.add_signal_handler(sig, stop.set)
    server = KVMemServer(config)
    starting = asyncio.create_task(server.start())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # a signal while it waits for its memory: undo the start, exit 0
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        log.info("stopped before it was ready")
        return
    stopping.cancel()
    starting.result()  # a failed start raises here
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
