"""An owner's accounting: :class:`Owner` (what :class:`~kvmem.server.core.slots.RequestTable`
keeps per session, and alone changes)."""

from __future__ import annotations

import dataclasses

from kvmem.server.core.config import OwnerId

__all__ = ["Owner"]


@dataclasses.dataclass(slots=True)
class Owner:
    """Accounting of one owner (a session, known here by its small integer); only
    :class:`RequestTable` changes it.

    ``num_pages_held`` is the sum over its open requests of their page counts;
    ``num_requests`` their number. ``request_slots`` maps the request ids of its open
    requests to their slots, and only those: a release drops its ids (released ids
    keep no memory)."""

    index: OwnerId
    slot_expect: bytes  # the slot words of its slots listed at positions 0, 1, 2, ...
    num_pages_held: int = 0
    num_requests: int = 0
    request_slots: dict[str, int] = dataclasses.field(default_factory=dict)
    namespace: str = ""  # its prefix-cache namespace
    record: int = -1  # its record in the state image (-1: no image)
    prefix_query_tokens: int = 0  # tokens its match items asked for
    prefix_hit_tokens: int = 0  # tokens they matched
    num_evictions: int = 0  # cached pages its allocs evicted
