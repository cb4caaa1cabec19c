"""The model seam: what the scheduler (:mod:`.scheduler`) calls for each iteration's
forward pass. Two models implement it: the synthetic one of ``kvmem simulate``
(:mod:`.simulate.synthetic`) and a transformers model (:mod:`.generate.hf_model`).

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
  (sampling parameters; the synthetic model's sequences);
* ``wait`` (None: nothing to wait for): some K/V the batch reads is still being copied
  in from the server's host tier (``kvmem serve --host-memory``); a model calls
  ``wait(i)`` before it reads layer ``i`` of the cache (its attention hook does: layer
  ``i`` waits only for layer ``i``'s copy, the layers before it computing meanwhile),
  or ``wait(None)`` once for every layer. It returns the seconds waited.

The loop calls :meth:`Model.forward` once per Step, with an empty batch too (an iteration
of releases only, or all of whose allocs ran out of pages). A model that raises fails the
worker: the loop wraps it in :class:`ModelFailure`, which names the iteration and batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


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
    wait: Callable[[int | None], float] | None = None  # K/V still loading from the host tier

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
    (int32), the token sampled after each of request ``i``'s sampled positions;
    ``logits``: the logits they were sampled from, one row per sampled position (a model
    that has them; the scheduler keeps them for a request when asked)."""

    next_tokens: np.ndarray
    logits: Any = None


class Model(Protocol):
    """What the scheduler drives: one forward pass per iteration."""

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...


class ModelFailure(Exception):
    """The model's forward pass raised or answered the wrong shape: the worker fails."""


class BatchBuilder:
    """Gathers one iteration's requests, then packs them: the token ids into one array,
    the token slots given whole (the Step's, when every request's are its, in order) or
    gathered per request."""

    __slots__ = ("_arrays", "_counts", "_ids", "_kv_loc", "_num_samples", "_rows", "_starts", "_tokens", "_unsampled")

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._rows: list[int] = []
        self._starts: list[int] = []
        self._counts: list[int] = []
        self._tokens: list[np.ndarray | int] = []  # an int: one token
        self._kv_loc: list[np.ndarray] = []
        self._num_samples: list[int] = []
        self._arrays = 0  # entries whose tokens are an array
        self._unsampled = 0  # entries not sampled exactly once

    def add(
        self,
        request_id: str,
        row: int,
        start: int,
        tokens: np.ndarray | int,
        kv_loc: np.ndarray | None = None,
        samples: int = 0,
    ) -> None:
        """Request ``request_id`` computes ``tokens`` (an array, or one token id) at
        positions ``start ..`` into ``kv_loc`` (as many; None: given whole to
        :meth:`build`), its last ``samples`` positions sampled."""
        self._ids.append(request_id)
        self._rows.append(row)
        self._starts.append(start)
        if isinstance(tokens, int):
            self._counts.append(1)
        else:
            self._counts.append(tokens.size)
            self._arrays += 1
        self._tokens.append(tokens)
        if kv_loc is not None:
            self._kv_loc.append(kv_loc)
        self._num_samples.append(samples)
        self._unsampled += samples != 1

    def add_decodes(self, request_ids: list[str], rows: list[int], starts: list[int], tokens: list[int]) -> None:
        """As :meth:`add` once per request, each computing one token (``tokens[i]`` at
        position ``starts[i]``) and sampling after it, token slots given whole."""
        self._ids += request_ids
        self._rows += rows
        self._starts += starts
        self._counts += [1] * len(request_ids)
        self._tokens += tokens
        self._num_samples += [1] * len(request_ids)

    def build(
        self, admitted: list[Admission], released: list[str], has_kv: bool, kv_loc: np.ndarray | None = None
    ) -> ForwardBatch:
        """The batch; ``kv_loc``: every token's slot, in the order added (else those
        given to :meth:`add` are concatenated)."""
        n = len(self._ids)
        starts = np.array(self._starts, dtype=np.int64)
        if not self._arrays:  # one token each (decodes): its position its start, one conversion
            offsets = np.arange(n + 1, dtype=np.int64)
            seq_lens = starts + 1
            total = n
            positions = starts
            token_ids = np.array(self._tokens, dtype=np.int32)
        else:
            counts = np.array(self._counts, dtype=np.int64)
            offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(counts, out=offsets[1:])
            total = int(offsets[-1])
            positions = np.repeat(starts - offsets[:-1], counts) + np.arange(total, dtype=np.int64)
            seq_lens = starts + counts
            token_ids = np.empty(total, dtype=np.int32)
            for tokens, at, count in zip(self._tokens, offsets.tolist(), self._counts, strict=False):
                token_ids[at : at + count] = tokens
        loc = None
        if has_kv:
            if kv_loc is None:
                kv_loc = np.concatenate(self._kv_loc) if self._kv_loc else np.zeros(0, np.int64)
            loc = kv_loc.astype(np.int64, copy=False)
            if loc.size != total:
                raise ValueError(f"{loc.size} token slots for {total} tokens: every token computed needs its kv_loc")
        if self._unsampled:
            sample_offsets = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(self._num_samples, out=sample_offsets[1:])
        else:  # each sampled once
            sample_offsets = np.arange(n + 1, dtype=np.int64)
        return ForwardBatch(
            self._ids,
            np.array(self._rows, dtype=np.int64),
            offsets,
            token_ids,
            positions,
            loc,
            seq_lens,
            sample_offsets,
            admitted,
            released,
        )
