"""The asyncio client: the same methods as :class:`~kvmem.client.sync.KVMemClient`,
awaitable, with the keep-alive as a task on the caller's loop."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import grpc
import torch

from kvmem.client import _common as common
from kvmem.client._common import IntsLike, StepResult
from kvmem.client.admin import CHANNEL_OPTIONS, auth_metadata, normalize_target
from kvmem.client.errors import KVMemError, SessionLost, from_rpc_error
from kvmem.client.memory import MemoryViews
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

T = TypeVar("T")


class AsyncKVMemClient(MemoryViews):
    """A session with a kvmem server, for asyncio schedulers.

    ``client = await AsyncKVMemClient.connect(target, name=...)`` or
    ``async with AsyncKVMemClient(target, name=...) as client:``.
    """

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
        self.timeout = timeout
        self._name = name
        self._quota_pages = quota_pages
        self._keepalive_enabled = keepalive
        self._metadata = auth_metadata(auth_token)
        self._channel: grpc.aio.Channel | None = None
        self._stub: kvmem_pb2_grpc.KVMemoryStub | None = None
        self._broken: KVMemError | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self.session_id = ""
        self.epoch = ""
        self.lease_ms = 0
        self.geometry = kvmem_pb2.PoolGeometry()
        self.memory_handles: list[kvmem_pb2.MemoryHandle] = []

    @classmethod
    async def connect(cls, target: str, **kwargs: Any) -> "AsyncKVMemClient":
        client = cls(target, **kwargs)
        await client.attach()
        return client

    async def attach(self) -> None:
        self._channel = grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = kvmem_pb2_grpc.KVMemoryStub(self._channel)
        try:
            resp = await self._call(
                self._stub.Attach, common.attach_request(self._name, self._quota_pages), None, check=False
            )
        except BaseException:
            await self._channel.close()
            self._channel = None
            raise
        self.session_id = resp.session_id
        self.epoch = resp.epoch
        self.lease_ms = resp.lease_ms
        self.geometry = resp.geometry
        self.memory_handles = list(resp.memory)
        if self._keepalive_enabled:
            self._keepalive_task = asyncio.create_task(self._keepalive(), name="kvmem-keepalive")

    async def _call(self, rpc: Callable[..., Awaitable[T]], request: Any, timeout: float | None, check: bool = True) -> T:
        if self._broken is not None:
            raise self._broken
        try:
            resp = await rpc(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        if check:
            common.check_epoch(self.epoch, resp.epoch)  # type: ignore[attr-defined]
        return resp

    @property
    def _s(self) -> kvmem_pb2_grpc.KVMemoryStub:
        if self._stub is None:
            raise RuntimeError("not attached: use `await AsyncKVMemClient.connect(...)` or `async with`")
        return self._stub

    async def open(self, request_ids: list[str], *, timeout: float | None = None) -> torch.Tensor:
        resp = await self._call(
            self._s.Open, kvmem_pb2.OpenRequest(session_id=self.session_id, request_ids=request_ids), timeout
        )
        return torch.tensor(list(resp.slots), dtype=torch.int32)

    async def step(
        self,
        *,
        release_slots: IntsLike = (),
        truncate_slots: IntsLike = (),
        truncate_lens: IntsLike = (),
        alloc_slots: IntsLike = (),
        alloc_needs: IntsLike = (),
        alloc_expected_lens: IntsLike | None = None,
        atomic: bool = False,
        timeout: float | None = None,
    ) -> StepResult:
        request = common.step_request(
            self.session_id, release_slots, truncate_slots, truncate_lens, alloc_slots, alloc_needs,
            alloc_expected_lens, atomic,
        )  # fmt: skip
        return common.step_result(await self._call(self._s.Step, request, timeout))

    async def alloc(
        self, slots: IntsLike, needs: IntsLike, expected_lens: IntsLike | None = None, *, atomic: bool = False,
        timeout: float | None = None,
    ) -> StepResult:  # fmt: skip
        return await self.step(alloc_slots=slots, alloc_needs=needs, alloc_expected_lens=expected_lens,
                               atomic=atomic, timeout=timeout)  # fmt: skip

    async def truncate(self, slots: IntsLike, new_lens: IntsLike, *, timeout: float | None = None) -> StepResult:
        return await self.step(truncate_slots=slots, truncate_lens=new_lens, timeout=timeout)

    async def release(self, slots: IntsLike, *, timeout: float | None = None) -> StepResult:
        return await self.step(release_slots=slots, timeout=timeout)

    async def stats(self, *, audit: bool = False, timeout: float | None = None) -> kvmem_pb2.StatsResponse:
        return await self._call(self._s.Stats, kvmem_pb2.StatsRequest(audit=audit), timeout)

    async def detach(self, *, timeout: float | None = None) -> int:
        try:
            resp = await self._call(self._s.Detach, kvmem_pb2.DetachRequest(session_id=self.session_id), timeout)
        finally:
            await self._stop_keepalive()
            self._broken = SessionLost(grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_SESSION", "this session was detached")
        return resp.num_requests_released

    async def close(self) -> None:
        if self._channel is None:
            return
        try:
            if self._broken is None:
                await self.detach(timeout=min(self.timeout, 2.0))
        except KVMemError:
            pass
        finally:
            await self._stop_keepalive()
            self._unmap()
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> "AsyncKVMemClient":
        if self._channel is None:
            await self.attach()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _keepalive(self) -> None:
        interval = max(self.lease_ms / 3000, 0.01)

        async def requests() -> AsyncIterator[kvmem_pb2.KeepAliveRequest]:
            yield kvmem_pb2.KeepAliveRequest(session_id=self.session_id)
            while True:
                try:
                    await asyncio.wait_for(self._closing.wait(), interval)
                    return
                except asyncio.TimeoutError:
                    yield kvmem_pb2.KeepAliveRequest()

        call = self._s.KeepAlive(requests(), metadata=self._metadata)
        try:
            async for _ in call:
                pass
        except grpc.RpcError as err:
            if not self._closing.is_set():
                broken = from_rpc_error(err)
                self._broken = broken if isinstance(broken, SessionLost) else SessionLost(
                    err.code(), "KEEPALIVE_BROKEN", f"the keep-alive stream broke: {broken.message}"
                )  # fmt: skip
        except asyncio.CancelledError:
            call.cancel()
            raise
        else:
            if not self._closing.is_set():
                self._broken = SessionLost(
                    grpc.StatusCode.UNAVAILABLE, "KEEPALIVE_BROKEN", "the server ended the keep-alive stream"
                )

    async def _stop_keepalive(self) -> None:
        self._closing.set()
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
