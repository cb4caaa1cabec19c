"""Named points inside a Step where a test can stop the process (a test-only hook).

``KVMEM_TEST_CRASH_AT=point`` (or ``point:N``, the ``N``-th time the point is passed,
counted from 1) in a server's environment SIGKILLs it there; in one process a test may
set :data:`hook` instead (called with the point's name). The points, in a Step's order:

* ``after-releases``: the releases and truncates applied, nothing else;
* ``after-prefix``: the cache and match items applied too;
* ``mid-allocs``: an alloc's pages written into the rows, the lengths not yet;
* ``before-commit``: the whole Step applied, its answer not yet kept;
* ``after-commit``: the Step applied and committed, its answer not yet sent.

Off (the default), a point costs one check of a module-level bool.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

POINTS = ("after-releases", "after-prefix", "mid-allocs", "before-commit", "after-commit")

_spec = os.environ.get("KVMEM_TEST_CRASH_AT", "")
_point, _, _nth = _spec.partition(":")
if _spec and _point not in POINTS:
    raise ValueError(f"KVMEM_TEST_CRASH_AT={_spec!r}: the points are {', '.join(POINTS)} (point or point:N)")
_left = int(_nth or 1)
hook: Callable[[str], None] | None = None  # a test's, in one process
armed = bool(_spec)  # checked at each point: set with hook


def at(point: str) -> None:
    """The Step is at ``point``: SIGKILL this process if it is the one asked for."""
    global _left
    if hook is not None:
        hook(point)
        return
    if point == _point:
        _left -= 1
        if _left <= 0:
            os.kill(os.getpid(), signal.SIGKILL)
