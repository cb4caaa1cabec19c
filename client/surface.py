"""The method surface both clients expose, written once: each public method is an
:class:`Operation` over a :class:`~kvmem.client.session.Session` method that builds its
:class:`~kvmem.client.session.Call`; :class:`ClientBase` holds what both clients share
(the constructor, the session's attributes, the lease, the memory views). The clients
(:mod:`kvmem.client.sync`, :mod:`kvmem.client.aio`) only make the calls.
"""

from __future__ import annotations

import functools
import inspect
import time
import types
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import torch

from kvmem.v1 import kvmem_pb2

from .channel import PemSource, transport
from .errors import SessionLost
from .memory import KVLayer, MappedMemory
from .session import Call, Session, checked_timeout

T = TypeVar("T")
P = ParamSpec("P")
Mode = TypeVar("Mode")


class Blocking:
    """Type tag of a client whose methods block and return their result."""


class Awaiting:
    """Type tag of a client whose methods return awaitables."""


class Operation(Generic[P, T]):
    """A client method written once: ``build``, the :class:`Session` method that makes
    its :class:`Call`; the client it is read from makes the call (``_invoke``), blocking
    for a ``ClientBase[Blocking]``, awaitable for a ``ClientBase[Awaiting]``. The
    method's name, docstring and parameters are ``build``'s."""

    def __init__(self, build: Callable[Concatenate[Session, P], Call[T]]) -> None:
        def method(client: ClientBase[Any], /, *args: P.args, **kwargs: P.kwargs) -> Any:
            return client._invoke(build, *args, **kwargs)

        functools.update_wrapper(method, build)
        signature = inspect.signature(build)
        method.__signature__ = signature.replace(return_annotation=inspect.Signature.empty)  # type: ignore[attr-defined]
        self._method = method
        self.__doc__ = build.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._method.__qualname__ = f"{owner.__qualname__}.{name}"

    @overload
    def __get__(self, client: None, owner: type | None = None) -> Operation[P, T]: ...
    @overload
    def __get__(self, client: ClientBase[Blocking], owner: type | None = None) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, client: ClientBase[Awaiting], owner: type | None = None
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, client: ClientBase[Any] | None, owner: type | None = None) -> Any:
        if client is None:
            return self
        return types.MethodType(self._method, client)


class SessionField(Generic[T]):
    """A read-only attribute of the client that is its :class:`Session`'s of the same name."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, client: None, owner: type | None = None) -> SessionField[T]: ...
    @overload
    def __get__(self, client: ClientBase[Any], owner: type | None = None) -> T: ...
    def __get__(self, client: ClientBase[Any] | None, owner: type | None = None) -> T | SessionField[T]:
        if client is None:
            return self
        value: T = getattr(client._session, self.name)
        return value

    def __set__(self, client: ClientBase[Any], value: T) -> None:
        raise AttributeError(f"{self.name} is the session's: read-only")


class ClientBase(Generic[Mode]):
    """A session with a kvmem server: what both clients are. ``target`` is a unix
    socket path (``/tmp/kvmem.sock`` or ``unix:/tmp/kvmem.sock``) or ``HOST:PORT``.
    Every call takes ``timeout`` seconds (default: the client's). ``on_views_stale`` is
    called once (from the keep-alive thread or task, or a call) when the session is lost
    because the server is gone or replaced: the client has dropped its own mappings, and
    the application must drop every view it took (see ``SessionLost.views_stale``). The memory handles of
    the Attach are mapped on first use (``memory``, ``kv_cache``, ``block_table``).
    ``cache_namespace``: the prefix-cache namespace the session shares cached pages in
    (sessions of other namespaces never see them: other models, adapters, tenants);
    empty is the shared default. ``prefix_cache`` says what the server does with it.
    ``wait_for_ready`` (default on): the Attach waits for a server that is not there yet
    (no socket, connection refused) or not ready (its KV memory not allocated yet:
    ``NOT_READY``), retrying up to ``timeout`` seconds, so a scheduler may start before
    its sidecar; a server that is shutting down is not waited for. ``tls_ca``: TLS to a
    ``HOST:PORT`` whose server has ``--tls-cert`` (the CA certificate that signed it, a
    path or PEM bytes, or ``True`` for gRPC's default roots); ``tls_server_name``: the
    name to check the certificate against instead of the host; ``tls_cert`` and
    ``tls_key``: this client's certificate and key, for a server with
    ``--tls-client-ca`` (see :mod:`kvmem.client.channel`). A TLS mismatch raises
    :class:`~kvmem.client.channel.TLSError` (an ``Unavailable``) at once.
    ``step_stream`` (default on): the Steps (``step``, ``alloc``, ``truncate``,
    ``release``, ``match``, ``cache``) go over one long-lived StepStream, opened at the
    first, with the same results and errors as the unary ``Step`` and no call set-up per
    step; off, each Step is a unary call (see :mod:`kvmem.client.stepstream`). Steps of
    one client go one at a time on the stream (threads of the blocking client wait
    their turn)."""

    _mapped: MappedMemory | None = None

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
        cache_namespace: str = "",
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
            wait_for_ready=wait_for_ready,
        )
        self._step_stream = step_stream
        self._on_views_stale = on_views_stale
        self._session.on_views_stale = self._views_stale
        self._setup()

    def _setup(self) -> None:
        """The client's own start, at the end of the constructor."""

    def _invoke(self, build: Callable[Concatenate[Session, P], Call[T]], /, *args: P.args, **kwargs: P.kwargs) -> Any:
        """Build the call with ``build`` and make it (blocking: its result; asyncio: an
        awaitable of it)."""
        raise NotImplementedError

    open = Operation(Session.open)
    step = Operation(Session.step)
    alloc = Operation(Session.alloc)
    truncate = Operation(Session.truncate)
    release = Operation(Session.release)
    match = Operation(Session.match)
    cache = Operation(Session.cache)
    stats = Operation(Session.stats)
    detach = Operation(Session.detach)

    # ----------------------------------------------------------- the session

    @property
    def timeout(self) -> float:
        """The default deadline of a call, in seconds."""
        return self._session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._session.timeout = checked_timeout(seconds)

    session_id = SessionField[str]("Unguessable: it names the session in every call (empty until attached).")
    lease_valid_until = SessionField[float](
        "Until when (``time.monotonic()`` seconds) the session's lease is known to hold: check it right before "
        "launching the kernels that write K/V through a Step's ``kv_loc`` (see :meth:`lease_remaining`)."
    )
    epoch = SessionField[str]("The server run the session lives in (empty until attached).")
    lease_ms = SessionField[int]("The session ends after this long without a call or keep-alive message.")
    geometry = SessionField[kvmem_pb2.PoolGeometry]("The pool's geometry, as Attach reported it.")
    memory_handles = SessionField[list[kvmem_pb2.MemoryHandle]]("The memory handles Attach returned.")
    prefix_cache = SessionField[kvmem_pb2.PrefixCacheInfo](
        "The server's prefix cache as Attach reported it: ``enabled``, ``hash`` (the page-key recipe, e.g. "
        "'xxh3-128') and this session's ``cache_namespace``."
    )

    def lease_remaining(self) -> float:
        """Seconds the lease is still known to hold (negative once it may have lapsed).
        A scheduler that writes K/V after a pause checks it is comfortably positive
        before launching the writes; a Step answer that arrives past it is refused
        with :class:`~kvmem.client.errors.SessionLost`."""
        return self._session.lease_valid_until - time.monotonic()

    # -------------------------------------------------------------- memory

    @property
    def memory(self) -> MappedMemory:
        """The server's KV memory and block table(s), mapped into this process."""
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

    def _views_stale(self, lost: SessionLost) -> None:
        """The server is gone or replaced: drop this client's mappings and tell the
        application (``on_views_stale``), which must drop the views it took."""
        self._unmap()
        if self._on_views_stale is not None:
            self._on_views_stale(lost)

    def _unmap(self) -> None:
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            mapped.close()
