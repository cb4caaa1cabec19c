"""The blocking client: one object per session, a keep-alive thread in the background.

Each method is written out here and is one line over the
:class:`kvmem.client.session.Session` builder of its call; :class:`kvmem.client.base.ClientBase`
holds what both clients share. This module makes the calls, blocking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import grpc
import torch

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

from .base import ClientBase
from .call import Call
from .channel import deadline_exceeded
from .errors import KVMemError, SessionLost, from_rpc_error
from .events import EventStream, watch_request
from .handoff import AdoptItems
from .step import NO_COLUMN, CacheItems, IntsLike, MatchItems, StepResult, TokenLists, TokensLike
from .stepstream import StepStream

T = TypeVar("T")


class KVMemClient(ClientBase):
    """A session with a kvmem server; the constructor attaches (or raises), ``close()``
    (or leaving a ``with`` block) detaches.

    ``target`` is a unix socket path (``/tmp/kvmem.sock`` or ``unix:/tmp/kvmem.sock``)
    or ``HOST:PORT`` (TLS with ``tls_ca``: see :class:`kvmem.client.base.ClientBase`,
    which also says every other argument). Every call takes ``timeout`` seconds
    (default: the client's). A keep-alive thread holds the session's lease; if the
    session breaks, the next call raises :class:`kvmem.client.SessionLost`.

    The constructor raises what an Attach can: :class:`kvmem.client.Unavailable` (no
    server within ``timeout``, or one shutting down; :class:`kvmem.client.TLSError` for a
    TLS mismatch), :class:`kvmem.client.Unauthenticated` (a missing or wrong
    ``auth_token``), :class:`kvmem.client.TooManySessions`, and
    :class:`kvmem.client.InvalidArgument` (a bad ``name`` or ``quota_pages``).
    """

    _channel: grpc.Channel | None
    _stub: kvmem_pb2_grpc.KVMemoryStub

    def _setup(self) -> None:
        self._closing = threading.Event()
        self._keepalive_call: Any = None  # grpc's stream call: an iterator that can be cancelled
        self._keepalive_thread: threading.Thread | None = None
        self._steps: StepStream | None = None  # opened at the first Step (step_stream)
        self._steps_lock = threading.Lock()
        self._step_serial = threading.Lock()  # a Step is numbered and sent (and resent) under it
        self._resume_lock = threading.Lock()  # one resume at a time (a call's or the keep-alive's)
        self._channel = self._transport.channel()
        self._stub = kvmem_pb2_grpc.KVMemoryStub(self._channel)
        try:
            self._attach()
        except BaseException:
            self._channel.close()
            raise
        if self._session.keepalive:
            self._keepalive_thread = threading.Thread(target=self._keepalive, name="kvmem-keepalive", daemon=True)
            self._keepalive_thread.start()

    def _attach(self) -> None:
        """Attach, trying again while the session says so (a server not there or not
        ready yet: ``wait_for_ready``)."""
        started = time.monotonic()
        while True:
            try:
                return self._perform(self._session.attach())
            except KVMemError as err:
                delay = self._session.attach_retry(err, started)
                if delay is None:
                    raise
                time.sleep(delay)

    # ------------------------------------------------------------- the calls

    def open(self, request_ids: list[str], *, timeout: float | None = None) -> torch.Tensor:
        """Request slots for ``request_ids``: an int32 tensor, in their order. An id
        already open in this session keeps its slot (Open is idempotent per id).

        Cost: one round trip (a unary Open); the server's work is O(len(request_ids)).

        :raises NoFreeRequestSlot: every request slot of the server is open; nothing changed.
        :raises InvalidArgument: an empty request id, or more ids than one Open takes.
        :raises SessionLost: the session is gone (detached, its lease lapsed, the server restarted).
        :raises Unavailable: the server is shutting down or cannot be reached.
        :raises KVMemError: no answer within ``timeout`` seconds (code ``DEADLINE_EXCEEDED``).
        """
        return self._perform(self._session.open(request_ids, timeout=timeout))

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
    ) -> StepResult:
        """One scheduler step in one round trip: releases, truncates, hand-offs, caches,
        matches, adoptions, then allocs, validated whole (an invalid item changes nothing). Per alloc item
        ``i``: ``alloc_needs[i]`` more tokens for request slot ``alloc_slots[i]`` (with
        ``alloc_expected_lens[i]``, the request's alloced_len it must have, -1: any;
        ``atomic``: no alloc unless all fit). Running out of pages is no error: it is the
        item's ``StepResult.status`` (:class:`kvmem.client.AllocStatus`), and that item
        changed nothing. Truncate item ``i``: slot ``truncate_slots[i]`` shrinks to
        ``truncate_lens[i]`` tokens; release items end their requests.

        The prefix cache (token ids: lists, numpy arrays or torch tensors of ints):

        * ``release_token_ids``: per release item, the request's token ids (or None):
          its full pages enter the cache as the request ends (at most its alloced_len).
        * ``cache``: ``(slot, token_ids)`` items: insert a running request's full pages
          now (chunked prefill); where the cache holds an equal page the row is switched
          to it (``StepResult.cache_switched``).
        * ``match``: ``(slot, token_ids)`` or ``(slot, token_ids, max_tokens)`` items on
          fresh requests (alloced_len 0): attach the longest run of cached full pages of
          at most ``max_tokens`` tokens (None: no limit; pass ``len - 1`` to keep one
          token to compute), written into the row; ``StepResult.match_lens`` says how
          many tokens. An alloc of the same slot in this step asks for the request's
          whole length (``need`` counts from 0: the match is not known when the step is
          sent) and gets the remainder, ``need - matched`` tokens from the match's end
          (give it no expected length).

        Hand-offs (:meth:`handoff`, :meth:`adopt`): ``handoff`` slots leave this session,
        each under a ticket (``StepResult.tickets``), with ``handoff_states`` if given;
        ``adopt`` items ``(ticket, request_id)`` take tickets' requests over, with the same
        slot, row and length (``StepResult.adopt_slots``, ``adopt_lens``, ``adopt_states``);
        an alloc item may name an adopted slot (:func:`kvmem.client.ticket_slot`).

        Cost: one round trip, one message each way on the step stream (``step_stream``;
        else a unary Step). Columns that are numpy arrays or CPU tensors travel as their
        int32 bytes (no per-item encoding); the server's work is O(items + pages
        touched), never per token; the result's tensors are views of the answer's bytes,
        made on first access.

        :raises InvalidArgument: a malformed column (``BAD_VALUE``, ``LENGTH_MISMATCH``,
            ``DUPLICATE_SLOT``); nothing changed.
        :raises NotFound: a slot that is not open in this session (``SLOT_NOT_FOUND``; the
            client says so before sending for a slot this session handed off), or a
            ticket that is not open (``TICKET_NOT_FOUND``); nothing changed.
        :raises FailedPrecondition: an item that disagrees with its request
            (``ALLOCED_LEN_MISMATCH``, ``TRUNCATE_BEYOND_ALLOCED``, ``PAGE_SHARED``), a
            ticket of another cache namespace (``NAMESPACE_MISMATCH``); nothing changed.
        :raises KVMemError: an adoption past the session's quota (``RESOURCE_EXHAUSTED``,
            ``QUOTA_EXCEEDED``); nothing changed.
        :raises SessionLost: the session is gone, or the answer came when the lease was
            no longer known to hold (withheld: the pages may be another's by then).
        :raises Unavailable: the server is shutting down or cannot be reached.
        :raises KVMemError: no answer within ``timeout`` seconds (code ``DEADLINE_EXCEEDED``).
        """
        return self._perform(
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

    def handoff(self, slots: IntsLike, states: list[bytes] | None = None, *, timeout: float | None = None) -> list[str]:
        """Hand running requests to another session of this server, copying nothing:
        each of ``slots`` leaves this session with its row, pages and length, held under
        the ticket returned for it until a session of the same cache namespace adopts it
        (:meth:`adopt`), ``kvmem serve --handoff-ms`` passes, or this session ends (then
        it is released with it). ``states``: per slot, opaque bytes (at most 256 KiB) for
        the adopter. A ticket is a secret: send it to the adopting process yourself. This
        process must not write the requests' pages from now on: drop their ``kv_loc``
        (this client refuses Step items naming the slots until they are its own again).
        Cost and errors: :meth:`step`'s (one round trip; O(slots): no page is touched)."""
        return self._perform(self._session.handoff(slots, states, timeout=timeout))

    def adopt(self, tickets: list[str], request_ids: list[str], *, timeout: float | None = None) -> StepResult:
        """Take over requests another session handed off (:meth:`handoff`), with nothing
        copied: each ticket's request becomes this session's under the request id of the
        same position (new to this session), with the same slot, row, pages and length,
        so its K/V is read in place (``StepResult.adopt_slots``, ``adopt_lens``,
        ``adopt_states``), counted against this session's quota; :meth:`step` adopts and
        decodes in one round trip. Cost and errors: :meth:`step`'s (one round trip;
        O(tickets); a ticket used, expired or forged: ``TICKET_NOT_FOUND``)."""
        return self._perform(self._session.adopt(tickets, request_ids, timeout=timeout))

    def alloc(
        self,
        slots: IntsLike,
        needs: IntsLike,
        expected_lens: IntsLike | None = None,
        *,
        atomic: bool = False,
        timeout: float | None = None,
    ) -> StepResult:
        """A step of allocs only: ``needs[i]`` more tokens for request slot ``slots[i]``
        (``expected_lens[i]``: the alloced_len it must have, -1: any; ``atomic``: none
        unless all fit). Cost and errors: :meth:`step`'s (one round trip)."""
        return self._perform(self._session.alloc(slots, needs, expected_lens, atomic=atomic, timeout=timeout))

    def truncate(self, slots: IntsLike, new_lens: IntsLike, *, timeout: float | None = None) -> StepResult:
        """A step of truncates only: request slot ``slots[i]`` shrinks to ``new_lens[i]``
        tokens (pages past it return). Cost and errors: :meth:`step`'s (one round trip)."""
        return self._perform(self._session.truncate(slots, new_lens, timeout=timeout))

    def release(
        self, slots: IntsLike, token_ids: TokenLists | None = None, *, timeout: float | None = None
    ) -> StepResult:
        """A step of releases only: the requests end, their slots and pages return.
        With ``token_ids`` (per slot, its token ids or None) their full pages enter the
        prefix cache first, for later matches of any session in this namespace. Cost
        and errors: :meth:`step`'s (one round trip)."""
        return self._perform(self._session.release(slots, token_ids, timeout=timeout))

    def match(
        self, slot: int, token_ids: TokensLike, max_tokens: int | None = None, *, timeout: float | None = None
    ) -> int:
        """A step of one match item: request slot ``slot`` (fresh: alloced_len 0) takes
        the longest run of cached full pages of ``token_ids`` (at most ``max_tokens``
        tokens). Returns the tokens matched (a multiple of the page size; 0 with the
        prefix cache off); the request's alloced_len is that now. Cost and errors:
        :meth:`step`'s (one round trip; hashing the tokens is O(len(token_ids)) on the server)."""
        return self._perform(self._session.match(slot, token_ids, max_tokens, timeout=timeout))

    def cache(self, slot: int, token_ids: TokensLike, *, timeout: float | None = None) -> int:
        """A step of one cache item: the full pages of ``token_ids`` (the request's
        tokens so far, at most its alloced_len) enter the prefix cache now. Returns how
        many pages of the row were switched to equal pages already cached (the block
        table's row changed; their K/V need not be written again). Cost and errors:
        :meth:`step`'s (one round trip; hashing the tokens is O(len(token_ids)) on the server)."""
        return self._perform(self._session.cache(slot, token_ids, timeout=timeout))

    def stats(self, *, audit: bool = False, timeout: float | None = None) -> kvmem_pb2.StatsResponse:
        """The server's Stats: the pool's counters, per-session usage, the prefix cache.

        Cost: one round trip (a unary Stats); O(sessions) on the server, and with
        ``audit`` the full audit, O(pool), run while no step can go.

        :raises SessionLost: this client's session is gone (checked before the call).
        :raises KVMemError: ``audit`` found a broken invariant (code ``INTERNAL``,
            reason ``CORRUPTION``: a bug in kvmem), or no answer within ``timeout``
            seconds (code ``DEADLINE_EXCEEDED``).
        :raises Unavailable: the server is shutting down or cannot be reached.
        """
        return self._perform(self._session.stats(audit=audit, timeout=timeout))

    def wait_loads(
        self, slot: int, match_len: int, loading: int, *, layer: int | None = None, timeout: float = 60.0
    ) -> float:
        """Wait until the last ``loading`` tokens of a match of ``match_len`` tokens in
        request ``slot`` (``StepResult.match_lens`` and ``match_loading`` of its match
        item) are copied in from the host tier: layer ``layer`` of them, or every layer
        (None). Returns the seconds waited (0.0 at once when nothing is loading, or no
        host tier). No round trip: the counters are in memory this process maps.
        :class:`~kvmem.client.loads.LoadTimeout` after ``timeout`` seconds."""
        loads = self.page_loads
        if loads is None or loading <= 0:
            return 0.0
        return loads.wait(loads.pages_of(self.block_table[slot], match_len, loading), layer, timeout)

    def detach(self, *, timeout: float | None = None) -> int:
        """End the session: every request it holds is released. Returns how many. The
        session is over from the call on, whatever its fate; the keep-alive ends with it.

        Cost: one round trip (a unary Detach); O(requests held + their pages) on the server.

        :raises SessionLost: the session was already gone.
        :raises Unavailable: the server is shutting down or cannot be reached.
        :raises KVMemError: no answer within ``timeout`` seconds (code ``DEADLINE_EXCEEDED``).
        """
        return self._perform(self._session.detach(timeout=timeout))

    def _perform(self, call: Call[T]) -> T:
        """Make ``call`` (:meth:`_perform_once`); when the server went away and the
        session may be resumed, resume it and make the call again, or hand over the kept
        answer of a Step that was applied (:meth:`kvmem.client.session.Session.step_fate`).
        Steps are numbered and sent one at a time."""
        if call.method != "Step":
            return self._perform_resuming(call)
        with self._step_serial:
            return self._perform_resuming(call)

    def _perform_resuming(self, call: Call[T]) -> T:
        session = self._session
        while True:
            session.number(call)
            seen = session.epoch
            try:
                return self._perform_once(call)
            except KVMemError as err:
                raised = session.call_failed(call, err)
                if raised is err:
                    raise
                if raised is not None:
                    raise raised from None
            except BaseException:  # interrupted, cancelled: the Step's fate is not known
                session.call_failed(call, None)
                raise
            self._resume(seen)
            if call.method == "Step":
                answer = session.step_fate(call)
                if answer is not None:
                    return session.finish(call, answer)

    def _resume(self, seen_epoch: str) -> None:
        """Resume the session on the server's next run (unless another thread already
        did: the epoch is no longer ``seen_epoch``), trying until it is back, refuses,
        or the window passes (then SessionLost, views stale)."""
        session = self._session
        with self._resume_lock:
            if session.lost is not None:
                raise session.lost.with_traceback(None)
            if session.epoch != seen_epoch:
                return
            while True:
                call = session.resume_call()
                try:
                    answer = self._stub.Attach(call.request, timeout=call.timeout, metadata=session.metadata)
                    session.finish(call, answer)
                    break
                except grpc.RpcError as rpc_err:
                    err = from_rpc_error(rpc_err)
                except KVMemError as kv_err:
                    err = kv_err
                delay = session.resume_retry(err)
                if delay is None:
                    lost = session.resume_failed(err)
                    self._stop_keepalive()
                    raise lost from None
                time.sleep(delay)
            session.resumed()  # the old step stream went with the old server: the next Step opens another

    def _perform_once(self, call: Call[T]) -> T:
        """Make ``call`` the way :meth:`kvmem.client.session.Session.route` says, and
        hand its answer to the session to read."""
        try:
            try:
                route = self._session.route(call)
                if route == "stream":
                    response = self._session.streamed(self._stream_step(call))
                elif route == "bounded":
                    response = self._bounded(call)
                else:
                    rpc = getattr(self._stub, call.method)
                    response = rpc(call.request, timeout=call.timeout, metadata=self._session.metadata)
            except grpc.RpcError as err:
                raise self._failure(call, err) from None
            return self._session.finish(call, response)
        except SessionLost:
            if self._session.lost is not None:
                self._stop_keepalive()  # over for this client: closing the stream tells the server it let go
            raise
        finally:
            if call.ends_session:
                self._stop_keepalive()
                self._close_steps()

    def _bounded(self, call: Call[T]) -> Any:
        """A unary call with a big request, waited for no longer than its deadline (see
        :data:`kvmem.client.channel.BIG_REQUEST_BYTES`): cancelled past it."""
        future = getattr(self._stub, call.method).future(
            call.request, timeout=call.timeout, metadata=self._session.metadata
        )
        try:
            return future.result(timeout=call.timeout)
        except grpc.FutureTimeoutError:
            future.cancel()
            raise deadline_exceeded(call.method, call.timeout) from None

    def _stream_step(self, call: Call[T]) -> kvmem_pb2.StepResponse:
        """``call`` on the step stream, opened (again) when there is none that works;
        anything but an answer leaves the stream done, and the next step opens another."""
        with self._steps_lock:
            stream = self._steps
            if stream is None or not stream.usable:
                if stream is not None:
                    stream.close()
                stream = self._steps = StepStream(self._stub, self._session.metadata)
        try:
            return stream.step(call.request, call.timeout)
        except BaseException:
            stream.close()
            raise

    def _close_steps(self) -> None:
        with self._steps_lock:
            stream, self._steps = self._steps, None
        if stream is not None:
            stream.close()

    # ------------------------------------------------------------ the client

    def watch_events(self, from_seq: int = 0, epoch: str = "") -> EventStream:
        """The prefix cache's events from batch ``from_seq`` of ``epoch`` (empty: the
        server's current one) on, then live: an iterator of ``kvmem.v1.KVEventBatch``
        (see :mod:`kvmem.client.events`); ``close()`` it to cancel the call. It needs no
        session (a router without one: :func:`kvmem.client.watch_events`). Cost: one
        server-streaming call on the client's channel, open until closed."""
        if self._channel is None:
            raise RuntimeError("the client is closed")
        request = watch_request(from_seq, epoch)
        return EventStream(self._stub.WatchEvents(request, metadata=self._session.metadata))

    def close(self) -> None:
        """Detach (if still attached: a Detach with a deadline of at most 2 s, whose
        failure is ignored, since the session is gone either way) and close the channel.
        Idempotent."""
        detach = self._session.close()
        try:
            if detach is not None:
                self._perform(detach)
        except KVMemError as err:
            self._session.detach_failed(err)  # the session is gone either way; maybe the server too
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        self._stop_keepalive()
        self._close_steps()
        self._unmap()
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> KVMemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keepalive(self) -> None:
        """The keep-alive stream, and again after each resume (the server went away and
        the session may be resumed: this thread resumes it)."""
        session = self._session
        while True:
            seen = session.epoch
            try:
                self._keepalive_stream()
            except grpc.RpcError as err:
                resume = session.keepalive_ended(err, self._closing.is_set())
            else:
                resume = session.keepalive_ended(None, self._closing.is_set())
            if not resume:
                return
            try:
                self._resume(seen)
            except KVMemError:
                return  # lost: the next call raises it

    def _keepalive_stream(self) -> None:
        first, later = self._session.keepalive_requests()
        interval = self._session.keepalive_interval
        session = self._session

        def requests() -> Iterator[kvmem_pb2.KeepAliveRequest]:
            session.keepalive_sent()
            yield first
            while not self._closing.wait(interval):
                session.keepalive_sent()
                yield later

        self._keepalive_call = self._stub.KeepAlive(requests(), metadata=session.metadata)
        for _ in self._keepalive_call:
            session.keepalive_answered()

    def _stop_keepalive(self) -> None:
        self._closing.set()
        if self._keepalive_call is not None:
            self._keepalive_call.cancel()
        if self._keepalive_thread is not None and self._keepalive_thread is not threading.current_thread():
            self._keepalive_thread.join(timeout=5)
            self._keepalive_thread = None
