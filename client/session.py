"""The session logic of both clients, written once.

:class:`Session` builds every request and reads every response and failure of one
session, and does no I/O: attach, the calls, detach and close, the keep-alive's messages
and what its end means, the epoch check, the lease fence, the error mapping, and how
each call goes (:meth:`Session.route`). Each method of
:class:`kvmem.client.KVMemClient` and :class:`kvmem.client.AsyncKVMemClient`
is one line over the builder of the same name here: the Session builds the
:class:`Call`, the client makes it (blocking, or awaited), the Session reads the answer.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import grpc
import torch

from kvmem.v1 import kvmem_pb2

from .call import Call
from .channel import BIG_REQUEST_BYTES, TLSError, auth_metadata, checked_timeout
from .errors import KVMemError, Reason, SessionLost, Unavailable, from_rpc_error, from_status
from .handoff import AdoptItems, Handoffs
from .resume import Resuming
from .step import (
    NO_COLUMN,
    CacheItems,
    IntsLike,
    MatchItems,
    StepResult,
    TokenLists,
    TokensLike,
    add_column,
    match_len_of,
    pages_switched_of,
    prefix_columns,
)

_UNREACHABLE: Reason = Reason["UNSPECIFIED"]  # gRPC's own UNAVAILABLE: no server there (yet)
_NOT_READY: Reason = Reason["NOT_READY"]


T = TypeVar("T")
Route = Literal["stream", "bounded", "unary"]  # how a client makes a call: see Session.route

_MAX_UNANSWERED = 1024  # keep-alive send times kept while their answers are due
UNSPECIFIED: Reason = Reason["UNSPECIFIED"]  # what the client says where it has no server's reason
_NOT_ATTACHED = "not attached: use `await AsyncKVMemClient.connect(...)` or `async with AsyncKVMemClient(...)`"


class Session(Resuming, Handoffs):
    """One session's state and logic, without I/O. ``lost`` is why the session ended
    (detached, keep-alive broken, server restarted); every later call raises it.
    ``step_stream``: the Steps go on the client's step stream (else unary calls)."""

    def __init__(
        self,
        *,
        name: str,
        quota_pages: int | None,
        timeout: float,
        auth_token: str | None,
        keepalive: bool,
        cache_namespace: str = "",
        model_id: str = "",
        wait_for_ready: bool = True,
        step_stream: bool = True,
    ) -> None:
        self.wait_for_ready = wait_for_ready
        self.step_stream = step_stream
        self.name = name
        self.quota_pages = quota_pages
        self.cache_namespace = cache_namespace
        self.model_id = model_id
        self.timeout = checked_timeout(timeout)
        self.metadata = auth_metadata(auth_token)
        self.keepalive = keepalive
        self.session_id = ""
        self.epoch = ""
        self.lease_ms = 0
        self.geometry = kvmem_pb2.PoolGeometry()
        self.memory_handles: list[kvmem_pb2.MemoryHandle] = []
        self.prefix_cache = kvmem_pb2.PrefixCacheInfo()
        self.lost: KVMemError | None = None
        # Until when (monotonic seconds) the lease is known to hold: the send time of the
        # latest message the server is known to have taken (its answer came), plus the
        # lease. The server refreshes the lease when it takes a message, never earlier.
        self.lease_valid_until = 0.0
        self._keepalive_sent: collections.deque[float] = collections.deque()
        self._keepalive_overflow = False  # more than _MAX_UNANSWERED unanswered: see keepalive_sent
        # Called once, the first time the session is lost with its views stale: see SessionLost.views_stale.
        self.on_views_stale: Callable[[SessionLost], None] | None = None
        self.views_dropped = False
        self._attach_tries = 0  # Attaches retried so far (see attach_retry)
        self._init_resuming()  # the server keeps its state: see kvmem.client.resume
        self._init_handoffs()  # the slots it handed off: see kvmem.client.handoff

    # ------------------------------------------------------------------ calls

    def attach_retry(self, err: KVMemError, started: float) -> float | None:
        """After a failed Attach begun at ``started`` (monotonic): how long to wait
        before trying again, or None to give up (and raise ``err``). Retried, while
        ``wait_for_ready`` and within ``timeout``: a server not reachable yet (a refused
        connection, no socket: gRPC's UNAVAILABLE without a kvmem reason) or not ready
        (``NOT_READY``). Never: a TLS mismatch, a server shutting down, or any other
        refusal."""
        if not self.wait_for_ready or err.code != grpc.StatusCode.UNAVAILABLE or isinstance(err, TLSError):
            return None
        if err.reason not in (_UNREACHABLE, _NOT_READY):
            return None
        left = started + self.timeout - time.monotonic()
        if left <= 0:
            return None
        self._attach_tries += 1
        return min(0.05 * 2 ** min(self._attach_tries, 5), 1.0, left)

    def attach(self) -> Call[None]:
        """The Attach that starts the session."""
        self._check_not_lost()
        if self.session_id:
            raise RuntimeError(f"already attached as session {self.session_id[:6]}...: one client is one session")
        request = kvmem_pb2.AttachRequest(name=self.name, cache_namespace=self.cache_namespace, model_id=self.model_id)
        if self.quota_pages is not None:
            request.quota_pages = self.quota_pages
        return Call("Attach", request, self.timeout, self._attached)

    def _attached(self, resp: kvmem_pb2.AttachResponse) -> None:
        self.session_id = resp.session_id
        self.epoch = resp.epoch
        self.lease_ms = resp.lease_ms
        self.geometry = resp.geometry
        self.memory_handles = list(resp.memory)
        self.prefix_cache = resp.prefix_cache
        self.resume_ms = resp.resume_ms

    def open(self, request_ids: list[str], *, timeout: float | None = None) -> Call[torch.Tensor]:
        """The Open of ``open``: slots (int32) for ``request_ids``."""
        request = kvmem_pb2.OpenRequest(session_id=self._live_id(), request_ids=request_ids)
        return Call("Open", request, self._deadline(timeout), self.opened)

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
        release_token_ids: TokenLists | None = None,
        cache: CacheItems | None = None,
        match: MatchItems | None = None,
        handoff: IntsLike | None = None,
        handoff_states: list[bytes] | None = None,
        adopt: AdoptItems | None = None,
        timeout: float | None = None,
    ) -> Call[StepResult]:
        """The Step of ``step`` (the clients' ``step`` says what each column does):
        only the columns given, as int32 bytes where they are arrays or tensors."""
        # One constructor call with only the columns given: a column left at its default
        # costs nothing, and on a client whose caches are cold between steps (as when many
        # scheduler processes share the cores) one call costs about two thirds of
        # constructing and then extending (measured: 93 vs 130+ µs for a 32-item decode).
        columns: dict[str, Any] = {}
        if release_slots is not NO_COLUMN:  # the default; anything else is sent, even if empty
            add_column(columns, "release_slots", release_slots)
        if truncate_slots is not NO_COLUMN:
            add_column(columns, "truncate_slots", truncate_slots)
        if truncate_lens is not NO_COLUMN:
            add_column(columns, "truncate_lens", truncate_lens)
        if alloc_slots is not NO_COLUMN:
            add_column(columns, "alloc_slots", alloc_slots)
        if alloc_needs is not NO_COLUMN:
            add_column(columns, "alloc_needs", alloc_needs)
        if alloc_expected_lens is not None:
            add_column(columns, "alloc_expected_lens", alloc_expected_lens)
        if atomic:
            columns["atomic"] = True
        if release_token_ids is not None or cache or match:
            prefix_columns(columns, release_token_ids, cache, match)
        read: Callable[[kvmem_pb2.StepResponse], StepResult] = StepResult
        if self.handed_off:
            self.fence(
                release_slots,
                truncate_slots,
                alloc_slots,
                [c[0] for c in cache or ()],
                [m[0] for m in match or ()],
                handoff,
            )
        if handoff is not None or handoff_states is not None or adopt:
            given = self.handoff_columns(columns, handoff, handoff_states, adopt)
            read = functools.partial(self.stepped, given)
        request = kvmem_pb2.StepRequest(session_id=self._live_id(), **columns)
        return Call("Step", request, self._deadline(timeout), read, fenced=True)

    def handoff(
        self, slots: IntsLike, states: list[bytes] | None = None, *, timeout: float | None = None
    ) -> Call[list[str]]:
        """The Step of ``handoff``: hand-off items only; its answer read as the tickets."""
        call = self.step(handoff=slots, handoff_states=states, timeout=timeout)
        return Call("Step", call.request, call.timeout, lambda resp: call.read(resp).tickets, fenced=True)

    def adopt(self, tickets: list[str], request_ids: list[str], *, timeout: float | None = None) -> Call[StepResult]:
        """The Step of ``adopt``: adopt items only (tickets and request ids of one length)."""
        if len(tickets) != len(request_ids):
            raise ValueError(f"{len(tickets)} tickets but {len(request_ids)} request ids")
        return self.step(adopt=list(zip(tickets, request_ids, strict=True)), timeout=timeout)

    def match(
        self, slot: int, token_ids: TokensLike, max_tokens: int | None = None, *, timeout: float | None = None
    ) -> Call[int]:
        """The Step of ``match``: one match item; its answer read as the tokens matched."""
        call = self.step(match=[(slot, token_ids, max_tokens)], timeout=timeout)
        return Call("Step", call.request, call.timeout, match_len_of, fenced=True)

    def cache(self, slot: int, token_ids: TokensLike, *, timeout: float | None = None) -> Call[int]:
        """The Step of ``cache``: one cache item; its answer read as the pages switched."""
        call = self.step(cache=[(slot, token_ids)], timeout=timeout)
        return Call("Step", call.request, call.timeout, pages_switched_of, fenced=True)

    def alloc(
        self,
        slots: IntsLike,
        needs: IntsLike,
        expected_lens: IntsLike | None = None,
        *,
        atomic: bool = False,
        timeout: float | None = None,
    ) -> Call[StepResult]:
        """The Step of ``alloc``: allocs only."""
        return self.step(
            alloc_slots=slots, alloc_needs=needs, alloc_expected_lens=expected_lens, atomic=atomic, timeout=timeout
        )

    def truncate(self, slots: IntsLike, new_lens: IntsLike, *, timeout: float | None = None) -> Call[StepResult]:
        """The Step of ``truncate``: truncates only."""
        return self.step(truncate_slots=slots, truncate_lens=new_lens, timeout=timeout)

    def release(
        self, slots: IntsLike, token_ids: TokenLists | None = None, *, timeout: float | None = None
    ) -> Call[StepResult]:
        """The Step of ``release``: releases only (with their token ids, if given)."""
        return self.step(release_slots=slots, release_token_ids=token_ids, timeout=timeout)

    def stats(self, *, audit: bool = False, timeout: float | None = None) -> Call[kvmem_pb2.StatsResponse]:
        """The Stats of ``stats`` (with the audit if ``audit``)."""
        self._live_id()
        return Call("Stats", kvmem_pb2.StatsRequest(audit=audit), self._deadline(timeout), _stats)

    def detach(self, *, timeout: float | None = None) -> Call[int]:
        """The Detach of ``detach``: the session is lost from now on, whatever the call's fate."""
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

    def route(self, call: Call[Any]) -> Route:
        """How a client makes ``call``, decided here for both: ``"stream"``, a Step on
        the client's step stream (``step_stream``: see :mod:`kvmem.client.stepstream`);
        ``"bounded"``, a unary call whose request is too big for gRPC's own deadline to
        be trusted (:data:`kvmem.client.channel.BIG_REQUEST_BYTES`): the client waits no
        longer than ``call.timeout`` and cancels it past that; ``"unary"``, a unary call."""
        if self.step_stream and call.method == "Step":
            return "stream"
        if call.request.ByteSize() > BIG_REQUEST_BYTES:
            return "bounded"
        return "unary"

    def _live_id(self) -> str:
        self._check_not_lost()
        if not self.session_id:
            raise RuntimeError(_NOT_ATTACHED)
        return self.session_id

    def _check_not_lost(self) -> None:
        if self.lost is not None:
            raise self.lost.with_traceback(None)  # a fresh traceback each time, not a growing one

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else checked_timeout(timeout)

    # -------------------------------------------------------------- answers

    def finish(self, call: Call[T], response: Any) -> T:
        """What the caller gets from ``call``'s response. A changed epoch means the
        server restarted: the session and its memory handles are gone. A fenced call's
        answer that arrives when the lease is no longer known to hold is withheld: the
        server may have ended the session meanwhile and handed its pages to another
        (docs/DESIGN.md, Leases and fencing), so writing K/V through that answer could land in someone else's
        pages."""
        epoch = response.epoch
        if epoch and self.epoch and epoch != self.epoch and call.method != "Attach":
            if self.resume_ms > 0 and self.lost is None:
                # Taken by the run another thread is resuming the session into: a Step's answer stands.
                if call.method != "Step":
                    raise Unavailable(grpc.StatusCode.UNAVAILABLE, UNSPECIFIED, f"the server restarted ({epoch})")
            else:
                self._restarted(epoch)
        if call.fenced:
            self.lease_confirmed(call.sent_at)
            now = time.monotonic()
            if now >= self.lease_valid_until:
                late_ms = (now - call.sent_at) * 1000
                self._lose(
                    SessionLost(
                        grpc.StatusCode.FAILED_PRECONDITION,
                        UNSPECIFIED,
                        f"the {call.method} answer arrived {late_ms:.0f} ms after it was sent, past the "
                        f"{self.lease_ms} ms lease (the process was stopped or starved): the server may have ended "
                        "the session and given its pages to another, so the answer is withheld; attach again",
                    )
                )
                self._check_not_lost()
        value = call.read(response)
        if not call.fenced:  # after the read: Attach's sets the lease it confirms
            self.lease_confirmed(call.sent_at)
        elif call.method == "Step":
            seq = response.seq
            if seq:
                self.applied_seq, self.seq_known = seq, True
        return value

    def _restarted(self, epoch: str) -> None:  # an answer from another run: no resume, lost
        message = f"the server restarted (epoch {self.epoch} is now {epoch}): attach again"
        restarted = SessionLost(grpc.StatusCode.FAILED_PRECONDITION, UNSPECIFIED, message)
        restarted.views_stale = True
        self._lose(restarted)
        self._check_not_lost()

    def streamed(self, response: kvmem_pb2.StepResponse) -> kvmem_pb2.StepResponse:
        """A StepStream answer as the unary Step's outcome: the response, or the error
        it carries raised as the unary call's failure would be."""
        if response.HasField("error"):
            raise self.failed(from_status(response.error))
        return response

    def lease_confirmed(self, sent_at: float) -> None:
        """The server answered a message sent at ``sent_at``: it took it no earlier, so
        the lease holds at least until ``sent_at`` + the lease."""
        until = sent_at + self.lease_ms / 1000
        if until > self.lease_valid_until:
            self.lease_valid_until = until

    def failed(self, err: grpc.RpcError | KVMemError) -> KVMemError:
        """The kvmem error of a failed call (gRPC's error, or the error a StepStream
        answer carried). An unknown session stays unknown: later calls raise at once."""
        error = err if isinstance(err, KVMemError) else from_rpc_error(err)
        if isinstance(error, SessionLost) and not self.resumable(error):
            server_epoch = error.metadata.get("epoch")
            error.views_stale = bool(server_epoch) and server_epoch != self.epoch  # another server run
            self._lose(error)
        return error

    # ------------------------------------------------------------ keep-alive

    @property
    def keepalive_interval(self) -> float:
        """Seconds between keep-alive messages: a third of the lease."""
        return max(self.lease_ms / 3000, 0.01)

    def keepalive_requests(self) -> tuple[kvmem_pb2.KeepAliveRequest, kvmem_pb2.KeepAliveRequest]:
        """The first message of a new stream (it names the session) and every later one."""
        self._keepalive_sent.clear()
        return kvmem_pb2.KeepAliveRequest(session_id=self.session_id), kvmem_pb2.KeepAliveRequest()

    def keepalive_sent(self) -> None:
        """A keep-alive message goes out now (called just before it is yielded). Unanswered
        messages (a server that parks the stream of a lapsed session answers none) are
        remembered up to a bound; past it the pairing of answers to messages is lost, and
        keep-alive answers confirm the lease no more (calls still do)."""
        if len(self._keepalive_sent) >= _MAX_UNANSWERED:
            self._keepalive_overflow = True
        if not self._keepalive_overflow:
            self._keepalive_sent.append(time.monotonic())

    def keepalive_answered(self) -> None:
        """The server answered the oldest unanswered keep-alive message (answers come
        in order, one per message): the lease holds until its send time + the lease."""
        if self._keepalive_sent and not self._keepalive_overflow:
            self.lease_confirmed(self._keepalive_sent.popleft())

    def keepalive_ended(self, err: grpc.RpcError | None, closing: bool) -> bool:
        """The keep-alive stream ended: broken with ``err``, or closed by the server
        (None). Unless the client ended it itself (``closing``), the session is lost,
        with the server's reason if it sent one; or, when the server went away and the
        session may be resumed (:meth:`resumable`), True: the client resumes it."""
        if closing:
            return False
        gone = Unavailable(grpc.StatusCode.UNAVAILABLE, UNSPECIFIED, "the server ended the keep-alive stream")
        if self.resumable(gone if err is None else from_rpc_error(err)):
            return True
        if err is None:
            message = "the server ended the keep-alive stream"
            lost = SessionLost(grpc.StatusCode.UNAVAILABLE, UNSPECIFIED, message)
        else:
            error = from_rpc_error(err)
            lost = SessionLost(error.code, error.raw_reason, f"the keep-alive stream broke: {error}", error.metadata)
        # Refused by this same server (the session lapsed, or a bad message): its memory is
        # still there. Anything else (a transport failure, SHUTTING_DOWN, a server that
        # does not know its own epoch) means the server is gone or going.
        lost.views_stale = not (lost.reason == Reason["UNKNOWN_SESSION"] and lost.metadata.get("epoch") == self.epoch)
        self._lose(lost)
        return False

    def detach_failed(self, err: KVMemError) -> None:
        """Closing the client, its Detach failed. UNAVAILABLE means the server cannot be
        reached, is going or has just been replaced: its memory is gone or going, so the
        views are stale (the keep-alive stream, which would have said so, is closed with
        the client)."""
        if err.code == grpc.StatusCode.UNAVAILABLE:
            gone = SessionLost(err.code, err.raw_reason, f"the server is gone: {err.message}", err.metadata)
            gone.views_stale = True
            self._lose(gone)

    def _lose(self, why: KVMemError) -> None:
        """The session is lost: the first cause stands, except that a later one saying the
        server is gone (views stale) replaces one that did not, so the caller learns it."""
        stale = why if isinstance(why, SessionLost) and why.views_stale and not self.views_dropped else None
        if self.lost is not None and stale is None:
            return
        self.lost = why
        if stale is not None:
            self.views_dropped = True
            if self.on_views_stale is not None:
                self.on_views_stale(stale)


def _stats(resp: kvmem_pb2.StatsResponse) -> kvmem_pb2.StatsResponse:
    return resp


def _num_released(resp: kvmem_pb2.DetachResponse) -> int:
    return resp.num_requests_released
