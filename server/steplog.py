"""Each session's last Step answer, kept where the next server run finds it (with
``--keep-state``: a file beside the state image), so that a client whose Step was
applied just before a crash gets that Step's answer when it resumes, instead of
applying it twice or not knowing its fate.

One region per owner record of the state image: a header (owner index, Step number,
answer length) and the answer's bytes (a serialized ``StepResponse``). The Step is
committed (:meth:`kvmem.server.core.KVCore.commit`) only after its answer is written
here, so the answer of every committed Step is here, unless it was larger than a region
(:data:`REGION_BYTES`, about 16,000 tokens' slots: the header then says "too large", and
the resumed client learns that the Step was applied but not its answer). Written in
place, never synced: the file lives in memory (``/dev/shm``) and outlives the process,
not the machine. O(answer bytes) per Step.
"""

from __future__ import annotations

import numpy as np

__all__ = ["REGION_BYTES", "StepLog"]

REGION_BYTES = 64 * 1024
_HEAD = 3  # int64s: owner index, Step number, answer bytes (-1: too large to keep)
TOO_LARGE = -1


class StepLog:
    """The regions of ``max_owners`` owner records over ``buffer`` (writable, at least
    :meth:`size` bytes; zeroed: no answers)."""

    def __init__(self, buffer: object, max_owners: int) -> None:
        raw = np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]
        if raw.size < self.size(max_owners):
            raise ValueError(f"the step log is {raw.size} bytes, {max_owners} records need {self.size(max_owners)}")
        self.regions = raw[: self.size(max_owners)].reshape(max_owners, REGION_BYTES)
        self.heads = self.regions[:, : 8 * _HEAD].view(np.int64)  # (max_owners, 3), over the same memory

    @staticmethod
    def size(max_owners: int) -> int:
        return max_owners * REGION_BYTES

    def write(self, record: int, owner: int, seq: int, answer: bytes) -> bool:
        """Keep ``answer``, owner ``owner``'s Step ``seq``, in its record's region (the
        number last: a region half written names the Step before). False if it is too
        large to keep (the header says so)."""
        head = self.heads[record]
        n = len(answer)
        fits = n <= REGION_BYTES - 8 * _HEAD
        if fits:
            self.regions[record, 8 * _HEAD : 8 * _HEAD + n] = np.frombuffer(answer, dtype=np.uint8)
        head[0], head[2] = owner, n if fits else TOO_LARGE
        head[1] = seq
        return fits

    def answers(self) -> dict[int, tuple[int, bytes | None]]:
        """Every owner's latest answer, by owner index: ``(seq, bytes)``, bytes None
        when it was too large to keep (a record reused since a restore may still hold
        an older one: the highest number wins). O(max_owners), once at a restore."""
        out: dict[int, tuple[int, bytes | None]] = {}
        for record in np.flatnonzero(self.heads[:, 0] > 0).tolist():
            owner, seq, n = (int(v) for v in self.heads[record])
            if owner in out and out[owner][0] >= seq:
                continue
            if n == TOO_LARGE:
                out[owner] = (seq, None)
            elif 0 <= n <= REGION_BYTES - 8 * _HEAD:
                out[owner] = (seq, self.regions[record, 8 * _HEAD : 8 * _HEAD + n].tobytes())
        return out
