"""A Step is applied whole or not at all, across a crash: the undo record.

A Step changes lengths, closes slots, rewrites row entries, caches pages and evicts
others, each written in place into the state image (:mod:`.image`) as it goes. Before
each change the owner that makes it writes what it overwrites into the image's undo
record (:class:`UndoLog`); the Step is applied once its owner's ``owner_seq`` is set to
the Step's number (:meth:`UndoLog.commit`, one word: the commit point). A process that
restores the image (:mod:`.restore`) finds an undo record whose Step was not committed and
puts back what it lists (:func:`undo`) before it reads the facts: the state is the one
before the Step, as if it never came. A committed Step's record is stale: nothing to do.

What is recorded (each array grows by appending; its count in the header is written
after its entries, so a crash never leaves a count over entries not yet written):

* the length of every slot the Step names, before it (released, truncated, matched,
  allocated); a decode Step's record (``undo_kind`` 1) holds its alloc slots' lengths
  and their flat block-table positions (the slot is a position's quotient), written
  there by the allocator as it reads and computes them, and its evictions, nothing else;
* the owner word and request-id length of every slot it closes (a release);
* the rows a release zeroes, as one block (their first ``width`` entries), and each row
  entry before a truncate or a cache switch overwrote it;
* the pages it cached (their ``cached`` flags cleared again) and the pages its allocs
  evicted (cached again: their facts stay in the image until they are cached anew,
  which no later item of the same Step does: cache items come before allocs).

Pages need no record of their own: reference counts, the free stack and the key index
are derived at a restore from the rows and the flags. The record's start (:meth:`begin`)
clears ``undo_seq`` first and sets it last, so a record half written is no record. The
LRU order is not put back (an order "good enough to evict by").

Cost per Step: a decode Step copies nothing (its lengths and positions are written
once, into the record) and writes its kind and number; any other Step copies the named
slots and their lengths (O(n)), and a release, truncate, switch, insert or eviction
writes what it overwrites once more (O(P)). Nothing is proportional to the pool.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvmem.server.core.image import _STATE_AT, CoreImage

__all__ = ["PendingUndo", "UndoLog", "pending", "undo"]

_SEQ, _RECORD = _STATE_AT["undo_seq"], _STATE_AT["undo_record"]
_LENS, _CLOSED, _ENTRIES = _STATE_AT["undo_lens"], _STATE_AT["undo_closed"], _STATE_AT["undo_entries"]
_INSERTED, _EVICTED, _KIND = _STATE_AT["undo_inserted"], _STATE_AT["undo_evicted"], _STATE_AT["undo_kind"]
_DECODE = 1  # a record of lengths and evictions only: its other counts are not read
_ROWS, _ROW_WIDTH = _STATE_AT["undo_rows"], _STATE_AT["undo_row_width"]


class UndoLog:
    """The writing side, over an image. ``active`` while a Step is being applied (between
    :meth:`begin` and :meth:`commit` or :meth:`abort`); the record calls do nothing
    otherwise (a Detach's releases are no Step: a restore repairs a cut one)."""

    def __init__(self, image: CoreImage) -> None:
        self.image = image
        self.ints = image.ints.data  # the header's numbers: a memoryview's item writes cost a third of numpy's
        self._seqs = image.owner_seq.data
        self._lens, self._len_slot = image.undo_len, image.undo_len_slot
        self._alloced = image.alloced
        self.active = False
        self.record = -1
        self._dirty = False  # entries, pages or closed slots recorded since the counts were last zeroed
        self._evicted = False  # evictions recorded since that count was last zeroed
        self._kind = -1  # the record kind last written
        self._views: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._k = -1  # the length count last written (a decode Step of the same size writes it not again)

    def begin(self, record: int, seq: int, named: list[np.ndarray], closing: np.ndarray) -> None:
        """A Step of owner ``record``, number ``seq`` (> 0), starts: the lengths of the
        ``named`` slots and the words and id lengths of the ``closing`` ones, before it.
        Slots out of range read (and would be put back at) a clipped index: the
        validation that follows refuses them before anything changes."""
        ints = self.ints
        if record != self.record or self.active:  # the last record is stale only for its own owner
            ints[_SEQ] = 0  # no record until it is whole
        n = 0
        for slots in named:
            k = slots.size
            if k:
                self._len_slot[n : n + k] = slots
                self._alloced.take(slots, mode="clip", out=self._lens[n : n + k])
                n += k
        k = closing.size
        if k:
            image = self.image
            image.undo_closed_slot[:k] = closing
            image.undo_word[:k] = image.slot_word.take(closing, mode="clip")
            image.undo_rid_len[:k] = image.rid_len.take(closing, mode="clip")
        ints[_LENS] = self._k = n
        if k or self._dirty:
            ints[_CLOSED] = k
            ints[_ENTRIES] = ints[_INSERTED] = ints[_EVICTED] = ints[_ROWS] = 0
            self._dirty, self._evicted = bool(k), False
        if self._kind != 0:
            ints[_KIND] = self._kind = 0
        if record != self.record:
            ints[_RECORD] = record
        ints[_SEQ] = seq
        self.active, self.record = True, record

    def decode_views(self, record: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`begin` for the decode fast path (allocs only, every slot valid), in
        the fewest operations: where the allocator writes the ``k`` lengths it reads and
        the flat block-table positions it computes anyway (``slot * width + column``:
        the slot is the position's quotient), then :meth:`activate_decode`, before it
        changes anything. Nothing is copied for the record."""
        if record != self.record or self.active:
            self.ints[_SEQ] = 0  # the last record is stale only for its own owner
        return self._views.get(k) or self._cut(k)

    def activate_decode(self, record: int, seq: int, k: int) -> None:
        """The decode record of :meth:`decode_views` is written: its counts, then its number."""
        ints = self.ints
        if k != self._k:
            ints[_LENS] = self._k = k
        if self._evicted:  # the other counts a decode record does not read: left as they are
            ints[_EVICTED] = 0
            self._evicted = False
        if self._kind != _DECODE:
            ints[_KIND] = self._kind = _DECODE
        if record != self.record:
            ints[_RECORD] = self.record = record
        ints[_SEQ] = seq
        self.active = True

    def _cut(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``k`` entries of the length and slot records (made once per ``k``:
        a dict lookup costs less than two slicings, paid on every decode Step)."""
        views = self._views[k] = (self._lens[:k], self._len_slot[:k])
        return views

    def entries(self, pos: np.ndarray, pages: np.ndarray) -> None:
        """Row entries at flat block-table positions ``pos``, holding ``pages``, are
        about to change."""
        if self.active and pos.size:
            n, k = self.ints[_ENTRIES], pos.size
            self.image.undo_pos[n : n + k] = pos
            self.image.undo_page[n : n + k] = pages
            self.ints[_ENTRIES] = n + k
            self._dirty = True

    def rows(self, slots: np.ndarray, width: int, heads: np.ndarray) -> None:
        """The first ``width`` entries of the rows of ``slots`` (``heads``, row after row)
        are about to be zeroed (a release): kept as one block, with no position per
        entry. One block per Step (a Step releases once); another goes as entries."""
        if not self.active or not slots.size:
            return
        ints = self.ints
        if ints[_ROWS]:
            self.entries((slots[:, None] * self.image.layout.width + np.arange(width)).reshape(-1), heads)
            return
        n = slots.size
        self.image.undo_row_slot[:n] = slots
        self.image.undo_row_pages[: n * width] = heads
        ints[_ROW_WIDTH] = width
        ints[_ROWS] = n
        self._dirty = True

    def pages(self, which: int, pages: np.ndarray) -> None:
        """Pages about to be cached (``which`` is ``_INSERTED``) or evicted (``_EVICTED``)."""
        if self.active and pages.size:
            n, k = self.ints[which], pages.size
            (self.image.undo_inserted if which == _INSERTED else self.image.undo_evicted)[n : n + k] = pages
            self.ints[which] = n + k
            self._dirty = True
            self._evicted |= which == _EVICTED

    def inserted(self, pages: np.ndarray) -> None:
        self.pages(_INSERTED, pages)

    def evicted(self, pages: np.ndarray) -> None:
        self.pages(_EVICTED, pages)

    def commit(self, seq: int) -> None:
        """The Step is applied: its owner's sequence number is ``seq`` (the commit
        point: the record is stale from then on, :func:`pending` ignores it)."""
        if self.active:
            self._seqs[self.record] = seq
            self.active = False

    def abort(self) -> None:
        """The Step changed nothing (it was refused): no record."""
        if self.active:
            self.ints[_SEQ] = 0
            self.active = False


@dataclasses.dataclass(frozen=True, slots=True)
class PendingUndo:
    """An undo record whose Step was cut before its commit, copied out of an image."""

    record: int
    seq: int
    len_slot: np.ndarray
    lens: np.ndarray
    closed_slot: np.ndarray
    words: np.ndarray
    rid_lens: np.ndarray
    pos: np.ndarray
    pages: np.ndarray
    inserted: np.ndarray
    evicted: np.ndarray
    row_slots: np.ndarray
    row_heads: np.ndarray  # (len(row_slots), width): the rows' first entries

    def describe(self, owner: int) -> str:
        return (
            f"a Step (number {self.seq}) of owner {owner} cut by the crash was undone: {self.lens.size} length(s), "
            f"{self.closed_slot.size} closed slot(s), {self.row_slots.size} row(s) and {self.pos.size} row entries, "
            f"{self.inserted.size} page(s) "
            f"cached and {self.evicted.size} evicted put back as they were"
        )


def pending(image: CoreImage) -> PendingUndo | None:
    """The image's undo record if its Step was not committed, else None. Counts out of
    their arrays' bounds (a torn image) read as no record: a restore repairs the rest."""
    ints = image.ints
    seq, record = int(ints[_SEQ]), int(ints[_RECORD])
    if seq <= 0 or not 0 <= record < image.owner_seq.size or int(image.owner_seq[record]) >= seq:
        return None
    counts = (int(ints[_LENS]), int(ints[_CLOSED]), int(ints[_ENTRIES]), int(ints[_INSERTED]), int(ints[_EVICTED]))
    decode = int(ints[_KIND]) == _DECODE
    rows, width = int(ints[_ROWS]), int(ints[_ROW_WIDTH])
    if decode:  # lengths and evictions only; the slots are given as flat block-table positions
        counts, rows = (counts[0], 0, 0, 0, counts[4]), 0
    if not 0 <= rows <= image.undo_row_slot.size or not 0 <= width <= image.layout.width:
        return None
    sizes = (
        image.undo_len.size,
        image.undo_word.size,
        image.undo_pos.size,
        image.undo_inserted.size,
        image.undo_evicted.size,
    )
    if any(not 0 <= c <= s for c, s in zip(counts, sizes, strict=True)):
        return None
    n, k, e, i, v = counts
    slots = image.undo_len_slot[:n] // image.layout.width if decode else image.undo_len_slot[:n].copy()
    return PendingUndo(
        record,
        seq,
        slots,
        image.undo_len[:n].copy(),
        image.undo_closed_slot[:k].copy(),
        image.undo_word[:k].copy(),
        image.undo_rid_len[:k].copy(),
        image.undo_pos[:e].copy(),
        image.undo_page[:e].copy(),
        image.undo_inserted[:i].copy(),
        image.undo_evicted[:v].copy(),
        image.undo_row_slot[:rows].copy(),
        image.undo_row_pages[: rows * width].reshape(rows, width).copy(),
    )


def undo(
    record: PendingUndo,
    words: np.ndarray,
    alloced: np.ndarray,
    rid_len: np.ndarray,
    rows: np.ndarray,
    cached: np.ndarray,
    page_size: int,
) -> None:
    """Put back, in the given copies of the image's arrays (slot words, lengths, id
    lengths, the block table's rows, the ``cached`` flags), what the cut Step changed;
    each value as it was first recorded (before the Step). Row entries past a restored
    length are zeroed (an alloc's new pages). O(the record)."""
    n_slots, flat = words.size, rows.reshape(-1)
    slots = np.clip(record.len_slot, 0, n_slots - 1)
    first = np.unique(slots, return_index=True)[1]
    alloced[slots[first]] = record.lens[first]
    closed = np.clip(record.closed_slot, 0, n_slots - 1)
    words[closed] = record.words
    rid_len[closed] = record.rid_lens
    if record.row_slots.size:  # recorded at the release, the Step's first change of them
        row_slots = np.clip(record.row_slots, 0, rows.shape[0] - 1)
        rows[row_slots, : record.row_heads.shape[1]] = record.row_heads
    if record.pos.size:
        pos_first = np.unique(record.pos, return_index=True)[1]
        ok = record.pos[pos_first] < flat.size
        flat[record.pos[pos_first][ok]] = record.pages[pos_first][ok]
    cached[record.evicted[(record.evicted > 0) & (record.evicted < cached.size)]] = True
    cached[record.inserted[(record.inserted > 0) & (record.inserted < cached.size)]] = False
    touched = np.unique(np.concatenate([slots, closed]))
    touched = touched[(touched > 0) & (touched < rows.shape[0])]
    if touched.size:
        need = (alloced[touched].astype(np.int64) + page_size - 1) // page_size
        past = np.arange(rows.shape[1])[None, :] >= need[:, None]
        sub = rows[touched]
        sub[past] = 0
        rows[touched] = sub
