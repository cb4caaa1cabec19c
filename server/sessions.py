"""Sessions over the core, with no gRPC: what the service calls.

This layer is the one registry of sessions: their unguessable ids, names, leases and
quotas live here and only here; the core knows each session as a small integer owner
(:meth:`KVCore.add_owner`). It is given the core it serves (built where the server is
put together: :mod:`kvmem.server.process.app`) and holds the server's epoch, the memory
backend it syncs the block table's changed rows to, and the totals that metrics read.
Every method runs to
completion without awaiting, so on the server's one event loop each call is one
critical section: steps of many sessions interleave, never half-applied.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from kvmem.server.core import AllocStatus, KVCore, OwnerId, StepBatch, StepOutcome, crash
from kvmem.server.core.restore import Restoration
from kvmem.server.errors import KVMemError, Reason
from kvmem.server.server_stats import ServerStats, SessionUsage, StateOrigin
from kvmem.server.steplog import StepLog

log = logging.getLogger("kvmem.sessions")

MAX_NAME_CHARS = 256
MAX_NAMESPACE_CHARS = 256  # a prefix-cache namespace (AttachRequest.cache_namespace)
DEFAULT_MAX_SESSIONS = 1024  # sessions attached at once (`kvmem serve --max-sessions`)
QUARANTINE_LEASES = 6  # the default quarantine, in leases
DEFAULT_HANDOFF_S = 30.0  # how long a hand-off ticket waits for its adopter (kvmem serve --handoff-ms)


class BlockTableSink(Protocol):
    """What the sessions layer needs of a memory backend: the host block table the core
    writes, and a hook run after each step with the rows it changed."""

    block_table: np.ndarray
    syncs_rows: bool  # False: sync_rows is a no-op and need not be called

    def sync_rows(self, rows: np.ndarray) -> None: ...


@dataclasses.dataclass(slots=True)
class Session:
    """One attached client. ``last_seen`` (monotonic seconds) is refreshed by every
    call and keep-alive message; the session ends when it is older than the lease.
    ``owner`` is its index in the core, shown in Stats (never the id).
    ``cache_namespace``: the prefix-cache namespace it shares pages in ("" = the shared
    default), fixed at Attach; the core keeps the same for its owner."""

    session_id: str
    name: str
    owner: OwnerId
    quota_pages: int | None
    last_seen: float
    cache_namespace: str = ""
    applied_seq: int = 0  # its last Step applied (numbered by the client, or here: see Sessions.step)


@dataclasses.dataclass(slots=True)
class Dormant:
    """A session of the last server run (restored with its state), waiting for its client
    to resume it until ``until`` (monotonic seconds); ``answer``: its last Step's
    answer, kept across the restart (None when it was too large to keep, or lost)."""

    session: Session
    until: float
    answer: bytes | None


@dataclasses.dataclass(frozen=True, slots=True)
class Resumed:
    """What a resuming client is told: its session, the number of its last Step
    applied, and that Step's answer (b"" if it has none to give)."""

    session: Session
    applied_seq: int
    answer: bytes
    answer_kept: bool
    num_requests: int


@dataclasses.dataclass(slots=True)
class Quarantine:
    """The pages of a session whose lease lapsed while its process may still write
    into them (docs/DESIGN.md, Leases and fencing). They go back to the pool when the session's
    keep-alive stream breaks or closes (the process is gone, or it let go) or at
    ``until`` (monotonic seconds), whichever comes first."""

    name: str
    owner: OwnerId
    until: float


class Sessions:
    """The server's state. Not thread-safe: call it from one event loop."""

    def __init__(
        self,
        core: KVCore,
        lease_s: float,
        memory: BlockTableSink | None = None,
        *,
        quarantine_s: float | None = None,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        steplog: StepLog | None = None,
        resume_s: float = 0.0,
        handoff_s: float = DEFAULT_HANDOFF_S,
    ) -> None:
        """Sessions over ``core``, built where the server is put together (its block
        table ``memory``'s, when there is one: the rows each step changes are synced to
        ``memory``)."""
        if lease_s <= 0:
            raise ValueError(f"lease must be > 0 seconds, got {lease_s}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        if quarantine_s is not None and quarantine_s < 0:
            raise ValueError(f"quarantine must be >= 0 seconds, got {quarantine_s}")
        if handoff_s <= 0:
            raise ValueError(f"the hand-off window must be > 0 seconds, got {handoff_s}")
        if memory is not None and core.block_table is not memory.block_table:
            raise ValueError("the core must write the memory's block table: KVCore(config, memory.block_table, ...)")
        self.core = core
        self.max_sessions = max_sessions
        self.epoch = secrets.token_hex(8)
        self.lease_s = lease_s
        # How long a lapsed session's pages stay out of use (default: six leases).
        self.quarantine_s = QUARANTINE_LEASES * lease_s if quarantine_s is None else quarantine_s
        self.quarantined: dict[str, Quarantine] = {}  # by session id
        self.origin = StateOrigin("new" if core.image is not None else "fresh")  # the server sets a restoration's
        self._sync_memory = memory if memory is not None and memory.syncs_rows else None
        self.by_id: dict[str, Session] = {}
        self._started = time.monotonic()
        # Totals since start, for metrics: integer additions on the hot path.
        self.num_steps = 0
        self.num_pages_allocated = 0
        self.num_pages_released = 0
        self.alloc_items = [0] * len(AllocStatus)  # by AllocStatus value
        self.num_pages_cached = 0  # pages steps inserted into the prefix cache
        self.sessions_ended: dict[str, int] = {}  # by why
        self.accepting = True  # False once shutdown starts: no new sessions
        # --keep-state: each Step's answer is kept (steplog) before the Step is committed, and
        # the last run's sessions wait resume_s for their clients (dormant, by id).
        self.steplog = steplog
        self.resume_s = resume_s
        self.dormant: dict[str, Dormant] = {}
        self.num_resumed = 0
        self.num_not_resumed = 0
        # Hand-off tickets: each is released if not adopted within handoff_s (by ticket; an
        # adopted one, or one its giver's end released, is dropped at the next expire).
        self.handoff_s = handoff_s
        self.ticket_until: dict[str, float] = {}

    # ---------------------------------------------------------------- sessions

    def attach(self, name: str, quota_pages: int | None, cache_namespace: str = "") -> Session:
        """Start a session, sharing cached pages with the sessions of ``cache_namespace``.
        O(1) (plus the core's O(max_requests) numpy, once). RESOURCE_EXHAUSTED
        (TOO_MANY_SESSIONS) when ``max_sessions`` are attached."""
        if not self.accepting:
            raise KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: no new sessions")
        if len(self.by_id) >= self.max_sessions:
            raise KVMemError(
                Reason.TOO_MANY_SESSIONS,
                f"too many sessions: {len(self.by_id)} attached, at most max_sessions = {self.max_sessions} "
                "(kvmem serve --max-sessions); detach one or wait for one to end",
                sessions=len(self.by_id),
                limit=self.max_sessions,
            )
        if len(name) > MAX_NAME_CHARS:
            raise KVMemError(Reason.BAD_VALUE, f"session name is {len(name)} characters, at most {MAX_NAME_CHARS}")
        if len(cache_namespace) > MAX_NAMESPACE_CHARS:
            raise KVMemError(
                Reason.BAD_VALUE,
                f"cache_namespace is {len(cache_namespace)} characters, at most {MAX_NAMESPACE_CHARS}",
                length=len(cache_namespace),
                limit=MAX_NAMESPACE_CHARS,
            )
        if quota_pages is not None and (not isinstance(quota_pages, int) or quota_pages < 0):
            raise KVMemError(Reason.BAD_VALUE, f"quota_pages must be an integer >= 0, got {quota_pages!r}")
        if quota_pages is not None and quota_pages > self.core.config.num_pages:
            quota_pages = self.core.config.num_pages  # a quota above the pool is no quota
        owner = self.core.add_owner(cache_namespace)
        session = Session(
            secrets.token_urlsafe(24), name or f"session-{owner}", owner, quota_pages, time.monotonic(), cache_namespace
        )
        self.core.set_session(owner, session.session_id, session.name, quota_pages)
        self.by_id[session.session_id] = session
        log.info(
            "session attached name=%s index=%d quota_pages=%s cache_namespace=%r",
            session.name,
            owner,
            quota_pages,
            cache_namespace,
        )
        return session

    def session(self, session_id: str) -> Session:
        """The live session with this id, its lease refreshed; FAILED_PRECONDITION if
        there is none (never attached, ended, or from an earlier server run)."""
        session = self.by_id.get(session_id)
        if session is None:
            if session_id in self.dormant:
                raise KVMemError(
                    Reason.UNKNOWN_SESSION,
                    f"session {_redact(session_id)} is of the last server run and waits to be resumed "
                    f"(Attach with resume_session_id); this server's epoch is {self.epoch}",
                    epoch=self.epoch,
                )
            raise KVMemError(
                Reason.UNKNOWN_SESSION,
                f"unknown session {_redact(session_id)}: it ended (detach, lease expiry or a broken "
                f"keep-alive) or belongs to another server run; this server's epoch is {self.epoch}",
                epoch=self.epoch,
            )
        session.last_seen = time.monotonic()
        return session

    def end(self, session_id: str, why: str, *, quarantine: bool = False, now: float | None = None) -> int:
        """Release everything the session holds and forget it; with ``quarantine`` the
        pages it leaves unreferenced stay out of use (:class:`Quarantine`). Returns the
        number of requests released; 0 if it had already ended."""
        session = self.by_id.pop(session_id, None)
        if session is None:
            return 0
        sink = self._sync_memory
        rows = self.core.slots_of(session.owner) if sink is not None else None
        self.num_pages_released += self.core.pages_held(session.owner)
        released = self.core.remove_owner(session.owner, quarantine=quarantine)
        if sink is not None and rows is not None and rows.size:
            sink.sync_rows(rows)
        self.sessions_ended[why] = self.sessions_ended.get(why, 0) + 1
        held = self.core.quarantined_pages(session.owner) if quarantine else 0
        if held:
            until = (time.monotonic() if now is None else now) + self.quarantine_s
            self.quarantined[session_id] = Quarantine(session.name, session.owner, until)
        log.info(
            "session ended name=%s index=%d why=%s requests_released=%d pages_quarantined=%d",
            session.name,
            session.owner,
            why,
            released,
            held,
        )
        return released

    def restore_sessions(self, restoration: Restoration, answers: dict[int, tuple[int, bytes | None]]) -> None:
        """A restored core's owners are the last run's sessions: each waits ``resume_s``
        for its client (:meth:`resume`; ``answers``: the step log's, by owner), and is
        then ended as a lapsed lease ends (:meth:`expire`). An owner with no session
        (or with ``resume_s`` 0) ends now, its pages quarantined (its process may still
        write into them); the quarantines the last run left are kept as long again.
        O(owners + their requests)."""
        now = time.monotonic()
        known = {s.owner: s for s in restoration.sessions}
        for owner in self.core.owner_ids():
            restored = known.get(owner)
            if restored is None or not restored.session_id or self.resume_s <= 0:
                requests = int(self.core.slots_of(owner).size)
                self.num_pages_released += self.core.pages_held(owner)
                self.core.remove_owner(owner, quarantine=True)
                log.info("adopted owner ended index=%d requests_released=%d (no session to resume)", owner, requests)
                continue
            session = Session(
                restored.session_id,
                restored.name,
                OwnerId(owner),
                restored.quota_pages,
                now,
                restored.cache_namespace,
                restored.applied_seq,
            )
            seq, answer = answers.get(owner, (-1, None))
            kept = answer if seq == session.applied_seq else None
            self.dormant[session.session_id] = Dormant(session, now + self.resume_s, kept)
        for owner in self.core.quarantine_owners():
            held = self.core.quarantined_pages(owner)
            self.quarantined[f"adopted-{owner}"] = Quarantine(
                f"(adopted owner {owner})", OwnerId(owner), now + self.quarantine_s
            )
            log.info("adopted quarantine index=%d pages=%d for %.1fs", owner, held, self.quarantine_s)
        if self.dormant:
            log.info("%d session(s) of the last run may resume within %.1fs", len(self.dormant), self.resume_s)

    def resume(self, session_id: str) -> Resumed:
        """The client of a session of the last run (:meth:`restore_sessions`) is back:
        the session is live again with its requests, rows and lengths; it is told the
        number of its last Step applied and, if kept, that Step's answer. A live
        session's resume (its client's earlier resume answer was lost) says the same
        without the answer. UNKNOWN_SESSION when there is none to resume. O(1)."""
        if not self.accepting:
            raise KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: no session resumes")
        dormant = self.dormant.pop(session_id, None)
        if dormant is None:
            live = self.by_id.get(session_id)
            if live is None:
                raise KVMemError(
                    Reason.UNKNOWN_SESSION,
                    f"no session {_redact(session_id)} to resume: its resume window "
                    f"(--resume-ms {self.resume_s * 1000:.0f}) passed, it ended, or this server kept no state "
                    f"of it; attach anew (this server's epoch is {self.epoch})",
                    epoch=self.epoch,
                )
            live.last_seen = time.monotonic()
            return Resumed(live, live.applied_seq, b"", False, int(self.core.slots_of(live.owner).size))
        session = dormant.session
        session.last_seen = time.monotonic()
        self.by_id[session_id] = session
        self.num_resumed += 1
        requests = int(self.core.slots_of(session.owner).size)
        waited = dormant.until - self.resume_s
        log.info(
            "session resumed name=%s index=%d requests=%d pages=%d applied_seq=%d after %.0f ms",
            session.name,
            session.owner,
            requests,
            self.core.pages_held(session.owner),
            session.applied_seq,
            1000 * (session.last_seen - waited),
        )
        answer = dormant.answer
        return Resumed(session, session.applied_seq, answer or b"", answer is not None, requests)

    def expire(self, now: float | None = None) -> list[str]:
        """End every session idle for longer than the lease, its pages quarantined (its
        process may be stopped, not dead, and wake up to write into them); free the
        quarantines whose time is up. O(sessions + quarantines)."""
        now = time.monotonic() if now is None else now
        stale = [s.session_id for s in self.by_id.values() if now - s.last_seen > self.lease_s]
        for session_id in stale:
            self.end(session_id, "lease expired", quarantine=True, now=now)
        for session_id in [k for k, d in self.dormant.items() if d.until <= now]:
            session = self.dormant.pop(session_id).session
            self.by_id[session_id] = session  # ended as a lapsed lease ends
            self.end(session_id, "not resumed in time", quarantine=True, now=now)
            self.num_not_resumed += 1
            stale.append(session_id)
        for session_id in [k for k, q in self.quarantined.items() if q.until <= now]:
            self._unquarantine(session_id, "the quarantine period passed")
        if self.ticket_until:
            core = self.core
            done = [t for t, until in self.ticket_until.items() if until <= now or not core.has_ticket(t)]
            late = [t for t in done if core.has_ticket(t)]
            for ticket in done:
                del self.ticket_until[ticket]
            if late:
                log.info("hand-off tickets released count=%d: not adopted within %.1fs", len(late), self.handoff_s)
                core.release_tickets(late)
        return stale

    def in_quarantine(self, session_id: str) -> bool:
        return session_id in self.quarantined

    def stream_gone(self, session_id: str) -> None:
        """A keep-alive stream of this session ended from the client's side (its process
        is gone, or it closed the stream): a live session ends at once and its pages
        are free; a quarantined one's pages are free now, since no process of it is
        left to write into them."""
        if session_id in self.by_id:
            self.end(session_id, "keep-alive stream closed")
        elif session_id in self.quarantined:
            self._unquarantine(session_id, "its keep-alive stream closed")

    def _unquarantine(self, session_id: str, why: str) -> None:
        q = self.quarantined.pop(session_id)
        freed = self.core.release_quarantine(q.owner)
        log.info("quarantine ended name=%s index=%d why=%s pages_freed=%d", q.name, q.owner, why, freed)

    # --------------------------------------------------------------- requests

    def open(self, session_id: str, request_ids: Sequence[str]) -> np.ndarray:
        return self.core.open(self.session(session_id).owner, request_ids)

    def step(
        self, session_id: str, batch: StepBatch, seq: int = 0, answer: Callable[[StepOutcome, int], Any] | None = None
    ) -> Any:
        """Apply one Step of the session: its result, or ``answer(result)`` (the
        response message) when given. Steps are numbered per session: ``seq`` is the
        next number (its last applied + 1), or 0 to have it numbered here; another is
        refused (BAD_VALUE, naming the number expected). With a step log the answer is
        kept in it before the Step is committed (see :mod:`kvmem.server.core.undo`):
        after a crash, a Step is either undone or applied with its answer kept."""
        session = self.session(session_id)
        expected = session.applied_seq + 1
        if seq and seq != expected:
            raise KVMemError(
                Reason.BAD_VALUE,
                f"Step number {seq} is not this session's next: its last applied Step is {session.applied_seq}, "
                f"so the next is {expected} (a resumed session is told which)",
                seq=seq,
                expected=expected,
            )
        core = self.core
        result = core.step(session.owner, batch, session.quota_pages, expected)
        try:
            out: Any = result if answer is None else answer(result, expected)
            if self.steplog is not None and answer is not None:  # the answer is a message
                record = core.slots.owner(session.owner).record
                self.steplog.write(record, session.owner, expected, out.SerializeToString())
            if crash.armed:
                crash.at("before-commit")
        finally:  # applied here, answered or not
            core.commit(expected)
            session.applied_seq = expected
        if crash.armed:
            crash.at("after-commit")
        self.num_steps += 1
        self.num_pages_allocated += result.new_pages.size
        self.num_pages_released += result.num_pages_released
        refused = result.num_refused
        self.alloc_items[AllocStatus.OK] += result.alloc_status.size - refused
        self.num_pages_cached += result.num_pages_cached
        if result.tickets:
            until = time.monotonic() + self.handoff_s
            self.ticket_until.update(dict.fromkeys(result.tickets, until))
        if refused:  # the core counted them: no array operation for metrics on a step that fits
            for value, n in enumerate(np.bincount(result.alloc_status, minlength=len(AllocStatus)).tolist()[1:], 1):
                self.alloc_items[value] += n
        if self._sync_memory is not None:
            self._sync_changed_rows(batch, result)
        return out

    def _sync_changed_rows(self, batch: StepBatch, result: StepOutcome) -> None:
        """Rows that changed: released and truncated ones, allocs that took pages (a
        decode step mostly fills tails: few rows change), and the rows matches and cache
        items rewrote (``changed_rows``)."""
        al = batch.alloc_slots
        grew = al[np.diff(result.new_page_offsets) > 0] if result.new_pages.size else al[:0]
        changed = [a for a in (batch.release_slots, batch.truncate_slots, grew, result.changed_rows) if a.size]
        if changed and self._sync_memory is not None:
            self._sync_memory.sync_rows(np.concatenate(changed) if len(changed) > 1 else changed[0])

    def stats(self, audit: bool) -> ServerStats:
        core, t = self.core, self.core.tickets
        pool = core.stats()
        usage = {o.owner: o for o in pool.owners}
        rows = []
        for s in self.by_id.values():
            u = usage[s.owner]
            rows.append(
                SessionUsage(
                    s, u.num_requests, u.num_pages_held, u.prefix_query_tokens, u.prefix_hit_tokens, u.num_evictions
                )
            )
        audit_report = core.audit() if audit else None
        uptime = time.monotonic() - self._started
        return ServerStats(
            pool,
            tuple(rows),
            audit_report,
            self.num_steps,
            uptime,
            core.prefix_enabled,
            core.page_keys.name,
            self.origin,
            len(self.dormant),
            self.num_resumed,
            self.num_not_resumed,
            (t.num_handed_off, t.num_adopted, t.num_expired, t.num_given_up),
        )


def _redact(session_id: str) -> str:
    """Enough of a session id to recognise it in a log, not enough to use it."""
    return repr(session_id[:6] + "…") if len(session_id) > 6 else repr(session_id)
