"""The server's link to its store (``kvmem serve --store URL``): one thread that makes
every store call, so neither the event loop nor a Step ever waits for the store.

The core's host tier (on the event loop's thread) talks to it through two queues:

* **to the thread** (:meth:`StoreLink.events`, :meth:`StoreLink.offer`,
  :meth:`StoreLink.want`, :meth:`StoreLink.reserved`): the cache's events (from them the
  thread keeps each cached page's store digest: :mod:`kvmem.server.store.value`, a
  SHA-256 chain over the tokens, whatever the local prefix hash), host pages to write,
  matches whose prefix continues past what the node holds, and the host pages the tier
  reserved for a fetch;
* **back** (:attr:`StoreLink.results`, then :attr:`StoreLink.notify` wakes the loop):
  pages written (counted off the write bound), fetches that found pages in the store (the tier
  reserves host pages for them), and fetches read and checked (the tier installs the
  valid pages into its index, a chain's pages in order, and frees the rest).

**Write path.** A page the host tier takes (write-through with a store: as it is cached)
is offered, parents first; past the bound of pages waiting, an offer is dropped and
counted: the Step never waits. Nothing is pinned: the thread copies each page out of
the host tier into a staging buffer and keeps the copy only if the tier did not free
the page meanwhile (its generation: a page freed may be reused), then writes the run in
one batch (from registered memory with no further copy where the store reads it).

**Read path.** A match whose pages end on this node before its prompt's last full page
asks for the continuation (:meth:`StoreLink.want`): the thread asks the store which of
those keys it has (one batch), the tier reserves host pages for the run it has from the
first, the thread reads the values into them (and the headers beside), checks each
(``value.Codec.check``), and hands back how many of the run's first pages are valid. A
value that fails is a miss (counted by reason, logged once per reason), never loaded.

**Faults.** A store call that fails (down, slow past ``--store-timeout-ms``, refused)
marks the store unreachable: writes are dropped and counted, fetches find nothing, and
the thread reconnects with backoff (0.1 s doubling to 5 s), saying so in the log, the
stats and the metrics. Nothing of it reaches a client as an error.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvmem.server.core.events import CacheEvent, PagesRemoved, PagesStored
from kvmem.server.memory.geometry import KVGeometry
from kvmem.server.store import value
from kvmem.server.store.base import Store, StoreError

log = logging.getLogger("kvmem.server.store")

_BACKOFF_S = (0.1, 5.0)
ABSENT_S = 2.0  # how long a key the store lacked is not asked for again
PING_S = 2.0  # an idle store thread asks the store this often whether it answers
STAGING_BYTES = 64 << 20  # per rank: the pages of one write run, copied out of the host tier
_DEVICE, _HOST = 1, 2  # where a cached key is (a bit each): the events' medium


@dataclasses.dataclass(slots=True)
class Fetch:
    """A match's continuation past what the node holds: ``keys`` (the local keys of its
    full pages, in chain order) after ``parent`` (the local key before the first: the
    namespace's root or the last page held), ``tokens`` (int32, ``len(keys)`` pages),
    ``depth`` (the first page's column in its chain). The thread fills ``digests``,
    ``found`` (how many of the first pages the store has) and ``valid`` (how many of them
    were read and checked); the tier fills ``host`` (the host pages reserved)."""

    namespace: str
    parent: bytes
    root: bytes
    keys: list[bytes]
    tokens: np.ndarray
    depth: int
    digests: list[bytes] = dataclasses.field(default_factory=list)
    found: int = 0
    host: list[int] = dataclasses.field(default_factory=list)
    valid: int = 0
    started: float = 0.0


@dataclasses.dataclass(slots=True)
class StoreCounters:
    """Since start, for stats and metrics (the thread writes, anyone reads)."""

    reachable: bool = False
    connects: int = 0
    failures: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    write_dropped: int = 0  # offers refused: the write bound was reached, or the store was down
    write_failed: int = 0
    fetches: int = 0
    pages_found: int = 0
    pages_read: int = 0
    bytes_read: int = 0
    rejected: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(value.REASONS, 0))
    no_room: int = 0  # pages found that the host tier had no room for
    last_error: str = ""


class StoreLink:
    """The store thread and what the tier and the stats see of it.

    ``store``: the adapter (not connected yet); ``host``: the host tier's pages per
    rank (``host[r][page]`` a contiguous ``[planes, row]`` uint8 view: the mover's
    :meth:`page`), ``host_buffers``: that memory whole, per rank (registered with stores
    that read and write registered memory); ``geometry``, ``ranks``, ``prefix_hash`` and
    ``seed`` for the fingerprint; ``mac_key`` (``--store-key-file``); ``max_writes``:
    the host pages that may wait for their write at once (an offer past it is dropped);
    ``max_fetch_pages``: the most pages one match fetches."""

    def __init__(
        self,
        store: Store,
        page: Callable[[int, int], np.ndarray],
        host_buffers: Sequence[np.ndarray],
        geometry: KVGeometry,
        ranks: int,
        prefix_hash: str,
        seed: str | None,
        mac_key: bytes | None,
        max_writes: int,
        max_fetch_pages: int,
    ) -> None:
        self.store = store
        self._page = page
        self._host_buffers = list(host_buffers)
        self.geometry = geometry
        self.ranks = ranks
        self._prefix_hash, self._seed, self._mac_key = prefix_hash, seed, mac_key
        self.max_writes = max_writes
        self.max_fetch_pages = max_fetch_pages
        self.model_id: str | None = None  # from the first Attach that gives one
        self._codecs: list[value.Codec] = []
        self.counters = StoreCounters()
        self.writing = 0  # host pages offered and not handed back (the loop's count)
        self.results: collections.deque[tuple[str, Any]] = collections.deque()
        self.notify: Callable[[], None] | None = None
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._pending: list[tuple[str, Any]] = []  # a call's writes and fetches, sent after its events (flush)
        self._idle = threading.Condition()
        self._jobs = 0  # sent and not done (wait_idle)
        self._thread: threading.Thread | None = None
        self._stopping = False
        # The thread's: each cached key's digest, where it is (device, host bits) and its parent.
        self._digest: dict[bytes, bytes] = {}
        self._where: dict[bytes, int] = {}
        self._fetching: set[bytes] = set()  # keys of fetches in flight (a second want skips them)
        # Keys the store lacked when last asked, until when (the loop reads it: want).
        self._absent: dict[bytes, float] = {}
        self._roots: dict[str, bytes] = {}
        self._fetch_ms: collections.deque[float] = collections.deque(maxlen=1024)
        self._said: set[str] = set()  # reasons logged once
        # Writes go in runs: each page copied out to a staging buffer per rank (so a page the
        # tier reuses meanwhile is never sent), a header per page beside it; one per page read.
        self._span = max(1, min(64, max_writes, STAGING_BYTES // geometry.page_bytes))
        self._stage = [np.zeros((self._span, geometry.page_bytes), dtype=np.uint8) for _ in range(ranks)]
        self._generation = np.zeros(0, dtype=np.int64)  # the tier's (offer gives it)
        self._headers_out = [np.zeros((self._span, value.HEADER_BYTES), dtype=np.uint8) for _ in range(ranks)]
        self._headers_in = [np.zeros((max_fetch_pages, value.HEADER_BYTES), dtype=np.uint8) for _ in range(ranks)]

    # ------------------------------------------------------------ the loop's side

    def start(self) -> None:
        """Start the store thread (it connects, and reconnects, on its own)."""
        self._thread = threading.Thread(target=self._run, name="kvmem-store", daemon=True)
        self._thread.start()

    def set_model(self, model_id: str) -> str | None:
        """An Attach's model id: the first one fixes the fingerprint (keys and values are
        made from then on); another later is refused: returns why (None: accepted)."""
        if self.model_id is None:
            self.model_id = model_id
            self._send(("model", model_id))
            return None
        if model_id != self.model_id:
            return (
                f"this server's store keys are for model {self.model_id!r}; a session of model {model_id!r} cannot "
                "share its pool (one model per server)"
            )
        return None

    def flush(self, events: list[CacheEvent]) -> None:
        """The end of a mutating call: its cache events (both tiers': the thread keeps
        the digests from them), then the writes and fetches it asked for, in that order
        (a write's digest comes from the events of the call that cached it)."""
        if events:
            self._send(("events", events))
        pending, self._pending = self._pending, []
        for job in pending:
            self._send(job)

    def offer(self, host_pages: list[int], keys: list[bytes], generation: np.ndarray) -> int:
        """Pages the host tier just took (their bytes in ``host_pages``, parents first):
        how many of the first ones the thread will write; the rest are dropped and
        counted. ``generation``: the tier's count of frees per host page (live): the
        thread copies a page out and keeps the copy only if its count is still the one
        of now (else the page was freed, maybe reused: not written). O(pages)."""
        if self.model_id is None:
            return 0
        room = self.max_writes - self.writing
        if not self.counters.reachable:
            room = 0
        n = min(len(host_pages), max(room, 0))
        if n < len(host_pages):
            self.counters.write_dropped += len(host_pages) - n
        if n:
            self.writing += n
            self._generation = generation
            self._pending.append(("write", (host_pages[:n], keys[:n], generation[host_pages[:n]].copy())))
        return n

    def want(
        self, namespace: str, parent: bytes, root: bytes, keys: list[bytes], tokens: np.ndarray, depth: int
    ) -> int:
        """A match's continuation (a :class:`Fetch` of these fields). Returns the tokens
        the answer says are being fetched (``match_fetching``), for a scheduler that
        holds the request and matches it again:

        * its first page is being read from the store already (an earlier match's
          fetch): the pages in flight from there, nothing asked again;
        * the store lacked its first page when last asked, within :data:`ABSENT_S`: 0
          (a prompt the store does not have is computed at once, never waited for);
        * else the thread asks the store: all of it (the answer is not known yet; a
          second match a moment later says what was found).

        0 as well with no model id yet, or the store unreachable. O(pages asked) here."""
        if self.model_id is None or not self.counters.reachable or not keys:
            return 0
        ps = self.geometry.page_size
        fetching, absent = self._fetching, self._absent
        if keys[0] in fetching:
            return ps * next((i for i, k in enumerate(keys) if k not in fetching), len(keys))
        gone = absent.get(keys[0])
        if gone is not None and time.monotonic() < gone:
            return 0
        del keys[self.max_fetch_pages :]
        fetch = Fetch(namespace, parent, root, keys, tokens[: len(keys) * ps], depth)
        fetch.started = time.perf_counter()
        self._pending.append(("want", fetch))
        return len(keys) * ps

    def reserved(self, fetch: Fetch) -> None:
        """The tier reserved ``fetch.host`` (maybe fewer pages than found, maybe none)."""
        self._send(("read", fetch))

    def landed(self, fetch: Fetch) -> None:
        """The tier installed (or freed) a fetch's pages: its keys are no longer in flight.
        On the loop, after the install, so that no match sees them neither cached nor fetching."""
        self._fetching.difference_update(fetch.keys[: fetch.found])

    def close(self) -> None:
        """Stop the thread (a call in flight is abandoned after its timeout) and close the store."""
        self._stopping = True
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=max(5.0, 2 * self.store.timeout_s))
            if thread.is_alive():  # a call past its bound: closing under it could crash the process (Mooncake)
                log.warning(
                    "store: a call to %s did not return; leaving it to the process's exit", self.store.describe()
                )
                return
        self.store.close()

    def snapshot(self) -> dict[str, object]:
        """The figures of proto ``StoreStats``, by its field names (read on the loop)."""
        c = self.counters
        p50, p99 = self.fetch_stats()
        error = c.last_error
        if self._thread is not None and not self._thread.is_alive():  # a bug killed it: never silent
            error = "the store thread is not running (a bug: see the server's log); nothing is written or fetched"
        return {
            "url": self.store.url.redacted(),
            "kind": self.store.name,
            "reachable": c.reachable,
            "connects": c.connects,
            "failures": c.failures,
            "last_error": error,
            "model_id": self.model_id or "",
            "pages_written": c.pages_written,
            "bytes_written": c.bytes_written,
            "write_dropped": c.write_dropped,
            "write_failed": c.write_failed,
            "fetches": c.fetches,
            "pages_found": c.pages_found,
            "pages_read": c.pages_read,
            "bytes_read": c.bytes_read,
            "rejected": dict(c.rejected),
            "no_room": c.no_room,
            "writes_pending": self.writing,
            "fetch_ms_p50": p50,
            "fetch_ms_p99": p99,
        }

    def fetch_stats(self) -> tuple[float, float]:
        """Recent fetches' time from the match to their pages checked: p50, p99 in ms."""
        recent = list(self._fetch_ms)
        if not recent:
            return 0.0, 0.0
        p50, p99 = np.percentile(recent, [50, 99]).tolist()
        return p50, p99

    def _send(self, job: tuple[str, Any]) -> None:
        with self._idle:
            self._jobs += 1
        self._queue.put(job)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the thread has done every job sent so far (tests and tools: what it hands
        back is then in :attr:`results`, for the tier to take)."""
        with self._idle:
            if not self._idle.wait_for(lambda: self._jobs == 0, timeout):
                raise TimeoutError(f"the store thread still has {self._jobs} job(s) after {timeout:.0f} s")

    def _back(self, kind: str, item: Any) -> None:
        self.results.append((kind, item))
        notify = self.notify
        if notify is not None:
            notify()

    # ------------------------------------------------------------ the thread's side

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException:
            log.exception("store: the store thread stopped; nothing is written to or fetched from the store")
            raise

    def _loop(self) -> None:
        backoff = _BACKOFF_S[0]
        next_try = 0.0
        while True:
            if not self.counters.reachable and time.monotonic() >= next_try and not self._stopping:
                if self._connect():
                    backoff = _BACKOFF_S[0]
                else:
                    next_try = time.monotonic() + backoff
                    backoff = min(backoff * 2, _BACKOFF_S[1])
            try:
                timeout = PING_S if self.counters.reachable else max(0.01, next_try - time.monotonic())
                job = self._queue.get(timeout=timeout)
            except queue.Empty:
                if self.counters.reachable and not self._stopping:
                    self._ping()
                continue
            if job is None:
                return
            kind, item = job
            try:
                getattr(self, "_on_" + kind)(item)
            except StoreError as exc:
                self._failed(exc)
                self._abandon(kind, item)
            except Exception:  # a bug: logged, the job handed back so no page stays pinned
                log.exception("store: %s failed", kind)
                self._abandon(kind, item)
            finally:
                with self._idle:
                    self._jobs -= 1
                    self._idle.notify_all()

    def _ping(self) -> None:
        """An idle store is asked about one key now and then, so that ``reachable`` (stats,
        metrics, ``kvmem health``) says what the store is now, not at the last write."""
        try:
            self.store.exists(["kvmem/ping"])
        except StoreError as exc:
            self._failed(exc)

    def _connect(self) -> bool:
        try:
            self.store.connect()
            buffers = [*self._host_buffers, *self._stage, *self._headers_out, *self._headers_in]
            self.store.register([b.reshape(-1) for b in buffers])
        except StoreError as exc:
            self._failed(exc)
            return False
        c = self.counters
        c.connects += 1
        c.reachable = True
        log.info("store: connected to %s%s", self.store.describe(), "" if c.connects == 1 else " again")
        return True

    def _failed(self, exc: BaseException) -> None:
        c = self.counters
        c.failures += 1
        c.last_error = str(exc)
        if c.reachable or c.failures == 1:
            log.warning(
                "store: %s unreachable (%s): matches miss it and writes are dropped until it is back",
                self.store.describe(),
                exc,
            )
        c.reachable = False

    def _abandon(self, kind: str, item: Any) -> None:
        """A job the store could not do: counted. Its pages went back already (a write's
        and a read's ``finally``); a lookup that failed marked nothing in flight."""
        if kind == "write":
            self.counters.write_failed += len(item[0])

    def _on_model(self, model_id: str) -> None:
        self._codecs = [
            value.Codec(
                value.Fingerprint.of(self.geometry, rank, self.ranks, self._prefix_hash, self._seed, model_id),
                self.geometry,
                self._mac_key,
            )
            for rank in range(self.ranks)
        ]

    def _on_events(self, events: list[CacheEvent]) -> None:
        """Each stored page's digest (its parent's, or its namespace's root, chained
        over its tokens) and where it is; a key on no tier any more is forgotten."""
        digest, where = self._digest, self._where
        ps = self.geometry.page_size
        for e in events:
            if isinstance(e, PagesStored):
                bit = _HOST if e.medium == "CPU" else _DEVICE
                parent = e.parent_key
                start = self._namespace_root(e.namespace) if parent is None else digest.get(parent)
                tokens = np.asarray(e.token_ids)
                for i, key in enumerate(e.keys):
                    where[key] = where.get(key, 0) | bit
                    have = digest.get(key)
                    if have is None and start is not None:
                        have = value.chain(start, tokens[i * ps :], 1, ps)[0]
                        digest[key] = have
                    start = have
            elif isinstance(e, PagesRemoved):
                bit = _HOST if e.medium == "CPU" else _DEVICE
                for key in e.keys:
                    left = where.get(key, 0) & ~bit
                    if left:
                        where[key] = left
                    else:
                        where.pop(key, None)
                        digest.pop(key, None)
            else:  # AllCleared
                digest.clear()
                where.clear()

    def _namespace_root(self, namespace: str) -> bytes | None:
        if not self._codecs:
            return None
        got = self._roots.get(namespace)
        if got is None:
            got = self._roots[namespace] = value.root(self._codecs[0].fingerprint.digest, namespace)
        return got

    def _on_write(self, item: tuple[list[int], list[bytes], np.ndarray]) -> None:
        """Write pages from the host tier, in runs of the staging buffer: each page copied
        out first, kept only if the tier did not free it meanwhile (its generation), then
        its header made and the run put in one batch per rank."""
        pages, keys, gens = item
        try:
            for lo in range(0, len(pages), self._span):
                self._write_run(pages[lo : lo + self._span], keys[lo : lo + self._span], gens[lo : lo + self._span])
        finally:
            self._back("written", pages)

    def _write_run(self, pages: list[int], keys: list[bytes], gens: np.ndarray) -> None:
        c = self.counters
        digests = [self._digest.get(k) for k in keys]
        generation = self._generation
        at = np.array(pages, dtype=np.intp)
        ok = [i for i, d in enumerate(digests) if d is not None]
        c.write_dropped += len(keys) - len(ok)  # no digest: a parent the thread never saw
        ok = [i for i in ok if generation[at[i]] == gens[i]]
        if not ok or not self._codecs:
            return
        for rank in range(self.ranks):
            stage = self._stage[rank]
            for j, i in enumerate(ok):
                stage[j] = self._page(pages[i], rank).reshape(-1)
        kept = [j for j, i in enumerate(ok) if generation[at[i]] == gens[i]]  # not freed while copied
        c.write_dropped += len(ok) - len(kept)
        if not kept:
            return
        for rank, codec in enumerate(self._codecs):
            headers, stage = self._headers_out[rank], self._stage[rank]
            names, values = [], []
            for j in kept:
                d = digests[ok[j]]
                assert d is not None
                codec.header(d, stage[j], headers[j])
                names.append(value.key_of(d) + (f"/{rank}" if self.ranks > 1 else ""))
                values.append([headers[j].data, stage[j].data])
            stored = self.store.put(names, values)
            if rank == 0:
                c.pages_written += sum(stored)
                c.write_failed += len(stored) - sum(stored)
            c.bytes_written += sum(stored) * (value.HEADER_BYTES + self.geometry.page_bytes)

    def _names(self, digests: list[bytes], rank: int) -> list[str]:
        suffix = f"/{rank}" if self.ranks > 1 else ""
        return [value.key_of(d) + suffix for d in digests]

    def _on_want(self, fetch: Fetch) -> None:
        """Which of the continuation's first pages the store has (rank 0's keys)."""
        start = self._namespace_root(fetch.namespace) if fetch.parent == fetch.root else self._digest.get(fetch.parent)
        fetch.found = 0
        if start is None or not self._codecs:
            return
        fetch.digests = value.chain(start, fetch.tokens, len(fetch.keys), self.geometry.page_size)
        # pages another fetch is getting are left to it: this one stops before them
        busy = next((i for i, k in enumerate(fetch.keys) if k in self._fetching), len(fetch.keys))
        del fetch.keys[busy:], fetch.digests[busy:]
        if fetch.keys:
            self.counters.fetches += 1
            present = self.store.exists(self._names(fetch.digests, 0))
            fetch.found = next((i for i, p in enumerate(present) if not p), len(present))
            self.counters.pages_found += fetch.found
            self._fetching.update(fetch.keys[: fetch.found])
            if fetch.found < len(fetch.keys):  # a match of this prefix soon after is not held for it
                absent = self._absent
                if len(absent) > 65536:
                    now = time.monotonic()
                    for key in [k for k, until in absent.items() if until < now]:
                        del absent[key]
                absent[fetch.keys[fetch.found]] = time.monotonic() + ABSENT_S
        if fetch.found:  # else the loop has nothing to do: it keeps no record of a fetch
            self._back("found", fetch)

    def _on_read(self, fetch: Fetch) -> None:
        """Read the reserved pages' values into them (the headers beside), check each;
        ``valid``: how many of the first ones passed on every rank."""
        n = len(fetch.host)
        try:
            valid = n
            for rank, codec in enumerate(self._codecs):
                if not valid:
                    break
                headers = self._headers_in[rank]
                payloads = [self._page(p, rank) for p in fetch.host[:valid]]
                values = [[headers[j].data, payloads[j].data.cast("B")] for j in range(valid)]
                sizes = self.store.get_into(self._names(fetch.digests[:valid], rank), values)
                for j, size in enumerate(sizes):
                    if size < 0:
                        valid = j
                        break
                    reason = codec.check(fetch.digests[j], size, headers[j], payloads[j])
                    if reason is not None:
                        self._reject(reason, fetch.digests[j])
                        # as good as absent: a match of this prefix soon after is not held for it again
                        self._absent[fetch.keys[j]] = time.monotonic() + ABSENT_S
                        valid = j
                        break
                    if rank == 0:
                        self.counters.bytes_read += size
            fetch.valid = valid
            self.counters.pages_read += valid
            if n:
                self._fetch_ms.append(1000 * (time.perf_counter() - fetch.started))
        finally:
            # its keys stay in flight until the tier has installed its pages (:meth:`landed`): a
            # match in between would otherwise find them neither local nor fetching, and read them again
            self._back("fetched", fetch)

    def _reject(self, reason: str, digest: bytes) -> None:
        self.counters.rejected[reason] += 1
        if reason not in self._said:
            self._said.add(reason)
            log.warning(
                "store: a value was refused (%s) under key %s: treated as a miss, never loaded (logged once per "
                "reason; kvmem stats counts them)",
                reason,
                value.key_of(digest),
            )
