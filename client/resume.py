"""Resuming a session after its server restarted (``kvmem serve --keep-state``), written
once for both clients: when the session may be resumed, how the resuming Attach is made,
retried and read, how Steps are numbered so that the one in flight at the restart is
answered exactly once (its kept answer if the server applied it, else sent again), and
the log line and callback that say so. :class:`kvmem.client.session.Session` is a
:class:`Resuming`; the clients make the calls (``_resume`` in each).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import grpc

from kvmem.v1 import kvmem_pb2

from .channel import TLSError
from .errors import KVMemError, Reason, SessionLost

_UNREACHABLE: Reason = Reason["UNSPECIFIED"]
_NOT_READY: Reason = Reason["NOT_READY"]
_SHUTTING_DOWN: Reason = Reason["SHUTTING_DOWN"]
_UNKNOWN_SESSION: Reason = Reason["UNKNOWN_SESSION"]
UNSPECIFIED: Reason = Reason["UNSPECIFIED"]
_RESUME_TRY_S = 2.0  # the deadline of one resuming Attach

log = logging.getLogger("kvmem.client")

if TYPE_CHECKING:
    from .session import Call


class Resumed:
    """A session resumed after its server restarted (``kvmem serve --keep-state``), as
    the ``on_resumed`` callback is told: the server runs before and after, how long the
    session was without a server, its open requests (the same slots, rows and K/V),
    and the number of its last Step applied. A Step in flight at the restart is then
    answered: with its kept answer if it was applied, else it is sent again."""

    __slots__ = ("applied_seq", "epoch", "num_requests", "old_epoch", "outage_s")

    def __init__(self, old_epoch: str, epoch: str, outage_s: float, num_requests: int, applied_seq: int) -> None:
        self.old_epoch = old_epoch
        self.epoch = epoch
        self.outage_s = outage_s
        self.num_requests = num_requests
        self.applied_seq = applied_seq

    def __repr__(self) -> str:
        return (
            f"Resumed(old_epoch={self.old_epoch!r}, epoch={self.epoch!r}, outage_s={self.outage_s:.3f}, "
            f"num_requests={self.num_requests}, applied_seq={self.applied_seq})"
        )


class Resuming:
    """The resume half of a session (mixed into :class:`kvmem.client.session.Session`,
    whose attributes it reads and sets)."""

    session_id: str
    name: str
    epoch: str
    lease_ms: int
    timeout: float
    memory_handles: list[kvmem_pb2.MemoryHandle]
    lost: KVMemError | None

    def _init_resuming(self) -> None:
        # Steps are numbered: the next is applied_seq + 1 (seq_known: else 0, the server
        # numbers it; after a Step whose fate the client cannot know, a deadline passed say).
        self.resume_ms = 0
        self.applied_seq = 0
        self.seq_known = True
        self.num_resumes = 0
        self.on_resumed: Callable[[Resumed], None] | None = None
        self._outage_since: float | None = None
        self._resumed = kvmem_pb2.ResumedSession()
        self._epoch_before = ""

    def _lose(self, why: KVMemError) -> None:
        raise NotImplementedError

    def resumable(self, err: KVMemError) -> bool:
        """Whether ``err`` means the server is gone, going or replaced while this session
        may be resumed on its next run (the server keeps its state: ``resume_ms`` > 0):
        a transport failure, SHUTTING_DOWN or NOT_READY, or UNKNOWN_SESSION from
        another server run."""
        if self.resume_ms <= 0 or not self.session_id or self.lost is not None or isinstance(err, TLSError):
            return False
        if err.code == grpc.StatusCode.UNAVAILABLE and err.reason in (_UNREACHABLE, _SHUTTING_DOWN, _NOT_READY):
            return True
        epoch = err.metadata.get("epoch", "")
        return err.reason == _UNKNOWN_SESSION and bool(epoch) and epoch != self.epoch

    def resume_call(self) -> Call[kvmem_pb2.ResumedSession]:
        """The Attach that resumes this session on the server's next run."""
        from .session import Call

        if self._outage_since is None:
            self._outage_since, self._epoch_before = time.monotonic(), self.epoch
        request = kvmem_pb2.AttachRequest(resume_session_id=self.session_id)
        return Call("Attach", request, min(_RESUME_TRY_S, self.timeout), self._resumed_read)

    def resume_retry(self, err: KVMemError) -> float | None:
        """After a failed resume: how long to wait before trying again (the server is
        not back yet), or None to give up: it refused (the window passed, it kept no
        state of this session), or it has not come back within ``resume_ms`` plus the
        client's ``timeout`` of the outage's start."""
        if self._outage_since is None or err.code != grpc.StatusCode.UNAVAILABLE or isinstance(err, TLSError):
            return None
        if err.reason not in (_UNREACHABLE, _SHUTTING_DOWN, _NOT_READY):
            return None
        waited = time.monotonic() - self._outage_since
        if waited > self.resume_ms / 1000 + self.timeout:
            return None
        return min(0.05 * 2 ** min(int(waited * 4), 3), 0.4)

    def resume_failed(self, err: KVMemError) -> SessionLost:
        """The resume is over without the session: it is lost, its views stale (the
        server is another run, or none)."""
        waited = 0.0 if self._outage_since is None else time.monotonic() - self._outage_since
        lost = SessionLost(
            err.code,
            err.raw_reason,
            f"the server restarted and this session could not be resumed after {waited:.1f}s: {err.message}",
            err.metadata,
        )
        lost.views_stale = True
        self._lose(lost)
        return lost

    def _resumed_read(self, resp: kvmem_pb2.AttachResponse) -> kvmem_pb2.ResumedSession:
        if not resp.HasField("resumed") or resp.session_id != self.session_id:
            raise KVMemError(grpc.StatusCode.UNKNOWN, UNSPECIFIED, "the server answered a resume without resuming")
        mine = [(h.name, h.rank, h.size_bytes, h.shm.path) for h in self.memory_handles]
        theirs = [(h.name, h.rank, h.size_bytes, h.shm.path) for h in resp.memory]
        if mine != theirs:
            raise KVMemError(
                grpc.StatusCode.FAILED_PRECONDITION,
                UNSPECIFIED,
                f"the resumed server's memory is not this session's (handles {theirs} were {mine})",
            )
        self.epoch, self.lease_ms, self.resume_ms = resp.epoch, resp.lease_ms, resp.resume_ms
        self._resumed = resp.resumed
        # An answer this client already has is of a committed Step (a concurrent call's): never behind it.
        known = self.applied_seq if self.seq_known else 0
        self.applied_seq, self.seq_known = max(known, resp.resumed.applied_seq), True
        return resp.resumed

    def resumed(self) -> None:
        """The resume is over: the log line and the ``on_resumed`` callback."""
        since, self._outage_since = self._outage_since, None
        self.num_resumes += 1
        info = Resumed(
            self._epoch_before,
            self.epoch,
            0.0 if since is None else time.monotonic() - since,
            self._resumed.num_requests,
            self._resumed.applied_seq,
        )
        log.warning(
            "kvmem session %s resumed after %.2fs without a server (epoch %s -> %s): %d requests kept, last Step "
            "applied %d",
            self.name or self.session_id[:6],
            info.outage_s,
            info.old_epoch,
            info.epoch,
            info.num_requests,
            info.applied_seq,
        )
        if self.on_resumed is not None:
            self.on_resumed(info)

    def number(self, call: Call[Any]) -> None:
        """A Step goes out now: its number (the next, or 0 when it is not known)."""
        if call.method == "Step":
            call.request.seq = self.applied_seq + 1 if self.seq_known else 0  # type: ignore[attr-defined]
            call.sent_at = time.monotonic()

    def step_fate(self, call: Call[Any]) -> kvmem_pb2.StepResponse | None:
        """After a resume, the Step ``call`` that was in flight: its answer if it was
        applied (kept by the server), None if it was not (send it again: it has the same
        number). A Step applied whose answer was not kept raises (the requests' rows and
        lengths are in the block table as it left them)."""
        seq: int = call.request.seq  # type: ignore[attr-defined]
        applied = self._resumed.applied_seq
        if seq and applied < seq:
            return None
        if seq and applied == seq and self._resumed.answer_kept:
            answer = kvmem_pb2.StepResponse.FromString(self._resumed.last_step_answer)
            answer.epoch = self.epoch  # given by the last run: this one keeps what it says
            return answer
        raise KVMemError(
            grpc.StatusCode.DATA_LOSS,
            UNSPECIFIED,
            f"the server restarted with this session's Step {seq or '(unnumbered)'} in flight: it was applied "
            f"(the last applied is {applied}) but its answer was not kept (larger than the server keeps)",
        )

    def call_failed(self, call: Call[Any], err: KVMemError | None) -> KVMemError | None:
        """A call failed with ``err`` (None: interrupted or cancelled): None when the
        session is to be resumed and the call made again; else the error to raise (the
        session's first cause when a resume refused it meanwhile), the Step's number
        left unknown if its fate is (:meth:`step_failed`)."""
        if err is not None and call.method != "Attach" and self.resumable(err):
            return None
        self.step_failed(call, err)
        if isinstance(err, SessionLost) and self.lost is not None and err is not self.lost:
            return self.lost.with_traceback(None)  # a resume refused the session meanwhile
        return err

    def step_failed(self, call: Call[Any], err: KVMemError | None) -> None:
        """A Step failed without an answer that says it was refused (a deadline, a
        cancel, an interrupt (``err`` None), a broken connection not resumed): its fate
        is unknown, so the next Step goes unnumbered and takes its number from the answer."""
        code = grpc.StatusCode
        fate_unknown = err is None or err.code in (
            code.DEADLINE_EXCEEDED,
            code.CANCELLED,
            code.UNAVAILABLE,
            code.UNKNOWN,
        )
        if call.method == "Step" and fate_unknown:
            self.seq_known = False
