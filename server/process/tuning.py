"""Process tuning that ``kvmem serve`` applies at start.

A step that allocates many tokens builds temporaries of megabytes; glibc returns such
memory to the kernel when it is freed (``mmap`` threshold, heap trimming), so the next
large step page-faults all of it back in (hundreds of faults per prefill step, each
costly in a VM). The server's working set is bounded by its pool, so it keeps freed
memory instead: raise the mmap and trim thresholds. A no-op where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("kvmem.tuning")

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3


def keep_freed_memory(threshold_bytes: int = 256 * 1024 * 1024) -> bool:
    """Have glibc keep up to ``threshold_bytes`` of freed heap instead of returning it
    to the kernel. Returns False (and changes nothing) where mallopt is unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, min(threshold_bytes, 32 * 1024 * 1024)),  # glibc's maximum
            (_M_TRIM_THRESHOLD, threshold_bytes),
            (_M_TOP_PAD, 64 * 1024 * 1024),
        )
    )
    log.debug("mallopt thresholds raised: %s", ok)
    return ok
