"""A drop-in for schedulers written against the reference allocator
(``shared/reference/seed_kv_allocator.py``): :class:`KVAllocator` has its class name,
methods and meaning, over a kvmem session. A scheduler switches by changing its import
and constructor, and adds one ``with allocator.iteration():`` line per iteration so its
calls go out as one Step (see the class; ``docs/COMPAT.md`` lists every difference from
the reference).

Inside: ``allocator.py`` the public class (each method checks its call and collects
it), ``calls.py`` the calls collected for the next Step and the one place that sends
them, ``book.py`` what the allocator knows of its kvmem requests and how an answered
Step changes it (no I/O), ``results.py`` the results resolved at the block's end and
``req_to_page``.
"""

from .allocator import KVAllocator
from .results import Iteration, KVLocResult, PendingInt, ReqToPage

__all__ = ["Iteration", "KVAllocator", "KVLocResult", "PendingInt", "ReqToPage"]

for _public in (Iteration, KVAllocator, KVLocResult, PendingInt, ReqToPage):
    _public.__module__ = __name__  # their public home: reprs, pickles and doc tools name it
del _public
