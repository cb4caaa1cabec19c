"""Malformed input and limits (issue 11): bodies that do not parse, rate-limited refusal
logs, and each documented limit at its boundary -- request id length, ids per Open,
items per Step column, sessions per server, message size -- plus released ids keeping
no memory. The server's behaviour is tested against a real ``kvmem serve`` (fixture
``server``: max_requests 16); the core's and the refusal log's directly.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, start_server
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status

from kvmem.client import KVMemClient
from kvmem.server.edge import refusals
from kvmem.server.process.app import MAX_MESSAGE_BYTES
from kvmem.server.core import CoreConfig, KVCore, StepBatch
from kvmem.server.core.slots import MAX_REQUEST_ID_BYTES
from kvmem.server.errors import KVMemError, Reason
from kvmem.server.edge.refusals import RefusalLog, peer_address
from kvmem.server.sessions import Sessions
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

MAX_REQUESTS = 16  # of the `server` fixture
SERVICE = "/kvmem.v1.KVMemory/"
BAD_BODIES = [b"\xff\xff\xff", b"\x08", b"\x0a\x05ab", b"garbage!", b"\x0a\x02\xff\xfe"]  # last: bad UTF-8
UNARY = ["Attach", "Detach", "Open", "Step", "Stats"]


# ---------------------------------------------------------------------------- helpers


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)
    assert status is not None, f"no google.rpc.Status in {err!r}"
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return info
    raise AssertionError(f"no ErrorInfo in {status}")


def raw_unary(channel: grpc.Channel, method: str, body: bytes, **kwargs) -> bytes:
    call = channel.unary_unary(SERVICE + method, request_serializer=None, response_deserializer=None)
    return call(body, timeout=10, **kwargs)


def refused(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


def audit_ok(stub: kvmem_pb2_grpc.KVMemoryStub) -> kvmem_pb2.StatsResponse:
    s = stub.Stats(kvmem_pb2.StatsRequest(audit=True), timeout=5)
    assert s.audit.ran and s.audit.ok, list(s.audit.problems)
    return s


def no_traceback(server: ServerProcess) -> None:
    log = server.log()
    assert "Traceback" not in log and " ERROR " not in log, log[-4000:]


def refusal_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "kvmem.refusals" in line]


@pytest.fixture
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


# --------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize("method", UNARY)
def test_a_body_that_does_not_parse_is_invalid_argument_naming_the_method(
    server: ServerProcess, channel: grpc.Channel, method: str
) -> None:
    stub = kvmem_pb2_grpc.KVMemoryStub(channel)
    before = audit_ok(stub)
    for body in BAD_BODIES if method != "Stats" else BAD_BODIES[:-1]:  # Stats has no string field 1
        err = refused(raw_unary, channel, method, body)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (body, err)
        assert f"{method}: the request body ({len(body)} bytes) is not a valid kvmem.v1.{method}Request" in (
            err.details() or ""
        ), err.details()
        assert error_info(err).reason == "BAD_VALUE"
    after = audit_ok(stub)
    assert (after.num_free_pages, len(after.sessions)) == (before.num_free_pages, len(before.sessions))
    no_traceback(server)


def test_the_client_library_raises_invalid_argument_for_a_bad_body(server: ServerProcess) -> None:
    """The same refusal read through kvmem.client's error mapping."""
    from kvmem.client.errors import InvalidArgument, from_rpc_error

    with grpc.insecure_channel(server.target) as ch:
        err = from_rpc_error(refused(raw_unary, ch, "Step", b"\xff\xff\xff"))
    assert isinstance(err, InvalidArgument) and err.reason == "BAD_VALUE"


def test_a_keepalive_message_that_does_not_parse_ends_the_stream_as_invalid_argument(
    server: ServerProcess, channel: grpc.Channel
) -> None:
    stream = channel.stream_stream(SERVICE + "KeepAlive", request_serializer=None, response_deserializer=None)
    # as the first message
    err = refused(lambda: list(stream(iter([b"\xff\xff\xff"]), timeout=10)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert "KeepAlive: the request body (3 bytes) is not a valid kvmem.v1.KeepAliveRequest" in (err.details() or "")
    # after a good one, from a live session: the stream is refused, and nothing freed early
    with KVMemClient(server.target, name="ka", keepalive=False) as kv:
        kv.alloc(kv.open(["r"]), [8])
        good = kvmem_pb2.KeepAliveRequest(session_id=kv.session_id).SerializeToString()
        answers = []
        with pytest.raises(grpc.RpcError) as info:
            for answer in stream(iter([good, b"\x08"]), timeout=10):
                answers.append(answer)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert len(answers) == 1
        stub = kvmem_pb2_grpc.KVMemoryStub(channel)
        assert audit_ok(stub).num_used_pages == 2  # the session and its pages are intact
    no_traceback(server)


def test_a_bad_body_from_an_unauthenticated_tcp_peer_is_refused_for_its_token(
    tmpdir_short: str, free_port: int
) -> None:
    srv = start_server(tmpdir_short, "--tcp", f"127.0.0.1:{free_port}", "--auth-token", "s3cret")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{free_port}") as ch:
            for _ in range(200):
                err = refused(raw_unary, ch, "Step", b"\xff\xff\xff")
                assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            stream = ch.stream_stream(SERVICE + "KeepAlive", request_serializer=None, response_deserializer=None)
            err = refused(lambda: list(stream(iter([b"\xff"]), timeout=10)))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
            # with the token, the bad body is what is refused
            meta = (("authorization", "Bearer s3cret"),)
            err = refused(raw_unary, ch, "Step", b"\xff\xff\xff", metadata=meta)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    finally:
        assert srv.stop() == 0
    log = srv.log()
    assert "Traceback" not in log
    lines = refusal_lines(log)
    # the first of each kind (Step and KeepAlive without a token, Step's bad body) at
    # once, the other 199 in the summary flushed at shutdown
    assert len(lines) == 4, lines
    assert "refused KeepAlive from ipv4:127.0.0.1: BAD_TOKEN" in lines[1], lines
    summary = [line for line in lines if "refused 199 calls" in line]
    assert len(summary) == 1, lines
    assert "199 x Step BAD_TOKEN from ipv4:127.0.0.1" in summary[0], summary[0]


@pytest.fixture
def free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------- refusals in the log


def test_200_refused_calls_make_a_bounded_log_that_names_the_count(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as ch:
        stub = kvmem_pb2_grpc.KVMemoryStub(ch)
        for _ in range(100):
            refused(raw_unary, ch, "Step", b"\xff\xff\xff")
        for _ in range(100):
            refused(stub.Step, kvmem_pb2.StepRequest(session_id="nobody"), timeout=5)
        during = refusal_lines(server.log())
    assert server.stop() == 0
    lines = refusal_lines(server.log())
    assert len(lines) <= 4, lines
    assert len(during) == 2, during  # the first of each kind at once, the rest later
    assert "refused Step from unix:" in during[0] and "BAD_VALUE" in during[0]
    assert "refused Step from unix:" in during[1] and "UNKNOWN_SESSION" in during[1]
    summary = [line for line in lines if "refused 198 calls" in line]
    assert len(summary) == 1, lines
    assert "99 x Step BAD_VALUE from unix:" in summary[0] and "99 x Step UNKNOWN_SESSION" in summary[0]
    assert "Traceback" not in server.log()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING, logger="kvmem.refusals")
    yield caplog


def test_refusal_log_first_line_at_once_then_one_summary_per_interval(logged) -> None:
    clock = _Clock()
    rl = RefusalLog(10.0, clock=clock)
    for i in range(200):
        rl.record("ipv4:10.0.0.1:5000", "Step", "BAD_VALUE", f"bad #{i}")
    assert len(logged.records) == 1 and "refused Step from ipv4:10.0.0.1: BAD_VALUE: bad #0" in logged.text
    clock.now += 10.0
    rl.record("ipv4:10.0.0.1:5001", "Step", "BAD_VALUE", "bad #200")  # the interval is over: a summary first
    assert len(logged.records) == 2
    assert "refused 199 calls in the last 10.0s: 199 x Step BAD_VALUE from ipv4:10.0.0.1 (last: bad #199)" in (
        logged.records[1].getMessage()
    )
    # a steady flood: one summary per interval, nothing else (the kind stays known)
    for _ in range(3):
        for _ in range(50):
            rl.record("ipv4:10.0.0.1:5002", "Step", "BAD_VALUE", "bad")
        clock.now += 10.0
        rl.flush()
    assert len(logged.records) == 5
    assert [r.levelno for r in logged.records] == [logging.WARNING] * 5
    rl.flush()  # nothing pending: no line
    assert len(logged.records) == 5
    assert rl.total == 351


def test_refusal_log_many_peers_cannot_flood_it(logged) -> None:
    clock = _Clock()
    rl = RefusalLog(10.0, clock=clock)
    for i in range(5000):
        rl.record(f"ipv6:[2001:db8::{i:x}]:443", "Attach", "BAD_TOKEN", "missing authorization metadata")
    assert len(logged.records) == refusals.FIRST_LINES_PER_INTERVAL
    rl.flush()
    assert len(logged.records) == refusals.FIRST_LINES_PER_INTERVAL + 1
    summary = logged.records[-1].getMessage()
    assert summary.startswith(f"refused {5000 - refusals.FIRST_LINES_PER_INTERVAL} calls")
    assert "(other peers)" in summary and "more of" in summary
    assert len(summary) < 4000
    assert len(rl._kinds) <= refusals.MAX_KINDS


def test_refusal_log_flushes_on_the_event_loop_by_itself(logged) -> None:
    async def main() -> None:
        rl = RefusalLog(0.05)
        for _ in range(3):
            rl.record("unix:", "Open", "BAD_VALUE", "x")
        await asyncio.sleep(0.2)

    asyncio.run(main())
    assert len(logged.records) == 2 and "refused 2 calls" in logged.records[1].getMessage()


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:127.0.0.1:5555", "ipv4:127.0.0.1"),
        ("ipv6:[::1]:5555", "ipv6:[::1]"),
        ("unix:", "unix:"),
        ("unix:/tmp/x.sock", "unix:/tmp/x.sock"),
        ("weird", "weird"),
    ],
)
def test_peer_address_drops_the_port(peer: str, address: str) -> None:
    assert peer_address(peer) == address


# ------------------------------------------------------------------ request ids


def test_request_id_length_limit_over_the_wire(server: ServerProcess, channel: grpc.Channel) -> None:
    with KVMemClient(server.target, name="ids") as kv:
        stub = kvmem_pb2_grpc.KVMemoryStub(channel)
        at_limit = "x" * MAX_REQUEST_ID_BYTES
        assert kv.open([at_limit]).tolist() == [1]
        for rid, size in (("y" * (MAX_REQUEST_ID_BYTES + 1), 257), ("é" * 129, 258), ("z" * (1 << 20), 1 << 20)):
            err = refused(
                stub.Open, kvmem_pb2.OpenRequest(session_id=kv.session_id, request_ids=["ok", rid]), timeout=10
            )
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"request id #1 is {size} bytes long (UTF-8), at most {MAX_REQUEST_ID_BYTES}" in err.details()
            info = error_info(err)
            assert info.reason == "BAD_VALUE" and info.metadata["length"] == str(size)
            assert len(err.details()) < 300  # the id itself is never echoed
        s = audit_ok(stub)
        assert s.num_open_requests == 1  # "ok" was not opened: all or nothing
    no_traceback(server)


def test_ids_per_open_and_items_per_step_column_are_at_most_max_requests(
    server: ServerProcess, channel: grpc.Channel
) -> None:
    stub = kvmem_pb2_grpc.KVMemoryStub(channel)
    with KVMemClient(server.target, name="cols") as kv:
        sid = kv.session_id
        ids = [f"r{i}" for i in range(MAX_REQUESTS + 1)]
        err = refused(stub.Open, kvmem_pb2.OpenRequest(session_id=sid, request_ids=ids), timeout=5)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"request_ids has {MAX_REQUESTS + 1} items, at most max_requests = {MAX_REQUESTS}" in err.details()
        slots = kv.open(ids[:MAX_REQUESTS]).tolist()  # exactly the limit: fine
        assert len(slots) == MAX_REQUESTS
        over = [*slots, slots[0]]
        for column, req in (
            ("release_slots", kvmem_pb2.StepRequest(session_id=sid, release_slots=over)),
            ("alloc_slots", kvmem_pb2.StepRequest(session_id=sid, alloc_slots=over, alloc_needs=[1] * len(over))),
            ("truncate_lens", kvmem_pb2.StepRequest(session_id=sid, truncate_slots=[1], truncate_lens=[0] * 17)),
            ("alloc_expected_lens", kvmem_pb2.StepRequest(
                session_id=sid, alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[0] * 100_000)),
        ):  # fmt: skip
            err = refused(stub.Step, req, timeout=5)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, column
            assert f"at most max_requests = {MAX_REQUESTS} per Step column" in err.details()
            assert err.details().startswith(f"{column} has "), err.details()
            assert error_info(err).metadata["column"] == column
        assert audit_ok(stub).num_used_pages == 0  # nothing applied
        r = kv.alloc(slots, [1] * MAX_REQUESTS)  # a full column is fine
        assert r.ok


# ------------------------------------------------------------------- sessions


def test_sessions_beyond_max_sessions_are_resource_exhausted(tmpdir_short: str) -> None:
    srv = start_server(
        tmpdir_short, "--max-sessions", "2", "--num-pages", "65", "--max-requests", "4", "--max-context", "64"
    )
    try:
        with grpc.insecure_channel(srv.target) as ch:
            stub = kvmem_pb2_grpc.KVMemoryStub(ch)
            a = stub.Attach(kvmem_pb2.AttachRequest(name="a"), timeout=5)
            stub.Attach(kvmem_pb2.AttachRequest(name="b"), timeout=5)
            err = refused(stub.Attach, kvmem_pb2.AttachRequest(name="c"), timeout=5)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 attached, at most max_sessions = 2" in err.details() and "--max-sessions" in err.details()
            info = error_info(err)
            assert info.reason == "TOO_MANY_SESSIONS" and info.metadata["limit"] == "2"
            from kvmem.client.errors import Reason as ClientReason
            from kvmem.client.errors import TooManySessions, from_rpc_error

            client_err = from_rpc_error(err)
            assert isinstance(client_err, TooManySessions) and client_err.reason is ClientReason["TOO_MANY_SESSIONS"]
            stub.Detach(kvmem_pb2.DetachRequest(session_id=a.session_id), timeout=5)
            stub.Attach(kvmem_pb2.AttachRequest(name="c"), timeout=5)  # room again
            assert len(audit_ok(stub).sessions) == 2
    finally:
        assert srv.stop() == 0


def test_sessions_refuse_a_max_sessions_below_1() -> None:
    with pytest.raises(ValueError, match="max_sessions"):
        Sessions(KVCore(CoreConfig(9, 4, 2, 16)), 1.0, max_sessions=0)


def test_sessions_refuse_a_core_that_writes_another_block_table_than_the_memory() -> None:
    """The server builds the core over its memory's block table and gives both to the
    sessions layer, which syncs the rows each step changes: a core writing a table of
    its own would leave the memory's stale."""

    class Memory:
        block_table = np.zeros(CoreConfig(9, 4, 2, 16).block_table_shape, dtype=np.int32)
        syncs_rows = True

        def sync_rows(self, rows: np.ndarray) -> None:
            raise AssertionError("no step runs")

    with pytest.raises(ValueError, match="block table"):
        Sessions(KVCore(CoreConfig(9, 4, 2, 16)), 1.0, Memory())
    memory = Memory()
    assert (
        Sessions(KVCore(CoreConfig(9, 4, 2, 16), memory.block_table), 1.0, memory).core.block_table
        is memory.block_table
    )


# --------------------------------------------------------------- message size


def test_a_message_over_the_size_limit_is_resource_exhausted_and_the_server_stays_up(
    server: ServerProcess,
) -> None:
    options = [("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(server.target, options=options) as ch:
        body = kvmem_pb2.OpenRequest(session_id="x", request_ids=["a" * MAX_MESSAGE_BYTES]).SerializeToString()
        assert len(body) > MAX_MESSAGE_BYTES
        err = refused(raw_unary, ch, "Open", body)
        del body
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert str(MAX_MESSAGE_BYTES) in (err.details() or ""), err.details()
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(server.target) as ch:
        audit_ok(kvmem_pb2_grpc.KVMemoryStub(ch))
    no_traceback(server)


# ---------------------------------------------------------- the core: ids, columns


def _core(max_requests: int = 8) -> tuple[KVCore, int]:
    core = KVCore(CoreConfig(65, 4, max_requests, 64), audit_every_step=True)
    return core, core.add_owner()


def _raises(reason: Reason, fn, *args) -> KVMemError:
    with pytest.raises(KVMemError) as info:
        fn(*args)
    assert info.value.reason is reason, info.value
    return info.value


@pytest.mark.parametrize(
    ("rid", "size"),
    [("a" * 257, 257), ("é" * 129, 258), ("😀" * 65, 260), ("€" * 86, 258), ("a" * 200 + "😀" * 15, 260)],
)
def test_core_refuses_a_request_id_over_the_byte_limit(rid: str, size: int) -> None:
    core, owner = _core()
    err = _raises(Reason.BAD_VALUE, core.open, owner, ["fine", rid])
    assert f"request id #1 is {size} bytes long (UTF-8), at most 256" in err.message
    assert err.metadata == {"index": "1", "length": str(size), "limit": "256"}
    assert core.stats().num_open_requests == 0


@pytest.mark.parametrize("rid", ["a" * 256, "é" * 128, "😀" * 64, "€" * 85 + "a", "\ud800" * 85])
def test_core_accepts_a_request_id_at_the_byte_limit(rid: str) -> None:
    core, owner = _core()
    assert core.open(owner, [rid]).tolist() == [1]


def test_core_refuses_more_ids_per_open_than_max_requests() -> None:
    core, owner = _core(4)
    err = _raises(Reason.BAD_VALUE, core.open, owner, ["a"] * 5)  # even repeated: the list is too long
    assert "request_ids has 5 items, at most max_requests = 4 per Open" in err.message
    assert core.open(owner, ["a"] * 4).tolist() == [1] * 4


def test_core_step_columns_over_max_requests_are_refused_first() -> None:
    core, owner = _core(4)
    nobody = 999  # an unknown slot: the length is checked before anything else
    err = _raises(Reason.BAD_VALUE, core.step, owner, StepBatch.of(truncate_slots=[nobody] * 5, truncate_lens=[0] * 5))
    assert err.message == "truncate_slots has 5 items, at most max_requests = 4 per Step column"
    assert err.metadata == {"column": "truncate_slots", "count": "5", "limit": "4"}


def test_released_ids_keep_no_memory() -> None:
    core, owner = _core(8)
    slots = core.slots
    state = slots.owners[owner]
    ids = [f"req-{i}" for i in range(8)]
    opened = core.open(owner, ids).astype(np.int64)
    core.step(owner, StepBatch(alloc_slots=opened, alloc_needs=np.full(8, 5, dtype=np.int64)))
    assert state.request_slots == dict(zip(ids, opened.tolist(), strict=True))
    # a partial release drops exactly its ids, from the map and from the slot array
    core.step(owner, StepBatch(release_slots=opened[[1, 4, 6]]))
    assert sorted(state.request_slots) == sorted(set(ids) - {"req-1", "req-4", "req-6"})
    assert [slots.request_id[s] for s in opened.tolist()] == [None if i in (1, 4, 6) else ids[i] for i in range(8)]
    # an id opened again gets a slot afresh, and the old one is not resurrected
    again = core.open(owner, ["req-4", "req-0"]).tolist()
    assert again[1] == opened[0] and again[0] not in (opened[0],)
    # releasing all it has empties the map
    rest = np.array(sorted(state.request_slots.values()), dtype=np.int64)
    core.step(owner, StepBatch(release_slots=rest))
    assert state.request_slots == {} and not any(x is not None for x in slots.request_id)
    # many opens and releases leave nothing behind (the map used to keep stale ids)
    for round_ in range(50):
        opened = core.open(owner, [f"r{round_}-{i}" for i in range(8)]).astype(np.int64)
        core.step(owner, StepBatch(release_slots=opened[:7]))
        core.step(owner, StepBatch(release_slots=opened[7:]))
    assert state.request_slots == {} and core.audit().ok
    # a removed owner's ids go too
    core.open(owner, ["x", "y"])
    core.remove_owner(owner)
    assert not any(x is not None for x in slots.request_id)


def test_audit_finds_a_stale_request_id() -> None:
    core, owner = _core(4)
    core.open(owner, ["a"])
    core.slots.owners[owner].request_slots["ghost"] = 2
    core.slots.request_id[3] = "left-behind"
    problems = " ".join(core.audit().problems)
    assert "maps 2 request ids for 1 requests" in problems
    assert "closed request slots keep a request id: [3]" in problems


def test_limits_are_documented_in_operations() -> None:
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md").read_text()
    section = readme.split("\n## Limits", 1)[1].split("\n## ", 1)[0]
    for fragment in ("256 bytes", "max_requests", "--max-sessions", "1024", "256 MiB", "RESOURCE_EXHAUSTED"):
        assert fragment in section, fragment
    assert re.search(r"refus\w+ .*summar", section, re.S)
