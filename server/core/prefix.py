"""The prefix cache's state: page keys, the key index, and the evictable queue.

A page is *cached* while ``cached[page]`` is set; then ``index[key[page]]`` is that
page, and ``parent``, ``tokens``, ``namespace`` and ``depth`` describe it (entries of
pages not cached are stale, never read). It is *evictable* while it is cached and no
request holds it (count 0): then it is in no row, no free stack and no quarantine,
only here.

Eviction is least recently used first, where "used" is the moment a page's last holder
let go. Holders let go of a row's pages together and they are queued chain end first
(:meth:`push_evictable` reverses them), and a match or cache item takes a run from its
first page on, so a cached page's parent is never evicted before it: no cached page
ever has a missing parent, and the audit checks that (a chain is never broken in the
middle, so "a page whose parent is gone" never waits in the queue). Cached pages are
immutable: no request writes into one (the step refuses a truncate into the middle of
one with PAGE_SHARED), so their keys stay true.

The queue is a FIFO array with lazy deletion: a page taken back into use (a match)
only clears its ``lru_seq``; eviction skips entries whose sequence number no longer
matches their page's. Each entry is pushed once and skipped or popped once, so every
operation costs O(pages involved), amortised: the array is compacted (O(entries
queued)) only after at least as many pushes as it holds.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from kvmem.server.core.events import CacheEvent, PagesRemoved, PagesStored
from kvmem.server.core.hashing import PageKeys
from kvmem.server.core.image import CoreImage, row_items
from kvmem.server.core.tier import HostTier
from kvmem.server.core.undo import UndoLog


class PrefixCache:
    """Keys and the evictable queue for pages ``[1, num_pages)``. The pool calls
    :meth:`push_evictable`, :meth:`unevict` and :meth:`evict`; the prefix step
    (:mod:`kvmem.server.core.prefix_step`) :meth:`insert`. Events of the current call collect in ``events``."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        page_keys: PageKeys,
        *,
        enabled: bool = True,
        image: CoreImage | None = None,
    ) -> None:
        self.enabled = enabled
        self._image = image  # each cached page's facts live there too (see .image)
        self.undo: UndoLog | None = None  # a Step's cached and evicted pages (see .undo), set by the core
        self.page_size = page_size
        self.page_keys = page_keys
        self.index: dict[bytes, int] = {}
        self.key = np.full(num_pages, None, dtype=object)  # bytes (of cached pages; else stale)
        self.parent = np.full(num_pages, None, dtype=object)  # the parent key (a root for a first page)
        self.tokens = np.full(num_pages, None, dtype=object)  # int32 token ids (for snapshots)
        self.namespace = np.full(num_pages, None, dtype=object)
        self.depth = np.zeros(num_pages, dtype=np.int32) if image is None else image.page_depth  # column in its chain
        # Cached now; the image's flags (image.page_cached) follow at flush_image(), after the facts.
        self.cached = np.zeros(num_pages, dtype=bool)
        # The facts of the pages this call cached, for the image (flush_image): chunks of
        # pages with their keys, parents and token rows as row items (image.row_items).
        self._img_pages: list[np.ndarray] = []
        self._img_keys: list[np.ndarray] = []
        self._img_parents: list[np.ndarray] = []
        self._img_tokens: list[np.ndarray] = []
        self._img_ns: list[tuple[str, int]] = []  # (namespace, pages) per chunk
        self._img_evictions = 0  # num_evictions when the call's first chunk came
        if image is not None:
            self._img_key_rows = row_items(image.page_key)
            self._img_parent_rows = row_items(image.page_parent)
            self._img_token_rows = row_items(image.page_tokens)
            self.key_item: np.dtype = self._img_key_rows.dtype  # a key's bytes as one item
            self.image_cached = image.page_cached  # the image's flags (set at flush_image)
        self.roots: dict[str, bytes] = {}  # namespace -> the parent key of its chains' first pages
        # The evictable queue: entries [head, tail) of (page, seq); valid while lru_seq[page] == seq.
        cap = 2 * num_pages + 64
        self._q_page = np.zeros(cap, dtype=np.int32)
        self._q_seq = np.zeros(cap, dtype=np.int64)
        self._head = self._tail = 0
        self._seq = 0
        self.lru_seq = np.full(num_pages, -1, dtype=np.int64) if image is None else image.page_lru  # -1: not evictable
        self.num_evictable = 0
        self.num_evictions = 0  # since start
        self.num_inserted = 0
        self.query_tokens = 0  # tokens match items asked for, since start
        self.hit_tokens = 0  # tokens they matched
        self.events: list[CacheEvent] = []
        self.tier: HostTier | None = None  # the host tier evicted pages go to (set by the core)

    def root(self, namespace: str) -> bytes:
        """The chain root of ``namespace`` (computed once per namespace)."""
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = self.page_keys.root(namespace)
        return root

    @property
    def num_entries(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------ insert

    def insert(
        self,
        pages: list[int],
        keys: list[bytes],
        tokens: np.ndarray,
        namespace: str,
        parent: bytes,
        first_col: int = 0,
        pend: bool = True,
    ) -> list[int]:
        """Cache the chain ``pages`` (held by a request, column ``first_col`` on) under
        ``keys`` (computed from ``tokens``, ``page_size`` each, in ``namespace`` from
        ``parent``: the root for column 0, else the key of the page before). A key the
        cache already has on another page is not inserted: the result lists, per page,
        the cached page of its key (its own when inserted or already cached). One
        :class:`PagesStored` per run of new pages. O(pages).

        With a state image, the new pages' facts go to :meth:`pend_image` (written at
        the call's end); with ``pend`` False the caller hands them to it itself (for
        many chains at once)."""
        index, get = self.index, self.index.get
        ps = self.page_size
        out: list[int] = []
        new: list[int] = []  # the columns inserted
        run_start = -1
        prev = parent
        chain_parent = None if first_col == 0 else parent  # the events' parent of the first page
        for col, (page, key) in enumerate(zip(pages, keys, strict=True)):
            have = get(key)
            if have is None:
                index[key] = page
                self.key[page] = key
                self.parent[page] = prev
                self.tokens[page] = tokens[col * ps : (col + 1) * ps].copy()
                self.namespace[page] = namespace
                self.depth[page] = first_col + col
                new.append(col)
                if run_start < 0:
                    run_start = col
                out.append(page)
            else:
                if run_start >= 0:
                    self._stored(keys, tokens, namespace, run_start, col, chain_parent)
                    run_start = -1
                out.append(have)
            prev = key
        if run_start >= 0:
            self._stored(keys, tokens, namespace, run_start, len(keys), chain_parent)
        if new:
            cols = np.array(new, dtype=np.intp)
            where = np.array(pages, dtype=np.intp)[cols]
            self.cached[where] = True
            if pend and self._image is not None:  # into the image at the call's end
                self._pend_chain(where, new, keys, parent, tokens, namespace)
            if self.tier is not None and self.tier.write_through:  # chain end first, as an eviction hands them
                self._to_tier(where[::-1])
        return out

    def _to_tier(self, pages: np.ndarray) -> None:
        """Cached ``pages`` (their facts still here), chain ends first, to the host tier:
        write-back as they are evicted, write-through as they are cached. O(pages) and
        the copies of those the host lacks."""
        assert self.tier is not None
        self.tier.demote(
            pages,
            self.key.take(pages).tolist(),
            self.parent.take(pages).tolist(),
            self.namespace.take(pages).tolist(),
            self.tokens.take(pages).tolist(),
            self.depth.take(pages),
        )
        self.events += self.tier.take_events()  # before a removal from the device that follows

    @property
    def keeps_image(self) -> bool:
        """Whether cached pages' facts go into a state image (:meth:`pend_image`)."""
        return self._image is not None

    def pend_image(
        self, pages: np.ndarray, keys: np.ndarray, parents: np.ndarray, tokens: np.ndarray, namespace: str
    ) -> None:
        """Facts of ``pages`` this call cached, for :meth:`flush_image`: their keys and
        parent keys (items of :attr:`key_item`) and token rows (row items of
        ``page_size`` int32, :func:`~kvmem.server.core.image.row_items`). O(1)."""
        if not self._img_pages:
            self._img_evictions = self.num_evictions
        self._img_pages.append(pages)
        self._img_keys.append(keys)
        self._img_parents.append(parents)
        self._img_tokens.append(tokens)
        self._img_ns.append((namespace, int(pages.size)))

    def _pend_chain(
        self, where: np.ndarray, cols: list[int], keys: list[bytes], parent: bytes, tokens: np.ndarray, namespace: str
    ) -> None:
        """One insert's new pages (``cols`` of its chain, at ``where``) for
        :meth:`pend_image`. O(pages)."""
        ps, kind = self.page_size, self.key_item
        first, last = cols[0], cols[-1]
        if last - first + 1 == len(cols):  # one run of columns (a chain's new end)
            key_list = keys[first : last + 1]
            parent_list = [keys[first - 1] if first else parent, *keys[first:last]]
            rows = tokens[first * ps : (last + 1) * ps]
        else:
            key_list = [keys[c] for c in cols]
            parent_list = [keys[c - 1] if c else parent for c in cols]
            rows = np.concatenate([tokens[c * ps : (c + 1) * ps] for c in cols])
        self.pend_image(
            where,
            np.frombuffer(b"".join(key_list), kind),
            np.frombuffer(b"".join(parent_list), kind),
            row_items(np.ascontiguousarray(rows, dtype=np.int32).reshape(-1, ps)),
            namespace,
        )

    def flush_image(self) -> None:
        """Write the facts of the pages this call cached (:meth:`pend_image`) into the
        image, then their flags: one scatter of whole rows per fact for the whole call.
        A crash before it leaves those pages uncached in the image (in their rows still:
        nothing lost but the cache entries). When the call evicted anything since its
        first insert, a page evicted since is skipped and one cached again after its
        eviction written once, with its last facts (else the pages are distinct and
        all cached). O(pages)."""
        image = self._image
        if image is None or not self._img_pages:
            return
        chunks = self._img_pages, self._img_keys, self._img_parents, self._img_tokens
        ns_runs = self._img_ns
        self._img_pages, self._img_keys, self._img_parents, self._img_tokens, self._img_ns = [], [], [], [], []
        where, keys, parents, rows = (np.concatenate(c) if len(c) > 1 else c[0] for c in chunks)
        ids = {image.namespace_id(name) for name, _ in ns_runs}
        ns: np.ndarray | int = (
            ids.pop()
            if len(ids) == 1
            else np.repeat([image.namespace_id(name) for name, _ in ns_runs], [n for _, n in ns_runs])
        )
        if self.num_evictions != self._img_evictions:  # some may be gone, or cached twice
            last = where.size - 1 - np.unique(where[::-1], return_index=True)[1]  # each page's last entry
            last = last[self.cached.take(where[last])]
            where, keys, parents, rows = where[last], keys[last], parents[last], rows[last]
            if isinstance(ns, np.ndarray):
                ns = ns[last]
            if not where.size:
                return
        self._img_key_rows[where] = keys
        self._img_parent_rows[where] = parents
        self._img_token_rows[where] = rows
        image.page_ns[where] = ns
        if self.undo is not None:
            self.undo.inserted(where.astype(np.int32))
        image.page_cached[where] = True  # the flags last

    def _stored(
        self, keys: list[bytes], tokens: np.ndarray, namespace: str, start: int, end: int, first_parent: bytes | None
    ) -> None:
        ps = self.page_size
        parent = keys[start - 1] if start else first_parent
        self.num_inserted += end - start
        self.events.append(PagesStored(keys[start:end], parent, tokens[start * ps : end * ps].copy(), ps, namespace))

    # ----------------------------------------------------- the evictable queue

    def push_evictable(self, pages: np.ndarray) -> None:
        """Queue cached pages whose last holder let go, listed in chain order (a row's
        pages, first column first): queued reversed, so chain ends go first. O(P)."""
        n = int(pages.size)
        if self._tail + n > self._q_page.size:
            self._compact(n)
        tail = self._tail
        seqs = np.arange(self._seq, self._seq + n, dtype=np.int64)
        self._seq += n
        rev = pages[::-1]
        self._q_page[tail : tail + n] = rev
        self._q_seq[tail : tail + n] = seqs
        self.lru_seq.put(rev, seqs)
        self._tail = tail + n
        self.num_evictable += n

    def unevict(self, pages: np.ndarray) -> None:
        """Evictable pages taken back into use (distinct). Their queue entries go stale. O(P)."""
        self.lru_seq.put(pages, -1)
        self.num_evictable -= int(pages.size)

    def evict(self, n: int) -> np.ndarray:
        """Remove the ``n`` least recently used evictable pages from the cache and
        return them (the pool hands them out). Caller checks ``n <= num_evictable``.
        O(n + stale entries skipped), amortised O(n).

        Evictions ride on an alloc's step, so their fixed cost counts: the common case
        (the queue's first ``n`` entries are all live) is one gather and a byte
        comparison, and forgetting the pages is one gather, the index deletions (in C)
        and one scatter. Evicted pages' queue entries lie behind the head (never read
        again), so their ``lru_seq`` is left as it is."""
        head, q_page, q_seq, lru_seq = self._head, self._q_page, self._q_seq, self.lru_seq
        first = q_page[head : head + n]
        if first.size == n and lru_seq.take(first).tobytes() == q_seq[head : head + n].tobytes():
            self._head = head + n
            pages = first.copy()
        else:
            pages = self._evict_skipping(n)
        self.num_evictable -= n
        self.num_evictions += n
        keys = self.key.take(pages).tolist()
        if self.tier is not None:  # write-back: their K/V to the host before the pages are reused
            self._to_tier(pages)
        deque(map(self.index.__delitem__, keys), maxlen=0)
        self.cached.put(pages, False)  # put: a third of a fancy assignment's fixed cost
        if self._image is not None:  # before an alloc hands the pages out
            if self.undo is not None and self.undo.active:  # those cached before this call
                self.undo.evicted(pages[self._image.page_cached.take(pages)])
            self._image.page_cached.put(pages, False)
        self.events.append(PagesRemoved(keys))
        return pages

    def _evict_skipping(self, n: int) -> np.ndarray:
        """The first ``n`` live entries from the head, skipping stale ones."""
        got: list[np.ndarray] = []
        want = n
        head, q_page, q_seq, lru_seq = self._head, self._q_page, self._q_seq, self.lru_seq
        while want:
            end = min(self._tail, head + max(2 * want, 64))
            if end <= head:
                raise AssertionError(f"evict({n}) with {self.num_evictable} evictable pages: the queue ran dry")
            window = q_page[head:end]
            live = np.flatnonzero(lru_seq[window] == q_seq[head:end])
            if live.size >= want:
                live = live[:want]
                head += int(live[-1]) + 1
            else:
                head = end
            got.append(window[live])
            want -= int(live.size)
        self._head = head
        return np.concatenate(got) if len(got) > 1 else got[0]

    def _compact(self, room: int) -> None:
        """Move the live entries to the front of the queue (growing it when ``room``
        more would not fit). O(entries queued), at most once per that many pushes."""
        head, tail = self._head, self._tail
        pages, seqs = self._q_page[head:tail], self._q_seq[head:tail]
        live = self.lru_seq[pages] == seqs
        pages, seqs = pages[live], seqs[live]
        k = int(pages.size)
        if k + room > self._q_page.size // 2:
            size = 2 * (k + room) + 64
            self._q_page = np.zeros(size, dtype=np.int32)
            self._q_seq = np.zeros(size, dtype=np.int64)
        self._q_page[:k] = pages
        self._q_seq[:k] = seqs
        self._head, self._tail = 0, k

    def queued(self) -> np.ndarray:
        """The evictable pages, least recently used first. O(queue): for the audit and tests."""
        pages = self._q_page[self._head : self._tail]
        return pages[self.lru_seq[pages] == self._q_seq[self._head : self._tail]]

    # ------------------------------------------------------------- restore

    def install(
        self,
        pages: np.ndarray,
        keys: list[bytes],
        parents: list[bytes],
        depth: np.ndarray,
        namespaces: list[str],
        tokens: np.ndarray,
        evictable: np.ndarray,
    ) -> None:
        """A restored cache (:mod:`.restore`): ``pages`` with their facts (checked there:
        whole chains, distinct keys), and the evictable ones among them least recently
        used first. O(pages), once."""
        image = self._image
        for namespace in set(namespaces):
            self.root(namespace)  # the roots the chains start from (the audit reads them)
        for i, page in enumerate(pages.tolist()):
            key = keys[i]
            if image is not None:
                image.page_key[page] = np.frombuffer(key, dtype=np.uint8)
                image.page_parent[page] = np.frombuffer(parents[i], dtype=np.uint8)
                image.page_tokens[page] = tokens[i]
                image.page_ns[page] = image.namespace_id(namespaces[i])
            self.index[key] = page
            self.key[page], self.parent[page], self.namespace[page] = key, parents[i], namespaces[i]
            self.tokens[page] = tokens[i].copy()
        self.depth[pages] = depth
        self.cached[pages] = True
        if image is not None:
            image.page_cached[pages] = True
        if evictable.size:
            self.push_evictable(evictable[::-1])  # queued reversed: least recently used first

    # ------------------------------------------------------------ snapshot

    def snapshot(self) -> list[CacheEvent]:
        """A :class:`PagesStored` for every cached page, parents before children.
        O(cache size log): for a watcher's resync only."""
        pages = np.flatnonzero(self.cached)
        pages = pages[np.argsort(self.depth[pages], kind="stable")]
        ps = self.page_size
        out: list[CacheEvent] = []
        for p in pages.tolist():
            parent = None if self.depth[p] == 0 else self.parent[p]
            out.append(PagesStored([self.key[p]], parent, self.tokens[p], ps, self.namespace[p]))
        return out
