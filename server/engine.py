"""Sessions, leases and the core, with no gRPC: what the service calls.

The engine adds to :class:`~kvmem.server.core.KVCore` what a shared server needs:
sessions with unguessable ids, a lease per session, the server's epoch, an optional
memory backend whose block table the core writes, and counters for Stats. Every
method runs to completion without awaiting, so on the server's one event loop each
call is one critical section: steps of many sessions interleave, never half-applied.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvmem.server.core import AllocStatus, CoreConfig, KVCore, PoolStats, StepResult, AuditReport
from kvmem.server.errors import KVMemError, Reason

log = logging.getLogger("kvmem.engine")


class BlockTableSink(Protocol):
    """What the engine needs of a memory backend: the host block table the core
    writes, and a hook run after each step with the rows it changed."""

    block_table: np.ndarray
    syncs_rows: bool  # False: sync_rows is a no-op and need not be called

    def sync_rows(self, rows: np.ndarray) -> None: ...


@dataclasses.dataclass(slots=True)
class Session:
    """One attached client. ``last_seen`` (monotonic seconds) is refreshed by every
    call and keep-alive message; the session ends when it is older than the lease."""

    session_id: str
    name: str
    index: int
    quota_pages: int | None
    attached_at: float
    last_seen: float
    num_keepalive_streams: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStats:
    pool: PoolStats
    sessions: tuple[tuple[Session, int, int], ...]  # (session, num_requests, num_pages_held)
    audit: AuditReport | None
    num_steps: int
    uptime_s: float


class Engine:
    """The server's state. Not thread-safe: call it from one event loop."""

    def __init__(self, config: CoreConfig, lease_s: float, memory: BlockTableSink | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease must be > 0 seconds, got {lease_s}")
        self.epoch = secrets.token_hex(8)
        self.lease_s = lease_s
        self.memory = memory
        self._sync_memory = memory if memory is not None and memory.syncs_rows else None
        self.core = KVCore(config, None if memory is None else memory.block_table)
        self.sessions: dict[str, Session] = {}
        self._next_index = 1
        self._started = time.monotonic()
        # Totals since start, for metrics: integer additions on the hot path.
        self.num_steps = 0
        self.num_pages_allocated = 0
        self.num_pages_released = 0
        self.alloc_items = [0] * len(AllocStatus)  # by AllocStatus value
        self.sessions_ended: dict[str, int] = {}  # by why
        self.accepting = True  # False once shutdown starts: no new sessions

    # ---------------------------------------------------------------- sessions

    def attach(self, name: str, quota_pages: int | None) -> Session:
        """Start a session. O(1)."""
        if not self.accepting:
            raise KVMemError(Reason.SHUTTING_DOWN, "the server is shutting down: no new sessions")
        if len(name) > 256:
            raise KVMemError(Reason.BAD_VALUE, f"session name is {len(name)} characters, at most 256")
        if quota_pages is not None and quota_pages > self.core.config.num_pages:
            quota_pages = self.core.config.num_pages  # a quota above the pool is no quota
        session_id = secrets.token_urlsafe(24)
        now = time.monotonic()
        session = Session(session_id, name or f"session-{self._next_index}", self._next_index, quota_pages, now, now)
        self._next_index += 1
        self.core.add_owner(session_id, quota_pages)
        self.sessions[session_id] = session
        log.info("session attached name=%s index=%d quota_pages=%s", session.name, session.index, quota_pages)
        return session

    def session(self, session_id: str) -> Session:
        """The live session with this id, its lease refreshed; FAILED_PRECONDITION if
        there is none (never attached, ended, or from an earlier server run)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise KVMemError(
                Reason.UNKNOWN_SESSION,
                f"unknown session {_redact(session_id)}: it ended (detach, lease expiry or a broken "
                f"keep-alive) or belongs to another server run; this server's epoch is {self.epoch}",
                epoch=self.epoch,
            )
        session.last_seen = time.monotonic()
        return session

    def end_session(self, session_id: str, why: str) -> int:
        """Release everything the session holds and forget it. Returns the number of
        requests released; 0 if it had already ended."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return 0
        rows = self._open_rows(session_id)
        self.num_pages_released += self.core.pages_held(session_id)
        released = self.core.remove_owner(session_id)
        self._sync(rows)
        self.sessions_ended[why] = self.sessions_ended.get(why, 0) + 1
        log.info("session ended name=%s index=%d why=%s requests_released=%d", session.name, session.index, why, released)
        return released

    def expire(self, now: float | None = None) -> list[str]:
        """End every session idle for longer than the lease. O(sessions)."""
        now = time.monotonic() if now is None else now
        stale = [s.session_id for s in self.sessions.values() if now - s.last_seen > self.lease_s]
        for session_id in stale:
            self.end_session(session_id, "lease expired")
        return stale

    # --------------------------------------------------------------- requests

    def open(self, session_id: str, request_ids: Sequence[str]) -> np.ndarray:
        self.session(session_id)
        return self.core.open(session_id, request_ids)

    def step(
        self,
        session_id: str,
        release_slots: np.ndarray,
        truncate_slots: np.ndarray,
        truncate_lens: np.ndarray,
        alloc_slots: np.ndarray,
        alloc_needs: np.ndarray,
        alloc_expected_lens: np.ndarray | None,
        atomic: bool,
    ) -> StepResult:
        self.session(session_id)
        result = self.core.step(
            session_id,
            release_slots=release_slots,
            truncate_slots=truncate_slots,
            truncate_lens=truncate_lens,
            alloc_slots=alloc_slots,
            alloc_needs=alloc_needs,
            alloc_expected_lens=alloc_expected_lens,
            atomic=atomic,
        )
        self.num_steps += 1
        self.num_pages_allocated += result.new_pages.size
        self.num_pages_released += result.num_pages_released
        refused = result.num_refused
        self.alloc_items[AllocStatus.OK] += result.alloc_status.size - refused
        if refused:  # the core counted them: no array operation for metrics on a step that fits
            for value, n in enumerate(np.bincount(result.alloc_status, minlength=len(AllocStatus)).tolist()[1:], 1):
                self.alloc_items[value] += n
        if self._sync_memory is not None:
            # Rows that changed: released and truncated ones, and allocs that took pages
            # (a decode step mostly fills tails: few rows change).
            grew = alloc_slots[np.diff(result.new_page_offsets) > 0] if result.new_pages.size else alloc_slots[:0]
            changed = [a for a in (release_slots, truncate_slots, grew) if a.size]
            if changed:
                self._sync_memory.sync_rows(np.concatenate(changed) if len(changed) > 1 else changed[0])
        return result

    def stats(self, audit: bool) -> EngineStats:
        pool = self.core.stats()
        usage = {o.owner: o for o in pool.owners}
        rows = tuple(
            (s, usage[sid].num_requests, usage[sid].num_pages_held) for sid, s in self.sessions.items()
        )
        return EngineStats(pool, rows, self.core.audit() if audit else None, self.num_steps, time.monotonic() - self._started)

    # ---------------------------------------------------------------- helpers

    def _open_rows(self, session_id: str) -> np.ndarray:
        if self._sync_memory is None:
            return np.zeros(0, dtype=np.int64)
        return self.core.slots_of(session_id)

    def _sync(self, rows: np.ndarray) -> None:
        if self._sync_memory is not None and rows.size:
            self._sync_memory.sync_rows(rows)


def _redact(session_id: str) -> str:
    """Enough of a session id to recognise it in a log, not enough to use it."""
    return repr(session_id[:6] + "…") if len(session_id) > 6 else repr(session_id)
