"""The allocation core: page pool, request slots, block table and batched steps.

Pure numpy. It knows nothing of gRPC, torch, proto or shared memory: the block table is
an int32 array it is *given* (a plain array in tests, a shared-memory view in the
server). Bottom up:

* :mod:`.words` -- the packed 64-bit word (a value and a scratch stamp), one layout;
* :mod:`.pool` -- :class:`PagePool`: page ids, reference counts, the free stack;
* :mod:`.table` -- :class:`BlockTable`: rows of page ids and the page arithmetic;
* :mod:`.slots` -- request slots, their owners (small integers) and lengths;
* :mod:`.batch` -- :class:`StepBatch` in, :class:`StepResult` out; the one
  "first offending item" rule;
* :mod:`.step` -- a step's validation, releases and truncates;
* :mod:`.alloc` -- allocs: the general path and the decode fast path;
* :mod:`.audit` -- every invariant, checked from scratch;
* :mod:`.kvcore` -- :class:`KVCore`, the front door.
"""

from kvmem.server.core.batch import NO_EXPECTATION, AllocStatus, StepBatch, StepResult
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
    "StepResult",
]
