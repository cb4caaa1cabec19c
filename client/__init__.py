"""The kvmem client library, used by scheduler workers.

    from kvmem.client import KVMemClient
    with KVMemClient("/tmp/kvmem.sock", name="worker-0") as kv:
        slots = kv.open(["req-1", "req-2"])
        result = kv.alloc(slots, [512, 300])          # one round trip
        kv_loc = result.kv_loc_of(0)                  # torch.int32 token slots

``AsyncKVMemClient`` offers the same methods for asyncio: each method of either client is
one line over the ``kvmem.client.session.Session`` builder of its call (one blocking,
one awaited), so both send the same requests, return the same results and raise the
same errors: the classes below, their ``reason`` the proto's closed ErrorReason. Each
method's docstring says what it costs and what it raises. What both clients share (the
constructor's arguments, the session's attributes, the lease, the memory views) is
``kvmem.client.base.ClientBase``'s.

This reference is made from the docstrings by pdoc: ``.venv/bin/python docs/build_api.py``
writes it to ``build/api/``.
"""

import importlib
from typing import Any

# Names resolve on first use (PEP 562), so `kvmem stats` and `kvmem health` do not pay
# for importing torch; `from kvmem.client import KVMemClient` works as usual.
_WHERE = {
    "AllocStatus": "kvmem.client.step",
    "StepResult": "kvmem.client.step",
    "AsyncKVMemClient": "kvmem.client.aio",
    "KVMemClient": "kvmem.client.sync",
    "stats": "kvmem.client.admin",
    "watch_events": "kvmem.client.admin",
    "EventStream": "kvmem.client.events",
    "AsyncEventStream": "kvmem.client.events",
    "MappedMemory": "kvmem.client.memory",
    "Resumed": "kvmem.client.resume",  # what on_resumed is told
    "ticket_slot": "kvmem.client.handoff",  # the slot a hand-off ticket holds
    "KVAllocator": "kvmem.client.compat",  # the reference allocator's interface (a drop-in)
    "TLSError": "kvmem.client.channel",  # an Unavailable: the connection failed for a reason of TLS
    **{
        name: "kvmem.client.errors"
        for name in (
            "FailedPrecondition",
            "InvalidArgument",
            "KVMemError",
            "NoFreeRequestSlot",
            "NotFound",
            "Reason",
            "SessionLost",
            "TooManySessions",
            "Unauthenticated",
            "Unavailable",
        )
    },
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmem.client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "AllocStatus",
    "AsyncEventStream",
    "AsyncKVMemClient",
    "EventStream",
    "FailedPrecondition",
    "InvalidArgument",
    "KVAllocator",
    "KVMemClient",
    "KVMemError",
    "MappedMemory",
    "NoFreeRequestSlot",
    "NotFound",
    "Reason",
    "Resumed",
    "SessionLost",
    "StepResult",
    "TLSError",
    "TooManySessions",
    "Unauthenticated",
    "Unavailable",
    "stats",
    "ticket_slot",
    "watch_events",
]
