"""The core's plain data: its geometry, the ids it deals in, and what it reports."""

from __future__ import annotations

import dataclasses
from typing import NewType

OwnerId = NewType("OwnerId", int)  # a small integer >= 1; the sessions layer maps sessions to it

INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class CoreConfig:
    """Pool geometry of the core (token and page counts; memory is not its concern)."""

    num_pages: int  # including the padding page 0
    page_size: int  # tokens per page
    max_requests: int  # request slots 1..max_requests
    max_context_len: int  # tokens per request

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "max_requests", "max_context_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is padding), got {self.num_pages}")
        if self.num_pages > INT32_MAX // self.page_size:
            raise ValueError(
                f"num_pages * page_size must fit in int32 token slots, got {self.num_pages} * {self.page_size}"
            )

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_context_len // self.page_size)

    @property
    def block_table_shape(self) -> tuple[int, int]:
        return (self.max_requests + 1, self.max_pages_per_request)


@dataclasses.dataclass(frozen=True, slots=True)
class OwnerUsage:
    owner: OwnerId
    num_requests: int
    num_pages_held: int
    namespace: str = ""
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_evictions: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class HostTierStats:
    """The host-memory tier (``kvmem serve --host-memory``): its pages (each ``page_bytes``
    per rank), and since start the pages moved each way, evicted and dropped, and the
    tokens matches took from it."""

    num_pages: int
    num_free_pages: int
    num_cached_pages: int
    page_bytes: int
    num_demoted: int = 0  # device pages copied to the host as the device evicted them
    num_loaded: int = 0  # host pages copied back into device pages for a match
    num_evicted: int = 0  # host pages evicted to make room (least recently used)
    num_dropped: int = 0  # evicted device pages the host could not take (more than it holds at once)
    hit_tokens: int = 0  # tokens matches loaded from the host
    num_loading_pages: int = 0  # host pages being copied into device pages now
    load_ms_p50: float = 0.0  # recent loads: from their Step to their last layer copied
    load_ms_p99: float = 0.0
    load_gib_per_s: float = 0.0  # the copy thread's bandwidth over recent loads


@dataclasses.dataclass(frozen=True, slots=True)
class PoolStats:
    num_pages_total: int  # usable pages: num_pages - 1
    num_free_pages: int
    num_cached_pages: int  # held only by the prefix cache: evictable
    num_used_pages: int
    num_quarantined_pages: int  # of owners removed with a quarantine, not yet released
    num_free_request_slots: int
    num_open_requests: int  # a hand-off ticket's request is open (held by no owner)
    owners: tuple[OwnerUsage, ...]  # the tickets' holder is none of them
    num_cache_entries: int = 0  # pages with a key in the prefix cache, held or not
    num_evictions: int = 0  # since start
    prefix_query_tokens: int = 0  # tokens match items asked for, since start
    prefix_hit_tokens: int = 0  # tokens they matched
    num_handoff_tickets: int = 0  # open hand-off tickets
    num_handoff_pages: int = 0  # page references their requests hold (counted in num_used_pages)
    host: HostTierStats | None = None  # None: no host tier
    store: dict[str, object] | None = None  # the store link's figures (kvmem serve --store), proto StoreStats' fields


@dataclasses.dataclass(frozen=True, slots=True)
class AuditReport:
    ok: bool
    problems: tuple[str, ...]
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int
    num_quarantined_pages: int
