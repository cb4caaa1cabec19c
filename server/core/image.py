"""The core's state image: every fact a restarted server needs to take the core over,
as fixed arrays in one buffer (shared memory beside the KV memory in the server; a
private buffer otherwise), written in place by the classes that own each fact, as part
of the calls that change it. Nothing is copied per Step.

What the image holds (the block-table rows are the given table, already shared):

* per request slot: its owner, its length (``alloced``), its request id (UTF-8 bytes),
  and the free slot stack;
* per owner record: the owner's index and its namespace (an index into the namespace
  table); ``next_owner`` in the header;
* per page: the prefix cache's facts (cached, key, parent key, depth in its chain,
  namespace, token ids, LRU sequence number) and the owner whose quarantine holds it
  (0: none); the free page stack (its order, kept when it is still right);
* the namespace table: each namespace's UTF-8 name;
* per owner record, the session it is (its id, name and quota, written at Attach: what a
  resuming client names) and the sequence number of its last Step applied whole;
* the undo record of the Step being applied (:mod:`.undo`): what the Step changed, as
  it was before, so that a Step cut by a crash is undone, never half applied;
* with a host tier (``kvmem serve --host-memory``; ``host_pages`` > 0), per host page
  the tier's facts (cached, key, parent key, depth, namespace, token ids, LRU sequence
  number): its pages' bytes are in a kept file of their own (:mod:`.tier`). A host
  page's facts are written after its bytes and before its flag, and its flag is
  cleared before the page is reused: each page is whole or absent, whatever the
  instant of a crash, and no Step's undo needs to know of the tier.

What it does not hold: reference counts, the evictable queue, the key index and the
per-owner accounting: :mod:`.restore` derives them from the above (O(pool), once). Nor
the counters "since start" (hits, evictions): a new process starts them at 0.

Write order makes a crash at any instant recoverable: a page's cache facts are written
before its ``cached`` flag is set, and its flag is cleared before it is handed out again;
a request's id is written before its owner, its row before its length grows, and a
shrinking row is zeroed before its length drops (a restore trims a length its row does
not cover); pages are let go only after that, so a page freed in a Step is in no row
when an alloc of the same Step takes it. The header's ``writer_pid`` names the process
that created or restored it (for the logs: a pid is no proof of life, pids are reused).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

__all__ = ["MAGIC", "VERSION", "CoreImage", "ImageLayout", "ImageMismatch", "row_items"]

MAGIC = b"KVMCORE1"
VERSION = 3  # 3: host_pages in the header, the host tier's facts
RID_BYTES = 256  # MAX_REQUEST_ID_BYTES in .slot_errors
NS_BYTES = 1024  # a namespace's UTF-8 (at most 256 characters: sessions.MAX_NAMESPACE_CHARS)
MAX_NAMESPACES = 4096
SID_BYTES = 64  # a session id (ASCII; the server makes 32-character ones)
NAME_BYTES = 1024  # a session's name, UTF-8 (at most 256 characters: sessions.MAX_NAME_CHARS)
_ALIGN = 64
_HEADER_INTS = (
    "version", "num_pages", "page_size", "max_requests", "width", "key_bytes", "max_owners", "host_pages",
)  # fmt: skip
_STATE_INTS = (
    "writer_pid", "num_free_pages", "num_free_slots", "next_owner", "num_namespaces",
    # the undo record (.undo): the Step's sequence number (0: none open), its owner's record, counts
    "undo_seq", "undo_record", "undo_lens", "undo_closed", "undo_entries", "undo_inserted", "undo_evicted",
    "undo_kind",  # 1: a decode Step's record (lengths and evictions only), 0: any other
    "undo_rows", "undo_row_width",  # the released rows' block: how many rows, of how many entries
)  # fmt: skip
_STATE_AT = {name: len(_HEADER_INTS) + i for i, name in enumerate(_STATE_INTS)}


def row_items(array: np.ndarray) -> np.ndarray:
    """A C-contiguous 2-D array as a 1-D view of its rows, each one item (a void of the
    row's bytes): a gather or scatter of whole rows (``rows[pages] = ...``) then copies
    each row in one piece, where a 2-D fancy index also loops over the columns (several
    times slower for rows of 16 to 64 bytes). Writes through it are the array's."""
    return array.view(np.dtype((np.void, array.shape[1] * array.itemsize))).reshape(array.shape[0])


class ImageMismatch(ValueError):
    """A state image that does not fit (another geometry or version, or not an image);
    the message names what differs."""


@dataclasses.dataclass(frozen=True, slots=True)
class ImageLayout:
    """The geometry an image is laid out for, and where each array lies in the buffer."""

    num_pages: int
    page_size: int
    max_requests: int
    width: int  # block-table columns
    key_bytes: int  # bytes of a page key
    max_owners: int
    host_pages: int = 0  # the host tier's pages (kvmem serve --host-memory); 0: none

    def arrays(self) -> list[tuple[str, Any, tuple[int, ...]]]:
        slots, pages, k = self.max_requests + 2, self.num_pages, self.key_bytes
        return [
            ("ints", np.int64, (len(_HEADER_INTS) + len(_STATE_INTS),)),
            ("slot_word", np.int64, (slots,)),
            ("alloced", np.int32, (slots,)),
            ("free_slots", np.int64, (self.max_requests,)),
            ("rid_len", np.int16, (slots,)),
            ("rid", np.uint8, (slots, RID_BYTES)),
            ("owner_id", np.int64, (self.max_owners,)),
            ("owner_ns", np.int32, (self.max_owners,)),
            ("owner_seq", np.int64, (self.max_owners,)),
            ("owner_quota", np.int64, (self.max_owners,)),  # -1: none
            ("owner_sid", np.uint8, (self.max_owners, SID_BYTES)),
            ("owner_name_len", np.int16, (self.max_owners,)),
            ("owner_name", np.uint8, (self.max_owners, NAME_BYTES)),
            ("page_cached", np.bool_, (pages,)),
            ("page_key", np.uint8, (pages, k)),
            ("page_parent", np.uint8, (pages, k)),
            ("page_depth", np.int32, (pages,)),
            ("page_ns", np.int32, (pages,)),
            ("page_tokens", np.int32, (pages, self.page_size)),
            ("page_lru", np.int64, (pages,)),
            ("page_held_by", np.int64, (pages,)),
            ("free_pages", np.int32, (pages,)),
            ("ns_len", np.int16, (MAX_NAMESPACES,)),
            ("ns_name", np.uint8, (MAX_NAMESPACES, NS_BYTES)),
            # the undo record: lengths (every slot a Step names), closed slots' words and
            # id lengths, row entries before they changed, pages cached and evicted
            ("undo_len_slot", np.int64, (4 * slots,)),
            ("undo_len", np.int32, (4 * slots,)),
            ("undo_closed_slot", np.int64, (slots,)),
            ("undo_word", np.int64, (slots,)),
            ("undo_rid_len", np.int16, (slots,)),
            ("undo_row_slot", np.int64, (slots,)),
            ("undo_row_pages", np.int32, (slots * self.width,)),
            ("undo_pos", np.int64, (slots * self.width,)),
            ("undo_page", np.int32, (slots * self.width,)),
            ("undo_inserted", np.int32, (pages,)),
            ("undo_evicted", np.int32, (pages,)),
            # the host tier (empty without one)
            ("host_cached", np.bool_, (self.host_pages,)),
            ("host_key", np.uint8, (self.host_pages, k)),
            ("host_parent", np.uint8, (self.host_pages, k)),
            ("host_depth", np.int32, (self.host_pages,)),
            ("host_ns", np.int32, (self.host_pages,)),
            ("host_tokens", np.int32, (self.host_pages, self.page_size)),
            ("host_lru", np.int64, (self.host_pages,)),
        ]

    def offsets(self) -> tuple[dict[str, tuple[int, Any, tuple[int, ...]]], int]:
        at = _ALIGN  # the magic first
        out = {}
        for name, dtype, shape in self.arrays():
            out[name] = (at, dtype, shape)
            at += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        return out, at

    @property
    def size(self) -> int:
        """Bytes of an image of this layout."""
        return self.offsets()[1]


class CoreImage:
    """The arrays of an image over ``buffer`` (writable, at least ``layout.size``
    bytes). :meth:`create` lays out a fresh one; :meth:`open` checks an existing one
    against the layout and raises :class:`ImageMismatch` naming the difference."""

    def __init__(self, buffer: Any, layout: ImageLayout) -> None:
        offsets, size = layout.offsets()
        raw = np.frombuffer(buffer, dtype=np.uint8)
        if raw.size < size:
            raise ImageMismatch(f"the state image is {raw.size} bytes, its layout needs {size}")
        self.buffer, self.layout, self.raw = buffer, layout, raw[:size]
        for name, (at, dtype, shape) in offsets.items():
            count = int(np.prod(shape))
            setattr(self, name, raw[at : at + count * np.dtype(dtype).itemsize].view(dtype).reshape(shape))
        self._ns_ids: dict[str, int] = {}
        self.ints: np.ndarray
        self.slot_word: np.ndarray
        self.alloced: np.ndarray
        self.free_slots: np.ndarray
        self.rid_len: np.ndarray
        self.rid: np.ndarray
        self.owner_id: np.ndarray
        self.owner_ns: np.ndarray
        self.page_cached: np.ndarray
        self.page_key: np.ndarray
        self.page_parent: np.ndarray
        self.page_depth: np.ndarray
        self.page_ns: np.ndarray
        self.page_tokens: np.ndarray
        self.page_lru: np.ndarray
        self.page_held_by: np.ndarray
        self.free_pages: np.ndarray
        self.ns_len: np.ndarray
        self.ns_name: np.ndarray
        self.owner_seq: np.ndarray
        self.owner_quota: np.ndarray
        self.owner_sid: np.ndarray
        self.owner_name_len: np.ndarray
        self.owner_name: np.ndarray
        self.undo_len_slot: np.ndarray
        self.undo_len: np.ndarray
        self.undo_closed_slot: np.ndarray
        self.undo_word: np.ndarray
        self.undo_rid_len: np.ndarray
        self.undo_row_slot: np.ndarray
        self.undo_row_pages: np.ndarray
        self.undo_pos: np.ndarray
        self.undo_page: np.ndarray
        self.undo_inserted: np.ndarray
        self.undo_evicted: np.ndarray
        self.host_cached: np.ndarray
        self.host_key: np.ndarray
        self.host_parent: np.ndarray
        self.host_depth: np.ndarray
        self.host_ns: np.ndarray
        self.host_tokens: np.ndarray
        self.host_lru: np.ndarray

    @classmethod
    def create(cls, buffer: Any, layout: ImageLayout) -> CoreImage:
        """A fresh image: zeroed, its header written, no namespace but ``""``."""
        image = cls(buffer, layout)
        image.raw[:] = 0
        image.page_lru[:] = -1
        image.raw[: len(MAGIC)] = np.frombuffer(MAGIC, dtype=np.uint8)
        for i, name in enumerate(_HEADER_INTS):
            image.ints[i] = VERSION if name == "version" else getattr(layout, name)
        image.set("next_owner", 1)
        image.set("writer_pid", os.getpid())
        image.namespace_id("")
        return image

    @classmethod
    def private(cls, layout: ImageLayout) -> CoreImage:
        """A fresh image in memory of its own (a core whose state no one restores)."""
        return cls.create(bytearray(layout.size), layout)

    @classmethod
    def open(cls, buffer: Any, layout: ImageLayout) -> CoreImage:
        """An existing image, checked: the magic, the version and every number of the
        layout; its namespace table is read back."""
        raw = np.frombuffer(buffer, dtype=np.uint8)
        if raw.size < _ALIGN or raw[: len(MAGIC)].tobytes() != MAGIC:
            raise ImageMismatch("not a kvmem state image (no magic at its start)")
        header = raw[_ALIGN : _ALIGN + 8 * len(_HEADER_INTS)]  # the "ints" array comes first
        if header.size < 8 * len(_HEADER_INTS):
            raise ImageMismatch(f"the state image is {raw.size} bytes: not even its header")
        have = dict(zip(_HEADER_INTS, header.view(np.int64).tolist(), strict=True))
        want = {name: VERSION if name == "version" else int(getattr(layout, name)) for name in _HEADER_INTS}
        differs = [
            f"{name} {have[name]} (this server's {want[name]})" for name in _HEADER_INTS if have[name] != want[name]
        ]
        if differs:
            raise ImageMismatch(f"the state image is of another geometry or version: {', '.join(differs)}")
        image = cls(buffer, layout)
        count = image.get("num_namespaces")
        if not 0 < count <= MAX_NAMESPACES:
            raise ImageMismatch(f"the state image's namespace table is corrupt ({count} entries)")
        image.read_namespaces(count)
        return image

    def get(self, name: str) -> int:
        return int(self.ints[_STATE_AT[name]])

    def set(self, name: str, value: int) -> None:
        self.ints[_STATE_AT[name]] = value

    def counter(self, name: str) -> np.ndarray:
        """A one-element view of a header number, for a hot path to write (``[0] = n``)."""
        at = _STATE_AT[name]
        return self.ints[at : at + 1]

    # ------------------------------------------------------------- namespaces

    def namespace_id(self, name: str) -> int:
        """The index of ``name`` in the namespace table, added when new. O(1)."""
        found = self._ns_ids.get(name)
        if found is not None:
            return found
        data = name.encode("utf-8", "surrogatepass")
        n = self.get("num_namespaces")
        if n >= MAX_NAMESPACES or len(data) > NS_BYTES:
            raise ValueError(f"the state image holds {MAX_NAMESPACES} namespaces of up to {NS_BYTES} bytes")
        self.ns_name[n, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.ns_len[n] = len(data)
        self.set("num_namespaces", n + 1)
        self._ns_ids[name] = n
        return n

    def read_namespaces(self, count: int) -> None:
        """Index the table's first ``count`` names (an opened image's)."""
        for i in range(count):
            self._ns_ids[self.namespace_name(i)] = i

    def namespace_name(self, index: int) -> str:
        return self.ns_name[index, : int(self.ns_len[index])].tobytes().decode("utf-8", "surrogatepass")

    # --------------------------------------------------------------- sessions

    def write_session(self, record: int, session_id: str, name: str, quota: int | None) -> None:
        """The session an owner record is: its id, name and quota (None: no quota).
        O(1), at Attach."""
        sid, data = session_id.encode("ascii"), name.encode("utf-8", "surrogatepass")
        if len(sid) > SID_BYTES or len(data) > NAME_BYTES:
            raise ValueError(f"the state image holds session ids of up to {SID_BYTES} bytes, names of {NAME_BYTES}")
        self.owner_sid[record] = 0
        self.owner_sid[record, : len(sid)] = np.frombuffer(sid, dtype=np.uint8)
        self.owner_name[record, : len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.owner_name_len[record] = len(data)
        self.owner_quota[record] = -1 if quota is None else quota

    def session(self, record: int) -> tuple[str, str, int | None]:
        """The session id, name and quota of an owner record ("" when it has none)."""
        sid = self.owner_sid[record].tobytes().rstrip(b"\0").decode("ascii", "replace")
        name = self.owner_name[record, : int(self.owner_name_len[record])].tobytes().decode("utf-8", "surrogatepass")
        quota = int(self.owner_quota[record])
        return sid, name, None if quota < 0 else quota

    # ------------------------------------------------------------ request ids

    def write_request_ids(self, slots: np.ndarray, ids: list[str]) -> None:
        """The UTF-8 of ``ids`` into their slots' entries. O(their bytes), one scatter."""
        data = [rid.encode("utf-8", "surrogatepass") for rid in ids]
        lens = np.fromiter(map(len, data), dtype=np.int16, count=len(data))
        flat = np.frombuffer(b"".join(data), dtype=np.uint8)
        rows = np.repeat(np.asarray(slots, dtype=np.int64), lens)
        cols = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)
        self.rid[rows, cols] = flat
        self.rid_len[slots] = lens

    def request_id(self, slot: int) -> str:
        return self.rid[slot, : int(self.rid_len[slot])].tobytes().decode("utf-8", "surrogatepass")
