"""The blocking client: one object per session, a keep-alive thread in the background."""

from __future__ import annotations

import threading
from typing import Any, Callable, TypeVar

import grpc
import torch

from kvmem.client import _common as common
from kvmem.client._common import IntsLike, StepResult
from kvmem.client.admin import CHANNEL_OPTIONS, auth_metadata, normalize_target
from kvmem.client.errors import KVMemError, SessionLost, from_rpc_error
from kvmem.client.memory import MemoryViews
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

T = TypeVar("T")



class KVMemClient(MemoryViews):
    """A session with a kvmem server.

    ``target`` is a unix socket path (``/tmp/kvmem.sock`` or ``unix:/tmp/kvmem.sock``)
    or ``HOST:PORT``. The constructor attaches; ``close()`` (or leaving a ``with``
    block) detaches. Every call takes ``timeout`` seconds (default: the client's).
    A keep-alive thread holds the session's lease; if the session breaks, the next call
    raises :class:`~kvmem.client.errors.SessionLost`.
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
        self._metadata = auth_metadata(auth_token)
        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self._stub = kvmem_pb2_grpc.KVMemoryStub(self._channel)
        self._broken: KVMemError | None = None
        self._closing = threading.Event()
        self._keepalive_call: Any = None
        self._keepalive_thread: threading.Thread | None = None
        try:
            resp: kvmem_pb2.AttachResponse = self._call(
                self._stub.Attach, common.attach_request(name, quota_pages), None, check=False
            )
        except BaseException:
            self._channel.close()
            raise
        self.session_id = resp.session_id
        self.epoch = resp.epoch
        self.lease_ms = resp.lease_ms
        self.geometry = resp.geometry
        self.memory_handles = list(resp.memory)
        if keepalive:
            self._keepalive_thread = threading.Thread(target=self._keepalive, name="kvmem-keepalive", daemon=True)
            self._keepalive_thread.start()

    # ----------------------------------------------------------------- calls

    def _call(self, rpc: Callable[..., T], request: Any, timeout: float | None, check: bool = True) -> T:
        if self._broken is not None:
            raise self._broken
        try:
            resp = rpc(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None
        if check:
            common.check_epoch(self.epoch, resp.epoch)  # type: ignore[attr-defined]
        return resp

    def open(self, request_ids: list[str], *, timeout: float | None = None) -> torch.Tensor:
        """Request slots (int32) for ``request_ids``; an id already open keeps its slot."""
        resp = self._call(
            self._stub.Open, kvmem_pb2.OpenRequest(session_id=self.session_id, request_ids=request_ids), timeout
        )
        return torch.tensor(list(resp.slots), dtype=torch.int32)

    def step(
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
        """One scheduler step in one round trip: releases, truncates, then allocs."""
        request = common.step_request(
            self.session_id, release_slots, truncate_slots, truncate_lens, alloc_slots, alloc_needs,
            alloc_expected_lens, atomic,
        )  # fmt: skip
        return common.step_result(self._call(self._stub.Step, request, timeout))

    def alloc(
        self, slots: IntsLike, needs: IntsLike, expected_lens: IntsLike | None = None, *, atomic: bool = False,
        timeout: float | None = None,
    ) -> StepResult:  # fmt: skip
        return self.step(alloc_slots=slots, alloc_needs=needs, alloc_expected_lens=expected_lens, atomic=atomic,
                         timeout=timeout)  # fmt: skip

    def truncate(self, slots: IntsLike, new_lens: IntsLike, *, timeout: float | None = None) -> StepResult:
        return self.step(truncate_slots=slots, truncate_lens=new_lens, timeout=timeout)

    def release(self, slots: IntsLike, *, timeout: float | None = None) -> StepResult:
        return self.step(release_slots=slots, timeout=timeout)

    def stats(self, *, audit: bool = False, timeout: float | None = None) -> kvmem_pb2.StatsResponse:
        return self._call(self._stub.Stats, kvmem_pb2.StatsRequest(audit=audit), timeout)

    def detach(self, *, timeout: float | None = None) -> int:
        """End the session: every request it holds is released. Returns how many."""
        # Detach first: closing the keep-alive stream first would end the session by itself.
        try:
            resp = self._call(self._stub.Detach, kvmem_pb2.DetachRequest(session_id=self.session_id), timeout)
        finally:
            self._stop_keepalive()
            self._broken = SessionLost(grpc.StatusCode.FAILED_PRECONDITION, "UNKNOWN_SESSION", "this session was detached")
        return resp.num_requests_released

    def close(self) -> None:
        """Detach (if still attached) and close the channel. Idempotent."""
        if self._channel is None:
            return
        try:
            if self._broken is None:
                self.detach(timeout=min(self.timeout, 2.0))
        except KVMemError:
            pass  # the session is gone either way
        finally:
            self._stop_keepalive()
            self._unmap()
            self._channel.close()
            self._channel = None  # type: ignore[assignment]

    def __enter__(self) -> "KVMemClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------- keep-alive

    def _keepalive(self) -> None:
        interval = max(self.lease_ms / 3000, 0.01)
        first = kvmem_pb2.KeepAliveRequest(session_id=self.session_id)
        later = kvmem_pb2.KeepAliveRequest()

        def requests() -> Any:
            yield first
            while not self._closing.wait(interval):
                yield later

        try:
            self._keepalive_call = self._stub.KeepAlive(requests(), metadata=self._metadata)
            for _ in self._keepalive_call:
                pass
        except grpc.RpcError as err:
            if not self._closing.is_set():
                self._broken = from_rpc_error(err)
                if not isinstance(self._broken, SessionLost):
                    self._broken = SessionLost(
                        err.code(), "KEEPALIVE_BROKEN", f"the keep-alive stream broke: {self._broken.message}"
                    )
        else:
            if not self._closing.is_set():
                self._broken = SessionLost(
                    grpc.StatusCode.UNAVAILABLE, "KEEPALIVE_BROKEN", "the server ended the keep-alive stream"
                )

    def _stop_keepalive(self) -> None:
        self._closing.set()
        if self._keepalive_call is not None:
            self._keepalive_call.cancel()
        if self._keepalive_thread is not None and self._keepalive_thread is not threading.current_thread():
            self._keepalive_thread.join(timeout=5)
            self._keepalive_thread = None

