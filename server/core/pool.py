"""The page pool: page ids ``[1, num_pages)``, a reference count each, a free stack."""

from __future__ import annotations

import numpy as np

from kvmem.server.core.image import CoreImage
from kvmem.server.core.prefix import PrefixCache
from kvmem.server.core.words import StampedWords
from kvmem.server.errors import CorruptionError


class PagePool:
    """Page ids ``[1, num_pages)`` with a reference count each and a free stack.

    Invariants (only this class changes ``ref_cnt``, ``_free``, ``_num_free`` and
    ``num_quarantined``): a page whose ``ref_cnt`` is 0 is either in ``_free[:_num_free]``
    or held in exactly one quarantine (a list of arrays its caller keeps, counted in
    ``num_quarantined``), never both; page 0 is in neither and its ``ref_cnt`` stays 0.
    The stack is a preallocated array, so a take or a give back of ``P`` pages costs
    O(P), whatever the pool's size.

    With a prefix cache (``cache``), a cached page whose count reaches 0 is neither
    free nor quarantined: it waits in the cache's evictable queue, and :meth:`take`
    evicts from there when the free stack is short (:attr:`num_available` counts both).

    Each page has one :class:`~kvmem.server.core.words.StampedWords` word: the
    reference count is its value (``ref_cnt``), and :meth:`unref` uses the stamp to
    find pages listed twice, so a free check reads count and stamp with one gather.
    """

    def __init__(self, num_pages: int, image: CoreImage | None = None) -> None:
        self.num_pages = num_pages
        self._words = StampedWords(num_pages, 1 << 16)
        self.ref_cnt = self._words.value
        self._image = image  # the free stack and the quarantines' pages live there (see .image)
        # Descending, so the first pages handed out are 1, 2, 3, ... (readable in tests).
        self._free = np.arange(num_pages - 1, 0, -1, dtype=np.int32) if image is None else image.free_pages
        self._image_free: np.ndarray | None = None  # the image's count of free pages (a view)
        if image is not None:
            self._free[: num_pages - 1] = np.arange(num_pages - 1, 0, -1, dtype=np.int32)
            self._image_free = image.counter("num_free_pages")
            self._image_free[0] = num_pages - 1
        self._num_free = num_pages - 1
        self.num_quarantined = 0
        self.cache: PrefixCache | None = None  # set by the core when the prefix cache is on
        # The words of pages held once and stamped 0, 1, 2, ...
        self._expect_once = StampedWords.expected(1, self._words.order_size)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_available(self) -> int:
        """Pages an alloc may take: free ones and evictable cached ones."""
        cache = self.cache
        return self._num_free if cache is None else self._num_free + cache.num_evictable

    def free_pages(self) -> np.ndarray:
        """The free stack (a view; the top is the end). For the audit and tests."""
        return self._free[: self._num_free]

    def take(self, num: int) -> np.ndarray:
        """Pop ``num`` free pages and set their count to 1, evicting cached pages first
        when the free stack is short. O(num). Caller checks :attr:`num_available`."""
        top = self._num_free
        if num > top:
            return self._take_evicting(num)
        pages = self._free[top - num : top][::-1].copy()
        self._num_free = top - num
        if self._image_free is not None:
            self._image_free[0] = top - num
        self._words.word[pages] = 1  # count 1, stamp cleared
        return pages

    def _take_evicting(self, num: int) -> np.ndarray:
        """:meth:`take` when the free stack is short: all of it, then pages evicted
        from the cache, least recently used first (straight into use: no push)."""
        top = self._num_free
        if self.cache is None or num > top + self.cache.num_evictable:
            raise CorruptionError(f"take({num}) with only {self.num_available} free or evictable pages")
        evicted = self.cache.evict(num - top)
        pages = np.concatenate((self._free[:top][::-1], evicted)) if top else evicted
        self._num_free = 0
        if self._image_free is not None:
            self._image_free[0] = 0
        self._words.word.put(pages, 1)
        return pages

    def unref(self, pages: np.ndarray, hold: list[np.ndarray] | None = None) -> int:
        """Drop one reference from each entry of ``pages`` (a page may appear several
        times); pages whose count reaches 0 go back to the free stack, or into ``hold``
        (a quarantine: they are reused only once :meth:`release_held` gives them back). A page that is
        already free, page 0, or a page listed more often than it is referenced is a
        double free: nothing changes and :class:`CorruptionError` is raised. Returns the
        number of pages freed.

        Cost O(P), three passes over the pages (the stamped-word check: scatter the
        positions, gather the words, compare with ``position << 32 | 1``) proving every
        page held once and listed once; then one scatter frees them. Shared pages
        (counts above 1) take a second look at the counts; pages listed more than once
        are counted with a sort, O(P log P).
        """
        n = pages.size
        if n == 0:
            return 0
        idx = self._indices(pages)
        words = self._words
        order = words.positions(n)
        expect = self._expect_once if n <= words.order_size else StampedWords.expected(1, n)
        try:
            words.stamp_positions(idx, order)  # scratch: changes no count
        except IndexError:
            raise self._out_of_range(pages) from None
        word = words.word
        got = word.take(idx)  # a shade cheaper than word[idx]
        if expect.startswith(got):  # type: ignore[arg-type]  # numpy's stubs omit the buffer protocol
            word[idx] = 0
            return self._push(pages, hold)
        counts, stamps = StampedWords.split(got)
        if np.count_nonzero(counts < 1):
            bad = pages[counts < 1].tolist()[:16]
            raise CorruptionError(f"double free of page(s) {bad}", pages=bad)
        if np.count_nonzero(stamps != order):
            return self._unref_repeated(pages, hold)  # some page listed more than once
        counts = counts - 1
        word[idx] = counts  # new counts, stamps cleared
        return self._push(pages[counts == 0], hold)

    def _indices(self, pages: np.ndarray) -> np.ndarray:
        """intp indices (numpy would convert int32 ones on every use). int32 ids (a
        block table's) go through uint32: a negative id becomes one past the pool and
        fails the stamp scatter; page 0 has count 0, so it reads as a double free. No
        pass of its own for either check."""
        if pages.dtype == np.int32:
            return pages.view(np.uint32).astype(np.intp)
        wide = np.asarray(pages, dtype=np.int64)
        if int(wide.min()) < 0 or int(wide.max()) >= self.num_pages:
            raise self._out_of_range(wide)
        return wide.astype(np.intp)

    def _out_of_range(self, pages: np.ndarray) -> CorruptionError:
        bad = pages[(pages < 0) | (pages >= self.num_pages)].tolist()[:16]
        return CorruptionError(f"unref of page ids outside [1, {self.num_pages}): {bad}", pages=bad)

    def _unref_repeated(self, pages: np.ndarray, hold: list[np.ndarray] | None) -> int:
        """:meth:`unref` of a list with repeated pages (nothing changed yet). O(P log P).
        The pages freed keep the order of their first appearance: rows listed one after
        another name a page's parent before the page (one column earlier in every row
        that holds it), and the cache's evictable queue relies on that order."""
        pages, first, times = np.unique(pages, return_index=True, return_counts=True)
        idx = pages.astype(np.intp)
        counts = self.ref_cnt[idx]
        short = counts < times
        if np.count_nonzero(short):
            bad = pages[short].tolist()[:16]
            raise CorruptionError(f"double free of page(s) {bad}", pages=bad)
        counts -= times
        self._words.word[idx] = counts
        freed = counts == 0
        return self._push(pages[freed][np.argsort(first[freed], kind="stable")], hold)

    def share(self, pages: np.ndarray) -> None:
        """One more reference to each of ``pages`` (cached pages a match or a cache
        item attaches; repeats allowed). Evictable ones leave the cache's queue. O(P)."""
        if not pages.size:
            return
        idx = pages.astype(np.intp)
        ref = self.ref_cnt
        if self.cache is not None:
            idle = np.unique(idx[ref[idx] == 0])
            if idle.size:
                self.cache.unevict(idle)
        np.add.at(ref, idx, 1)

    def _push(self, freed: np.ndarray, hold: list[np.ndarray] | None = None) -> int:
        """Pages whose count reached 0: cached ones to the cache's evictable queue (in
        the order given: chain order), the others to ``hold`` or the free stack."""
        cache = self.cache
        if cache is not None and cache.num_entries and freed.size:
            is_cached = cache.cached[freed]
            if np.count_nonzero(is_cached):
                cache.push_evictable(freed[is_cached])
                freed = freed[~is_cached]
        if hold is not None:
            hold.append(np.array(freed, dtype=np.int32))  # a copy: the caller's array may be a view
            self.num_quarantined += int(freed.size)
            return int(freed.size)
        top = self._num_free
        self._free[top : top + freed.size] = freed
        self._num_free = top + freed.size
        if self._image_free is not None:
            self._image_free[0] = self._num_free
        return int(freed.size)

    def release_held(self, hold: list[np.ndarray]) -> int:
        """Give the pages of a quarantine back to the free stack. O(pages held)."""
        freed = 0
        for pages in hold:
            self.num_quarantined -= int(pages.size)
            if self._image is not None:
                self._image.page_held_by[pages] = 0
            freed += self._push(pages)
        hold.clear()
        return freed

    def mark_held(self, owner: int, hold: list[np.ndarray]) -> None:
        """Record in the image whose quarantine holds the pages of ``hold``. O(pages)."""
        if self._image is not None:
            for pages in hold:
                self._image.page_held_by[pages] = owner

    def install(self, ref_cnt: np.ndarray, free: np.ndarray, held: int) -> None:
        """A restored state (:mod:`.restore`): the reference counts, the free stack (in
        stack order, the top last) and how many pages quarantines hold. O(pool), once."""
        self._words.word[:] = ref_cnt.astype(np.int64)
        self._free[: free.size] = free
        self._num_free = int(free.size)
        self.num_quarantined = held
        if self._image_free is not None:
            self._image_free[0] = self._num_free
