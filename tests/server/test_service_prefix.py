"""The prefix cache and its events through the service: a real ``kvmem serve`` process on
a unix socket, real channels, the real sync and asyncio clients (no mocks).

Geometry of the ``server`` fixture (conftest): page_size 4, pages 1..256, request slots
1..16, max_context 256 tokens (64 pages), lease 1500 ms, the audit after every step.
The pool hands out pages 1, 2, 3, ... and a freed page is the next one handed out (a
stack). ``PROMPT`` is 10 tokens: two full pages and a partial one, which is never cached.
Rows are drawn in comments (``# row 1: [1, 2, 3]  len 10``); the cache as
``cache: [1, 2]`` (the pages that carry a key).
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, start_server
from test_service import error_info, free_tcp_port, raw_error, snapshot

from kvmem.client import AsyncKVMemClient, InvalidArgument, KVMemClient, Unauthenticated, Unavailable, watch_events
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

PS = 4
TOTAL = 256
PROMPT = list(range(100, 110))  # pages [100..103] [104..107], partial [108, 109]
FIXTURE_ARGS = ("--num-pages", "257", "--page-size", "4", "--max-requests", "16", "--max-context", "256")


def le(*values: int) -> bytes:
    """int32 little-endian bytes, as the proto carries token ids and offsets."""
    return np.array(values, dtype="<i4").tobytes()


def kinds(batch: kvmem_pb2.KVEventBatch) -> list[str]:
    return [e.WhichOneof("event") for e in batch.events]


@pytest.fixture
def stub(server: ServerProcess) -> Iterator[kvmem_pb2_grpc.KVMemoryStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield kvmem_pb2_grpc.KVMemoryStub(channel)


# ------------------------------------------------------------------- Attach


def test_attach_reports_the_prefix_cache_and_the_namespace_round_trips(
    server: ServerProcess, stub: kvmem_pb2_grpc.KVMemoryStub
) -> None:
    longest = "n" * 256
    with (
        KVMemClient(server.target, name="shared") as shared,
        KVMemClient(server.target, name="model-b", cache_namespace="model-b/lora-7") as other,
        KVMemClient(server.target, name="longest", cache_namespace=longest) as edge,
        KVMemClient(server.target, name="unicode", cache_namespace="模型-ä") as uni,
    ):
        for kv, namespace in ((shared, ""), (other, "model-b/lora-7"), (edge, longest), (uni, "模型-ä")):
            info = kv.prefix_cache
            assert (info.enabled, info.hash, info.cache_namespace) == (True, "xxh3-128", namespace)
        s = stub.Stats(kvmem_pb2.StatsRequest(audit=True), timeout=5)
        assert {u.name: u.cache_namespace for u in s.sessions} == {
            "shared": "", "model-b": "model-b/lora-7", "longest": longest, "unicode": "模型-ä",
        }  # fmt: skip
        assert s.prefix_cache_enabled and s.prefix_hash == "xxh3-128"
        assert (s.num_cached_pages, s.num_cache_entries, s.num_evictions) == (0, 0, 0)
        assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (0, 0)

        # One character too many: INVALID_ARGUMENT naming the field and the length; no session.
        before = snapshot(stub)
        err = raw_error(stub.Attach, kvmem_pb2.AttachRequest(name="x", cache_namespace="n" * 257))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cache_namespace" in err.details() and "257" in err.details() and "256" in err.details()
        assert error_info(err).reason == "BAD_VALUE"
        with pytest.raises(InvalidArgument, match="cache_namespace"):
            KVMemClient(server.target, name="x", cache_namespace="n" * 300)
        assert snapshot(stub) == before


# ------------------------------------------------------- bad input on the wire


@pytest.fixture
def world(server: ServerProcess, stub: kvmem_pb2_grpc.KVMemoryStub) -> Iterator[tuple[KVMemClient, Any]]:
    """Session A: slot 1, row [1, 2]  len 6; slot 2 fresh (len 0). Nothing cached."""
    with KVMemClient(server.target, name="alpha") as A:
        assert A.open(["a", "fresh"]).tolist() == [1, 2]
        assert A.alloc([1], [6]).new_pages.tolist() == [1, 2]
        yield A, stub


def probe(A: KVMemClient) -> list[int]:
    """Slot 1 is row [1, 2] len 6, slot 2 is fresh: one token each, then truncated away."""
    res = A.alloc([1, 2], [1, 1], expected_lens=[6, 0])
    assert res.ok, res
    out = res.kv_loc.tolist()
    A.truncate([1, 2], [6, 0])
    return out


PROBE = [10, 12]  # token 6 of row [1, 2]; token 0 of slot 2's new page 3 (freed again after)

BAD_PREFIX_STEPS: list[tuple[str, dict[str, Any], str, tuple[str, ...]]] = [
    # (case, StepRequest fields, reason, words the message must contain)
    ("release token ids not whole int32", dict(release_slots=[1], release_token_ids=b"\1\2\3\4\5",
     release_token_offsets=le(0, 1)), "BAD_VALUE", ("release_token_ids", "5 bytes", "multiple of 4")),
    ("release offsets not whole int32", dict(release_slots=[1], release_token_ids=le(1, 2),
     release_token_offsets=b"\0" * 6), "BAD_VALUE", ("release_token_offsets", "6 bytes")),
    ("release offsets for two items, one slot", dict(release_slots=[1], release_token_ids=le(1, 2),
     release_token_offsets=le(0, 1, 2)), "LENGTH_MISMATCH", ("release_token_offsets",)),
    ("release tokens without offsets", dict(release_slots=[1], release_token_ids=le(1, 2)),
     "LENGTH_MISMATCH", ("release_token_offsets",)),
    ("cache slot without tokens", dict(cache_slots=[1]), "LENGTH_MISMATCH", ("cache_slots", "cache_token_offsets")),
    ("cache offsets for two items, one slot", dict(cache_slots=[1], cache_token_ids=le(1, 2, 3, 4),
     cache_token_offsets=le(0, 2, 4)), "LENGTH_MISMATCH", ("cache_token_offsets",)),
    ("cache offsets not from 0", dict(cache_slots=[1], cache_token_ids=le(1, 2, 3, 4), cache_token_offsets=le(1, 4)),
     "BAD_VALUE", ("cache_token_offsets", "from 0 to 4")),
    ("match offsets not to the total", dict(match_slots=[2], match_token_ids=le(1, 2, 3, 4),
     match_token_offsets=le(0, 3)), "BAD_VALUE", ("match_token_offsets", "from 0 to 4")),
    ("match offsets decreasing", dict(match_slots=[2, 3], match_token_ids=le(1, 2), match_token_offsets=le(0, 3, 2)),
     "BAD_VALUE", ("match_token_offsets[2]", "below")),
    ("match tokens without a slot", dict(match_token_ids=le(1), match_token_offsets=le(0, 1)), "LENGTH_MISMATCH",
     ("match_token_offsets",)),
    ("match max tokens for two items, one slot", dict(match_slots=[2], match_token_ids=le(1, 2, 3, 4),
     match_token_offsets=le(0, 4), match_max_tokens=[4, 4]), "LENGTH_MISMATCH", ("match_max_tokens",)),
    # validated whole: the valid release with tokens caches nothing when the alloc is bad
    ("valid release with tokens, bad alloc", dict(release_slots=[1], release_token_ids=le(*range(6)),
     release_token_offsets=le(0, 6), alloc_slots=[2], alloc_needs=[-1]), "BAD_VALUE", ("alloc_needs[0]",)),
]  # fmt: skip


def test_bad_prefix_columns_are_invalid_argument_naming_the_field_and_change_nothing(world) -> None:
    A, stub = world
    assert probe(A) == PROBE
    before = snapshot(stub)
    for case, fields, reason, words in BAD_PREFIX_STEPS:
        err = raw_error(stub.Step, kvmem_pb2.StepRequest(session_id=A.session_id, **fields))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err)
        assert error_info(err).reason == reason, (case, err.details())
        for word in words:
            assert word in err.details(), f"{case}: {word!r} not in {err.details()!r}"
        assert snapshot(stub) == before, case
    assert probe(A) == PROBE

    # The client refuses what it cannot encode before sending anything.
    with pytest.raises(ValueError, match=r"release_token_ids\[0\]"):
        A.release([1], [np.zeros((2, 2), dtype=np.int32)])
    with pytest.raises(ValueError, match="outside int32"):
        A.step(match=[(2, [2**40])])
    with pytest.raises(TypeError, match="integer"):
        A.cache(1, [1.5, 2.5])
    assert snapshot(stub) == before


# ------------------------------------------------------ sharing between sessions


def test_release_with_tokens_then_a_match_in_another_session_shares_the_pages(
    server: ServerProcess, stub: kvmem_pb2_grpc.KVMemoryStub
) -> None:
    with (
        KVMemClient(server.target, name="A") as A,
        KVMemClient(server.target, name="B") as B,
        KVMemClient(server.target, name="C", cache_namespace="other-model") as C,
    ):
        [a] = A.open(["prompt"]).tolist()
        assert A.alloc([a], [10]).new_pages.tolist() == [1, 2, 3]  # row a: [1, 2, 3]  len 10
        res = A.release([a], [PROMPT])  # full pages enter the cache; page 3 (partial) is freed
        assert res.num_pages_cached == 2 and res.num_pages_released == 3
        s = snapshot(stub)
        assert (int(s["numCachedPages"]), int(s["numCacheEntries"]), int(s["numFreePages"])) == (2, 2, 254)

        # B (same namespace) matches the prompt and allocs the rest in the same step: the
        # alloc asks for the whole length (10) and gets what the match left (2).
        [b] = B.open(["same-prompt"]).tolist()
        res = B.step(match=[(b, PROMPT)], alloc_slots=[b], alloc_needs=[len(PROMPT)])
        assert res.match_lens.tolist() == [8] and res.ok
        assert res.kv_loc.tolist() == [12, 13]  # tokens 8, 9 on page 3, the next free one
        assert B.block_table[b][:4].tolist() == [1, 2, 3, 0]  # row b: [1, 2, 3]  len 10; pages 1, 2 shared
        assert res.num_pages_cached == 0 and res.cache_switched.tolist() == []

        # C (another namespace) sees none of it.
        [c] = C.open(["same-prompt"]).tolist()
        assert C.match(c, PROMPT) == 0
        assert C.block_table[c][:2].tolist() == [0, 0]

        # max_tokens: at most 7 tokens is one full page.
        [b2] = B.open(["second"]).tolist()
        assert B.match(b2, PROMPT, max_tokens=7) == 4
        assert B.block_table[b2][:2].tolist() == [1, 0]

        s = stub.Stats(kvmem_pb2.StatsRequest(audit=True), timeout=5)
        assert s.audit.ok, list(s.audit.problems)
        usage = {u.name: u for u in s.sessions}
        assert usage["B"].prefix_hit_tokens == 12 and usage["C"].prefix_hit_tokens == 0
        assert usage["C"].prefix_query_tokens == 10 and usage["C"].cache_namespace == "other-model"
        assert usage["B"].prefix_query_tokens >= 17  # 10 + (10, at most 7 of them asked for)
        assert s.prefix_hit_tokens == 12
        assert s.prefix_query_tokens == sum(u.prefix_query_tokens for u in s.sessions)
        assert s.num_cache_entries == 2 and s.num_cached_pages == 0  # both pages are held by B now

        # A cache item: D computed the same two pages itself; its row switches to the cached ones.
        [d] = A.open(["recomputed"]).tolist()
        pages = A.alloc([d], [8]).new_pages.tolist()  # two new pages
        assert A.cache(d, PROMPT[:8]) == 2
        assert A.block_table[d][:3].tolist() == [1, 2, 0]  # its duplicates went back to the pool
        assert snapshot(stub)["numFreePages"] == str(TOTAL - 3 - 0)  # pages 1, 2, 3 held; d's two freed
        assert pages and set(pages).isdisjoint({1, 2, 3})


def test_eviction_under_pressure_is_reported_by_the_step_stats_and_events(
    server: ServerProcess, stub: kvmem_pb2_grpc.KVMemoryStub
) -> None:
    with KVMemClient(server.target, name="A") as A, watch_events(server.target) as events:
        [a] = A.open(["prompt"]).tolist()
        A.alloc([a], [10])
        A.release([a], [PROMPT])  # cache: [1, 2]; free 254
        slots = A.open([f"big-{i}" for i in range(4)]).tolist()
        res = A.alloc(slots, [256] * 4)  # 4 x 64 pages = 256 > 254 free: the 2 cached go
        assert res.ok and res.num_pages_evicted == 2
        s = A.stats(audit=True)
        assert s.audit.ok and (s.num_evictions, s.num_cache_entries, s.num_free_pages) == (2, 0, 0)
        assert {u.name: u.num_evictions for u in s.sessions} == {"A": 2}

        first, stored, removed = next(events), next(events), next(events)
        assert (first.seq, kinds(first)) == (1, ["cleared"]) and first.epoch == A.epoch
        assert (stored.seq, kinds(stored), removed.seq, kinds(removed)) == (2, ["stored"], 3, ["removed"])
        [event] = stored.events
        assert len(event.stored.keys) == 2 and event.stored.parent_key == b""
        assert event.stored.token_ids == le(*PROMPT[:8]) and event.stored.page_size == PS
        assert event.stored.cache_namespace == ""
        assert sorted(removed.events[0].removed.keys) == sorted(event.stored.keys)


def test_no_prefix_cache_caches_nothing_and_matches_nothing(tmpdir_short: str) -> None:
    srv = start_server(tmpdir_short, *FIXTURE_ARGS, "--no-prefix-cache")
    try:
        with KVMemClient(srv.target, name="A") as A:
            assert (A.prefix_cache.enabled, A.prefix_cache.hash) == (False, "xxh3-128")
            [a, b] = A.open(["a", "b"]).tolist()
            A.alloc([a], [10])
            assert A.release([a], [PROMPT]).num_pages_cached == 0
            assert A.match(b, PROMPT) == 0
            assert A.cache(b, []) == 0
            s = A.stats(audit=True)
            assert s.audit.ok and not s.prefix_cache_enabled
            assert (s.num_cached_pages, s.num_cache_entries, s.num_free_pages) == (0, 0, TOTAL)
    finally:
        assert srv.stop() == 0, srv.log()


# -------------------------------------------------------------- WatchEvents


def test_watch_events_replays_resumes_and_resyncs_through_both_clients(server: ServerProcess) -> None:
    with KVMemClient(server.target, name="A") as A:
        [a] = A.open(["prompt"]).tolist()
        A.alloc([a], [10])
        A.release([a], [PROMPT])

        with A.watch_events() as stream:  # from 0: the whole buffer, then live
            assert [(b.seq, kinds(b)) for b in (next(stream), next(stream))] == [(1, ["cleared"]), (2, ["stored"])]
            [b] = A.open(["second"]).tolist()
            A.alloc([b], [4])
            A.cache(b, [*PROMPT[8:], 7, 7])  # a new chain of one page: a live batch
            live = next(stream)
            assert (live.seq, kinds(live), live.snapshot) == (3, ["stored"], False)
            assert live.events[0].stored.token_ids == le(108, 109, 7, 7)
        assert list(stream) == []  # closed: the iteration is over

        # Resuming from a seq of this epoch replays from there; another epoch's seq gets a snapshot.
        with watch_events(server.target, from_seq=3, epoch=A.epoch) as resumed:
            assert next(resumed).seq == 3
        with watch_events(server.target, from_seq=3, epoch="an-earlier-run") as resync:
            batch = next(resync)
            assert batch.snapshot and batch.seq == 3 and kinds(batch)[0] == "cleared" and batch.snapshot_done
            assert all(kind == "stored" for kind in kinds(batch)[1:])
            assert sum(len(e.stored.keys) for e in batch.events[1:]) == 3  # every page with a key

        async def watch_async() -> list[tuple[int, list[str]]]:
            async with AsyncKVMemClient(server.target, name="async-watcher") as kv:
                stream = kv.watch_events(from_seq=2)
                got = [(b.seq, kinds(b)) async for b in _first(stream, 2)]
                stream.close()
                assert [b async for b in stream] == []
                return got

        assert asyncio.run(watch_async()) == [(2, ["stored"]), (3, ["stored"])]


async def _first(stream: Any, n: int) -> Any:
    async for batch in stream:
        yield batch
        n -= 1
        if n == 0:
            return


def test_watch_events_needs_the_token_over_tcp_and_refuses_a_body_that_does_not_parse(tmpdir_short: str) -> None:
    port = free_tcp_port()
    srv = start_server(tmpdir_short, *FIXTURE_ARGS, "--tcp", f"127.0.0.1:{port}", "--auth-token", "s3cret")
    try:
        tcp = f"127.0.0.1:{port}"
        with watch_events(tcp) as stream, pytest.raises(Unauthenticated, match="missing authorization"):
            next(stream)
        with watch_events(tcp, auth_token="wrong") as stream, pytest.raises(Unauthenticated, match="wrong bearer"):
            next(stream)
        with watch_events(tcp, auth_token="s3cret") as stream:
            assert kinds(next(stream)) == ["cleared"]
        with grpc.insecure_channel(srv.target) as channel:
            call = channel.unary_stream("/kvmem.v1.KVMemory/WatchEvents")(b"\xff\xff\xff", timeout=5)
            with pytest.raises(grpc.RpcError) as exc_info:
                list(call)
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "WatchEvents" in exc_info.value.details() and "WatchEventsRequest" in exc_info.value.details()
        with pytest.raises(ValueError, match="from_seq"):
            watch_events(tcp, from_seq=-1)
    finally:
        assert srv.stop() == 0, srv.log()


def test_shutdown_ends_a_watch_stream_promptly_with_unavailable(tmpdir_short: str) -> None:
    srv = start_server(tmpdir_short, *FIXTURE_ARGS, "--shutdown-grace-ms", "5000")
    with watch_events(srv.target) as stream:
        assert kinds(next(stream)) == ["cleared"]
        started = time.monotonic()
        srv.proc.send_signal(15)
        with pytest.raises(Unavailable) as exc_info:
            next(stream)
        assert exc_info.value.reason == "SHUTTING_DOWN", exc_info.value
        assert time.monotonic() - started < 4.0  # not the 5 s grace
    assert srv.stop() == 0, srv.log()


# ---------------------------------------------- two processes, with the K/V data

WRITER = r"""
import json, sys, torch
from kvmem.client import KVMemClient
target, prompt = sys.argv[1], json.loads(sys.argv[2])
with KVMemClient(target, name="writer") as kv:
    [slot] = kv.open(["p"]).tolist()
    loc = kv.alloc([slot], [len(prompt)]).kv_loc.long()
    values = torch.arange(1, len(prompt) + 1, dtype=torch.float32)
    for layer, (k, v) in enumerate(kv.kv_cache()):
        k[loc] = (values + 100 * layer)[:, None, None].to(k.dtype).expand(-1, *k.shape[1:])
        v[loc] = (-values - 100 * layer)[:, None, None].to(v.dtype).expand(-1, *v.shape[1:])
    res = kv.release([slot], [prompt])
    print(json.dumps({"kv_loc": loc.tolist(), "cached": res.num_pages_cached}), flush=True)
"""


def test_a_second_process_matches_the_prompt_and_reads_the_first_ones_kv_in_place(server: ServerProcess) -> None:
    import torch

    with watch_events(server.target) as events:
        assert kinds(next(events)) == ["cleared"]
        run = subprocess.run([sys.executable, "-c", WRITER, server.target, json.dumps(PROMPT)], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr
        written = json.loads(run.stdout.strip().splitlines()[-1])
        assert written["cached"] == 2
        stored = next(events)
        assert kinds(stored) == ["stored"] and len(stored.events[0].stored.keys) == 2

        with KVMemClient(server.target, name="reader") as kv:  # the writer has detached: its pages are cache-only
            [slot] = kv.open(["same-prompt"]).tolist()
            res = kv.step(match=[(slot, PROMPT)], alloc_slots=[slot], alloc_needs=[len(PROMPT)])
            assert res.match_lens.tolist() == [8]
            row = kv.block_table[slot].tolist()
            loc = torch.tensor([row[t // PS] * PS + t % PS for t in range(8)])
            assert loc.tolist() == written["kv_loc"][:8]  # the writer's token slots, shared
            values = torch.arange(1, 9, dtype=torch.float32)
            for layer, (k, v) in enumerate(kv.kv_cache()):
                assert torch.equal(k[loc].float(), (values + 100 * layer)[:, None, None].expand(-1, *k.shape[1:]))
                assert torch.equal(v[loc].float(), (-values - 100 * layer)[:, None, None].expand(-1, *v.shape[1:]))
            kv.release([slot])  # back to cache-only

            # Pressure: allocs that need every page evict the cached two; the stream says so.
            slots = kv.open([f"big-{i}" for i in range(4)]).tolist()
            assert kv.alloc(slots, [256] * 4).num_pages_evicted == 2
            removed = next(events)
            assert kinds(removed) == ["removed"]
            assert sorted(removed.events[0].removed.keys) == sorted(stored.events[0].stored.keys)


# ------------------------------------------------------------ vLLM's ZMQ format


def test_kv_events_zmq_publishes_vllm_batches_and_replays_them(tmpdir_short: str) -> None:
    zmq = pytest.importorskip("zmq")
    msgspec = pytest.importorskip("msgspec")
    srv = start_server(tmpdir_short, *FIXTURE_ARGS, "--kv-events-zmq", "tcp://127.0.0.1:*",
                       "--kv-events-replay", "tcp://127.0.0.1:*", "--kv-events-topic", "kv@pod-0")  # fmt: skip
    ctx = zmq.Context()
    try:
        found = re.search(r"kv events in vLLM's format on (tcp://\S+) \(replay (tcp://\S+)\)", srv.log())
        assert found, srv.log()
        sub = ctx.socket(zmq.SUB)
        sub.connect(found.group(1))
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@pod-0")
        # A SUB socket misses what is published before it has joined: probes (pages cached
        # in another namespace, tokens from 1000 on) until one gets through.
        with KVMemClient(srv.target, name="probe", cache_namespace="probe") as probe:
            deadline, n = time.monotonic() + 30, 0
            while not sub.poll(50):
                assert time.monotonic() < deadline, "the subscriber never joined"
                [p] = probe.open([f"probe{n}"]).tolist()
                probe.alloc([p], [4])
                probe.release([p], [list(range(1000 + 4 * n, 1004 + 4 * n))])
                n += 1
        with KVMemClient(srv.target, name="A") as A:
            [a] = A.open(["prompt"]).tolist()
            A.alloc([a], [10])
            A.release([a], [PROMPT])
        while True:  # the probes' batches, then the prompt's
            assert sub.poll(10_000), "no ZMQ message"
            topic, seq, payload = sub.recv_multipart()
            ts, [event], rank = msgspec.msgpack.decode(payload)
            if event["token_ids"][0] < 1000:
                break
        # ZMQ batch 0 was the "all cleared" sent at start (before this subscriber joined),
        # then one batch per probe.
        assert (topic, int.from_bytes(seq, "big")) == (b"kv@pod-0", 1 + n)
        assert ts > 0 and rank == 0
        assert event["type"] == "BlockStored" and len(event["block_hashes"]) == 2
        assert event["token_ids"] == PROMPT[:8] and event["block_size"] == PS
        assert event["parent_block_hash"] is None

        replay = ctx.socket(zmq.DEALER)
        replay.connect(found.group(2))
        replay.send_multipart((b"", (0).to_bytes(8, "big")))
        assert replay.poll(10_000), "no replay answer"
        replayed = [replay.recv_multipart() for _ in range(2 + n + 1)]
        zero = replayed[0]
        assert zero[:3] == [b"", b"kv@pod-0", (0).to_bytes(8, "big")]
        assert [e["type"] for e in msgspec.msgpack.decode(zero[3])[1]] == ["AllBlocksCleared"]
        assert replayed[1 + n] == [b"", b"kv@pod-0", seq, payload]
        assert replayed[2 + n] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    finally:
        ctx.destroy(linger=0)
        assert srv.stop() == 0, srv.log()


def test_asyncio_watch_in_a_thread_follows_live_batches(server: ServerProcess) -> None:
    """A router on asyncio follows the stream while a scheduler (another thread here) steps."""
    got: list[int] = []
    ready = threading.Event()

    async def follow() -> None:
        async with AsyncKVMemClient(server.target, name="router-ish") as kv:
            stream = kv.watch_events()
            async for batch in stream:
                got.append(batch.seq)
                ready.set()
                if len(got) == 3:
                    stream.close()

    thread = threading.Thread(target=asyncio.run, args=(follow(),))
    thread.start()
    assert ready.wait(30)
    with KVMemClient(server.target, name="scheduler") as kv:
        [a, b] = kv.open(["a", "b"]).tolist()
        kv.alloc([a, b], [4, 4])
        kv.release([a, b], [[1, 2, 3, 4], [5, 6, 7, 8]])  # one step: one batch
        [c] = kv.open(["c"]).tolist()
        kv.alloc([c], [4])
        kv.cache(c, [9, 9, 9, 9])
    thread.join(30)
    assert not thread.is_alive() and got == [1, 2, 3]


# ---------------------------------------- rows a match or cache item rewrote, synced


class RecordingTable:
    """A memory backend's block-table side as the sessions layer sees it (the cuda
    backend copies the rows it is told of to the device): it records them."""

    syncs_rows = True

    def __init__(self, shape: tuple[int, int]) -> None:
        self.block_table = np.zeros(shape, dtype=np.int32)
        self.synced: list[list[int]] = []

    def sync_rows(self, rows: np.ndarray) -> None:
        self.synced.append(sorted(set(np.asarray(rows).tolist())))


def test_rows_rewritten_by_match_and_cache_items_are_synced_to_the_device_table() -> None:
    from kvmem.server.core import CoreConfig, KVCore, StepBatch
    from kvmem.server.sessions import Sessions

    config = CoreConfig(num_pages=33, page_size=PS, max_requests=4, max_context_len=64)
    table = RecordingTable(config.block_table_shape)
    sessions = Sessions(KVCore(config, table.block_table, audit_every_step=True), 10.0, table)
    a, b = sessions.attach("A", None), sessions.attach("B", None)
    [sa] = sessions.open(a.session_id, ["p"]).tolist()
    [sb, sc] = sessions.open(b.session_id, ["q", "r"]).tolist()
    sessions.step(a.session_id, StepBatch.of(alloc_slots=[sa], alloc_needs=[10]))
    sessions.step(a.session_id, StepBatch.of(release_slots=[sa], release_tokens=[PROMPT]))
    assert table.synced[-1] == [sa]

    # A match with no alloc: only the row the match wrote changed.
    result = sessions.step(b.session_id, StepBatch.of(match=[(sb, PROMPT)]))
    assert result.match_lens.tolist() == [8] and table.synced[-1] == [sb]
    assert table.block_table[sb, :3].tolist() == [1, 2, 0]

    # A cache item that switches its row to the cached pages: that row is synced.
    sessions.step(b.session_id, StepBatch.of(alloc_slots=[sc], alloc_needs=[8]))
    synced_before = len(table.synced)
    result = sessions.step(b.session_id, StepBatch.of(cache=[(sc, PROMPT[:8])]))
    assert result.cache_switched.tolist() == [2] and len(table.synced) == synced_before + 1
    assert table.synced[-1] == [sc] and table.block_table[sc, :2].tolist() == [1, 2]
    assert sessions.num_pages_cached == 2
    report = sessions.stats(audit=True).audit
    assert report is not None and report.ok, report
