"""The asyncio client: the methods of :class:`kvmem.client.KVMemClient`,
awaitable, with the keep-alive as a task on the caller's loop.

Each method is written out here, with its full signature, and is one line over the
:class:`kvmem.client.session.Session` builder of its call; its docstring (what it does,
costs and raises) is the blocking client's method's, assigned under it so that it is
written once. :class:`kvmem.client.base.ClientBase` holds what both clients share. This
module awaits the calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import grpc
import torch

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .base import ClientBase
from .call import Call
from .channel import deadline_exceeded
from .errors import KVMemError, SessionLost, from_rpc_error
from .events import AsyncEventStream, watch_request
from .handoff import AdoptItems
from .step import NO_COLUMN, CacheItems, IntsLike, MatchItems, StepResult, TokenLists, TokensLike
from .stepstream import AsyncStepStream
from .sync import KVMemClient

T = TypeVar("T")


class AsyncKVMemClient(ClientBase):
    """A session with a kvmem server, for asyncio schedulers.

    ``client = await AsyncKVMemClient.connect(target, name=...)`` or
    ``async with AsyncKVMemClient(target, name=...) as client:``; the constructor takes
    the arguments of :class:`kvmem.client.KVMemClient`'s (see
    :class:`kvmem.client.base.ClientBase`) and attaches nothing. Its methods are the
    blocking client's, awaitable, with the same results, costs and errors; a call
    before the attach raises ``RuntimeError``.
    """

    _stub: kvmem_pb2_grpc.KVMemoryStub  # set by attach(): no call is built before it

    def _setup(self) -> None:
        self._channel: grpc.aio.Channel | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._steps: AsyncStepStream | None = None  # opened at the first Step (step_stream)
        self._step_serial = asyncio.Lock()  # a Step is numbered and sent (and resent) under it
        self._resume_lock = asyncio.Lock()  # one resume at a time (a call's or the keep-alive's)

    @classmethod
    async def connect(cls, target: str, **kwargs: Any) -> AsyncKVMemClient:
        """A client of ``target``, attached: ``cls(target, **kwargs)``, then :meth:`attach`."""
        client = cls(target, **kwargs)
        await client.attach()
        return client

    async def attach(self) -> None:
        """Open the channel and attach; the keep-alive task starts on this loop. Raises
        what the blocking client's constructor raises (see :class:`kvmem.client.KVMemClient`)."""
        self._channel = self._transport.aio_channel()
        self._stub = kvmem_pb2_grpc.KVMemoryStub(self._channel)
        started = time.monotonic()
        try:
            while True:
                try:
                    await self._perform(self._session.attach())
                    break
                except KVMemError as err:
                    delay = self._session.attach_retry(err, started)
                    if delay is None:
                        raise
                    await asyncio.sleep(delay)
        except BaseException:
            await self._channel.close()
            self._channel = None
            raise
        if self._session.keepalive:
            self._keepalive_task = asyncio.create_task(self._keepalive(), name="kvmem-keepalive")

    # ------------------------------------------------------------- the calls

    async def open(self, request_ids: list[str], *, timeout: float | None = None) -> torch.Tensor:
        return await self._perform(self._session.open(request_ids, timeout=timeout))

    open.__doc__ = KVMemClient.open.__doc__

    async def step(
        self,
        *,
        release_slots: IntsLike = NO_COLUMN,
        truncate_slots: IntsLike = NO_COLUMN,
        truncate_lens: IntsLike = NO_COLUMN,
        alloc_slots: IntsLike = NO_COLUMN,
        alloc_needs: IntsLike = NO_COLUMN,
        alloc_expected_lens: IntsLike | None = None,
        atomic: bool = False,
        release_token_ids: TokenLists | None = None,
        cache: CacheItems | None = None,
        match: MatchItems | None = None,
        handoff: IntsLike | None = None,
        handoff_states: list[bytes] | None = None,
        adopt: AdoptItems | None = None,
        timeout: float | None = None,
    ) -> StepResult:
        return await self._perform(
            self._session.step(
                release_slots=release_slots,
                truncate_slots=truncate_slots,
                truncate_lens=truncate_lens,
                alloc_slots=alloc_slots,
                alloc_needs=alloc_needs,
                alloc_expected_lens=alloc_expected_lens,
                atomic=atomic,
                release_token_ids=release_token_ids,
                cache=cache,
                match=match,
                handoff=handoff,
                handoff_states=handoff_states,
                adopt=adopt,
                timeout=timeout,
            )
        )

    step.__doc__ = KVMemClient.step.__doc__

    async def handoff(
        self, slots: IntsLike, states: list[bytes] | None = None, *, timeout: float | None = None
    ) -> list[str]:
        return await self._perform(self._session.handoff(slots, states, timeout=timeout))

    handoff.__doc__ = KVMemClient.handoff.__doc__

    async def adopt(self, tickets: list[str], request_ids: list[str], *, timeout: float | None = None) -> StepResult:
        return await self._perform(self._session.adopt(tickets, request_ids, timeout=timeout))

    adopt.__doc__ = KVMemClient.adopt.__doc__

    async def alloc(
        self,
        slots: IntsLike,
        needs: IntsLike,
        expected_lens: IntsLike | None = None,
        *,
        atomic: bool = False,
        timeout: float | None = None,
    ) -> StepResult:
        return await self._perform(self._session.alloc(slots, needs, expected_lens, atomic=atomic, timeout=timeout))

    alloc.__doc__ = KVMemClient.alloc.__doc__

    async def truncate(self, slots: IntsLike, new_lens: IntsLike, *, timeout: float | None = None) -> StepResult:
        return await self._perform(self._session.truncate(slots, new_lens, timeout=timeout))

    truncate.__doc__ = KVMemClient.truncate.__doc__

    async def release(
        self, slots: IntsLike, token_ids: TokenLists | None = None, *, timeout: float | None = None
    ) -> StepResult:
        return await self._perform(self._session.release(slots, token_ids, timeout=timeout))

    release.__doc__ = KVMemClient.release.__doc__

    async def match(
        self, slot: int, token_ids: TokensLike, max_tokens: int | None = None, *, timeout: float | None = None
    ) -> int:
        return await self._perform(self._session.match(slot, token_ids, max_tokens, timeout=timeout))

    match.__doc__ = KVMemClient.match.__doc__

    async def cache(self, slot: int, token_ids: TokensLike, *, timeout: float | None = None) -> int:
        return await self._perform(self._session.cache(slot, token_ids, timeout=timeout))

    cache.__doc__ = KVMemClient.cache.__doc__

    async def stats(self, *, audit: bool = False, timeout: float | None = None) -> kvmem_pb2.StatsResponse:
        return await self._perform(self._session.stats(audit=audit, timeout=timeout))

    stats.__doc__ = KVMemClient.stats.__doc__

    async def wait_loads(
        self, slot: int, match_len: int, loading: int, *, layer: int | None = None, timeout: float = 60.0
    ) -> float:
        loads = self.page_loads
        if loads is None or loading <= 0:
            return 0.0
        pages = loads.pages_of(self.block_table[slot], match_len, loading)
        return await loads.wait_async(pages, layer, timeout)

    wait_loads.__doc__ = KVMemClient.wait_loads.__doc__

    async def detach(self, *, timeout: float | None = None) -> int:
        return await self._perform(self._session.detach(timeout=timeout))

    detach.__doc__ = KVMemClient.detach.__doc__

    async def _perform(self, call: Call[T]) -> T:
        """Make ``call`` (:meth:`_perform_once`), resuming the session when the server
        went away and it may be (as the blocking client's ``_perform``). Steps are
        numbered and sent one at a time."""
        if call.method != "Step":
            return await self._perform_resuming(call)
        async with self._step_serial:
            return await self._perform_resuming(call)

    async def _perform_resuming(self, call: Call[T]) -> T:
        session = self._session
        while True:
            session.number(call)
            seen = session.epoch
            try:
                return await self._perform_once(call)
            except KVMemError as err:
                raised = session.call_failed(call, err)
                if raised is err:
                    raise
                if raised is not None:
                    raise raised from None
            except BaseException:  # interrupted, cancelled: the Step's fate is not known
                session.call_failed(call, None)
                raise
            await self._resume(seen)
            if call.method == "Step":
                answer = session.step_fate(call)
                if answer is not None:
                    return session.finish(call, answer)

    async def _resume(self, seen_epoch: str) -> None:
        """Resume the session on the server's next run unless it already was (the
        epoch is no longer ``seen_epoch``); SessionLost when it cannot be."""
        session = self._session
        async with self._resume_lock:
            if session.lost is not None:
                raise session.lost.with_traceback(None)
            if session.epoch != seen_epoch:
                return
            while True:
                call = session.resume_call()
                try:
                    response = await self._stub.Attach(call.request, timeout=call.timeout, metadata=session.metadata)
                    session.finish(call, response)
                    break
                except grpc.RpcError as rpc_err:
                    err = from_rpc_error(rpc_err)
                except KVMemError as kv_err:
                    err = kv_err
                delay = session.resume_retry(err)
                if delay is None:
                    lost = session.resume_failed(err)
                    await self._stop_keepalive()
                    raise lost from None
                await asyncio.sleep(delay)
            session.resumed()  # the old step stream went with the old server: the next Step opens another

    async def _perform_once(self, call: Call[T]) -> T:
        """Make ``call`` the way :meth:`kvmem.client.session.Session.route` says, and
        hand its answer to the session to read."""
        try:
            try:
                route = self._session.route(call)
                if route == "stream":
                    response = self._session.streamed(await self._stream_step(call))
                elif route == "bounded":
                    response = await self._bounded(call)
                else:
                    rpc = getattr(self._stub, call.method)
                    response = await rpc(call.request, timeout=call.timeout, metadata=self._session.metadata)
            except grpc.RpcError as err:
                raise self._failure(call, err) from None
            return self._session.finish(call, response)
        except SessionLost:
            if self._session.lost is not None:
                await self._stop_keepalive()  # over for this client: closing the stream tells the server it let go
            raise
        finally:
            if call.ends_session:
                await self._stop_keepalive()
                self._close_steps()

    async def _bounded(self, call: Call[T]) -> Any:
        """A unary call with a big request, waited for no longer than its deadline (see
        :data:`kvmem.client.channel.BIG_REQUEST_BYTES`): cancelled past it."""
        pending = getattr(self._stub, call.method)(call.request, timeout=call.timeout, metadata=self._session.metadata)
        try:
            async with asyncio.timeout(call.timeout):
                return await pending
        except TimeoutError:
            pending.cancel()
            raise deadline_exceeded(call.method, call.timeout) from None

    async def _stream_step(self, call: Call[T]) -> kvmem_pb2.StepResponse:
        """``call`` on the step stream, opened (again) when there is none that works
        (the stream drops itself when anything but an answer ends a step)."""
        stream = self._steps
        if stream is None or not stream.usable:
            if stream is not None:
                stream.close()
            stream = self._steps = AsyncStepStream(self._stub, self._session.metadata)
        return await stream.step(call.request, call.timeout)

    def _close_steps(self) -> None:
        stream, self._steps = self._steps, None
        if stream is not None:
            stream.close()

    # ------------------------------------------------------------ the client

    def watch_events(self, from_seq: int = 0, epoch: str = "") -> AsyncEventStream:
        """The prefix cache's events from batch ``from_seq`` of ``epoch`` (empty: the
        server's current one) on, then live: ``async for batch in
        client.watch_events(...)`` yields ``kvmem.v1.KVEventBatch`` messages (see
        :mod:`kvmem.client.events`); ``close()`` it to cancel the call. It needs no
        session, only the client's channel (open once attached). Cost: one
        server-streaming call on the client's channel, open until closed."""
        if self._channel is None:
            raise RuntimeError("not attached: the channel opens at attach()")
        request = watch_request(from_seq, epoch)
        return AsyncEventStream(self._stub.WatchEvents(request, metadata=self._session.metadata))

    async def close(self) -> None:
        """Detach (if still attached: a Detach with a deadline of at most 2 s, whose
        failure is ignored, since the session is gone either way) and close the channel.
        Idempotent."""
        detach = self._session.close()
        try:
            if detach is not None:
                await self._perform(detach)
        except KVMemError as err:
            self._session.detach_failed(err)  # the session is gone either way; maybe the server too
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        await self._stop_keepalive()
        self._close_steps()
        self._unmap()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def __aenter__(self) -> AsyncKVMemClient:
        if self._channel is None:
            await self.attach()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _keepalive(self) -> None:
        """The keep-alive stream, and again after each resume (this task resumes the
        session when the server went away and it may be)."""
        session = self._session
        while True:
            seen = session.epoch
            if not await self._keepalive_stream():
                return
            try:
                await self._resume(seen)
            except KVMemError:
                return  # lost: the next call raises it

    async def _keepalive_stream(self) -> bool:
        """One keep-alive stream, to its end; True when the session is to be resumed."""
        first, later = self._session.keepalive_requests()
        interval = self._session.keepalive_interval

        session = self._session

        async def requests() -> AsyncIterator[kvmem_pb2.KeepAliveRequest]:
            session.keepalive_sent()
            yield first
            while True:
                try:
                    await asyncio.wait_for(self._closing.wait(), interval)
                    return
                except TimeoutError:
                    session.keepalive_sent()
                    yield later

        call = self._stub.KeepAlive(requests(), metadata=session.metadata)
        try:
            async for _ in call:
                session.keepalive_answered()
        except grpc.RpcError as err:
            return self._session.keepalive_ended(err, self._closing.is_set())
        except asyncio.CancelledError:
            call.cancel()
            raise
        return self._session.keepalive_ended(None, self._closing.is_set())

    async def _stop_keepalive(self) -> None:
        self._closing.set()
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
