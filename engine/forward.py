"""The model seam: what the scheduler loop (:mod:`.scheduler`) calls for each iteration's
forward pass, and :class:`SyntheticModel`, the model of ``kvmem simulate``.

Once per iteration, after its Step, the loop hands the model one :class:`ForwardBatch`:
every request that computes tokens this iteration (prefill chunks and decodes, drafts
included, packed ragged), as flat arrays, not per-token Python objects:

* request ``i`` computes ``token_ids[offsets[i] : offsets[i + 1]]`` at ``positions``
  (contiguous, from its K/V's length before the forward) into token slots ``kv_loc``
  (what the allocator gave this iteration; None where the allocator has no KV memory);
* it reads its K/V through block-table row ``rows[i]`` (a kvmem request slot, or the
  drop-in's request index into ``req_to_page``), ``seq_lens[i]`` tokens in all, this
  forward's included;
* its last ``sample_offsets[i + 1] - sample_offsets[i]`` positions are sampled: the
  model answers the next token after each (:class:`ForwardOutput`), one after the last
  prompt chunk or a decode, ``1 + k`` for a decode with ``k`` drafts (the loop accepts
  the drafts the samples confirm);
* ``released``, then ``admitted``: requests that left (released or preempted) and that
  joined (with a row) since the last forward, for a model that keeps state per request
  (sampling parameters; the synthetic model's sequences).

The loop calls :meth:`Model.forward` once per Step, with an empty batch too (an iteration
of releases only, or all of whose allocs ran out of pages). A model that raises fails the
worker: the loop wraps it in :class:`ModelFailure`, which names the iteration and batch.

:class:`SyntheticModel` writes the K/V pattern (:mod:`.kv_check`) of the given tokens at
their ``kv_loc`` and sleeps ``--forward-ms``; it "samples" the workload's fixed next
tokens, and reads a request back (:class:`ReadBack`) before its release. Without KV
memory (the ``--baseline`` run on the reference allocator) it only samples.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from .kv_check import KVMemory, Mismatch  # torch: imported by the workers that write K/V, not by the command

_NO_TOKEN = 0  # the synthetic "sample" past a sequence's end (workload tokens are >= 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """A request that joined the batch's requests: its id and the tokens the scheduler
    knows of it (its prompt; a synthetic request's whole sequence, its fixed output
    included, which is what :class:`SyntheticModel` samples)."""

    request_id: str
    tokens: np.ndarray


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    """One iteration's forward pass, packed (see the module's docstring). ``n``
    requests, ``T`` tokens, ``S`` sampled positions; arrays int64 but ``token_ids``
    (int32)."""

    request_ids: list[str]  # [n], the scheduler's ids
    rows: np.ndarray  # [n] block-table rows
    offsets: np.ndarray  # [n + 1] into the token arrays
    token_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    kv_loc: np.ndarray | None  # [T] token slots written; None: no KV memory
    seq_lens: np.ndarray  # [n] tokens read through each row, this forward's included
    sample_offsets: np.ndarray  # [n + 1] into ForwardOutput.next_tokens
    admitted: list[Admission] = dataclasses.field(default_factory=list)
    released: list[str] = dataclasses.field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    def describe(self) -> str:
        """``"3 requests, 150 tokens"``: for messages."""
        return f"{self.num_requests} requests, {self.num_tokens} tokens"


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardOutput:
    """The model's answer: ``next_tokens[sample_offsets[i] : sample_offsets[i + 1]]``
    (int32), the token sampled after each of request ``i``'s sampled positions."""

    next_tokens: np.ndarray


class Model(Protocol):
    """What the scheduler loop drives: one forward pass per iteration."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...


@runtime_checkable
class ReadBack(Protocol):
    """A model whose K/V the loop can check: before a request's release it reads
    positions ``0 .. num_tokens - 1`` back through ``row`` and compares them with what
    the model wrote (the pages read, and the first wrong element or None)."""

    def check(self, request_id: str, row: int, num_tokens: int) -> tuple[int, Mismatch | None]: ...

    def corrupt(self, row: int, position: int) -> None:
        """Test hook: change one written value of ``position`` of the request in ``row``."""
        ...


class ModelFailure(Exception):
    """The model's forward pass raised or answered the wrong shape: the worker fails."""


class BatchBuilder:
    """Gathers one iteration's requests, then packs them (one concatenation per array)."""

    __slots__ = ("_ids", "_kv_loc", "_num_samples", "_rows", "_starts", "_tokens")

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._rows: list[int] = []
        self._starts: list[int] = []
        self._tokens: list[np.ndarray] = []
        self._kv_loc: list[np.ndarray] = []
        self._num_samples: list[int] = []

    def add(
        self, request_id: str, row: int, start: int, tokens: np.ndarray, kv_loc: np.ndarray | None, samples: int
    ) -> None:
        """Request ``request_id`` computes ``tokens`` at positions ``start ..`` into
        ``kv_loc`` (as many), its last ``samples`` positions sampled."""
        self._ids.append(request_id)
        self._rows.append(row)
        self._starts.append(start)
        self._tokens.append(tokens)
        if kv_loc is not None:
            self._kv_loc.append(kv_loc)
        self._num_samples.append(samples)

    def build(self, admitted: list[Admission], released: list[str], has_kv: bool) -> ForwardBatch:
        n = len(self._ids)
        counts = np.fromiter((t.size for t in self._tokens), dtype=np.int64, count=n)
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        starts = np.array(self._starts, dtype=np.int64)
        total = int(offsets[-1])
        positions = np.repeat(starts - offsets[:-1], counts) + np.arange(total, dtype=np.int64)
        token_ids = np.concatenate(self._tokens).astype(np.int32, copy=False) if n else np.zeros(0, np.int32)
        kv_loc = None
        if has_kv:
            kv_loc = np.concatenate(self._kv_loc).astype(np.int64, copy=False) if n else np.zeros(0, np.int64)
            if kv_loc.size != total:
                raise ValueError(f"{kv_loc.size} token slots for {total} tokens: every token computed needs its kv_loc")
        sample_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self._num_samples, out=sample_offsets[1:])
        return ForwardBatch(
            self._ids,
            np.array(self._rows, dtype=np.int64),
            offsets,
            token_ids,
            positions,
            kv_loc,
            starts + counts,
            sample_offsets,
            admitted,
            released,
        )


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
