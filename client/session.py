"""The session logic of both clients, written once.

:class:`Session` builds every request and reads every response and failure of one
session, and does no I/O: attach, the calls, detach and close, the keep-alive's messages
and what its end means, the epoch check, the error mapping. :class:`ClientBase` is the
method surface both clients expose; each method is an :class:`Operation`: the Session
builds the :class:`Call`, the client makes it, the Session reads the answer.
:class:`~kvmem.client.sync.KVMemClient` makes calls blocking,
:class:`~kvmem.client.aio.AsyncKVMemClient` awaits them; that is all they add.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import grpc
import torch
from google.protobuf.message import Message

from kvmem.v1 import kvmem_pb2

from .channel import auth_metadata, normalize_target
from .errors import KVMemError, Reason, SessionLost, from_rpc_error
from .memory import KVLayer, MappedMemory
from .step import NO_COLUMN, IntsLike, StepResult, as_ints

T = TypeVar("T")
P = ParamSpec("P")
Mode = TypeVar("Mode")

UNSPECIFIED: Reason = Reason["UNSPECIFIED"]  # what the client says where it has no server's reason
_NOT_ATTACHED = "not attached: use `await AsyncKVMemClient.connect(...)` or `async with AsyncKVMemClient(...)`"


class Call(Generic[T]):
    """One unary call, described and not made: the stub's method name, the request, the
    deadline in seconds, and ``read``, which turns the response into what the caller
    gets. ``ends_session``: the client stops its keep-alive once the call is done."""

    __slots__ = ("ends_session", "method", "read", "request", "timeout")

    def __init__(
        self, method: str, request: Message, timeout: float, read: Callable[[Any], T], ends_session: bool = False
    ) -> None:
        self.method = method
        self.request = request
        self.timeout = timeout
        self.read = read
        self.ends_session = ends_session


class Session:
    """One session's state and logic, without I/O. ``lost`` is why the session ended
    (detached, keep-alive broken, server restarted); every later call raises it."""

    def __init__(
        self, *, name: str, quota_pages: int | None, timeout: float, auth_token: str | None, keepalive: bool
    ) -> None:
        self.name = name
        self.quota_pages = quota_pages
        self.timeout = timeout
        self.metadata = auth_metadata(auth_token)
        self.keepalive = keepalive
        self.session_id = ""
        self.epoch = ""
        self.lease_ms = 0
        self.geometry = kvmem_pb2.PoolGeometry()
        self.memory_handles: list[kvmem_pb2.MemoryHandle] = []
        self.lost: KVMemError | None = None

    # ------------------------------------------------------------------ calls

    def attach(self) -> Call[None]:
        """The Attach that starts the session."""
        self._check_not_lost()
        if self.session_id:
            raise RuntimeError(f"already attached as session {self.session_id[:6]}...: one client is one session")
        request = kvmem_pb2.AttachRequest(name=self.name)
        if self.quota_pages is not None:
            request.quota_pages = self.quota_pages
        return Call("Attach", request, self.timeout, self._attached)

    def _attached(self, resp: kvmem_pb2.AttachResponse) -> None:
        self.session_id = resp.session_id
        self.epoch = resp.epoch
        self.lease_ms = resp.lease_ms
        self.geometry = resp.geometry
        self.memory_handles = list(resp.memory)

    def open(self, request_ids: list[str], *, timeout: float | None = None) -> Call[torch.Tensor]:
        """Request slots (int32) for ``request_ids``; an id already open keeps its slot."""
        request = kvmem_pb2.OpenRequest(session_id=self._live_id(), request_ids=request_ids)
        return Call("Open", request, self._deadline(timeout), _slots)

    def step(
        self,
        *,
        release_slots: IntsLike = NO_COLUMN,
        truncate_slots: IntsLike = NO_COLUMN,
        truncate_lens: IntsLike = NO_COLUMN,
        alloc_slots: IntsLike = NO_COLUMN,
        alloc_needs: IntsLike = NO_COLUMN,
        alloc_expected_lens: IntsLike | None = None,
        atomic: bool = False,
        timeout: float | None = None,
    ) -> Call[StepResult]:
        """One scheduler step in one round trip: releases, truncates, then allocs."""
        # One constructor call with only the columns given: a column left at its default
        # costs nothing, and on a client whose caches are cold between steps (as when many
        # scheduler processes share the cores) one call costs about two thirds of
        # constructing and then extending (measured: 93 vs 130+ µs for a 32-item decode).
        columns: dict[str, Any] = {}
        if release_slots is not NO_COLUMN:  # the default; anything else is sent, even if empty
            columns["release_slots"] = as_ints(release_slots)
        if truncate_slots is not NO_COLUMN:
            columns["truncate_slots"] = as_ints(truncate_slots)
        if truncate_lens is not NO_COLUMN:
            columns["truncate_lens"] = as_ints(truncate_lens)
        if alloc_slots is not NO_COLUMN:
            columns["alloc_slots"] = as_ints(alloc_slots)
        if alloc_needs is not NO_COLUMN:
            columns["alloc_needs"] = as_ints(alloc_needs)
        if alloc_expected_lens is not None:
            columns["alloc_expected_lens"] = as_ints(alloc_expected_lens)
        if atomic:
            columns["atomic"] = True
        request = kvmem_pb2.StepRequest(session_id=self._live_id(), **columns)
        return Call("Step", request, self._deadline(timeout), StepResult)

    def alloc(
        self, slots: IntsLike, needs: IntsLike, expected_lens: IntsLike | None = None, *, atomic: bool = False,
        timeout: float | None = None,
    ) -> Call[StepResult]:  # fmt: skip
        """A step of allocs only: ``needs[i]`` more tokens for request slot ``slots[i]``."""
        return self.step(
            alloc_slots=slots, alloc_needs=needs, alloc_expected_lens=expected_lens, atomic=atomic, timeout=timeout
        )

    def truncate(self, slots: IntsLike, new_lens: IntsLike, *, timeout: float | None = None) -> Call[StepResult]:
        """A step of truncates only: request slot ``slots[i]`` shrinks to ``new_lens[i]`` tokens."""
        return self.step(truncate_slots=slots, truncate_lens=new_lens, timeout=timeout)

    def release(self, slots: IntsLike, *, timeout: float | None = None) -> Call[StepResult]:
        """A step of releases only: the requests end, their slots and pages return."""
        return self.step(release_slots=slots, timeout=timeout)

    def stats(self, *, audit: bool = False, timeout: float | None = None) -> Call[kvmem_pb2.StatsResponse]:
        """The server's Stats; ``audit`` runs the full audit (O(pool))."""
        self._live_id()
        return Call("Stats", kvmem_pb2.StatsRequest(audit=audit), self._deadline(timeout), _stats)

    def detach(self, *, timeout: float | None = None) -> Call[int]:
        """End the session: every request it holds is released. Returns how many."""
        request = kvmem_pb2.DetachRequest(session_id=self._live_id())
        # Ended from now on, whatever the call's fate; the keep-alive ends after the call
        # (closing its stream first would end the session by itself).
        self.lost = SessionLost(grpc.StatusCode.FAILED_PRECONDITION, UNSPECIFIED, "this session was detached")
        return Call("Detach", request, self._deadline(timeout), _num_released, ends_session=True)

    def close(self) -> Call[int] | None:
        """What closing the client sends: a Detach with a short deadline while the
        session lives, else nothing. The client ignores its failure: the session is gone
        either way."""
        if self.lost is not None or not self.session_id:
            return None
        return self.detach(timeout=min(self.timeout, 2.0))

    def _live_id(self) -> str:
        self._check_not_lost()
        if not self.session_id:
            raise RuntimeError(_NOT_ATTACHED)
        return self.session_id

    def _check_not_lost(self) -> None:
        if self.lost is not None:
            raise self.lost.with_traceback(None)  # a fresh traceback each time, not a growing one

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    # -------------------------------------------------------------- answers

    def finish(self, call: Call[T], response: Any) -> T:
        """What the caller gets from ``call``'s response. A changed epoch means the
        server restarted: the session and its memory handles are gone."""
        epoch = response.epoch
        if epoch and self.epoch and epoch != self.epoch:
            lost = SessionLost(
                grpc.StatusCode.FAILED_PRECONDITION, UNSPECIFIED,
                f"the server restarted (epoch {self.epoch} is now {epoch}): attach again",
            )  # fmt: skip
            self._lose(lost)
            raise lost
        return call.read(response)

    def failed(self, err: grpc.RpcError) -> KVMemError:
        """The kvmem error of a failed call. An unknown session stays unknown: later
        calls raise at once."""
        error = from_rpc_error(err)
        if isinstance(error, SessionLost):
            self._lose(error)
        return error

    # ------------------------------------------------------------ keep-alive

    @property
    def keepalive_interval(self) -> float:
        """Seconds between keep-alive messages: a third of the lease."""
        return max(self.lease_ms / 3000, 0.01)

    def keepalive_requests(self) -> tuple[kvmem_pb2.KeepAliveRequest, kvmem_pb2.KeepAliveRequest]:
        """The stream's first message (it names the session) and every later one."""
        return kvmem_pb2.KeepAliveRequest(session_id=self.session_id), kvmem_pb2.KeepAliveRequest()

    def keepalive_ended(self, err: grpc.RpcError | None) -> None:
        """The keep-alive stream ended: broken with ``err``, or closed by the server
        (None). Unless the client ended the session itself, the session is lost, with
        the server's reason if it sent one."""
        if err is None:
            message = "the server ended the keep-alive stream"
            lost = SessionLost(grpc.StatusCode.UNAVAILABLE, UNSPECIFIED, message)
        else:
            error = from_rpc_error(err)
            lost = SessionLost(error.code, error.raw_reason, f"the keep-alive stream broke: {error}", error.metadata)
        self._lose(lost)

    def _lose(self, why: KVMemError) -> None:
        if self.lost is None:  # the first cause stands (e.g. "detached", not the stream it closed)
            self.lost = why


def _slots(resp: kvmem_pb2.OpenResponse) -> torch.Tensor:
    return torch.tensor(list(resp.slots), dtype=torch.int32)


def _stats(resp: kvmem_pb2.StatsResponse) -> kvmem_pb2.StatsResponse:
    return resp


def _num_released(resp: kvmem_pb2.DetachResponse) -> int:
    return resp.num_requests_released


# ---------------------------------------------------------------- the surface


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
    Every call takes ``timeout`` seconds (default: the client's). The memory handles of
    the Attach are mapped on first use (``memory``, ``kv_cache``, ``block_table``)."""

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
    ) -> None:
        self.target = normalize_target(target)
        self._session = Session(
            name=name, quota_pages=quota_pages, timeout=timeout, auth_token=auth_token, keepalive=keepalive
        )
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
    stats = Operation(Session.stats)
    detach = Operation(Session.detach)

    # ----------------------------------------------------------- the session

    @property
    def timeout(self) -> float:
        """The default deadline of a call, in seconds."""
        return self._session.timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._session.timeout = seconds

    session_id = SessionField[str]("Unguessable: it names the session in every call (empty until attached).")
    epoch = SessionField[str]("The server run the session lives in (empty until attached).")
    lease_ms = SessionField[int]("The session ends after this long without a call or keep-alive message.")
    geometry = SessionField[kvmem_pb2.PoolGeometry]("The pool's geometry, as Attach reported it.")
    memory_handles = SessionField[list[kvmem_pb2.MemoryHandle]]("The memory handles Attach returned.")

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

    def _unmap(self) -> None:
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
