"""The packed 64-bit word: a value and a scratch stamp read together.

Pages (value: reference count) and request slots (value: owner index) each keep one
64-bit word per entry, always in this layout: the value in the low 32 bits, a stamp in
the high 32 bits. Both halves are strided int32 views of one int64 array.

What it proves: to check that ``n`` listed entries each have value ``v`` *and* are
listed once, scatter each item's position ``i`` into its entry's stamp, gather the
words, and compare the gathered bytes with ``i << 32 | v`` for ``i = 0..n-1``. An entry
listed twice keeps only one of its positions, so its other item reads a wrong stamp.
That is three array operations (scatter, gather, one byte comparison) for "right
value, no duplicates", where separate checks would take a sort or a bincount.
The comparison is ``bytes.startswith`` of a precomputed expectation against the
gathered array's own buffer: no comparison array, no count, no copy.
"""

from __future__ import annotations

import sys

import numpy as np

_LOW = 0 if sys.byteorder == "little" else 1  # index of the low half in an int32 view


class StampedWords:
    """``n`` 64-bit words; ``value`` and ``stamp`` are their low and high int32 halves.

    The stamp is scratch: it means something only between :meth:`stamp` and the
    gather that follows it, and a caller may leave stale stamps behind. ``value`` is
    owned by whoever owns the instance."""

    __slots__ = ("_order", "stamp", "value", "word")

    def __init__(self, n: int, order_size: int, word: np.ndarray | None = None) -> None:
        self.word = np.zeros(n, dtype=np.int64) if word is None else word  # word: an image's array
        halves = self.word.view(np.int32)
        self.value = halves[_LOW::2]
        self.stamp = halves[1 - _LOW :: 2]
        self._order = np.arange(order_size, dtype=np.int32)  # positions, for the stamps

    def positions(self, n: int) -> np.ndarray:
        """int32 ``0..n-1``: a slice of a prebuilt ramp when it is long enough."""
        return self._order[:n] if n <= self._order.size else np.arange(n, dtype=np.int32)

    @property
    def order_size(self) -> int:
        return int(self._order.size)

    @staticmethod
    def expected(value: int, n: int) -> bytes:
        """The bytes of the words ``i << 32 | value`` for ``i = 0..n-1``: what a gather
        of ``n`` entries reads when each holds ``value`` and is listed once."""
        return ((np.arange(n, dtype=np.int64) << 32) | value).tobytes()

    def stamp_positions(self, idx: np.ndarray, order: np.ndarray) -> None:
        """Write each item's position into its entry's stamp. Raises IndexError for an
        index past the end (a negative one wraps and is caught by the comparison)."""
        self.stamp[idx] = order

    @staticmethod
    def split(got: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values, stamps) of gathered words, as int32 views (no copy)."""
        halves = got.view(np.int32)
        return halves[_LOW::2], halves[1 - _LOW :: 2]
