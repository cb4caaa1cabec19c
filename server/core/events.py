"""What the prefix cache reports: pages stored, pages removed, everything cleared.

The core collects these per mutating call and hands them to its event sink (the
server's replay buffer, which feeds WatchEvents and the vLLM-format publisher). They
are plain dataclasses, never changed once made (not frozen: a frozen one costs about
twice as much to build, and an evicting Step builds one).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(slots=True)
class PagesStored:
    """Consecutive pages of one chain entered the cache: ``keys`` in chain order,
    ``parent_key`` the first one's parent (None: a chain's first page), ``token_ids``
    int32, ``page_size`` per key; ``medium`` the tier that holds them now ("GPU": the
    device pool, cached or loaded back; "CPU": the host tier, demoted)."""

    keys: list[bytes]
    parent_key: bytes | None
    token_ids: np.ndarray
    page_size: int
    namespace: str
    medium: str = "GPU"


@dataclasses.dataclass(slots=True)
class PagesRemoved:
    """Pages left a tier (evicted, or rewritten by their only holder): ``medium`` "GPU"
    the device pool (the host tier may still hold them), "CPU" the host tier."""

    keys: list[bytes]
    medium: str = "GPU"


@dataclasses.dataclass(slots=True)
class AllCleared:
    """The cache holds nothing (a new server run)."""


CacheEvent = PagesStored | PagesRemoved | AllCleared
