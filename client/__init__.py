"""The kvmem client library, used by scheduler workers.

    from kvmem.client import KVMemClient
    with KVMemClient("/tmp/kvmem.sock", name="worker-0") as kv:
        slots = kv.open(["req-1", "req-2"])
        result = kv.alloc(slots, [512, 300])          # one round trip
        kv_loc = result.kv_loc_of(0)                  # torch.int32 token slots

``AsyncKVMemClient`` offers the same methods for asyncio. Errors are the classes in
``kvmem.client.errors``; sync and asyncio raise the same ones.
"""

from kvmem.client._common import AllocStatus, StepResult
from kvmem.client.aio import AsyncKVMemClient
from kvmem.client.errors import (
    FailedPrecondition,
    InvalidArgument,
    KVMemError,
    NoFreeRequestSlot,
    NotFound,
    SessionLost,
    Unauthenticated,
    Unavailable,
)
from kvmem.client.sync import KVMemClient, stats

__all__ = [
    "AllocStatus",
    "AsyncKVMemClient",
    "FailedPrecondition",
    "InvalidArgument",
    "KVMemClient",
    "KVMemError",
    "NoFreeRequestSlot",
    "NotFound",
    "SessionLost",
    "StepResult",
    "Unauthenticated",
    "Unavailable",
    "stats",
]
