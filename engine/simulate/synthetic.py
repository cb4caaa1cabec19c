"""``kvmem simulate``'s model (:class:`SyntheticModel`) and the read-back it offers
(:class:`ReadBack`).

:class:`SyntheticModel` writes the K/V pattern (:mod:`.kv_check`) of the given tokens at
their ``kv_loc`` and sleeps ``--forward-ms``; it "samples" the workload's fixed next
tokens, and reads a request back before its release. Without KV memory (the
``--baseline`` run on the reference allocator) it only samples.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from ..forward import ForwardBatch, ForwardOutput

if TYPE_CHECKING:
    from .kv_check import KVMemory, Mismatch  # torch: imported by the workers that write K/V, not by the command

_NO_TOKEN = 0  # the synthetic "sample" past a sequence's end (workload tokens are >= 1)


@runtime_checkable
class ReadBack(Protocol):
    """A model whose K/V the loop can check: before a request's release it reads
    positions ``0 .. num_tokens - 1`` back through ``row`` and compares them with what
    the model wrote (the pages read, and the first wrong element or None)."""

    def check(self, request_id: str, row: int, num_tokens: int) -> tuple[int, Mismatch | None]: ...

    def corrupt(self, row: int, position: int) -> None:
        """Test hook: change one written value of ``position`` of the request in ``row``."""
        ...


class _Sequence:
    """What the synthetic model knows of a request: its tokens (with one past the end,
    :data:`_NO_TOKEN`, so a sample there needs no special case) and ``v(p)`` of each
    position (:meth:`~.kv_check.KVPattern.prefix_values`; None without KV memory)."""

    __slots__ = ("prefix", "tokens")

    def __init__(self, tokens: np.ndarray, prefix: np.ndarray | None) -> None:
        self.tokens = np.append(tokens, np.int32(_NO_TOKEN)).astype(np.int32, copy=False)
        self.prefix = prefix


class SyntheticModel:
    """``kvmem simulate``'s model. Each forward: the K/V of each request's given tokens
    at their ``kv_loc`` (the pattern of the request's sequence up to the first token
    that differs from it, a rejected draft, then of the given tokens from there), one
    write for the batch; then ``forward_s`` asleep (the forward pass's time); it samples
    the sequence's next token (the workload's output, fixed in advance). Its K/V before
    a forward's first position is taken to be the sequence's (so it is: the loop
    truncates rejected drafts). ``memory`` None: no K/V, samples only."""

    def __init__(self, memory: KVMemory | None, forward_s: float = 0.0) -> None:
        self.memory = memory
        self.forward_s = forward_s
        self.num_forwards = 0
        self._seqs: dict[str, _Sequence] = {}

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.wait is not None:  # a real model reads the K/V of every layer: all of it loaded
            batch.wait(None)
        for request_id in batch.released:
            self._seqs.pop(request_id, None)
        pattern = self.memory.pattern if self.memory is not None else None
        for a in batch.admitted:
            prefix = pattern.prefix_values(a.tokens) if pattern is not None else None
            self._seqs[a.request_id] = _Sequence(a.tokens, prefix)
        offsets, seq_lens, sample_offsets = (
            batch.offsets.tolist(),
            batch.seq_lens.tolist(),
            batch.sample_offsets.tolist(),
        )
        samples: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for i, request_id in enumerate(batch.request_ids):
            seq = self._seqs.get(request_id)
            if seq is None:
                raise KeyError(f"request {request_id} is in the batch but was never admitted (or was released)")
            end = seq_lens[i]
            start = end - (offsets[i + 1] - offsets[i])
            if end >= seq.tokens.size:
                raise ValueError(
                    f"request {request_id}: position {end - 1} is past the end of its "
                    f"{seq.tokens.size - 1}-token sequence"
                )
            samples.append(seq.tokens[end - (sample_offsets[i + 1] - sample_offsets[i]) + 1 : end + 1])
            if pattern is not None and seq.prefix is not None:
                given = batch.token_ids[offsets[i] : offsets[i + 1]]
                differ = np.flatnonzero(given != seq.tokens[start:end])
                if not differ.size:
                    values.append(seq.prefix[start:end])
                else:  # another sequence from the first difference on (rejected drafts)
                    at = start + int(differ[0])
                    base = seq.prefix[at - 1] if at else np.zeros((), dtype=np.uint64)
                    values += [seq.prefix[start:at], pattern.extend(base, given[at - start :], at)]
        if self.memory is not None and pattern is not None and values and batch.kv_loc is not None:
            self.memory.write(batch.kv_loc, pattern.hashes(np.concatenate(values), batch.positions))
        if self.forward_s:
            time.sleep(self.forward_s)
        self.num_forwards += 1
        return ForwardOutput(np.concatenate(samples) if samples else np.zeros(0, dtype=np.int32))

    def check(self, request_id: str, row: int, num_tokens: int) -> tuple[int, Mismatch | None]:
        """Read the request back through ``row`` (every plane) and compare positions
        ``0 .. num_tokens - 1`` with its sequence's pattern (:meth:`.KVMemory.check`)."""
        seq = self._seqs.get(request_id)
        if self.memory is None or seq is None or seq.prefix is None:
            raise ValueError(f"request {request_id}: nothing to read back (no KV memory, or not admitted)")
        return self.memory.check(row, self.memory.pattern.hashes(seq.prefix[:num_tokens], 0))

    def corrupt(self, row: int, position: int) -> None:
        if self.memory is None:
            raise ValueError("no KV memory to corrupt")
        self.memory.corrupt(row, position)
