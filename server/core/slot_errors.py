"""The errors of the request table's checks (:mod:`.slots`): the first bad slot of a
list its stamped-word check refused, and a request id over the length limit."""

from __future__ import annotations

import numpy as np

from kvmem.server.core.batch import raise_first
from kvmem.server.errors import CorruptionError, KVMemError, Reason

MAX_REQUEST_ID_BYTES = 256  # the longest request id, in bytes of UTF-8 (a documented limit)


def raise_first_bad_slot(owner_of: np.ndarray, scratch: np.ndarray, owner: int, slots: np.ndarray, what: str) -> None:
    """Raise the error naming the first of ``slots`` that is not open for ``owner``
    (``owner_of``: each slot's owner), or listed twice (``scratch``: scratch per slot).
    O(n)."""
    raise_first(
        owner_of.take(slots, mode="clip") != owner,
        lambda i: KVMemError(
            Reason.SLOT_NOT_FOUND,
            f"{what}[{i}]: request slot {int(slots[i])} is not open in this session",
            index=i,
            slot=int(slots[i]),
        ),
    )
    # Every slot is in [1, max_requests] now, so a list longer than the slot table
    # holds a duplicate too; it needs a position per item to say which.
    order = np.arange(slots.size)
    scratch[slots] = order
    raise_first(
        scratch[slots] != order,
        lambda i: KVMemError(
            Reason.DUPLICATE_SLOT,
            f"{what}[{i}]: request slot {int(slots[i])} appears twice",
            index=i,
            slot=int(slots[i]),
        ),
    )
    raise CorruptionError(f"{what}: the slot check refused slots it then found valid")


def check_id_length(i: int, rid: str) -> None:
    """BAD_VALUE when request id #``i`` is longer than :data:`MAX_REQUEST_ID_BYTES`
    bytes of UTF-8 (the message names its length, never the id)."""
    size = len(rid) if rid.isascii() else len(rid.encode("utf-8", "surrogatepass"))
    if size > MAX_REQUEST_ID_BYTES:
        raise KVMemError(
            Reason.BAD_VALUE,
            f"request id #{i} is {size} bytes long (UTF-8), at most {MAX_REQUEST_ID_BYTES} (the request id limit)",
            index=i,
            length=size,
            limit=MAX_REQUEST_ID_BYTES,
        )
