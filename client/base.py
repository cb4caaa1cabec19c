"""What both clients are: :class:`ClientBase` holds the constructor, the session's
attributes, the lease and the memory views, and the one piece of a call that is not
I/O on either side (its failure read as the client's error). The methods are written
out on each client (:mod:`kvmem.client.sync`, :mod:`kvmem.client.aio`), each one line
over the :class:`kvmem.client.session.Session` builder of its call; how a call goes
(the step stream, a unary call, a unary call under the client's own deadline) is
:meth:`kvmem.client.session.Session.route`'s to say.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import torch

from kvmem.v1 import kvmem_pb2

from .channel import PemSource, transport
from .errors import KVMemError, SessionLost
from .loads import PageLoads
from .memory import KVLayer, MappedMemory
from .resume import Resumed
from .session import Call, Session, checked_timeout


class ClientBase:
    """A session with a kvmem server: what both clients are. ``target`` is a unix
    socket path (``/tmp/kvmem.sock`` or ``unix:/tmp/kvmem.sock``) or ``HOST:PORT``.
    Every call takes ``timeout`` seconds (default: the client's). ``on_views_stale`` is
    called once (from the keep-alive thread or task, or a call) when the session is lost
    because the server is gone or replaced: the client has dropped its own mappings, and
    the application must drop every view it took (see ``SessionLost.views_stale``). The
    memory handles of the Attach are mapped on first use (``memory``, ``kv_cache``,
    ``block_table``).

    ``cache_namespace``: the prefix-cache namespace the session shares cached pages in
    (sessions of other namespaces never see them: other models, adapters, tenants);
    empty is the shared default. ``prefix_cache`` says what the server does with it.

    ``model_id``: the model (with its weights revision: ``"org/name@revision"``) whose KV
    this session reads and writes. A server with a store (``kvmem serve --store``) makes
    its store keys from it, so nodes share pages only for the same weights; a session
    naming another model than the server's is refused (``MODEL_MISMATCH``).

    ``wait_for_ready`` (default on): the Attach waits for a server that is not there yet
    (no socket, connection refused) or not ready (its KV memory not allocated yet:
    ``NOT_READY``), retrying up to ``timeout`` seconds, so a scheduler may start before
    its sidecar; a server that is shutting down is not waited for.

    ``tls_ca``: TLS to a ``HOST:PORT`` whose server has ``--tls-cert`` (the CA
    certificate that signed it, a path or PEM bytes, or ``True`` for gRPC's default
    roots); ``tls_server_name``: the name to check the certificate against instead of
    the host; ``tls_cert`` and ``tls_key``: this client's certificate and key, for a
    server with ``--tls-client-ca`` (see :mod:`kvmem.client.channel`). A TLS mismatch
    raises :class:`kvmem.client.TLSError` (an ``Unavailable``) at once.

    ``step_stream`` (default on): the Steps (``step``, ``alloc``, ``truncate``,
    ``release``, ``match``, ``cache``) go over one long-lived StepStream, opened at the
    first, with the same results and errors as the unary ``Step`` and no call set-up per
    step; off, each Step is a unary call (see :mod:`kvmem.client.stepstream`). Steps of
    one client go one at a time on the stream (threads of the blocking client wait
    their turn).

    Resuming: when the server keeps its state (``kvmem serve --keep-state``; Attach's
    ``resume_ms`` > 0) and goes away (a crash, a restart), the client resumes its session
    on the server's next run by itself: the call that found the server gone (or the
    keep-alive) waits for it, re-attaches with the session's id, and goes on. The
    requests, their rows and their K/V are as they were (the same memory: the views
    stay valid); a Step that was in flight is answered with its kept answer if the
    server applied it, else sent again (Steps are numbered per session). It logs one
    line and calls ``on_resumed`` (:class:`kvmem.client.Resumed`); :class:`SessionLost`
    is raised only when the resume is refused or ``resume_ms`` plus ``timeout`` pass
    without a server."""

    target: str
    """The server's address as the channel takes it: ``unix:/path`` or ``HOST:PORT``."""

    _mapped: MappedMemory | None = None
    _page_loads: PageLoads | None = None

    def __init__(
        self,
        target: str,
        *,
        name: str = "",
        quota_pages: int | None = None,
        timeout: float = 10.0,
        auth_token: str | None = None,
        keepalive: bool = True,
        on_views_stale: Callable[[SessionLost], None] | None = None,
        on_resumed: Callable[[Resumed], None] | None = None,
        cache_namespace: str = "",
        model_id: str = "",
        wait_for_ready: bool = True,
        tls_ca: PemSource | bool | None = None,
        tls_server_name: str | None = None,
        tls_cert: PemSource | None = None,
        tls_key: PemSource | None = None,
        step_stream: bool = True,
    ) -> None:
        self._transport = transport(
            target, tls_ca=tls_ca, tls_server_name=tls_server_name, tls_cert=tls_cert, tls_key=tls_key
        )
        self.target = self._transport.target
        self._session = Session(
            name=name,
            quota_pages=quota_pages,
            timeout=timeout,
            auth_token=auth_token,
            keepalive=keepalive,
            cache_namespace=cache_namespace,
            model_id=model_id,
            wait_for_ready=wait_for_ready,
            step_stream=step_stream,
        )
        self._on_views_stale = on_views_stale
        self._session.on_views_stale = self._views_stale
        self._session.on_resumed = on_resumed
        self._setup()

    def _setup(self) -> None:
        """The client's own start, at the end of the constructor."""

    def _failure(self, call: Call[Any], err: grpc.RpcError) -> KVMemError:
        """What ``call`` raises when gRPC failed it: the session's reading of the
        failure, told as a TLS problem where TLS explains it."""
        return self._transport.error(self._session.failed(err), first=call.method == "Attach")

    # ----------------------------------------------------------- the session

    @property
    def timeout(self) -> float:
        """The default deadline of a call, in seconds (settable: a positive number)."""
        return self._session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._session.timeout = checked_timeout(seconds)

    @property
    def session_id(self) -> str:
        """Unguessable: it names the session in every call (empty until attached)."""
        return self._session.session_id

    @property
    def lease_valid_until(self) -> float:
        """Until when (``time.monotonic()`` seconds) the session's lease is known to
        hold: check it right before launching the kernels that write K/V through a
        Step's ``kv_loc`` (see :meth:`lease_remaining`)."""
        return self._session.lease_valid_until

    @property
    def epoch(self) -> str:
        """The server run the session lives in (empty until attached)."""
        return self._session.epoch

    @property
    def num_resumes(self) -> int:
        """How many times the session was resumed after its server restarted."""
        return self._session.num_resumes

    @property
    def resume_ms(self) -> int:
        """How long after a restart the server lets this session resume (0: it keeps
        no state; a restart loses the session)."""
        return self._session.resume_ms

    @property
    def lease_ms(self) -> int:
        """The session ends after this long without a call or keep-alive message."""
        return self._session.lease_ms

    @property
    def geometry(self) -> kvmem_pb2.PoolGeometry:
        """The pool's geometry, as Attach reported it."""
        return self._session.geometry

    @property
    def memory_handles(self) -> list[kvmem_pb2.MemoryHandle]:
        """The memory handles Attach returned."""
        return self._session.memory_handles

    @property
    def prefix_cache(self) -> kvmem_pb2.PrefixCacheInfo:
        """The server's prefix cache as Attach reported it: ``enabled``, ``hash`` (the
        page-key recipe, e.g. 'xxh3-128') and this session's ``cache_namespace``."""
        return self._session.prefix_cache

    def lease_remaining(self) -> float:
        """Seconds the lease is still known to hold (negative once it may have lapsed).
        A scheduler that writes K/V after a pause checks it is comfortably positive
        before launching the writes; a Step answer that arrives past it is refused
        with :class:`kvmem.client.SessionLost`. Cost: a clock read, no call."""
        return self._session.lease_valid_until - time.monotonic()

    # -------------------------------------------------------------- memory

    @property
    def memory(self) -> MappedMemory:
        """The server's KV memory and block table(s), mapped into this process (on
        first use: one ``mmap`` per shared-memory file, one CUDA IPC open per device
        allocation; no per-page work)."""
        if self._mapped is None:
            self._mapped = MappedMemory.open(self.memory_handles, self.geometry)
        return self._mapped

    def kv_cache(self, rank: int = 0) -> list[KVLayer]:
        """Per layer: ``(k, v)`` views ``[num_tokens, kv_heads, head_dim]`` (mha) or the
        latent ``[num_tokens, kv_lora_rank + rope_dim]`` (mla), indexed by ``kv_loc``."""
        return self.memory.kv_cache(rank)

    @property
    def block_table(self) -> torch.Tensor:
        """int32 ``[max_requests + 1, max_pages_per_request]``; row ``slot`` lists the
        request's pages. Read-only (shm) or the device copy of rank 0 (cuda); it is
        current when a Step response arrives."""
        return self.memory.block_table

    @property
    def page_loads(self) -> PageLoads | None:
        """The server's load counters (``kvmem serve --host-memory``; None without a
        host tier): what a reader of pages a match is still loading waits on, in this
        process's memory, with no call (:mod:`kvmem.client.loads`)."""
        if self._page_loads is None:
            self._page_loads = self.memory.page_loads()
        return self._page_loads

    def _views_stale(self, lost: SessionLost) -> None:
        """The server is gone or replaced: drop this client's mappings and tell the
        application (``on_views_stale``), which must drop the views it took."""
        self._unmap()
        if self._on_views_stale is not None:
            self._on_views_stale(lost)

    def _unmap(self) -> None:
        self._page_loads = None
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            mapped.close()
