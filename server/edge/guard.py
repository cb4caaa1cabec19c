"""The one guard every call to the server passes: admission (the shutdown, the bearer
token), bodies that do not parse (:class:`~kvmem.server.edge.wire.Malformed`), the
rate-limited log of refused calls, the RPC metrics, and the end of a refused call with
its mapped status (:func:`~kvmem.server.edge.wire.to_status`).

A handler refuses by raising :class:`KVMemError`; it never logs a refusal nor aborts a
call itself. kvmem's own handlers (:class:`~kvmem.server.edge.service.KVMemoryService`,
whose ``guard`` attribute is the server's :class:`Guard`) are wrapped by :func:`unary`
(a plain function: one critical section on the event loop) or :func:`stream` (an async
generator); the stock services' by :meth:`Guard.stock`
(:func:`~kvmem.server.edge.handlers.add_guarded`). What each does:

- :func:`unary`: admits the call, refuses a body that does not parse, times and counts
  it (metrics), logs a refusal and fails the call with its status.
- :func:`stream`: admits the stream and checks its request once, at the start; a
  refusal the handler raises later (a bad message of a session stream: see
  :meth:`Guard.messages`) is logged and ends the stream with its status. Not in the
  metrics (a stream has no one duration).
- :meth:`Guard.run`, inside a stream, for each of StepStream's steps: as a unary call
  but for admission, which the stream had at its start; a refusal is returned, for the
  handler to answer in-band, the stream going on.
- :meth:`Guard.stock`: refuses a body that does not parse and logs it; no token and no
  shutdown refusal (the probes must see the server through its shutdown), no metrics.

At a shutdown (:meth:`Guard.stop`) every later call is refused as UNAVAILABLE
(SHUTTING_DOWN), and a stream ends with that status and the message :func:`stream` was
given, at once if it waits for the client's next message (:meth:`Guard.messages`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import inspect
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeAlias, TypeVar, cast

import grpc
from google.protobuf.descriptor import MethodDescriptor

from kvmem.server.edge.refusals import RefusalLog
from kvmem.server.edge.wire import STATUS_CODE, Malformed, to_status
from kvmem.server.errors import CorruptionError, KVMemError, Reason

if TYPE_CHECKING:
    from kvmem.server.observe.metrics import RpcStats

log = logging.getLogger("kvmem.service")

Context: TypeAlias = grpc.aio.ServicerContext
Req = TypeVar("Req")
Resp = TypeVar("Resp")


class Guard:
    """The server's admission, refusal log, RPC metrics and aborts (see the module).
    One per server; not thread-safe: call it from the server's one event loop."""

    def __init__(self, auth_token: str | None = None) -> None:
        self._auth = None if auth_token is None else f"Bearer {auth_token}".encode()
        self.refusals = RefusalLog()  # flushed by the server at shutdown
        self.rpc_stats: RpcStats | None = None  # set by the server when it serves metrics
        self.stopping = asyncio.Event()  # set by stop(): from then on every call is refused
        # The session streams' handler tasks while they wait for the client's next
        # message (KeepAlive, StepStream): what stop() cancels (see messages()).
        self.waiting: set[asyncio.Task[Any]] = set()

    def stop(self) -> None:
        """The drain of a shutdown is over: refuse every later call (UNAVAILABLE,
        SHUTTING_DOWN) and end the session streams that wait for a message."""
        self.stopping.set()
        for task in list(self.waiting):
            task.cancel()

    # ------------------------------------------------------------- admission

    def admit(self, context: Context) -> None:
        """Refuse every call once the drain of a shutdown is over (UNAVAILABLE, with the
        reason SHUTTING_DOWN); then, with a token set, every call that does not come
        over the unix socket must carry ``authorization: Bearer <token>``, compared in
        constant time (how long the comparison takes says nothing of how much of a
        guess was right)."""
        if self.stopping.is_set():
            raise KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: it takes no more calls")
        if self._auth is None or context.peer().startswith("unix:"):
            return
        given = dict(context.invocation_metadata() or ()).get("authorization")
        if given is None or not hmac.compare_digest(_as_bytes(given), self._auth):
            raise KVMemError(
                Reason.BAD_TOKEN,
                "missing authorization metadata" if given is None else "wrong bearer token in authorization metadata",
            )

    # --------------------------------------------------------------- refusals

    def refused(self, context: Context, method: str, err: KVMemError) -> None:
        """Log a refused call: corruption (a bug in kvmem) as an ERROR each time, any
        other refusal into the rate-limited summaries."""
        if isinstance(err, CorruptionError):
            log.error("corruption detected in %s: %s", method, err.message)
        else:
            self.refusals.record(context.peer(), method, err.reason.name, err.message)

    async def abort(self, context: Context, method: str, err: KVMemError) -> NoReturn:
        """Log the refusal and end the call with its status."""
        self.refused(context, method, err)
        await _end(context, err)

    def run(
        self,
        method: str,
        handler: Callable[[Any, Req, Context], Resp],
        servicer: Any,
        request: Req | Malformed,
        context: Context,
        *,
        admit: bool = False,
    ) -> tuple[Resp | None, KVMemError | None]:
        """Run one call's (or one stream message's) handler: ``(response, None)``, or
        ``(None, err)`` when it is refused (a KVMemError, an admission failure with
        ``admit``, a body that did not parse: INVALID_ARGUMENT naming ``method``), the
        refusal logged. With metrics on (``rpc_stats`` set) it is counted by its code
        and the handler timed; off, that costs two ``is None`` tests (the timing costs
        ~2% of a 256-item Step's round trip, measured)."""
        stats = self.rpc_stats
        started = 0.0 if stats is None else time.perf_counter()
        code, reason = "OK", None
        try:
            if admit:
                self.admit(context)
            if isinstance(request, Malformed):
                raise request.error(method)
            return handler(servicer, request, context), None
        except KVMemError as err:
            code, reason = STATUS_CODE[err.kind].name, err.reason.name
            self.refused(context, method, err)
            return None, err
        except Exception:
            code = grpc.StatusCode.UNKNOWN.name  # what gRPC answers for an unexpected exception
            raise
        finally:
            if stats is not None:
                stats.record(method, code, reason, time.perf_counter() - started)

    async def messages(self, requests: AsyncIterator[Req], method: str | None = None) -> AsyncIterator[Req]:
        """A session stream's messages, until the client ends the stream or the drain of
        a shutdown is over. With ``method``, a message that does not parse is refused
        (INVALID_ARGUMENT naming ``method``: raised, so it ends the stream); without, it
        is handed on (for :meth:`run` to refuse in-band).

        While it waits for the next message the handler's task is in
        :attr:`waiting`: :meth:`stop` cancels those tasks (:func:`stream` then ends the
        stream with SHUTTING_DOWN), and only those. A task cancelled while it sends an
        answer would send no status at all, leaving the client to wait for the end of
        the grace period (gRPC then fails the call); one that answers sees the shutdown
        here, before it waits again."""
        task = asyncio.current_task()
        assert task is not None
        waiting, stopping = self.waiting, self.stopping
        incoming = aiter(requests)
        while not stopping.is_set():
            waiting.add(task)
            try:
                message = await anext(incoming)
            except StopAsyncIteration:
                return
            finally:
                waiting.discard(task)
            if method is not None and isinstance(message, Malformed):
                raise message.error(method)
            yield message

    # --------------------------------------------------------- stock services

    def stock(self, handler: Any, method: MethodDescriptor) -> Any:
        """A stock service's ``handler`` (a coroutine, an async generator or a plain
        function) behind a check of its request, or of each request of a stream: one
        that does not parse is refused as INVALID_ARGUMENT naming the method and the
        message type, and logged. A method the stock servicer leaves out
        (NotImplementedError) is UNIMPLEMENTED."""
        name = f"{method.containing_service.full_name}/{method.name}"

        async def checked(requests: AsyncIterator[Any], context: Context) -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, Malformed):
                    await self.abort(context, name, request.error(name))
                yield request

        async def call(request: Any, context: Context) -> Any:
            if method.client_streaming:
                request = checked(request, context)
            elif isinstance(request, Malformed):
                await self.abort(context, name, request.error(name))
            try:
                result = handler(request, context)
                return await result if inspect.isawaitable(result) else result
            except NotImplementedError:  # the stock stubs' methods that the servicer leaves out (Health/List)
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name} is not implemented by this server")

        async def streamed(request: Any, context: Context) -> AsyncIterator[Any]:
            if method.client_streaming:
                request = checked(request, context)
            elif isinstance(request, Malformed):
                await self.abort(context, name, request.error(name))
            async for response in handler(request, context):
                yield response

        # grpc.aio takes a server-streaming handler as an async generator or as a coroutine
        # that writes with context.write (the health servicer's Watch): keep the handler's kind.
        return streamed if inspect.isasyncgenfunction(handler) else call


class Guarded(Protocol):
    """A servicer whose handlers :func:`unary` and :func:`stream` wrap."""

    guard: Guard


S = TypeVar("S", bound=Guarded)


def unary(
    method: Callable[[S, Req, Context], Resp],
) -> Callable[[S, Req, Context], Coroutine[Any, Any, Resp]]:
    """A plain handler (it never awaits: each call is one critical section on the event
    loop) as the coroutine gRPC calls, behind the guard: admitted, its body checked,
    timed and counted; a refusal logged and the call's status."""
    name = method.__name__

    @functools.wraps(method)
    async def guarded(self: S, request: Req, context: Context) -> Resp:
        response, refused = self.guard.run(name, method, self, request, context, admit=True)
        if refused is not None:
            await _end(context, refused)
        return response  # type: ignore[return-value]  # set when not refused

    return guarded


StreamHandler = TypeVar("StreamHandler", bound=Callable[..., AsyncIterator[Any]])


def stream(on_shutdown: str) -> Callable[[StreamHandler], StreamHandler]:
    """A streaming handler (an async generator; its request a message or a stream of
    them) behind the guard: admitted and its body checked once, at the start; a
    :class:`KVMemError` it raises is logged and ends the stream with its status. Once
    the drain of a shutdown is over the stream ends with UNAVAILABLE (SHUTTING_DOWN)
    and ``on_shutdown`` as its message: when the handler returns, or at once where the
    shutdown cancelled it while it waited for a message (:meth:`Guard.messages`).
    grpc.aio sends no status for a handler that returns or is cancelled: without one
    the stream would stay open until the grace period runs out."""

    def wrap(method: StreamHandler) -> StreamHandler:
        name = method.__name__

        @functools.wraps(method)
        async def guarded(self: Guarded, request: Any, context: Context) -> AsyncGenerator[Any, None]:
            guard = self.guard
            try:
                guard.admit(context)
                if isinstance(request, Malformed):
                    raise request.error(name)
                responses = cast(AsyncGenerator[Any, None], method(self, request, context))
                async with contextlib.aclosing(responses):
                    async for response in responses:
                        yield response
            except KVMemError as err:
                await guard.abort(context, name, err)
            except asyncio.CancelledError:
                if not guard.stopping.is_set():
                    raise  # gRPC cancelled the call: the peer is gone, there is no one to answer
                # The shutdown cancelled this task while it waited for a message (see messages()).
            if guard.stopping.is_set():
                await _end(context, KVMemError(Reason.SHUTTING_DOWN, on_shutdown))

        return cast(StreamHandler, guarded)

    return wrap


async def _end(context: Context, err: KVMemError) -> NoReturn:
    """End the call with ``err``'s status (the refusal is logged already)."""
    await context.abort_with_status(to_status(err))
    raise AssertionError("abort_with_status returned") from err  # it always raises


def _as_bytes(value: str | bytes) -> bytes:
    """A metadata value as bytes (gRPC hands text keys' values as str)."""
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
