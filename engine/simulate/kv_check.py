"""The K/V that ``kvmem simulate``'s workers write, and the check that reads it back.

The value of a token's K/V is a deterministic function of the token's whole prefix, as a
model's is: position ``p`` of a sequence gets ``v(p) = sum(tokens[i] * w[i], i <= p)``
(uint64, wrapping; ``w`` fixed odd random words), hashed with ``p`` to 64 bits
(:meth:`KVPattern.hashes`). So a page the prefix cache shares holds exactly what this
worker would have written itself, whichever worker wrote it, and a page of another
request, another position or another layer reads differently.

Each of the token's K/V elements (every layer, K and V, every head and dimension, every
tensor-parallel rank: the "planes") takes a few bits of the hash, plus a fixed per-element
offset, as a small integer that the KV dtype holds exactly (:func:`exact_bits`: 8 bits in
bfloat16/float16/float32, 4 in float8_e4m3fn, 3 in float8_e5m2). Reading back compares
exactly: no tolerance, a wrong page is never "close".

``w`` and the offsets come from a fixed seed, never the run's: pages cached by an
earlier run (same server, same namespace) hold the same values and stay checkable.
Everything is vectorised over tokens and elements (numpy, then one torch write per plane).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import numpy as np
import torch

_PATTERN_SEED = 0x6B766D656D  # "kvmem": the simulated model's weights; never the run's seed
_W_BLOCK = 4096  # w is drawn in blocks, so w[:n] is the same whatever the longest request
_C_POS = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xFF51AFD7ED558CCD)
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)


def exact_bits(dtype: torch.dtype) -> int:
    """How many low bits of an integer ``dtype`` holds exactly (at most 8): a float with
    ``m`` mantissa bits holds every integer up to ``2**(m + 1)``."""
    if dtype.is_floating_point:
        mantissa = -round(math.log2(torch.finfo(dtype).eps))
        return min(8, mantissa + 1)
    return 8


@dataclasses.dataclass(frozen=True, slots=True)
class Plane:
    """One ``[num_tokens, ...]`` view of the mapped KV memory, indexed by token slot."""

    tensor: torch.Tensor
    what: str  # e.g. "layer 1 V" (or "rank 1 layer 0 K" with several ranks)


@dataclasses.dataclass(frozen=True, slots=True)
class Mismatch:
    """The first wrong element a read-back found, and how many were wrong in all."""

    position: int
    page: int
    row_index: int
    offset: int
    plane: str
    element: int
    expected: int
    found: float
    num_wrong: int


class KVPattern:
    """The values of the simulated model. ``planes`` x ``elements``: the K/V elements of
    one token; ``bits``: the exact bits of the KV dtype."""

    def __init__(self, num_planes: int, elements: int, bits: int) -> None:
        self.num_planes = num_planes
        self.elements = elements
        self.mask = np.uint8((1 << bits) - 1)
        n = num_planes * elements
        rng = np.random.default_rng([_PATTERN_SEED, num_planes, elements, bits])
        self._byte = (np.arange(n) % 8).astype(np.intp)  # which byte of the hash each element reads
        self._shift = ((np.arange(n) // 8) % (9 - bits)).astype(np.uint8)  # ...and which of its bits
        self._offset = rng.integers(0, 256, size=n, dtype=np.uint8)  # tells elements (planes) apart
        self._w = np.zeros(0, dtype=np.uint64)

    def weights(self, n: int) -> np.ndarray:
        """``w[:n]`` (grown in fixed blocks, each from its own seed)."""
        while self._w.size < n:
            block = self._w.size // _W_BLOCK
            more = np.random.default_rng([_PATTERN_SEED, 0x77, block]).integers(
                0, 2**64 - 1, size=_W_BLOCK, dtype=np.uint64, endpoint=True
            )
            self._w = np.concatenate([self._w, more | np.uint64(1)])
        return self._w[:n]

    def prefix_values(self, tokens: np.ndarray) -> np.ndarray:
        """``v(p)`` for every position of ``tokens`` (uint64). O(n)."""
        return np.cumsum(tokens.astype(np.uint64) * self.weights(tokens.size), dtype=np.uint64)

    def extend(self, base: np.ndarray, tokens: np.ndarray, start: int) -> np.ndarray:
        """``v`` at positions ``start ..`` of a sequence whose ``v(start - 1)`` is
        ``base`` (a 0-d or 1-element array; 0 for start 0) and whose tokens from
        ``start`` on are ``tokens`` (draft tokens: another sequence than the request's)."""
        w = self.weights(start + tokens.size)[start:]
        return np.cumsum(tokens.astype(np.uint64) * w, dtype=np.uint64) + np.uint64(base)

    @staticmethod
    def hashes(v: np.ndarray, start: int | np.ndarray) -> np.ndarray:
        """The 64-bit hash of each ``(v(p), p)`` (murmur3's fmix64): ``p`` from ``start``,
        or ``start`` the positions themselves (a packed batch of several requests)."""
        if isinstance(start, np.ndarray):
            pos = start.astype(np.uint64)
        else:
            pos = np.arange(start, start + v.size, dtype=np.uint64)
        x = v ^ (pos * _C_POS)
        x ^= x >> _S33
        x *= _M1
        x ^= x >> _S33
        x *= _M2
        x ^= x >> _S33
        return x

    def values(self, h: np.ndarray) -> np.ndarray:
        """uint8 ``[n, planes, elements]``: every K/V element of the tokens whose hashes
        are ``h``, each an integer the KV dtype holds exactly."""
        n = h.size
        raw = np.ascontiguousarray(h, dtype="<u8").view(np.uint8).reshape(n, 8)
        cols = (raw[:, self._byte] >> self._shift) + self._offset
        return (cols & self.mask).reshape(n, self.num_planes, self.elements)


class BlockTable(Protocol):
    """Rows of page ids by request: the client's block table (by kvmem slot) or the
    drop-in's ``req_to_page`` (by request index); ``table[row, :n]`` is a tensor."""

    def __getitem__(self, key: Any, /) -> torch.Tensor: ...


class KVMemory:
    """A worker's writes and read-backs through the client's mapped KV memory:
    ``planes`` (the client's ``kv_cache()`` views, every rank), ``block_table`` (the
    client's, host or device, indexed by slot; or the drop-in's ``req_to_page``, indexed
    by request index: what ``slot`` means below), wherever they live (shm on the CPU,
    CUDA IPC on a GPU)."""

    def __init__(self, planes: list[Plane], block_table: BlockTable, page_size: int) -> None:
        if not planes:
            raise ValueError("no KV planes: the server has no KV memory")
        first = planes[0].tensor
        self.planes = planes
        self.block_table = block_table
        self.page_size = page_size
        self.devices = list(dict.fromkeys(plane.tensor.device for plane in planes))  # a GPU per rank, or the CPU
        self.dtype = first.dtype
        elements = math.prod(first.shape[1:])
        self.bits = exact_bits(first.dtype)
        self.pattern = KVPattern(len(planes), elements, self.bits)
        self.num_writes = 0

    def write(self, locs: np.ndarray, h: np.ndarray) -> None:
        """Write the K/V of tokens with hashes ``h`` at token slots ``locs`` (every plane).
        One index write per plane; on a GPU it completes before this returns (the pages
        may be cached, and read by other processes, in the next Step)."""
        n = locs.size
        if not n:
            return
        values = torch.from_numpy(self.pattern.values(h)).to(self.dtype)
        index = torch.from_numpy(locs.astype(np.int64, copy=False))
        on = {d: (index.to(d), values.to(d)) for d in self.devices}
        for p, plane in enumerate(self.planes):
            idx, vals = on[plane.tensor.device]
            plane.tensor[idx] = vals[:, p].reshape(n, *plane.tensor.shape[1:])
        self._synchronize()
        self.num_writes += n

    def _synchronize(self) -> None:
        for device in self.devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def _row(self, slot: int, num_tokens: int) -> np.ndarray:
        num_pages = -(-num_tokens // self.page_size)
        row: np.ndarray = self.block_table[slot, :num_pages].to("cpu", torch.int64).numpy()
        return row

    def token_slots(self, slot: int, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """The block-table row of request slot ``slot`` (its first pages) and the token
        slots of positions ``0 .. num_tokens - 1`` through it, as a kernel addresses them."""
        row = self._row(slot, num_tokens)
        pos = np.arange(num_tokens)
        return row, row[pos // self.page_size] * self.page_size + pos % self.page_size

    def check(self, slot: int, h: np.ndarray) -> tuple[int, Mismatch | None]:
        """Read the request in ``slot`` back as attention would (gather its positions
        ``0 .. len(h) - 1`` through its block-table row, every plane) and compare with
        the values of hashes ``h``. Returns the pages read and the first mismatch."""
        n = h.size
        if not n:
            return 0, None
        row, locs = self.token_slots(slot, n)
        index = {d: torch.from_numpy(locs).to(d) for d in self.devices}
        expected = torch.from_numpy(self.pattern.values(h)).to(torch.float32)
        first: Mismatch | None = None
        wrong = 0
        for p, plane in enumerate(self.planes):
            got = plane.tensor[index[plane.tensor.device]].reshape(n, -1).to("cpu", torch.float32)
            bad = got != expected[:, p]
            count = int(bad.sum())
            if not count:
                continue
            wrong += count
            pos, element = (int(i) for i in bad.nonzero()[0])
            if first is None or pos < first.position:
                ps = self.page_size
                first = Mismatch(
                    pos,
                    int(row[pos // ps]),
                    pos // ps,
                    pos % ps,
                    plane.what,
                    element,
                    int(expected[pos, p, element]),
                    float(got[pos, element]),
                    0,
                )
        if first is not None:
            first = dataclasses.replace(first, num_wrong=wrong)
        return int(row.size), first

    def corrupt(self, slot: int, position: int) -> None:
        """Test hook: change one element of ``position`` of the request in ``slot``
        (plane 0, element 0) to another value the dtype holds exactly."""
        _, locs = self.token_slots(slot, position + 1)
        view = self.planes[0].tensor.reshape(self.planes[0].tensor.shape[0], -1)
        loc = int(locs[position])
        old = float(view[loc, 0])
        view[loc, 0] = (old + 1) % (1 << self.bits)
        self._synchronize()


def planes_of(layers_by_rank: list[list[torch.Tensor | tuple[torch.Tensor, torch.Tensor]]]) -> list[Plane]:
    """The planes of a client's ``kv_cache(rank)`` lists: per rank, per layer, K and V
    (mha) or the latent (mla)."""
    planes = []
    several = len(layers_by_rank) > 1
    for rank, layers in enumerate(layers_by_rank):
        where = f"rank {rank} " if several else ""
        for i, layer in enumerate(layers):
            if isinstance(layer, tuple):
                planes += [Plane(layer[0], f"{where}layer {i} K"), Plane(layer[1], f"{where}layer {i} V")]
            else:
                planes.append(Plane(layer, f"{where}layer {i} latent"))
    return planes
