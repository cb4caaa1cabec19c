"""KV events without a server: vLLM's key recipe against a computation written here from
its definition, the event log (replay, live, bounds, snapshots, shutdown), and the ZMQ
publisher read by a real subscriber with vLLM's msgspec structs declared in this file."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest

from kvmem.server.core.events import AllCleared, CacheEvent, PagesRemoved, PagesStored
from kvmem.server.core.hashing import RECIPES, VllmSha256CborKeys, make_keys
from kvmem.server.observe.events import EventLog
from kvmem.v1 import kvmem_pb2

# ------------------------------------------------------------------ vLLM's key recipe
#
# vllm/v1/core/kv_cache_utils.py: hash_block_tokens(hash_fn, parent, tokens, extra_keys)
# = hash_fn((parent or NONE_HASH, tuple(tokens), extra_keys)); init_none_hash: NONE_HASH =
# hash_fn(PYTHONHASHSEED); generate_block_hash_extra_keys: cache_salt on the block that
# starts at token 0 only, None when a block has no extra key. vllm/utils/hashing.py:
# sha256_cbor(x) = sha256(cbor2.dumps(x, canonical=True)). The CBOR below is written by
# hand (RFC 8949 §3: major type in the top 3 bits, shortest argument), not with cbor2.


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
    raise ValueError(n)


def _cbor(x: Any) -> bytes:
    if x is None:
        return b"\xf6"
    if isinstance(x, int):
        return _cbor_head(0, x) if x >= 0 else _cbor_head(1, -1 - x)
    if isinstance(x, bytes):
        return _cbor_head(2, len(x)) + x
    if isinstance(x, str):
        data = x.encode()
        return _cbor_head(3, len(data)) + data
    assert isinstance(x, tuple)
    return _cbor_head(4, len(x)) + b"".join(_cbor(item) for item in x)


def _vllm_block_hashes(tokens: list[int], block_size: int, seed: str, cache_salt: str | None) -> list[bytes]:
    def sha256_cbor(x: Any) -> bytes:
        return hashlib.sha256(_cbor(x)).digest()

    none_hash = sha256_cbor(seed)
    out: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (cache_salt,) if start == 0 and cache_salt else None
        parent = sha256_cbor((parent or none_hash, tuple(tokens[start : start + block_size]), extra))
        out.append(parent)
    return out


def test_the_hand_written_cbor_agrees_with_cbor2_canonical() -> None:
    cbor2 = pytest.importorskip("cbor2")
    for x in [None, 0, 23, 24, 255, 256, 65536, 2**32, "salt", b"\x01" * 32, (b"ab", (1, 2, 300, 70000), None)]:
        assert _cbor(x) == cbor2.dumps(x, canonical=True)


@pytest.mark.parametrize("namespace", ["", "tenant-a"])
def test_vllm_recipe_keys_are_vllms_block_hashes(namespace: str) -> None:
    pytest.importorskip("cbor2")
    tokens = [128000, 9125, 0, 1, 127, 128, 255, 256, 65535, 65536, 128255, 42] * 4  # 48: every int width
    keys = make_keys("vllm-sha256-cbor", "1234")
    root = keys.root(namespace)
    got = list(keys.keys(namespace, root, np.array([*tokens, 7, 7], dtype=np.int32), 3, 16))
    assert got == _vllm_block_hashes(tokens, 16, "1234", namespace or None)
    assert [len(k) for k in got] == [32, 32, 32]
    assert root == hashlib.sha256(_cbor("1234")).digest()  # NONE_HASH: one root for every namespace


def test_vllm_recipe_namespace_salts_the_first_page_and_so_the_whole_chain() -> None:
    pytest.importorskip("cbor2")
    keys = make_keys("vllm-sha256-cbor", "0")
    tokens = np.arange(64, dtype=np.int32)
    plain = list(keys.keys("", keys.root(""), tokens, 4, 16))
    salted = list(keys.keys("a", keys.root("a"), tokens, 4, 16))
    assert not set(plain) & set(salted)
    # Page 2 of the salted chain: no extra key of its own, only its parent differs.
    assert salted[1] == hashlib.sha256(_cbor((salted[0], tuple(range(16, 32)), None))).digest()
    assert list(keys.keys("", keys.root(""), tokens, 4, 16)) == plain  # reproducible
    other_seed = make_keys("vllm-sha256-cbor", "1")
    assert next(other_seed.keys("", other_seed.root(""), tokens, 1, 16)) != plain[0]


def test_vllm_recipe_is_registered_and_needs_a_seed() -> None:
    pytest.importorskip("cbor2")
    assert RECIPES["vllm-sha256-cbor"] is VllmSha256CborKeys
    assert make_keys("vllm-sha256-cbor", "0").name == "vllm-sha256-cbor"
    with pytest.raises(ValueError, match="needs a seed"):
        make_keys("vllm-sha256-cbor")
    with pytest.raises(ValueError, match="takes no seed"):
        make_keys("xxh3-128", "0")


def test_vllm_recipe_without_cbor2_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cbor2", None)  # import cbor2 -> ImportError
    with pytest.raises(ImportError, match=r"kvmem\[events\]"):
        make_keys("vllm-sha256-cbor", "0")


# ----------------------------------------------------------------------- the event log


def _page(key: bytes, parent: bytes | None, first_token: int, namespace: str = "") -> PagesStored:
    return PagesStored([key], parent, np.arange(first_token, first_token + 4, dtype=np.int32), 4, namespace)


def _snapshot_of(events: list[CacheEvent]) -> Any:
    return lambda: [AllCleared(), *events]


def _log(capacity: int = 8, snapshot: list[CacheEvent] | None = None, pages: int = 4096) -> EventLog:
    return EventLog("epoch-1", 4, capacity=capacity, snapshot=_snapshot_of(snapshot or []), snapshot_batch_pages=pages)


def _req(from_seq: int = 0, epoch: str = "") -> kvmem_pb2.WatchEventsRequest:
    return kvmem_pb2.WatchEventsRequest(from_seq=from_seq, epoch=epoch)


async def _next(stream: AsyncIterator[kvmem_pb2.KVEventBatch], timeout: float = 5.0) -> kvmem_pb2.KVEventBatch:
    return await asyncio.wait_for(anext(stream), timeout)


async def _nothing_within(stream: AsyncIterator[kvmem_pb2.KVEventBatch], seconds: float = 0.05) -> bool:
    task = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(seconds)
    pending = not task.done()
    task.cancel()
    return pending


def _kinds(batch: kvmem_pb2.KVEventBatch) -> list[str]:
    return [str(e.WhichOneof("event")) for e in batch.events]


def test_a_fresh_log_starts_with_all_cleared_at_seq_1() -> None:
    async def main() -> None:
        log = _log()
        assert log.next_seq == 2
        stream = log.watch(_req(0))
        first = await _next(stream)
        assert (first.epoch, first.seq, _kinds(first), first.snapshot) == ("epoch-1", 1, ["cleared"], False)
        assert await _nothing_within(stream)

    asyncio.run(main())


def test_replay_from_a_seq_then_live_batches() -> None:
    async def main() -> None:
        log = _log()
        for i in range(4):  # seqs 2..5
            log.publish([PagesRemoved([bytes([i])])])
        stream = log.watch(_req(4))
        assert [(await _next(stream)).seq for _ in range(2)] == [4, 5]
        waiting = asyncio.ensure_future(_next(stream))
        await asyncio.sleep(0.01)
        assert not waiting.done()  # nothing new: it waits (no polling)
        log.publish([PagesRemoved([b"live"])])
        live = await waiting
        assert live.seq == 6 and list(live.events[0].removed.keys) == [b"live"]
        # from_seq == next_seq: nothing to replay, live only.
        tail = log.watch(_req(log.next_seq))
        log.publish([AllCleared()])
        assert (await _next(tail)).seq == 7

    asyncio.run(main())


def test_stored_pages_convert_once_and_only_when_watched() -> None:
    async def main() -> None:
        log = _log()
        tokens = np.array([1, -2, 70000, 3, 4, 5, 6, 7], dtype=np.int64)
        log.publish(
            [PagesStored([b"k1", b"k2"], None, tokens, 4, "ns"), PagesStored([b"k3"], b"k2", tokens[:4], 4, "")]
        )
        entry = log._ring[2 % log.capacity]
        assert entry is not None and entry.proto is None  # nobody watched yet: not converted
        a, b = log.watch(_req(2)), log.watch(_req(2))
        batch_a, batch_b = await _next(a), await _next(b)
        assert batch_a is batch_b  # one proto, shared by the watchers
        first, second = (e.stored for e in batch_a.events)
        assert list(first.keys) == [b"k1", b"k2"] and first.parent_key == b""
        assert first.token_ids == np.array([1, -2, 70000, 3, 4, 5, 6, 7], dtype="<i4").tobytes()
        assert (first.page_size, first.cache_namespace) == (4, "ns")
        assert second.parent_key == b"k2" and second.token_ids == tokens[:4].astype("<i4").tobytes()

    asyncio.run(main())


def test_the_buffer_holds_capacity_batches() -> None:
    log = _log(capacity=4)
    for i in range(10):
        log.publish([PagesRemoved([bytes([i])])])
    assert (log.oldest_seq, log.next_seq) == (8, 12)
    assert len(log._ring) == 4
    assert sorted(b.seq for b in log._ring if b is not None) == [8, 9, 10, 11]
    log.publish([])  # an empty list is no batch
    assert log.next_seq == 12


async def _read_snapshot(stream: AsyncIterator[kvmem_pb2.KVEventBatch]) -> list[kvmem_pb2.KVEventBatch]:
    batches = [await _next(stream)]
    while not batches[-1].snapshot_done:
        batches.append(await _next(stream))
    return batches


def test_from_a_seq_older_than_the_buffer_gets_a_snapshot_flagged_fell_behind() -> None:
    async def main() -> None:
        a1, a2, b1 = _page(b"a1", None, 0), _page(b"a2", b"a1", 4), _page(b"b1", None, 100, "ns")
        log = _log(capacity=4, snapshot=[a1, a2, b1])
        for i in range(6):
            log.publish([PagesRemoved([bytes([i])])])  # seqs 2..7; held: 4..7
        stream = log.watch(_req(2))
        (snap,) = await _read_snapshot(stream)
        assert (snap.seq, snap.snapshot, snap.snapshot_done, snap.fell_behind) == (7, True, True, True)
        assert _kinds(snap) == ["cleared", "stored", "stored"]
        chain, other = snap.events[1].stored, snap.events[2].stored
        assert list(chain.keys) == [b"a1", b"a2"] and chain.parent_key == b""  # one chain, one event
        assert chain.token_ids == np.arange(8, dtype="<i4").tobytes()
        assert list(other.keys) == [b"b1"] and other.cache_namespace == "ns"
        log.publish([AllCleared()])
        assert (await _next(stream)).seq == 8  # live after the snapshot
        assert log.num_snapshots == 1

    asyncio.run(main())


@pytest.mark.parametrize(
    ("from_seq", "epoch", "fell_behind"),
    [(3, "epoch-0", False), (0, "epoch-0", False), (99, "", False), (0, "", False)],
    ids=["another-epoch", "another-epoch-from-0", "future-seq", "from-0-after-batch-1-dropped"],
)
def test_other_starts_that_get_a_snapshot(from_seq: int, epoch: str, fell_behind: bool) -> None:
    async def main() -> None:
        log = _log(capacity=2, snapshot=[_page(b"a1", None, 0)])
        for i in range(3):
            log.publish([PagesRemoved([bytes([i])])])  # seqs 2..4; batch 1 is gone
        (snap,) = await _read_snapshot(log.watch(_req(from_seq, epoch)))
        assert (snap.seq, snap.snapshot, snap.fell_behind, _kinds(snap)) == (
            4,
            True,
            fell_behind,
            ["cleared", "stored"],
        )

    asyncio.run(main())


def test_this_epoch_named_explicitly_replays() -> None:
    async def main() -> None:
        log = _log()
        log.publish([AllCleared()])
        batch = await _next(log.watch(_req(2, "epoch-1")))
        assert (batch.seq, batch.snapshot) == (2, False)

    asyncio.run(main())


def test_a_snapshot_is_cut_into_batches_of_at_most_snapshot_batch_pages() -> None:
    async def main() -> None:
        pages: list[CacheEvent] = [_page(bytes([i]), None, i) for i in range(5)]  # five one-page chains
        log = _log(snapshot=pages, pages=2)
        batches = await _read_snapshot(log.watch(_req(0, "old")))
        assert [_kinds(b) for b in batches] == [["cleared", "stored", "stored"], ["stored", "stored"], ["stored"]]
        assert [b.snapshot_done for b in batches] == [False, False, True]
        assert {(b.seq, b.snapshot, b.fell_behind) for b in batches} == {(1, True, False)}

    asyncio.run(main())


def test_a_snapshot_joins_each_chain_back_into_one_event_and_splits_long_ones() -> None:
    async def main() -> None:
        # The core lists pages by depth: chains interleave.   a1 -> a2 -> a3 -> a4 -> a5
        # c1 has two children; the second starts its own run.  b1 -> b2      (namespace ns)
        #                                                       c1 -> c2, c1 -> d2
        a = [_page(f"a{i}".encode(), f"a{i - 1}".encode() if i > 1 else None, 4 * i) for i in range(1, 6)]
        b = [_page(b"b1", None, 100, "ns"), _page(b"b2", b"b1", 104, "ns")]
        c1, c2, d2 = _page(b"c1", None, 200), _page(b"c2", b"c1", 204), _page(b"d2", b"c1", 208)
        by_depth: list[CacheEvent] = [a[0], b[0], c1, a[1], b[1], c2, d2, a[2], a[3], a[4]]

        (snap,) = await _read_snapshot(_log(snapshot=by_depth).watch(_req(0, "old")))
        runs = [(list(e.stored.keys), e.stored.parent_key) for e in snap.events[1:]]
        assert runs == [([b"a1", b"a2", b"a3", b"a4", b"a5"], b""), ([b"b1", b"b2"], b""), ([b"c1", b"c2"], b""),
                        ([b"d2"], b"c1")]  # fmt: skip
        assert snap.events[1].stored.token_ids == np.arange(4, 24, dtype="<i4").tobytes()
        assert snap.events[2].stored.cache_namespace == "ns"

        batches = await _read_snapshot(_log(snapshot=by_depth, pages=3).watch(_req(0, "old")))
        pieces = [[(list(e.stored.keys), e.stored.parent_key) for e in b.events if e.stored.keys] for b in batches]
        assert pieces == [
            [([b"a1", b"a2", b"a3"], b"")],
            [([b"a4", b"a5"], b"a3"), ([b"b1"], b"")],
            [([b"b2"], b"b1"), ([b"c1", b"c2"], b"")],
            [([b"d2"], b"c1")],
        ]
        assert _kinds(batches[0])[0] == "cleared" and [b.snapshot_done for b in batches] == [False] * 3 + [True]

    asyncio.run(main())


def test_a_slow_watcher_lapped_by_the_ring_resyncs_from_a_snapshot() -> None:
    async def main() -> None:
        log = _log(capacity=4, snapshot=[_page(b"a1", None, 0)])
        stream = log.watch(_req(0))
        assert (await _next(stream)).seq == 1
        for i in range(6):  # seqs 2..7 while the watcher is not reading: 2 and 3 are overwritten
            log.publish([PagesRemoved([bytes([i])])])
        (snap,) = await _read_snapshot(stream)
        assert (snap.seq, snap.fell_behind, _kinds(snap)) == (7, True, ["cleared", "stored"])
        log.publish([AllCleared()])
        assert (await _next(stream)).seq == 8

    asyncio.run(main())


def test_close_ends_every_watcher_promptly() -> None:
    async def main() -> None:
        log = _log()

        async def drain(from_seq: int) -> list[int]:
            return [batch.seq async for batch in log.watch(_req(from_seq))]

        tasks = [asyncio.ensure_future(drain(0)), asyncio.ensure_future(drain(2))]
        await asyncio.sleep(0.01)
        assert log.num_watchers == 2
        log.close()
        assert await asyncio.wait_for(asyncio.gather(*tasks), 2.0) == [[1], []]
        assert log.num_watchers == 0
        assert [b.seq async for b in log.watch(_req(0))] == []  # a watcher after close ends at once

    asyncio.run(main())


def test_a_watcher_that_leaves_is_forgotten() -> None:
    async def main() -> None:
        log = _log()
        stream = log.watch(_req(2))
        task = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.01)
        assert log.num_watchers == 1 and log._num_waiting == 1
        task.cancel()  # what gRPC does when the watcher leaves, then it closes the stream
        await asyncio.sleep(0.01)
        await stream.aclose()
        assert log.num_watchers == 0 and log._num_waiting == 0
        log.publish([AllCleared()])  # no one waits: nothing to wake

    asyncio.run(main())


def test_listeners_get_every_batch_and_cannot_break_publish(caplog: pytest.LogCaptureFixture) -> None:
    log = _log()
    seen: list[tuple[int, list[CacheEvent]]] = []
    log.add_listener(lambda seq, ts, events: seen.append((seq, events)))

    def broken(seq: int, ts: float, events: list[CacheEvent]) -> None:
        raise RuntimeError("listener bug")

    log.add_listener(broken)
    events: list[CacheEvent] = [PagesRemoved([b"x"])]
    log.publish(events)
    assert seen == [(2, events)]
    assert "listener failed on batch 2" in caplog.text


# ------------------------------------------------------------- the vLLM ZMQ wire format

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
from kvmem.server.observe.events_zmq import ZmqEventPublisher, _wire  # noqa: E402


# vLLM's structs as vllm/distributed/kv_events.py declares them (v0.26: events are
# tagged maps since vllm-project/vllm#42892; the batch stays an array).
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
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
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


K1, K2, K3 = (hashlib.sha256(bytes([i])).digest() for i in range(3))


def _u64(key: bytes) -> int:  # vLLM's maybe_convert_block_hash with int hashes on (its default)
    return int.from_bytes(key, "big") & (2**64 - 1)


def _sample() -> list[CacheEvent]:
    tokens = np.arange(100, 108, dtype=np.int32)
    return [
        PagesStored([K1, K2], None, tokens, 4, "tenant"),
        PagesStored([K3], K2, tokens[:4], 4, "tenant"),
        PagesRemoved([K1]),
        AllCleared(),
    ]


def _expected(ts: float, int_hashes: bool = True) -> KVEventBatch:
    h = _u64 if int_hashes else bytes
    gpu = {"lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    return KVEventBatch(
        ts=ts,
        events=[
            BlockStored([h(K1), h(K2)], None, list(range(100, 108)), 4, extra_keys=[("tenant",), None], **gpu),
            BlockStored([h(K3)], h(K2), list(range(100, 104)), 4, extra_keys=[None], **gpu),
            BlockRemoved([h(K1)], "GPU", group_idx=0),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def _subscribe(ctx: Any, endpoint: str, topic: bytes = b"") -> Any:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(endpoint)
    return sub


def _until_subscribed(pub: ZmqEventPublisher, sub: Any) -> None:
    """PUB drops what it sends before a SUB's subscription arrives: send probes (an
    AllCleared batch at ts 0) until one gets through (:func:`_recv` skips the rest)."""
    deadline = time.monotonic() + 10
    while not sub.poll(50):
        assert time.monotonic() < deadline, "the subscriber never connected"
        pub.listener(0, 0.0, [AllCleared()])


def _recv(sub: Any) -> tuple[bytes, int, KVEventBatch]:
    """The next batch that is not a probe: (topic, seq, batch)."""
    while True:
        assert sub.poll(5000), "no batch within 5 s"
        topic, seq, payload = sub.recv_multipart()
        batch = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        if batch.ts != 0.0:
            return topic, int.from_bytes(seq, "big"), batch


def test_the_payload_is_what_vllms_structs_encode() -> None:
    pub = ZmqEventPublisher("inproc://unused-kvmem-test")
    try:
        ts = 1757500000.25
        payload = msgspec.msgpack.encode(pub.to_wire(ts, _sample()))
        assert payload == msgspec.msgpack.encode(_expected(ts))  # byte for byte
        assert msgspec.msgpack.Decoder(KVEventBatch).decode(payload) == _expected(ts)
        raw = msgspec.msgpack.decode(payload)  # the shape, as a router without msgspec sees it
        assert raw[0] == ts and raw[2] == 0 and len(raw) == 3
        assert list(raw[1][0]) == [
            "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
            "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        ]  # fmt: skip
        assert raw[1][2] == {"type": "BlockRemoved", "block_hashes": [_u64(K1)], "medium": "GPU", "group_idx": 0}
        assert raw[1][3] == {"type": "AllBlocksCleared"}
    finally:
        pub.close()


def test_live_batches_and_replay_over_real_sockets() -> None:
    ctx = zmq.Context()
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv@pod@model")
    sub = _subscribe(ctx, pub.bound_endpoint, b"kv@pod")
    other = _subscribe(ctx, pub.bound_endpoint, b"other-topic")
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert pub.bound_replay_endpoint is not None
        dealer.connect(pub.bound_replay_endpoint)
        _until_subscribed(pub, sub)
        log = EventLog("e", 4, snapshot=lambda: [AllCleared()])
        log.add_listener(pub.listener)
        first_seq = pub._next_seq
        log.publish(_sample())
        log.publish([PagesRemoved([K3])])
        topic, seq, batch = _recv(sub)
        assert (topic, seq) == (b"kv@pod@model", first_seq)
        assert batch.events == _expected(batch.ts).events and batch.data_parallel_rank == 0
        assert _recv(sub)[1] == first_seq + 1
        assert not other.poll(100)  # topic filtering is ZMQ's, on the topic frame

        # Replay: [b"", start_seq] -> [b"", topic, seq, payload]..., then [b"", b"", -1, b""].
        dealer.send_multipart([b"", first_seq.to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no end marker"
            frames = dealer.recv_multipart()
            if frames[-1] == b"":
                assert frames == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
                break
            empty, topic, seq, payload = frames
            assert (empty, topic) == (b"", b"kv@pod@model")
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert [s for s, _ in replayed] == [first_seq, first_seq + 1]
        assert msgspec.msgpack.Decoder(KVEventBatch).decode(replayed[0][1]).events == _expected(0.0).events
        dealer.send_multipart([b"not a replay request"])  # ignored, the publisher keeps going
        log.publish([AllCleared()])
        assert sub.poll(5000)
    finally:
        pub.close()
        for s in (sub, other, dealer):
            s.close(linger=0)
        ctx.term()


def test_bytes_hashes_and_a_rank_over_ipc(tmp_path: Any) -> None:
    ctx = zmq.Context()
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/events", int_block_hashes=False, data_parallel_rank=3)
    sub = _subscribe(ctx, pub.bound_endpoint)
    try:
        _until_subscribed(pub, sub)
        pub.listener(9, 5.0, _sample())
        batch = _recv(sub)[2]
        assert batch.events == _expected(5.0, int_hashes=False).events and batch.data_parallel_rank == 3
    finally:
        pub.close()
        sub.close(linger=0)
        ctx.term()
    pub.close()  # idempotent
    pub.listener(10, 6.0, [AllCleared()])  # after close: ignored


def test_without_pyzmq_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _wire.cache_clear()
    monkeypatch.setitem(sys.modules, "zmq", None)
    try:
        with pytest.raises(ImportError, match=r"kvmem\[events\]"):
            ZmqEventPublisher("inproc://x")
    finally:
        _wire.cache_clear()
