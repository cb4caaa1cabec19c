"""What the sessions layer reports (:meth:`kvmem.server.sessions.Sessions.stats`): the
pool, each session's usage, the audit, and where the run's state came from."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvmem.server.core import AuditReport, PoolStats
from kvmem.server.core.restore import Restoration

if TYPE_CHECKING:
    from kvmem.server.sessions import Session


@dataclasses.dataclass(frozen=True, slots=True)
class SessionUsage:
    session: Session
    num_requests: int
    num_pages_held: int
    prefix_query_tokens: int = 0  # tokens its match items asked for
    prefix_hit_tokens: int = 0  # tokens they matched
    num_evictions: int = 0  # cached pages its allocs evicted


@dataclasses.dataclass(frozen=True, slots=True)
class ServerStats:
    pool: PoolStats
    sessions: tuple[SessionUsage, ...]
    audit: AuditReport | None
    num_steps: int
    uptime_s: float
    prefix_cache_enabled: bool = False
    prefix_hash: str = ""  # the page-key recipe's name
    origin: StateOrigin | None = None
    num_dormant: int = 0  # restored sessions not resumed yet
    num_resumed: int = 0  # restored sessions their clients resumed
    num_not_resumed: int = 0  # restored sessions ended because no client resumed them in time
    handoffs: tuple[int, int, int, int] = (0, 0, 0, 0)  # since start: handed off, adopted, expired, given up


@dataclasses.dataclass(frozen=True, slots=True)
class StateOrigin:
    """Where the run's state came from (see ``StateOrigin`` in the proto): ``kind``
    "fresh", "new" or "adopted" (the wire's word for a kept state restored);
    ``restoration``, what was restored (None otherwise), in ``restore_ms`` (the wire's
    ``adopt_ms``)."""

    kind: str
    restoration: Restoration | None = None
    restore_ms: float = 0.0
