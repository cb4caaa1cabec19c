"""StepStream, the streamed Step the clients use by default: the same validation, the same
results and the same errors as the unary Step, errors answered in-band with the stream
going on, and a stream's end (a killed server, a shutdown, a deadline) handled as a broken
unary call is. Real servers over a real socket; the clients in both modes.

Geometry of the ``server`` fixture (conftest): page_size 4, pages 1..256, request slots
1..16, max_context 256, lease 1500 ms.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import ServerProcess, start_server
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from test_service import INVALID_STEPS, free_tcp_port, snapshot, stub_for

from kvmem.client import AsyncKVMemClient, InvalidArgument, KVMemClient, KVMemError, SessionLost, Unavailable
from kvmem.v1 import kvmem_pb2

STREAM = "/kvmem.v1.KVMemory/StepStream"
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVER_ARGS = ("--num-pages", "257", "--page-size", "4", "--max-requests", "16", "--max-context", "256",
               "--lease-ms", "1500")  # fmt: skip


def in_band(status: status_pb2.Status) -> tuple[int, str, str, dict[str, str]]:
    """Code, message, kvmem reason and its metadata of an answer's ``error``."""
    [detail] = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info) and info.domain == "kvmem.v1"
    return status.code, status.message, info.reason, dict(info.metadata)


def unary_failure(err: grpc.RpcError) -> tuple[int, str, str, dict[str, str]]:
    status = rpc_status.from_call(err)
    assert status is not None
    return in_band(status)


class RawStream:
    """A StepStream made by hand: ``send(request)`` returns its answer. ``request`` may be
    raw bytes (the serializer passes bytes through)."""

    def __init__(self, channel: grpc.Channel, metadata: Any = None) -> None:
        self.queue: list[Any] = []
        self.cond = threading.Condition()
        self.call = channel.stream_stream(
            STREAM,
            request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
            response_deserializer=kvmem_pb2.StepResponse.FromString,
        )(self._feed(), metadata=metadata)

    def _feed(self) -> Iterator[Any]:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.queue)
                item = self.queue.pop(0)
            if item is None:
                return
            yield item

    def send(self, request: Any) -> kvmem_pb2.StepResponse:
        with self.cond:
            self.queue.append(request)
            self.cond.notify()
        return next(self.call)

    def close(self) -> None:
        with self.cond:
            self.queue.append(None)
            self.cond.notify()
        self.call.cancel()


@pytest.fixture
def raw(server: ServerProcess) -> Iterator[tuple[grpc.Channel, KVMemClient]]:
    """A raw channel and an attached client whose slots 1, 2 hold 6 and 3 tokens."""
    with grpc.insecure_channel(server.target) as channel, KVMemClient(server.target, name="A") as kv:
        assert kv.open(["a", "b"]).tolist() == [1, 2]
        assert kv.alloc([1, 2], [6, 3]).ok
        yield channel, kv


def i32(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


# --------------------------------------------------------- the same as the unary Step


def test_every_invalid_step_gets_the_unary_status_in_band_and_the_stream_goes_on(raw) -> None:
    channel, kv = raw
    stub = stub_for(channel)
    stream = RawStream(channel)
    try:
        for case, args, reason, _named in INVALID_STEPS:
            request = kvmem_pb2.StepRequest(session_id=kv.session_id, **args)
            before = snapshot(stub)
            with pytest.raises(grpc.RpcError) as exc_info:
                stub.Step(request, timeout=5)
            answer = stream.send(request)
            assert answer.HasField("error") and answer.epoch == kv.epoch, case
            assert in_band(answer.error) == unary_failure(exc_info.value), case
            assert in_band(answer.error)[2] == reason, case
            assert not answer.kv_loc and not answer.alloc_status, case  # nothing but epoch and error
            assert snapshot(stub) == before, case
        # The stream is still usable: a valid step on it.
        ok = stream.send(kvmem_pb2.StepRequest(session_id=kv.session_id, alloc_slots=[1], alloc_needs=[1]))
        assert not ok.HasField("error") and np.frombuffer(ok.kv_loc, "<i4").tolist() == [2 * 4 + 2]
    finally:
        stream.close()


def test_a_body_that_does_not_parse_is_refused_in_band(raw) -> None:
    channel, kv = raw
    stream = RawStream(channel)
    try:
        answer = stream.send(b"\xff\xff\xff")
        code, message, reason, _ = in_band(answer.error)
        assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and reason == "BAD_VALUE"
        assert "StepStream" in message and "3 bytes" in message and "kvmem.v1.StepRequest" in message
        unknown = stream.send(kvmem_pb2.StepRequest(session_id="made-up-session", release_slots=[1]))
        assert in_band(unknown.error)[2] == "UNKNOWN_SESSION"
        ok = stream.send(kvmem_pb2.StepRequest(session_id=kv.session_id, truncate_slots=[1], truncate_lens=[6]))
        assert not ok.HasField("error")
    finally:
        stream.close()


def test_int32_byte_columns_are_the_repeated_columns(raw) -> None:
    """``alloc_slots_i32`` and the rest: the same step as the repeated fields; both forms
    of one column, or bytes that are not whole int32 values, are BAD_VALUE naming it."""
    channel, kv = raw
    stub = stub_for(channel)
    sid = kv.session_id
    as_bytes = stub.Step(kvmem_pb2.StepRequest(session_id=sid, alloc_slots_i32=i32([1, 2]),
                                               alloc_needs_i32=i32([3, 2]), alloc_expected_lens_i32=i32([6, -1])),
                         timeout=5)  # fmt: skip
    stub.Step(kvmem_pb2.StepRequest(session_id=sid, truncate_slots_i32=i32([1, 2]), truncate_lens_i32=i32([6, 3])),
              timeout=5)  # fmt: skip
    as_ints = stub.Step(kvmem_pb2.StepRequest(session_id=sid, alloc_slots=[1, 2], alloc_needs=[3, 2],
                                              alloc_expected_lens=[6, -1]), timeout=5)  # fmt: skip
    # The same step (the pool hands the pages back out in another order: compare all but page ids).
    for field in ("alloc_status", "kv_loc_offsets", "new_page_offsets", "num_free_pages"):
        assert getattr(as_bytes, field) == getattr(as_ints, field), field
    assert (np.frombuffer(as_bytes.kv_loc, "<i4") % 4).tolist() == (np.frombuffer(as_ints.kv_loc, "<i4") % 4).tolist()
    before = snapshot(stub)
    bad = [
        (dict(alloc_slots=[1], alloc_slots_i32=i32([1]), alloc_needs=[1]), ("alloc_slots", "both", "send one")),
        (dict(release_slots_i32=b"\x01\x00\x00"), ("release_slots_i32", "3 bytes", "int32")),
        (dict(alloc_slots_i32=i32([1]), alloc_needs_i32=i32([-4])), ("alloc_needs[0]", "-4")),
        (dict(alloc_slots_i32=i32([1, 1]), alloc_needs_i32=i32([1, 1])), ("slot 1", "twice")),
        (dict(truncate_slots_i32=i32([1]), truncate_lens_i32=i32([1, 2])), ("truncate_lens", "2")),
    ]
    for args, named in bad:
        with pytest.raises(grpc.RpcError) as exc_info:
            stub.Step(kvmem_pb2.StepRequest(session_id=sid, **args), timeout=5)
        assert exc_info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, args
        for word in named:
            assert word in exc_info.value.details(), (word, exc_info.value.details())
    assert snapshot(stub) == before


def _op(rng: random.Random, live: list[int], prompts: list[list[int]]) -> dict[str, Any]:
    """One step's arguments over the open slots ``live``: allocs that fit and some that
    do not, truncates, releases with token ids, matches, cache items, an invalid step.
    Token ids come from a few shared prompts, so matches hit."""
    kind = rng.choice(["alloc", "alloc", "alloc", "big", "truncate", "release", "match", "cache", "bad"])
    slots = rng.sample(live, rng.randint(1, min(3, len(live))))
    p = rng.choice(prompts)
    if kind == "alloc":
        return dict(alloc_slots=slots, alloc_needs=[rng.randint(0, 9) for _ in slots])
    if kind == "big":
        return dict(alloc_slots=slots, alloc_needs=[rng.choice([1, 200, 900]) for _ in slots], atomic=True)
    if kind == "truncate":
        return dict(truncate_slots=slots[:1], truncate_lens=[rng.randint(0, 8)])
    if kind == "release":
        return dict(release_slots=slots[:1], release_token_ids=[p[: rng.randint(0, 24)]])
    if kind == "match":
        return dict(match=[(slots[0], p, rng.choice([None, 7]))], alloc_slots=slots[:1], alloc_needs=[len(p)])
    if kind == "cache":
        return dict(cache=[(slots[0], p[: rng.randint(0, 8)])])
    return dict(alloc_slots=slots, alloc_needs=[-1] * len(slots))


def _outcome(client: KVMemClient, args: dict[str, Any]) -> tuple[Any, ...]:
    try:
        r = client.step(**args)
    except KVMemError as err:
        return ("error", type(err).__name__, err.code, err.reason, err.message)
    return (r.status.tolist(), r.kv_loc.tolist(), r.kv_loc_offsets.tolist(), r.new_pages.tolist(),
            r.new_page_offsets.tolist(), r.match_lens.tolist(), r.cache_switched.tolist(), r.num_pages_released,
            r.num_free_pages, r.num_pages_cached, r.num_pages_evicted)  # fmt: skip


def test_a_long_mixed_run_gives_the_same_results_streamed_and_unary(tmpdir_short: str) -> None:
    """Two servers with the same geometry: one client streams (columns as arrays, so as
    int32 bytes), the other calls unary Step (columns as lists, the repeated fields).
    Every result and every error is the same, step by step."""
    a = start_server(tmpdir_short, *SERVER_ARGS, socket_name="a.sock")
    b = start_server(tmpdir_short, *SERVER_ARGS, socket_name="b.sock")
    try:
        with KVMemClient(a.target, name="s") as streamed, KVMemClient(b.target, name="u", step_stream=False) as unary:
            ids = [f"r{i}" for i in range(6)]
            live = streamed.open(ids).tolist()
            assert unary.open(ids).tolist() == live == [1, 2, 3, 4, 5, 6]
            rng = random.Random(7)
            prompts = [[rng.randrange(1000) for _ in range(24)] for _ in range(3)]
            kinds: dict[str, int] = {}
            for i in range(300):
                args = _op(rng, live, prompts)
                as_arrays = {  # int32 and int64 arrays alike go as int32 bytes
                    k: np.asarray(v, dtype=np.int64 if i % 2 else np.int32) if k.endswith(("_slots", "_needs")) else v
                    for k, v in args.items()
                }
                got, want = _outcome(streamed, as_arrays), _outcome(unary, args)
                assert got == want, (i, args)
                kind = str(got[1]) if got[0] == "error" else "ok"
                kinds[kind] = kinds.get(kind, 0) + 1
                if "release_slots" in args and kind == "ok":  # open another in its place, on both
                    live.remove(args["release_slots"][0])
                    new_id = [f"n{i}"]
                    slot = streamed.open(new_id).tolist()
                    assert unary.open(new_id).tolist() == slot
                    live += slot
            assert "SessionLost" not in kinds, kinds
            assert kinds["ok"] > 150 and kinds.get("InvalidArgument", 0) > 10, kinds  # both paths exercised
            first_stream = streamed._steps
            assert first_stream is not None and first_stream.usable  # errors never broke the stream
        for srv in (a, b):
            with grpc.insecure_channel(srv.target) as channel:
                assert "sessions" not in snapshot(stub_for(channel))
    finally:
        assert a.stop() == 0 and b.stop() == 0


def test_threads_sharing_a_client_take_turns_on_its_stream(server: ServerProcess) -> None:
    with KVMemClient(server.target, name="threads") as kv:
        slots = kv.open([f"t{i}" for i in range(8)]).tolist()
        failures: list[BaseException] = []

        def work(mine: list[int]) -> None:
            try:
                for n in range(40):
                    r = kv.alloc(mine, [1, 1], expected_lens=[n, n])
                    assert r.ok and r.kv_loc.numel() == 2
            except BaseException as err:  # noqa: BLE001 - reported below
                failures.append(err)

        threads = [threading.Thread(target=work, args=(slots[i : i + 2],)) for i in range(0, 8, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not failures, failures
        assert kv.stats(audit=True).num_used_pages == 8 * 10


# ------------------------------------------------------ a stream's end, a broken call


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_a_step_past_its_deadline_fails_and_the_next_one_works(server: ServerProcess, step_stream: bool) -> None:
    """The server is stopped (SIGSTOP) until a step with a 0.3 s timeout has failed with
    DEADLINE_EXCEEDED, in both modes; after SIGCONT the next step goes through (on a new
    stream)."""
    with KVMemClient(server.target, name="late", step_stream=step_stream) as kv:
        slots = kv.open(["r"])
        assert kv.alloc(slots, [4]).ok
        server.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(KVMemError) as exc_info:
                kv.alloc(slots, [0], timeout=0.3)
            took = time.monotonic() - started
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert exc_info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, exc_info.value
        # Not early; and it did raise while the server was stopped (the SIGCONT comes after).
        assert 0.25 < took < 10, took
        r = kv.alloc(slots, [1])  # the timed-out alloc of 0 tokens changed nothing either way
        assert r.ok and r.kv_loc.tolist() == [2 * 4]  # token 4 of row [1, 2]


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_a_killed_server_fails_the_step_as_unavailable_or_session_lost(tmpdir_short: str, step_stream: bool) -> None:
    srv = start_server(tmpdir_short, *SERVER_ARGS)
    kv = KVMemClient(srv.target, name="k", step_stream=step_stream, keepalive=False)
    try:
        slots = kv.open(["r"])
        assert kv.alloc(slots, [4]).ok
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(10)
        with pytest.raises(Unavailable) as exc_info:
            kv.alloc(slots, [1])
        assert exc_info.value.code == grpc.StatusCode.UNAVAILABLE
        again = start_server(tmpdir_short, *SERVER_ARGS)  # the same socket: a new server run
        try:
            deadline = time.monotonic() + 15
            while True:  # UNAVAILABLE until the channel's reconnection backoff lets it reach the new server
                try:
                    kv.alloc(slots, [1])
                except Unavailable:
                    assert time.monotonic() < deadline, "never reached the new server"
                    time.sleep(0.1)
                    continue
                except SessionLost as lost:  # a new stream reached the new server
                    assert lost.reason == "UNKNOWN_SESSION" and lost.views_stale
                    break
                raise AssertionError("the step went through on a new server run")
        finally:
            kv.close()
            assert again.stop() == 0
    finally:
        kv.close()


@pytest.mark.parametrize("run", range(3))
@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
def test_after_the_drain_the_stream_ends_with_shutting_down(tmpdir_short: str, step_stream: bool, run: int) -> None:
    """Steps go on through the drain on the open stream; after it the step in flight or
    the next one fails UNAVAILABLE (SHUTTING_DOWN, or a refused connection once the
    listener is gone), as a unary Step does. (The keep-alive stream may tell first: the
    session is then lost with the same code and reason.)"""
    srv = start_server(tmpdir_short, *SERVER_ARGS[:-2], "--lease-ms", "3000", "--drain-ms", "1500",
                       "--shutdown-grace-ms", "2000")  # fmt: skip
    kv = KVMemClient(srv.target, name="drained", step_stream=step_stream)
    try:
        slots = kv.open(["r"])
        assert kv.alloc(slots, [4]).ok
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while srv.health() != NOT_SERVING:  # the drain has begun
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.01)
        ok, failure = 0, None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                kv.truncate(slots, [4])
                ok += 1
            except KVMemError as err:
                failure = err
                break
            time.sleep(0.01)
        assert ok >= 1, ok  # stepping through the drain
        assert isinstance(failure, (Unavailable, SessionLost)), failure
        assert failure.code == grpc.StatusCode.UNAVAILABLE, failure
        assert failure.reason in ("SHUTTING_DOWN", "UNSPECIFIED"), failure
        assert srv.proc.wait(timeout=10) == 0, srv.log()
    finally:
        kv.close()
        srv.stop()


def test_a_stream_without_the_token_ends_unauthenticated(tmpdir_short: str) -> None:
    port = free_tcp_port()
    srv = start_server(tmpdir_short, *SERVER_ARGS, "--tcp", f"127.0.0.1:{port}", "--auth-token", "tok",
                       socket_name="t.sock")  # fmt: skip
    try:
        with KVMemClient(f"127.0.0.1:{port}", name="remote", auth_token="tok") as kv:
            assert kv.alloc(kv.open(["r"]), [3]).ok  # the stream carries the token
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                for metadata in (None, (("authorization", "Bearer nope"),)):
                    stream = RawStream(channel, metadata=metadata)
                    with pytest.raises(grpc.RpcError) as exc_info:
                        stream.send(kvmem_pb2.StepRequest(session_id=kv.session_id, release_slots=[1]))
                    stream.close()
                    assert exc_info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert kv.stats().num_open_requests == 1  # nothing released
    finally:
        assert srv.stop() == 0


# ------------------------------------------------------------------------ asyncio


def test_the_async_client_streams_errors_in_band_and_recovers_from_a_cancelled_step(server: ServerProcess) -> None:
    async def main() -> None:
        async with AsyncKVMemClient(server.target, name="aio") as kv:
            slots = await kv.open(["x", "y"])
            r = await kv.alloc(slots, torch.tensor([5, 2]))
            assert r.ok and r.kv_loc.tolist() == [4, 5, 6, 7, 8, 12, 13]
            stream = kv._steps
            with pytest.raises(InvalidArgument, match=r"alloc_needs\[0\]"):
                await kv.alloc(slots[:1], [-1])
            with pytest.raises(KVMemError) as exc_info:
                await kv.alloc([9], [1])
            assert exc_info.value.reason == "SLOT_NOT_FOUND"
            assert kv._steps is stream and stream.usable  # in-band errors keep the stream
            # A step cancelled while in flight: the stream is dropped, the next step opens another.
            server.proc.send_signal(signal.SIGSTOP)
            try:
                task = asyncio.ensure_future(kv.alloc(slots, [0, 0]))
                await asyncio.sleep(0.2)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            finally:
                server.proc.send_signal(signal.SIGCONT)
            assert not stream.usable
            r = await kv.alloc(slots, [1, 1], expected_lens=[5, 2])
            assert r.ok and kv._steps is not stream
            server.proc.send_signal(signal.SIGSTOP)  # a step past its deadline, however fast the host
            try:
                with pytest.raises(KVMemError) as exc_info:
                    await kv.alloc(slots, [0, 0], timeout=0.2)
            finally:
                server.proc.send_signal(signal.SIGCONT)
            assert exc_info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert (await kv.alloc(slots, [0, 0], expected_lens=[6, 3])).ok

    asyncio.run(main())


def test_every_kind_of_int_column_is_sent_as_the_same_values(raw) -> None:
    """Views with an offset or a stride, int64 and int16 tensors and arrays, requires-grad
    free tensors, empty ones: each column reaches the server as the list would (int32
    bytes where it fits, the repeated field where a value does not)."""
    channel, kv = raw
    stub = stub_for(channel)
    big = torch.arange(0, 8, dtype=torch.int32)  # [0..7]: slot 1 at [1], slot 2 at [2]
    kinds = [
        ("offset view", big[1:3], torch.tensor([1, 1], dtype=torch.int32)[:2]),
        ("strided view", torch.tensor([1, 9, 2, 9], dtype=torch.int32)[::2], torch.ones(4, dtype=torch.int32)[::2]),
        ("int64 tensor", torch.tensor([1, 2]), torch.tensor([1, 1])),
        ("int16 array", np.array([1, 2], dtype=np.int16), np.array([1, 1], dtype=np.uint8)),
        ("big-endian array", np.array([1, 2], dtype=">i4"), np.array([1, 1], dtype=">i8")),
        ("list", [1, 2], [1, 1]),
    ]
    for case, slots, needs in kinds:
        r = kv.alloc(slots, needs, expected_lens=torch.tensor([6, 3]))
        assert r.ok and r.kv_loc.tolist() == [2 * 4 + 2, 3 * 4 + 3], case  # token 6 of [1, 2], token 3 of [3]
        assert kv.truncate(np.array([1, 2]), torch.tensor([6, 3], dtype=torch.int32)).num_pages_released == 0, case
    before = snapshot(stub)
    with pytest.raises(InvalidArgument, match=str(2**40)):  # beyond int32: sent as is, refused naming it
        kv.alloc(torch.tensor([1]), torch.tensor([2**40]))
    empty = kv.step(alloc_slots=torch.zeros(0, dtype=torch.int32), alloc_needs=np.zeros(0, dtype=np.int64))
    assert empty.ok and empty.kv_loc.numel() == 0
    assert snapshot(stub) == before


@pytest.mark.parametrize("step_stream", [True, False], ids=["stream", "unary"])
@pytest.mark.parametrize("api", ["sync", "asyncio"])
def test_a_big_step_to_a_stopped_server_ends_at_its_deadline(
    server: ServerProcess, step_stream: bool, api: str
) -> None:
    """An 8 MB step (2M token ids) cannot be handed to a stopped server (HTTP/2 flow
    control): gRPC (1.85) would wait past the call's deadline, sending it; the clients
    bound such calls themselves. DEADLINE_EXCEEDED at its timeout, and the next step
    works once the server runs again."""
    tokens = np.zeros(2_000_000, dtype=np.int32)

    def big_step_while_stopped(step: Any) -> tuple[KVMemError, float]:
        server.proc.send_signal(signal.SIGSTOP)
        started = time.monotonic()
        try:
            with pytest.raises(KVMemError) as exc_info:
                step()
            return exc_info.value, time.monotonic() - started
        finally:
            server.proc.send_signal(signal.SIGCONT)

    if api == "sync":
        with KVMemClient(server.target, name="big", step_stream=step_stream, keepalive=False) as kv:
            slot = int(kv.open(["big"])[0])
            err, took = big_step_while_stopped(lambda: kv.step(match=[(slot, tokens)], timeout=0.5))
            assert kv.alloc([slot], [1], timeout=30).ok
    else:

        async def main() -> tuple[KVMemError, float]:
            async with AsyncKVMemClient(server.target, name="big", step_stream=step_stream, keepalive=False) as kv:
                slot = int((await kv.open(["big"]))[0])
                server.proc.send_signal(signal.SIGSTOP)
                started = time.monotonic()
                try:
                    with pytest.raises(KVMemError) as exc_info:
                        await kv.step(match=[(slot, tokens)], timeout=0.5)
                    outcome = exc_info.value, time.monotonic() - started
                finally:
                    server.proc.send_signal(signal.SIGCONT)
                assert (await kv.alloc([slot], [1], timeout=30)).ok
                return outcome

        err, took = asyncio.run(main())
    assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert 0.4 < took < 10, took  # not early; raised while the server was stopped (SIGCONT comes after)


def test_a_timeout_is_a_positive_finite_number_of_seconds(server: ServerProcess) -> None:
    """gRPC fails a call with an infinite deadline at once (DEADLINE_EXCEEDED, even the
    Attach): the clients refuse such a timeout up front, naming it, and change nothing."""
    for bad in (float("inf"), 0, -1.0, float("nan"), "10"):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            KVMemClient(server.target, name="t", timeout=bad)  # type: ignore[arg-type]
    with KVMemClient(server.target, name="t") as kv:
        slots = kv.open(["r"])
        with pytest.raises(ValueError, match="got inf"):
            kv.alloc(slots, [1], timeout=float("inf"))
        with pytest.raises(ValueError, match="got 0"):
            kv.timeout = 0
        assert kv.timeout == 10.0 and kv.alloc(slots, [1], expected_lens=[0], timeout=1e6).ok
