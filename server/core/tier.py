"""The host-memory tier: cached pages the device pool evicted, kept in host memory under
the same keys, and loaded back into device pages when a match reaches them.

One index over both tiers: a cached page's key is in the device cache's index
(:class:`~kvmem.server.core.prefix.PrefixCache`, the page on the device), in this
tier's (:attr:`HostTier.index`, the page in host memory), or in both (a page loaded
back keeps its host copy until the host evicts it). The server moves the bytes
(:class:`PageMover`); clients never see the host tier's pages.

**Write-back.** A cached page goes to the host as the device pool evicts it: the
device cache hands the evicted pages to :meth:`HostTier.demote` before an alloc takes
them, which copies each one whose key the host does not hold yet (one the host holds is
only touched). The copy is made within the evicting call, before anyone can write into
the page again (the pages go to the allocating request, whose writes come after the
Step's answer): an eviction never waits for anything but its own copy, and never loses
a page silently (one the host cannot take, when a batch is bigger than the host's room,
is counted in :attr:`HostTier.num_dropped` and reported as removed).

**Least recently used first, chains whole.** The host evicts the page whose last use is
oldest: its demotion, or its last load or touch. The device evicts a chain's end before
its parent (see :mod:`.prefix`) and demotes in that order; a load touches a run from its
end to its first page; so a page's parent on the host is used more recently than the
page, and the host evicts children first. Of an evicted batch, the host keeps a page
only with its parent (decided parents first); a page whose parent leaves both tiers
anyway (a batch bigger than the room) goes with it, descendants included. A chain is
never broken in the middle on either tier: the audit checks that every cached page's
parent is a root or cached on one of the tiers.

**Loads.** A match whose chain continues past the device's pages in this tier
(:meth:`HostTier.run`) gets device pages for them in the same call (charged to the
requester as any alloc; the match is shortened to the pages the pool and the quota can
give), and the pages are cached on the device too; the bytes are copied in by the
mover's copy thread (:meth:`HostTier.load`), layer by layer, after the call returns:
the answer says how many of the match's tokens are still loading, and a reader waits
on the load counters. The host pages of a load are pinned from the moment the match
finds them until their copy has finished (:meth:`HostTier.finished`): a page is never
evicted, nor its host page reused, from under its own load; the device pages hold one
reference of the load's own until then, so a request released while its pages load
frees them only when the copy ends.

Costs: O(pages moved) per call, plus the bytes copied; nothing proportional to either
tier's size but :meth:`HostTier.audit`.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from kvmem.server.core.events import CacheEvent, PagesRemoved, PagesStored
from kvmem.server.core.image import CoreImage, row_items

# The events' medium (vLLM's BlockStored / BlockRemoved ``medium``): where the page is.
DEVICE, HOST = "GPU", "CPU"


class PageMover(Protocol):
    """Copies whole pages (all layers, all ranks) between the device pool and the host
    tier (:class:`kvmem.server.memory.host.HostPages`): a demotion within the call, a
    load on a copy thread, layer by layer, its progress in ``counters`` (per device
    page: layers copied; ``num_layers`` when not loading), its token put in
    ``finished`` at its end."""

    num_layers: int
    counters: np.ndarray
    finished: collections.deque[Any]

    def to_host(self, device_pages: np.ndarray, host_pages: np.ndarray) -> None: ...

    def start_load(self, host_pages: np.ndarray, device_pages: np.ndarray, token: Any) -> None: ...

    def copy_now(self, host_pages: np.ndarray, device_pages: np.ndarray) -> None: ...

    def load_stats(self) -> tuple[float, float, float]: ...


class HostTier:
    """Host pages ``[0, num_pages)`` with the device pool's geometry: a free list, a key
    index, each cached page's facts (key, parent key, namespace, tokens, column in its
    chain) and an LRU order over the cached pages not pinned by a load in progress."""

    def __init__(
        self, num_pages: int, page_size: int, mover: PageMover, min_load_pages: int = 1, write_through: bool = False
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"a host tier needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        # write-through: pages go to the host as they are cached (PrefixCache.insert), so an
        # eviction only touches them; write-back (the default): as the pool evicts them.
        self.write_through = write_through
        self.min_load_pages = max(1, min_load_pages)  # a shorter load is not made: its tokens are computed
        self.page_size = page_size
        self.mover = mover
        self.index: dict[bytes, int] = {}
        self.key = np.full(num_pages, None, dtype=object)
        self.parent = np.full(num_pages, None, dtype=object)  # the parent key (a root for a first page)
        self.namespace = np.full(num_pages, None, dtype=object)
        self.tokens = np.full(num_pages, None, dtype=object)
        self.depth = np.zeros(num_pages, dtype=np.int32)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # the top is the end: 0, 1, 2... first
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._pinned: dict[int, int] = {}  # page -> the loads (and calls) that pin it
        # Loads in copy: their host pages (pinned), device pages, and the pages the load holds
        # a reference on (its device pages and the chain before them in the row).
        self.loading: dict[int, tuple[list[int], np.ndarray, np.ndarray]] = {}
        self.num_loading_pages = 0
        self._next_load = 0
        # The state image (kvmem serve --keep-state) the tier keeps its facts in; None: none.
        self.image: CoreImage | None = None
        self._seq = 0  # the LRU order's clock, kept in the image
        self.events: list[CacheEvent] = []  # since the device cache last took them (take_events)
        # Since start.
        self.num_demoted = 0  # pages copied to the host
        self.num_loaded = 0  # pages copied back to the device
        self.num_evicted = 0  # host pages evicted to make room
        self.num_dropped = 0  # evicted device pages the host could not take in their call
        self.hit_tokens = 0  # tokens matches took from the host
        # The cluster tier (kvmem serve --store; kvmem.server.store.link.StoreLink): host pages
        # reserved for values being read from the store.
        self.link: Any = None
        self.fetching: set[int] = set()
        # Per host page, how often it was freed: the store's thread copies a page out and
        # keeps the copy only if this did not change meanwhile (the page was not reused).
        self.generation = np.zeros(num_pages, dtype=np.int64)
        self.num_fetched = 0  # pages the store gave (read, checked, installed)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.index)

    def take_events(self) -> list[CacheEvent]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------ demotion

    def demote(
        self,
        device_pages: np.ndarray,
        keys: list[bytes],
        parents: list[bytes],
        namespaces: list[str],
        tokens: list[np.ndarray],
        depths: np.ndarray,
    ) -> None:
        """The device evicts ``device_pages`` (cached under ``keys``, least recently used
        first: a chain's end before its parent), whose K/V is still in them: copy those
        the host lacks into host pages, touch those it has.

        Which pages of the batch the host keeps is decided parents first: a page is kept
        when its parent stays on the device (not in the batch; a chain's first page's
        parent is its root) or is kept, while the host has room (every page but those a
        load pinned). A page of the batch the host had but does not keep is evicted from
        it; one it lacked and does not keep is dropped (counted). So no page is kept
        without its parent: a chain never breaks. O(pages)."""
        index, lru, pinned = self.index, self._lru, self._pinned
        n = len(keys)
        in_batch = set(keys)
        kept: set[bytes] = set()
        keep = [False] * n
        budget = self.num_pages - len(pinned) - len(self.fetching)
        for i in range(n - 1, -1, -1):
            key = keys[i]
            have = index.get(key)
            if have is not None and have in pinned:  # a load's: it stays as the load left it
                kept.add(key)
                continue
            if budget > 0 and (parents[i] not in in_batch or parents[i] in kept):
                keep[i] = True
                kept.add(key)
                budget -= 1
        gone: list[bytes] = []
        lost: set[bytes] = set()  # keys of the batch on neither tier after this call
        new: list[int] = []
        held: list[int] = []  # kept pages the host has: out of the LRU order while it makes room
        for i, key in enumerate(keys):
            have = index.get(key)
            if have is None:
                if keep[i]:
                    new.append(i)
                else:
                    self.num_dropped += 1
                    lost.add(key)
            elif have not in pinned:
                del lru[have]
                if keep[i]:
                    pinned[have] = 1
                    held.append(have)
                else:
                    del index[key]
                    self._release(have)
                    gone.append(key)
                    lost.add(key)
        if lost:
            gone += self._orphans(lost)
        if gone:
            self.num_evicted += len(gone)
            self.events.append(PagesRemoved(gone, HOST))
        host: list[int] = []
        if new:
            self._make_room(len(new))
            host = [self._free.pop() for _ in new]
            picked = np.array(new, dtype=np.intp)
            self.mover.to_host(device_pages[picked], np.array(host, dtype=np.int64))
        placed = dict(zip(new, host, strict=True))
        image = self.image
        if new and image is not None:  # the facts after the bytes, the flags last
            if image.page_cached.take(device_pages[picked]).all():  # the pool's facts, in the image already
                self._copy_facts(np.array(host, dtype=np.intp), device_pages[picked])
            else:  # some were cached in this very call (their facts reach the image at its end)
                self._write_facts(host, [keys[i] for i in new], [parents[i] for i in new],
                                  [namespaces[i] for i in new], [tokens[i] for i in new], depths[picked])  # fmt: skip
        held_set = set(held)
        used: list[int] = []  # in the LRU order's new order, written to the image at once
        for i, key in enumerate(keys):  # in the batch's order: a chain's end first, its parents after
            page = placed.get(i)
            if page is None:
                have = index.get(key)
                if have is not None and have in held_set:
                    del pinned[have]
                    lru[have] = None
                    used.append(have)
                continue
            index[key] = page
            self.key[page] = key
            self.parent[page] = parents[i]
            self.namespace[page] = namespaces[i]
            self.tokens[page] = tokens[i]
            self.depth[page] = depths[i]
            lru[page] = None
            used.append(page)
            parent = None if depths[i] == 0 else parents[i]
            self.events.append(PagesStored([key], parent, tokens[i], self.page_size, namespaces[i], HOST))
        if image is not None and used:
            image.host_lru[used] = np.arange(self._seq + 1, self._seq + 1 + len(used))
            self._seq += len(used)
        self.num_demoted += len(new)
        if host and self.link is not None:  # to the store, copied out of the host page by its thread
            # parents first: a bounded queue that drops keeps chains' first pages (a chain is read from its start)
            order = sorted(range(len(new)), key=lambda j: int(depths[new[j]]))
            self._offer([host[j] for j in order], [keys[new[j]] for j in order])

    # ------------------------------------------------------------ the store (--store)

    def _offer(self, host: list[int], keys: list[bytes]) -> None:
        """New host pages to the store's thread, which copies each out unless it was
        freed meanwhile (:attr:`generation`): nothing is pinned, so the LRU order and its
        chains stay as they are."""
        self.link.offer(host, keys, self.generation)

    def store_results(self, device_index: dict[bytes, int]) -> bool:
        """What the store's thread handed back since the last call: pages written
        (counted off the write bound), fetches the store has pages for (host pages reserved, sent to be
        read), fetches read and checked (their valid pages installed: a chain's first
        pages, while the page before them is cached on a tier). Whether anything
        changed. O(pages)."""
        results = self.link.results
        changed = False
        while results:
            kind, item = results.popleft()
            if kind == "written":
                self.link.writing -= len(item)
            elif kind == "found":
                self._reserve(item)
                changed = True
            else:  # "fetched"
                self._install(item, device_index)
                changed = True
        return changed

    def _reserve(self, fetch: Any) -> None:
        """Host pages for the first ``fetch.found`` pages of a fetch (the least recently
        used evicted for them; none pinned), then the thread reads them. O(pages)."""
        n = min(fetch.found, len(self._free) + len(self._lru))
        if n < fetch.found:
            self.link.counters.no_room += fetch.found - n
        if n:
            self._make_room(n)
            fetch.host = [self._free.pop() for _ in range(n)]
            self.fetching.update(fetch.host)
        self.link.reserved(fetch)

    def _install(self, fetch: Any, device_index: dict[bytes, int]) -> None:
        """A fetch's pages read and checked: the first ``fetch.valid`` cached under their
        keys (one the tiers hold already is left as it is; none when the page before
        them has left both tiers meanwhile: a chain never breaks), the rest freed."""
        host = fetch.host
        self.fetching.difference_update(host)
        ok = fetch.valid
        if fetch.depth and fetch.parent not in self.index and fetch.parent not in device_index:
            ok = 0
        ps = self.page_size
        placed: list[int] = []
        keys: list[bytes] = []
        parent = fetch.parent
        for j in range(ok):
            key = fetch.keys[j]
            if key in self.index or key in device_index:
                parent = key
                continue
            page = host[j]
            self.index[key] = page
            self.key[page] = key
            self.parent[page] = parent
            self.namespace[page] = fetch.namespace
            self.tokens[page] = np.ascontiguousarray(fetch.tokens[j * ps : (j + 1) * ps], dtype=np.int32)
            self.depth[page] = fetch.depth + j
            placed.append(page)
            keys.append(key)
            first_parent = None if fetch.depth + j == 0 else parent
            self.events.append(PagesStored([key], first_parent, self.tokens[page], ps, fetch.namespace, HOST))
            parent = key
        for page in reversed(placed):  # the run's end first: a parent stays more recent than its child
            self._used(page)
        if placed and self.image is not None:
            self._write_facts(placed, keys, [self.parent[p] for p in placed], [fetch.namespace] * len(placed),
                              [self.tokens[p] for p in placed], self.depth[placed])  # fmt: skip
        self.num_fetched += len(placed)
        taken = set(placed)
        for page in host:
            if page not in taken:
                self._release(page)
        self.link.landed(fetch)

    def _used(self, page: int) -> None:
        """``page`` is the most recently used (the LRU order's end; the image's clock)."""
        self._lru[page] = None
        if self.image is not None:
            self._seq += 1
            self.image.host_lru[page] = self._seq

    def _release(self, page: int) -> None:
        """``page`` is free (its image flag cleared before anyone can reuse it)."""
        if self.image is not None:
            self.image.host_cached[page] = False
        self.generation[page] += 1
        self._free.append(page)

    def _write_facts(
        self,
        pages: list[int],
        keys: list[bytes],
        parents: list[bytes],
        namespaces: list[str],
        tokens: list[np.ndarray],
        depths: np.ndarray,
    ) -> None:
        """New host pages (their bytes copied) into the image: one scatter per fact,
        then the flags. O(pages)."""
        image = self.image
        assert image is not None
        at = np.array(pages, dtype=np.intp)
        width = image.layout.key_bytes
        image.host_key[at] = np.frombuffer(b"".join(keys), np.uint8).reshape(-1, width)
        image.host_parent[at] = np.frombuffer(b"".join(parents), np.uint8).reshape(-1, width)
        image.host_depth[at] = depths
        image.host_ns[at] = [image.namespace_id(ns) for ns in namespaces]
        image.host_tokens[at] = np.stack(tokens)
        image.host_cached[at] = True

    def _copy_facts(self, host: np.ndarray, device: np.ndarray) -> None:
        """New host pages' facts from their device pages' in the image (written there
        when they were cached, not yet cleared by their eviction): a gather and a
        scatter per fact, then the flags. O(pages)."""
        image = self.image
        assert image is not None
        for to, source in self._row_items:  # whole rows at a time (see image.row_items)
            to[host] = source[device]
        image.host_depth[host] = image.page_depth[device]
        image.host_ns[host] = image.page_ns[device]
        image.host_cached[host] = True

    def attach_image(self, image: CoreImage) -> None:
        """Keep the tier's facts in ``image`` from now on (a fresh one, or a restored
        one once :meth:`install` filled it)."""
        if image.layout.host_pages != self.num_pages:
            raise ValueError(
                f"the state image holds {image.layout.host_pages} host pages, this host tier has {self.num_pages}"
            )
        self.image = image
        # the host's rows of keys, parents and tokens and the pool's, as row items (_copy_facts)
        self._row_items = [
            (row_items(getattr(image, f"host_{name}")), row_items(getattr(image, f"page_{name}")))
            for name in ("key", "parent", "tokens")
        ]

    def install(
        self,
        pages: np.ndarray,
        keys: list[bytes],
        parents: list[bytes],
        namespaces: list[str],
        tokens: np.ndarray,
        depths: np.ndarray,
    ) -> None:
        """A restored tier (:mod:`.restore`): host ``pages`` (least recently used first)
        cached under ``keys`` with their facts, their chains checked already; every
        other page free. Written into the image too. O(host pages), once."""
        for page, key, parent, ns, toks, depth in zip(
            pages.tolist(), keys, parents, namespaces, tokens, depths.tolist(), strict=True
        ):
            self.index[key] = page
            self.key[page] = key
            self.parent[page] = parent
            self.namespace[page] = ns
            self.tokens[page] = toks.copy()
            self.depth[page] = depth
        taken = set(pages.tolist())
        self._free = [p for p in range(self.num_pages - 1, -1, -1) if p not in taken]
        if self.image is not None and pages.size:
            self._write_facts(pages.tolist(), keys, parents, namespaces, list(tokens), depths)
        for page in pages.tolist():
            self._used(page)

    def _orphans(self, lost: set[bytes]) -> list[bytes]:
        """Evict the host pages whose chain goes through a key in ``lost`` (and their
        descendants): rare (a batch bigger than the room, every page pinned), so a pass
        over the host's index per generation. Returns their keys."""
        gone: list[bytes] = []
        while lost:
            orphans = [
                (key, page)
                for key, page in self.index.items()
                if self.parent[page] in lost and page not in self._pinned
            ]
            lost = set()
            for key, page in orphans:
                del self.index[key]
                self._lru.pop(page, None)
                self._release(page)
                gone.append(key)
                lost.add(key)
        return gone

    def _make_room(self, n: int) -> None:
        """Evict the least recently used unpinned pages until ``n`` are free."""
        short = n - len(self._free)
        if short <= 0:
            return
        lru, index = self._lru, self.index
        pages = [lru.popitem(last=False)[0] for _ in range(short)]
        at = np.array(pages, dtype=np.intp)
        gone: list[bytes] = self.key.take(at).tolist()
        for key in gone:
            del index[key]
        if self.image is not None:  # their flags cleared before anyone can reuse them: one scatter
            self.image.host_cached[at] = False
        self.generation[at] += 1
        self._free += pages
        self.num_evicted += short
        self.events.append(PagesRemoved(gone, HOST))

    # ------------------------------------------------------------ loads

    def run(self, keys: Iterable[bytes]) -> tuple[list[bytes], list[int]]:
        """The longest prefix of ``keys`` this tier holds, and its host pages (``keys``
        is read no further than the first key it lacks). O(run)."""
        found: list[bytes] = []
        pages: list[int] = []
        get = self.index.get
        for key in keys:
            page = get(key)
            if page is None:
                break
            found.append(key)
            pages.append(page)
        return found, pages

    def pin(self, pages: list[int]) -> None:
        """Keep ``pages`` from eviction until as many :meth:`unpin` calls (a page two
        matches load is pinned twice; a load's pages stay pinned until its copy ends,
        :meth:`finished`). O(pages)."""
        for page in pages:
            self._lru.pop(page, None)
            self._pinned[page] = self._pinned.get(page, 0) + 1

    def unpin(self, pages: list[int]) -> None:
        """Drop one pin of each of ``pages``; those left unpinned go back in the LRU
        order, end first (a parent stays more recent than its child). O(pages)."""
        for page in reversed(pages):
            count = self._pinned.get(page)
            if count == 1:
                del self._pinned[page]
                self._used(page)
            elif count is not None:
                self._pinned[page] = count - 1

    def load(self, host_pages: list[int], device_pages: np.ndarray, held: np.ndarray) -> None:
        """Have pinned ``host_pages`` (one chain's run, first page first) copied into
        ``device_pages`` on the copy thread; they stay pinned until :meth:`finished`
        hands the load back. The caller holds a reference on ``held`` until then: the
        device pages and every page of the chain before them (a parent is never
        evicted from under a child the load holds). O(pages)."""
        if not host_pages:
            return
        n = len(host_pages)
        token = self._next_load
        self._next_load += 1
        self.loading[token] = (host_pages, device_pages, held)
        self.num_loading_pages += n
        self.num_loaded += n
        self.hit_tokens += n * self.page_size
        self.mover.start_load(np.array(host_pages, dtype=np.int64), device_pages, token)

    def finished(self) -> list[np.ndarray]:
        """The loads the copy thread has finished since the last call: their host pages
        are used now (back in the LRU order as the most recent, the run's first page
        last, so a parent stays more recent than its child); returns the pages each
        one held, whose load reference the caller drops. O(pages)."""
        done = self.mover.finished
        out: list[np.ndarray] = []
        while done:
            host, _, held = self.loading.pop(done.popleft())
            self.num_loading_pages -= len(host)
            self.unpin(host)
            out.append(held)
        return out

    def loading_device_pages(self) -> np.ndarray:
        """The pages the loads in copy hold a reference on (one each, per load). O(pages)."""
        if not self.loading:
            return np.zeros(0, dtype=np.int32)
        return np.concatenate([held for _, _, held in self.loading.values()]).astype(np.int32)

    def snapshot(self) -> list[CacheEvent]:
        """A ``PagesStored`` (medium "CPU") per cached host page, parents before
        children. O(pages log pages): for a watcher's resync only."""
        pages = sorted(self.index.values(), key=lambda p: int(self.depth[p]))
        return [
            PagesStored(
                [self.key[p]],
                None if self.depth[p] == 0 else self.parent[p],
                self.tokens[p],
                self.page_size,
                self.namespace[p],
                HOST,
            )
            for p in pages
        ]

    # ------------------------------------------------------------ audit

    def audit(self, device_index: dict[bytes, int], roots: set[bytes]) -> list[str]:
        """Every host page accounted for (free + cached, a cached one either in the LRU
        order or in copy, none twice), the index and the facts agreeing, and every
        cached host page's parent a root or cached on a tier. O(host pages)."""
        problems: list[str] = []
        free = set(self._free)
        cached = set(self.index.values())
        lru = set(self._lru)
        if len(free) != len(self._free):
            problems.append("host tier: a page is twice on the free list")
        if free & cached:
            problems.append(f"host tier: pages both free and cached: {sorted(free & cached)[:8]}")
        pinned = set(self._pinned)
        if lru | pinned != cached or lru & pinned:
            problems.append("host tier: the LRU order and the pinned pages do not cover the cached pages once each")
        in_copy = [h for host, _, _ in self.loading.values() for h in host]
        if len(in_copy) != self.num_loading_pages or self._pinned != collections.Counter(in_copy):
            problems.append(
                f"host tier: {len(in_copy)} pages in copy ({self.num_loading_pages} by the count), "
                f"{len(self._pinned)} pinned (between calls, exactly the pages in copy are)"
            )
        fetching = self.fetching
        if fetching & (free | cached):
            problems.append(f"host tier: pages reserved for the store also free or cached: {sorted(fetching)[:8]}")
        if len(free) + len(cached) + len(fetching) != self.num_pages:
            problems.append(
                f"host tier: {len(free)} free + {len(cached)} cached + {len(fetching)} being read from the store "
                f"!= {self.num_pages} pages (some are lost)"
            )
        for key, page in self.index.items():
            if self.key[page] != key:
                problems.append(f"host tier: page {page} is indexed under a key it does not carry")
                break
            parent = self.parent[page]
            if self.depth[page] and parent not in self.index and parent not in device_index:
                problems.append(f"host tier: page {page}'s parent is cached on neither tier (a broken chain)")
                break
            if not self.depth[page] and parent not in roots:
                problems.append(f"host tier: page {page} starts a chain from an unknown root")
                break
        return problems
