"""The prefix cache's events in vLLM's KV-event wire format, for routers that read it.

KV-aware routers (llm-d, NVIDIA Dynamo through its ZMQ relay) subscribe to each vLLM
engine's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``); this publisher
speaks the same protocol, so they read kvmem unchanged:

* PUB socket, one multipart message per batch: ``[topic, seq, payload]``, ``seq`` an
  8-byte big-endian counter from 0, ``payload`` the msgpack of a ``KVEventBatch``.
  Bound when the endpoint has ``*`` or ``::`` or is ``ipc://``/``inproc://``, else
  connected (vLLM's rule). The port is used as given (vLLM adds the DP rank to it).
* The replay ROUTER socket (optional): a request ``[identity, b"", start_seq]``
  (8 bytes big-endian, from a REQ or DEALER) is answered with ``[identity, b"",
  topic, seq, payload]`` for every batch held with ``seq >= start_seq``, oldest first
  (the last ``buffer_steps``), then the end marker ``[identity, b"", b"", -1 as 8
  signed bytes, b""]``.
* The payload (vLLM after its #42892, e.g. v0.26): the batch is a msgpack *array*
  ``[ts, events, data_parallel_rank]``; each event a msgpack *map* tagged by
  ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), fields in
  vLLM's declaration order, optional fields left out while None (``omit_defaults``).

What kvmem puts in the fields, as vLLM does for a single-group full-attention model:
``medium`` "GPU", ``group_idx`` 0, ``kv_cache_spec_kind`` "full_attention", ``lora_id``
and ``lora_name`` None, ``block_size`` the page size; ``extra_keys`` one entry per block:
``[namespace]`` on a chain's first page when the namespace is not empty (vLLM's
``cache_salt``), else None. Hashes: by default the low 64 bits of the key as an unsigned
int (``int.from_bytes(key, "big") & (2**64 - 1)``), as vLLM sends them by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); ``int_block_hashes=False`` sends the key's
bytes (vLLM with that variable 0). ``data_parallel_rank`` None sends 0, what a vLLM
engine without data parallelism stamps. The ZMQ ``seq`` is this publisher's own count of
batches, not the event log's seq.

Threading, as vLLM's: :meth:`ZmqEventPublisher.listener` (called on the event loop by
:meth:`EventLog.publish`) only puts the batch on a bounded queue; a background thread
converts, encodes and sends it and serves replay requests. When the queue is full the
batch is dropped and its seq skipped: subscribers see the gap, ask for a replay that
cannot fill it, and rebuild (llm-d resets its index for the pod).

pyzmq and msgspec are the ``events`` extra; import this module only when the option
that needs it is given.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections import deque
from typing import Any, NamedTuple

from kvmem.server.core.events import CacheEvent, PagesRemoved, PagesStored

log = logging.getLogger("kvmem.events")

_MASK64 = (1 << 64) - 1
MEDIUM_GPU = "GPU"
KV_CACHE_SPEC_KIND = "full_attention"


class _Wire(NamedTuple):
    """vLLM's msgspec structs (kvmem's own declarations of them) and the modules."""

    zmq: Any
    msgspec: Any
    batch: type[Any]
    stored: type[Any]
    removed: type[Any]
    cleared: type[Any]


@functools.cache
def _wire() -> _Wire:
    """Import pyzmq and msgspec (the ``events`` extra) and declare the structs with
    the shape of ``vllm/distributed/kv_events.py``'s (same names, tags, fields, order
    and options), so msgspec encodes exactly what vLLM's publisher sends."""
    try:
        import msgspec
        import zmq
    except ImportError as e:
        raise ImportError(f"--kv-events-zmq needs pyzmq and msgspec ({e}): pip install 'kvmem[events]'") from e

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
        """Base of the events: a map with the tag (the class name) under ``"type"``."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int | bytes]
        parent_block_hash: int | bytes | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int | bytes]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return _Wire(zmq, msgspec, KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared)


class ZmqEventPublisher:
    """Publish the event log's batches on ``endpoint`` as a vLLM engine does (see the
    module docstring); pass :meth:`listener` to ``EventLog.add_listener``. ``bound_endpoint``
    and ``bound_replay_endpoint`` say where the sockets ended up (``tcp://127.0.0.1:*``
    binds an ephemeral port)."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    SHUTDOWN_TIMEOUT_S = 1.0
    _POLL_S = 0.05  # the thread's wait for a batch, and so the replay latency bound

    def __init__(
        self,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        data_parallel_rank: int | None = None,
        int_block_hashes: bool = True,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
    ) -> None:
        wire = self._wire = _wire()
        zmq = wire.zmq
        self._topic = topic.encode("utf-8")
        self._rank = 0 if data_parallel_rank is None else data_parallel_rank
        self._int_hashes = int_block_hashes
        self._queue: queue.Queue[tuple[int, float, list[CacheEvent]] | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)  # only the thread touches it
        self._next_seq = 0
        self.num_dropped = 0  # batches the full queue refused, since start
        self._closed = False
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.set_hwm(hwm)
            if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
                self._pub.bind(endpoint)
                self.bound_endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.bound_endpoint = endpoint
            self.bound_replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
                self.bound_replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="kvmem-zmq-events", daemon=True)
        self._thread.start()

    def listener(self, seq: int, ts: float, events: list[CacheEvent]) -> None:
        """Queue one batch for the thread; never blocks (``seq``, the log's, is unused)."""
        if self._closed:
            return
        zseq = self._next_seq
        self._next_seq = zseq + 1
        try:
            self._queue.put_nowait((zseq, ts, events))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("the ZMQ event queue is full: %d batches dropped so far", self.num_dropped)

    def close(self) -> None:
        """Send what is queued (for up to SHUTDOWN_TIMEOUT_S), stop the thread, close the
        sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(queue.Full):  # full: the thread sees _closed at its next wait
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():
            log.warning("the ZMQ event thread did not stop in %.1f s; leaving its sockets", self.SHUTDOWN_TIMEOUT_S)
            return
        self._ctx.destroy(linger=0)

    # ------------------------------------------------------------- the thread

    def _run(self) -> None:
        encode = self._wire.msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("serving a KV-event replay request failed")
            try:
                item = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                if self._closed:
                    return
                continue
            if item is None:
                return
            seq, ts, events = item
            try:
                payload = encode(self.to_wire(ts, events))
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                log.exception("publishing KV-event batch %d failed", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignored a KV-event replay request of %d frames (want identity, b'', seq)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    # --------------------------------------------------------- the conversion

    def to_wire(self, ts: float, events: list[CacheEvent]) -> Any:
        """One batch as vLLM's ``KVEventBatch`` struct. O(events + tokens)."""
        wire = self._wire
        out: list[Any] = []
        for event in events:
            if isinstance(event, PagesStored):
                n = len(event.keys)
                extra: list[tuple[Any, ...] | None] = [None] * n
                if event.parent_key is None and event.namespace and n:
                    extra[0] = (event.namespace,)
                out.append(
                    wire.stored(
                        block_hashes=[self._hash(k) for k in event.keys],
                        parent_block_hash=None if event.parent_key is None else self._hash(event.parent_key),
                        token_ids=event.token_ids.tolist(),
                        block_size=event.page_size,
                        lora_id=None,
                        medium=event.medium,
                        lora_name=None,
                        extra_keys=extra,
                        group_idx=0,
                        kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
                    )
                )
            elif isinstance(event, PagesRemoved):
                out.append(
                    wire.removed(block_hashes=[self._hash(k) for k in event.keys], medium=event.medium, group_idx=0)
                )
            else:
                out.append(wire.cleared())
        return wire.batch(ts=ts, events=out, data_parallel_rank=self._rank)

    def _hash(self, key: bytes) -> int | bytes:
        return int.from_bytes(key, "big") & _MASK64 if self._int_hashes else bytes(key)
