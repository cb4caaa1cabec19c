"""The allocation core: page pool, request table, block table and batched steps.

Pure numpy. It knows nothing of gRPC, torch, proto or shared memory: the block table is
an int32 array it is *given* (a plain array in tests, a shared-memory view in the
server). Each invariant has one owner, the only code that changes its state (a test
scans the sources for writes elsewhere): the pool's reference counts, the request
table's rows, lengths and per-owner counts, the prefix cache's keys. The step, alloc
and prefix modules plan and call the owners. Bottom up:

* :mod:`.words` -- the packed 64-bit word (a value and a scratch stamp), one layout;
* :mod:`.prefix` -- :class:`PrefixCache`: page keys, the key index, the evictable
  queue (the owner of the cache's state);
* :mod:`.pool` -- :class:`PagePool`: page ids, reference counts, the free stack (the
  owner of ``ref_cnt``);
* :mod:`.table` -- :class:`BlockTable`: the given table's geometry and the page
  arithmetic over its rows (read only);
* :mod:`.slots` -- :class:`RequestTable`: request slots, their owners (small
  integers), request ids, lengths (``alloced``) and block-table rows, and each owner's
  accounting (``num_pages_held``); the only code that changes them;
* :mod:`.batch` -- :class:`StepBatch` in, :class:`StepOutcome` out; the one
  "first offending item" rule;
* :mod:`.step` -- a step's validation;
* :mod:`.alloc` -- allocs, planned: the general path and the decode fast path;
* :mod:`.prefix_step` -- the prefix cache's part of a step, validated and planned;
* :mod:`.audit` -- every invariant, checked from scratch;
* :mod:`.kvcore` -- :class:`KVCore`, the front door: a step is validate, then each
  kind of item planned and applied in order, then one result.
"""

from kvmem.server.core.batch import NO_EXPECTATION, AllocStatus, StepBatch, StepOutcome
from kvmem.server.core.config import AuditReport, CoreConfig, OwnerId, OwnerUsage, PoolStats
from kvmem.server.core.kvcore import KVCore
from kvmem.server.core.pool import PagePool

__all__ = [
    "NO_EXPECTATION",
    "AllocStatus",
    "AuditReport",
    "CoreConfig",
    "KVCore",
    "OwnerId",
    "OwnerUsage",
    "PagePool",
    "PoolStats",
    "StepBatch",
    "StepOutcome",
]
