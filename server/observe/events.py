"""The event log behind WatchEvents: a bounded replay buffer of the prefix cache's batches.

The core hands each mutating call's events to :meth:`EventLog.publish` (its event sink):
one call, one batch, numbered 1, 2, 3, ... within the server's epoch. Batch 1 is an
``AllCleared`` recorded at construction, so a watcher of a fresh server learns that the
node holds nothing. The log keeps the last ``capacity`` batches in a ring; a watcher
replays from the buffer and then follows live batches as they are published.

Where the buffer cannot serve a watcher, it gets a *snapshot* instead: batches flagged
``snapshot``, the first starting with ``AllCleared``, then every cached page (at most
``snapshot_batch_pages`` pages a batch, each chain's pages joined back into one
``PagesStored``, parents first), the last flagged ``snapshot_done``; all carry the seq of the last batch
published when it was taken, and live batches follow from the next one. That happens
when the request's ``epoch`` is another run's, when ``from_seq`` is past ``next_seq``
(a seq this run never gave), when ``from_seq`` is older than the oldest batch held
(``fell_behind``), and when a watcher falls behind while streaming: the ring overwrote
batches it had not been sent yet (a slow consumer; ``fell_behind``). ``from_seq`` 0
means "everything": the buffer from batch 1 while it still holds it, else a snapshot
(not flagged ``fell_behind``: a new watcher of a long-running server fell behind nothing).

Costs: :meth:`publish` is O(events) plus one call per listener and never blocks or
converts anything. A batch is converted to its proto once, on first demand, and shared
by every watcher (never when nobody watches). Memory is the ring (``capacity``
batches); a watcher holds no queue of its own, only its cursor into the ring and the
batch being written (gRPC's flow control suspends it while its consumer is slow; when
the ring laps it, it resyncs from a snapshot), and during a snapshot the core's list of
cached pages (O(cache size), as :meth:`KVCore.snapshot_events` builds it).

Threading: one asyncio event loop, one thread. :meth:`publish` and :meth:`close` must be
called on the loop's thread (the service's handlers run there), or before it runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np

from kvmem.server.core.events import AllCleared, CacheEvent, PagesRemoved, PagesStored
from kvmem.v1 import kvmem_pb2

log = logging.getLogger("kvmem.events")

Listener = Callable[[int, float, list[CacheEvent]], None]


class _Batch:
    """One published batch; ``proto`` is built on first demand and then shared."""

    __slots__ = ("events", "proto", "seq", "ts")

    def __init__(self, seq: int, ts: float, events: list[CacheEvent]) -> None:
        self.seq = seq
        self.ts = ts
        self.events = events
        self.proto: kvmem_pb2.KVEventBatch | None = None


class EventLog:
    """The replay buffer of one server run (``epoch``); see the module docstring.

    ``snapshot`` returns ``AllCleared`` then one ``PagesStored`` per cached page, parents
    before children (``KVCore.snapshot_events``); it is called once per snapshot sent.
    """

    def __init__(
        self,
        epoch: str,
        page_size: int,
        *,
        capacity: int = 4096,
        snapshot: Callable[[], list[CacheEvent]],
        snapshot_batch_pages: int = 4096,
    ) -> None:
        if capacity < 1 or snapshot_batch_pages < 1:
            raise ValueError("capacity and snapshot_batch_pages must be at least 1")
        self.epoch = epoch
        self.page_size = page_size
        self.capacity = capacity
        self._snapshot = snapshot
        self._snapshot_batch_pages = snapshot_batch_pages
        # Batch ``seq`` lives at ``_ring[seq % capacity]`` while ``seq >= oldest_seq``.
        self._ring: list[_Batch | None] = [None] * capacity
        self._next_seq = 1
        self._listeners: list[Listener] = []
        self._wakeup = asyncio.Event()  # set (and replaced) by publish() while watchers wait
        self._num_waiting = 0
        self._closed = False
        self.num_watchers = 0
        self.num_snapshots = 0  # snapshots sent, since start
        self.publish([AllCleared()])

    # ----------------------------------------------------------- the producer side

    @property
    def next_seq(self) -> int:
        """The seq the next published batch gets (the last one is ``next_seq - 1``)."""
        return self._next_seq

    @property
    def oldest_seq(self) -> int:
        """The oldest batch the buffer still holds."""
        return max(1, self._next_seq - self.capacity)

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn(seq, ts, events)`` for every batch published from now on (on the
        publishing thread: it must not block). An exception it raises is logged."""
        self._listeners.append(fn)

    def publish(self, events: list[CacheEvent]) -> None:
        """Record one batch and wake the watchers; an empty list, or any call after
        :meth:`close`, records nothing. The log keeps ``events`` (the caller must not
        change it) and passes it to the listeners as is."""
        if not events or self._closed:
            return
        seq = self._next_seq
        self._next_seq = seq + 1
        batch = _Batch(seq, time.time(), events)
        self._ring[seq % self.capacity] = batch
        for fn in self._listeners:
            try:
                fn(seq, batch.ts, events)
            except Exception:
                log.exception("an event listener failed on batch %d", seq)
        if self._num_waiting:
            self._wake()

    def close(self) -> None:
        """Shutdown: every :meth:`watch` ends (after the batch it is writing, if any)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()

    # ----------------------------------------------------------- the watcher side

    async def watch(
        self, request: kvmem_pb2.WatchEventsRequest, context: object = None
    ) -> AsyncIterator[kvmem_pb2.KVEventBatch]:
        """The WatchEvents stream: replay or a snapshot, then live batches until
        :meth:`close`. ``context`` is not used: a watcher that leaves cancels the task
        iterating this generator, which ends it at its ``await`` or ``yield``."""
        cursor, resync = self._start(request)
        self.num_watchers += 1
        try:
            while not self._closed:
                if resync is not None or cursor < self.oldest_seq:
                    fell_behind = True if resync is None else resync
                    resync = None
                    last_seq = self._next_seq - 1
                    for batch in self._snapshot_batches(last_seq, fell_behind):
                        yield batch
                        if self._closed:
                            return
                    cursor = last_seq + 1
                elif cursor < self._next_seq:
                    entry = self._ring[cursor % self.capacity]
                    assert entry is not None and entry.seq == cursor
                    yield self._proto(entry)
                    cursor += 1
                else:
                    self._num_waiting += 1
                    try:
                        await self._wakeup.wait()
                    finally:
                        self._num_waiting -= 1
        finally:
            self.num_watchers -= 1

    def _start(self, request: kvmem_pb2.WatchEventsRequest) -> tuple[int, bool | None]:
        """Where a watcher starts: ``(cursor, None)`` to replay from ``cursor`` (live when
        it is ``next_seq``), or ``(0, fell_behind)`` to start with a snapshot."""
        from_seq = request.from_seq
        if request.epoch and request.epoch != self.epoch:
            return 0, False  # another run's seq means nothing here
        if from_seq == 0:
            oldest = self.oldest_seq
            return (oldest, None) if oldest == 1 else (0, False)
        if from_seq > self._next_seq:
            return 0, False  # a seq this run never gave
        if from_seq < self.oldest_seq:
            return 0, True
        return from_seq, None

    def _proto(self, entry: _Batch) -> kvmem_pb2.KVEventBatch:
        proto = entry.proto
        if proto is None:
            proto = entry.proto = kvmem_pb2.KVEventBatch(
                epoch=self.epoch, seq=entry.seq, ts=entry.ts, events=[_to_proto(e) for e in entry.events]
            )
        return proto

    def _snapshot_batches(self, last_seq: int, fell_behind: bool) -> Iterator[kvmem_pb2.KVEventBatch]:
        """The snapshot as batches, converted one at a time as they are sent."""
        self.num_snapshots += 1
        events = self._snapshot()
        if not events or not isinstance(events[0], AllCleared):
            events = [AllCleared(), *events]
        ts = time.time()
        held: list[kvmem_pb2.KVEvent] | None = None  # one batch of lookahead: is it the last?
        for chunk in _snapshot_chunks(events, self._snapshot_batch_pages):
            if held is not None:
                yield self._snapshot_batch(last_seq, ts, held, False, fell_behind)
            held = chunk
        assert held is not None
        yield self._snapshot_batch(last_seq, ts, held, True, fell_behind)

    def _snapshot_batch(
        self, seq: int, ts: float, events: list[kvmem_pb2.KVEvent], done: bool, fell_behind: bool
    ) -> kvmem_pb2.KVEventBatch:
        return kvmem_pb2.KVEventBatch(
            epoch=self.epoch,
            seq=seq,
            ts=ts,
            events=events,
            snapshot=True,
            snapshot_done=done,
            fell_behind=fell_behind,
        )


def _snapshot_chunks(events: list[CacheEvent], max_pages: int) -> Iterator[list[kvmem_pb2.KVEvent]]:
    """The snapshot's events as protos, in batches of at most ``max_pages`` pages.

    The core lists one page per ``PagesStored``, parents before children (in whatever
    order otherwise: by depth, so chains interleave); here each chain's pages are joined
    back into runs (a page extends the run that ends with its parent, while no other
    child of that parent has), so a chain of n pages is one event, not n, and runs are
    sent in the order they start, which keeps parents first. A run longer than a batch
    is split (each piece's parent is the previous piece's last key). Runs are per tier
    (``medium``): a page on the host tier never extends a run of the pool. O(pages)."""
    runs: list[CacheEvent | list[PagesStored]] = []
    ends: dict[tuple[bytes, str, int, str], list[PagesStored]] = {}  # (last key, namespace, page size, medium) -> run
    for event in events:
        if not isinstance(event, PagesStored) or not event.keys:
            runs.append(event)
            continue
        parent = event.parent_key
        run = None if parent is None else ends.pop((parent, event.namespace, event.page_size, event.medium), None)
        if run is None:
            run = []
            runs.append(run)
        run.append(event)
        ends[event.keys[-1], event.namespace, event.page_size, event.medium] = run
    chunk: list[kvmem_pb2.KVEvent] = []
    room = max_pages
    for item in runs:
        if not isinstance(item, list):
            chunk.append(_to_proto(item))
            continue
        first = item[0]
        ps, namespace, parent, medium = first.page_size, first.namespace, first.parent_key, first.medium
        keys = [key for event in item for key in event.keys]
        tokens = item[0].token_ids if len(item) == 1 else np.concatenate([event.token_ids for event in item])
        done = 0
        while done < len(keys):
            if room == 0:
                yield chunk
                chunk, room = [], max_pages
            take = min(room, len(keys) - done)
            piece = keys[done : done + take]
            chunk.append(_stored_proto(piece, parent, tokens[done * ps : (done + take) * ps], ps, namespace, medium))
            parent = piece[-1]
            done += take
            room -= take
    yield chunk


def _to_proto(event: CacheEvent) -> kvmem_pb2.KVEvent:
    if isinstance(event, PagesStored):
        return _stored_proto(
            event.keys, event.parent_key, event.token_ids, event.page_size, event.namespace, event.medium
        )
    if isinstance(event, PagesRemoved):
        return kvmem_pb2.KVEvent(removed=kvmem_pb2.PagesRemoved(keys=event.keys, medium=event.medium))
    return kvmem_pb2.KVEvent(cleared=kvmem_pb2.AllCleared())


def _stored_proto(
    keys: list[bytes],
    parent_key: bytes | None,
    tokens: np.ndarray,
    page_size: int,
    namespace: str,
    medium: str = "GPU",
) -> kvmem_pb2.KVEvent:
    return kvmem_pb2.KVEvent(
        stored=kvmem_pb2.PagesStored(
            keys=keys,
            parent_key=b"" if parent_key is None else parent_key,
            token_ids=np.ascontiguousarray(tokens, dtype="<i4").tobytes(),
            page_size=page_size,
            cache_namespace=namespace,
            medium=medium,
        )
    )
