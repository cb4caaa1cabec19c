"""The gRPC service end to end: a real ``kvmem serve`` process on a unix socket (fixture
``server``), real channels, the real sync and asyncio clients. No mocks.

Geometry of the ``server`` fixture: page_size 4, num_pages 257 (pages 1..256 usable,
page 0 is padding), request slots 1..16, max_context 256 tokens = 64 pages per request,
lease 1500 ms. A token slot (kv_loc) is ``page * 4 + offset``. The pool hands out pages
1, 2, 3, ... in order, and a freed page is the next one handed out (a stack), so the
expected values below are exact. Block-table rows are drawn in comments, e.g.
``# row 1: [1, 2]  len 6``.

The error tests follow docs/DESIGN.md, Errors, row by row. Each checks the status code, that the
message names the offending value, and that nothing changed: the Stats before and
after are equal, and a probe step (alloc one token, truncate it away) returns the same
kv_loc before and after.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch
from conftest import READINESS, ServerProcess, start_server, wait_keepalive_answered
from google.protobuf import descriptor_pb2, json_format
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from kvmem.client import (
    AllocStatus,
    AsyncKVMemClient,
    FailedPrecondition,
    InvalidArgument,
    KVMemClient,
    KVMemError,
    NoFreeRequestSlot,
    NotFound,
    SessionLost,
    Unauthenticated,
    Unavailable,
)
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

PS = 4  # page size of the fixture
TOTAL = 256  # usable pages of the fixture
MAX_REQUESTS = 16
BIG = 2**40
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


# ---------------------------------------------------------------------------- helpers


def tokens(pages: list[int], start: int, count: int) -> list[int]:
    """kv_loc of tokens [start, start + count) of a request whose row is ``pages``."""
    return [pages[t // PS] * PS + t % PS for t in range(start, start + count)]


def stub_for(channel: grpc.Channel) -> kvmem_pb2_grpc.KVMemoryStub:
    return kvmem_pb2_grpc.KVMemoryStub(channel)


def snapshot(stub: kvmem_pb2_grpc.KVMemoryStub) -> dict[str, Any]:
    """The server's state as Stats shows it, minus what changes with time alone
    (uptime, idle times) and the step counter. Asserts the audit holds."""
    s = stub.Stats(kvmem_pb2.StatsRequest(audit=True), timeout=5)
    assert s.audit.ran and s.audit.ok, list(s.audit.problems)
    assert s.num_free_pages + s.num_cached_pages + s.num_used_pages + s.num_quarantined_pages == s.num_pages_total
    d = json_format.MessageToDict(s)
    for key in ("uptimeMs", "numSteps"):
        d.pop(key, None)
    for usage in d.get("sessions", []):
        usage.pop("idleMs", None)
    return d


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    """The kvmem ErrorInfo detail of a failed raw call (there must be exactly one)."""
    status = rpc_status.from_call(err)
    assert status is not None, f"no google.rpc.Status in {err!r}"
    infos = []
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert len(infos) == 1, status
    assert infos[0].domain == "kvmem.v1"
    return infos[0]


def raw_error(call: Callable[..., Any], request: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc_info:
        call(request, timeout=5, **kwargs)
    return exc_info.value


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------ the happy path, sync


def test_sync_client_attach_open_step_stats(server: ServerProcess) -> None:
    with KVMemClient(server.target, name="worker-sync") as kv:
        assert kv.lease_ms == 1500
        assert len(kv.epoch) >= 8 and len(kv.session_id) >= 24
        g = kv.geometry
        assert (g.num_pages, g.page_size, g.max_requests, g.max_context_len, g.max_pages_per_request) == (
            257, 4, 16, 256, 64,
        )  # fmt: skip

        slots = kv.open(["r0", "r1"])
        assert slots.dtype == torch.int32 and slots.tolist() == [1, 2]
        assert kv.open(["r1", "r0"]).tolist() == [2, 1]  # idempotent per request id

        res = kv.alloc(slots, [5, 3])
        # row 1: [1, 2]  len 5     row 2: [3]  len 3
        assert res.ok and res.status.tolist() == [AllocStatus.OK, AllocStatus.OK]
        assert res.kv_loc.dtype == torch.int32
        assert res.kv_loc_offsets.tolist() == [0, 5, 8]
        assert res.kv_loc_of(0).tolist() == [4, 5, 6, 7, 8] == tokens([1, 2], 0, 5)
        assert res.kv_loc_of(1).tolist() == [12, 13, 14]
        assert res.new_page_offsets.tolist() == [0, 2, 3]
        assert res.new_pages_of(0).tolist() == [1, 2] and res.new_pages_of(1).tolist() == [3]
        assert (res.num_free_pages, res.num_pages_released) == (TOTAL - 3, 0)
        # The same columns as numpy views of the answer's bytes (read-only), or a clear refusal.
        for name in ("status", "kv_loc", "kv_loc_offsets", "new_pages", "new_page_offsets", "match_lens"):
            view = res.array(name)
            assert view.dtype == getattr(res, name).numpy().dtype and not view.flags.writeable, name
            assert view.tolist() == getattr(res, name).tolist(), name
        with pytest.raises(ValueError, match=r"no column 'slots': one of adopt_lens, adopt_slots, cache_switched"):
            res.array("slots")

        res = kv.alloc([1], [2], expected_lens=[5])  # fills page 2's tail: tokens 5, 6
        # row 1: [1, 2]  len 7
        assert res.kv_loc.tolist() == [9, 10] and res.new_pages.tolist() == []
        assert res.num_free_pages == TOTAL - 3

        res = kv.truncate([1], [3])  # keeps ceil(3 / 4) = 1 page; page 2 goes back
        # row 1: [1]  len 3
        assert res.status.tolist() == [] and res.kv_loc.tolist() == []
        assert (res.num_pages_released, res.num_free_pages) == (1, TOTAL - 2)

        res = kv.alloc([1, 2], [2, 1], expected_lens=[3, -1])
        # row 1: [1, 2]  len 5 (page 2 again: the last page freed is the next taken)
        # row 2: [3]  len 4
        assert res.ok
        assert res.kv_loc_of(0).tolist() == [7, 8] and res.new_pages_of(0).tolist() == [2]
        assert res.kv_loc_of(1).tolist() == [15] and res.new_pages_of(1).tolist() == []

        st = kv.stats(audit=True)
        assert st.epoch == kv.epoch
        assert st.audit.ran and st.audit.ok and list(st.audit.problems) == []
        assert (st.num_pages_total, st.num_free_pages, st.num_used_pages, st.num_cached_pages) == (TOTAL, 253, 3, 0)
        assert (st.num_open_requests, st.num_free_request_slots) == (2, MAX_REQUESTS - 2)
        assert st.num_steps == 4
        assert st.geometry == kv.geometry
        assert st.version == importlib.metadata.version("kvmem")  # what `kvmem --version` prints
        [usage] = st.sessions
        assert (usage.name, usage.num_requests, usage.num_pages_held) == ("worker-sync", 2, 3)
        assert not usage.HasField("quota_pages")
        assert kv.session_id not in str(st)  # the session id is never shown
        assert not kv.stats().audit.ran  # the O(pool) audit only on demand

        res = kv.release(slots)
        assert (res.num_pages_released, res.num_free_pages) == (3, TOTAL)
        st = kv.stats(audit=True)
        assert (st.num_free_pages, st.num_used_pages, st.num_open_requests) == (TOTAL, 0, 0)
        assert st.num_free_request_slots == MAX_REQUESTS and st.audit.ok
        assert [(u.num_requests, u.num_pages_held) for u in st.sessions] == [(0, 0)]
        assert kv.open(["r0"]).tolist() == [2]  # a released request id starts afresh
        assert kv.detach() == 1
        with pytest.raises(SessionLost):
            kv.open(["r9"])

    with grpc.insecure_channel(server.target) as channel:
        st = stub_for(channel).Stats(kvmem_pb2.StatsRequest(audit=True), timeout=5)
    assert list(st.sessions) == [] and st.num_free_pages == TOTAL and st.audit.ok


def test_alloc_statuses_are_per_item_results(server: ServerProcess) -> None:
    """Capacity shortfalls are results, not errors: a failed item changes nothing."""
    with KVMemClient(server.target, name="quota", quota_pages=10) as q, KVMemClient(server.target, name="big") as big:
        r = q.open(["long", "fits", "over-quota"]).tolist()
        res = q.alloc(r, [257, 24, 20])  # > max_context; 6 pages; 5 pages > 4 left of the quota
        assert res.status.tolist() == [AllocStatus.CONTEXT_TOO_LONG, AllocStatus.OK, AllocStatus.QUOTA_EXCEEDED]
        assert not res.ok
        assert res.kv_loc_offsets.tolist() == [0, 0, 24, 24] and res.new_page_offsets.tolist() == [0, 0, 6, 6]
        assert res.kv_loc_of(1).tolist() == tokens([1, 2, 3, 4, 5, 6], 0, 24)
        assert res.num_free_pages == TOTAL - 6

        res = q.alloc([r[0], r[2]], [4, 257], atomic=True)  # item 0 would fit: aborted
        assert res.status.tolist() == [AllocStatus.ABORTED, AllocStatus.CONTEXT_TOO_LONG]
        assert res.kv_loc.tolist() == [] and res.new_pages.tolist() == [] and res.num_free_pages == TOTAL - 6

        b = big.open(["b0", "b1", "b2", "b3"]).tolist()
        res = big.alloc(b, [256, 256, 256, 256])  # 4 x 64 pages; only 250 are free
        assert res.status.tolist() == [AllocStatus.OK] * 3 + [AllocStatus.OUT_OF_PAGES]
        assert res.num_free_pages == TOTAL - 6 - 192
        assert res.kv_loc_of(3).tolist() == [] and res.new_pages_of(3).tolist() == []

        st = q.stats(audit=True)
        held = {u.name: (u.num_requests, u.num_pages_held, u.quota_pages if u.HasField("quota_pages") else None)
                for u in st.sessions}  # fmt: skip
        assert held == {"quota": (3, 6, 10), "big": (4, 192, None)}
        assert st.audit.ok and st.num_used_pages == 198
        # Nothing of a failed item was applied: its alloced_len is still 0.
        assert q.alloc([r[0], r[2]], [1, 1], expected_lens=[0, 0]).ok
    with grpc.insecure_channel(server.target) as channel:
        assert snapshot(stub_for(channel))["numFreePages"] == str(TOTAL)


# --------------------------------------------------------- the happy path, asyncio


def test_async_client_attach_open_step_stats(server: ServerProcess) -> None:
    async def main() -> None:
        async with AsyncKVMemClient(server.target, name="worker-async") as kv:
            assert kv.lease_ms == 1500 and kv.geometry.page_size == PS
            slots = await kv.open(["a0", "a1"])
            assert slots.tolist() == [1, 2]
            assert (await kv.open(["a1"])).tolist() == [2]

            res = await kv.alloc(slots, [6, 1])
            # row 1: [1, 2]  len 6     row 2: [3]  len 1
            assert res.ok and res.kv_loc_of(0).tolist() == tokens([1, 2], 0, 6)
            assert res.kv_loc_of(1).tolist() == [12] and res.new_pages.tolist() == [1, 2, 3]

            res = await kv.step(truncate_slots=[1], truncate_lens=[2], alloc_slots=[1, 2], alloc_needs=[3, 4],
                                alloc_expected_lens=[2, 1])  # fmt: skip
            # truncate first: row 1: [1] len 2, page 2 freed; then allocs:
            # row 1: [1, 2] len 5 (page 2 again)    row 2: [3, 4] len 5
            assert res.ok and res.num_pages_released == 1
            assert res.kv_loc_of(0).tolist() == [6, 7, 8] and res.new_pages_of(0).tolist() == [2]
            assert res.kv_loc_of(1).tolist() == [13, 14, 15, 16] and res.new_pages_of(1).tolist() == [4]
            assert res.num_free_pages == TOTAL - 4

            with pytest.raises(InvalidArgument) as exc_info:  # the same errors as the sync client
                await kv.alloc([1], [-1])
            assert exc_info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "-1" in exc_info.value.message

            # A second asyncio client on the same loop; steps of both interleave.
            async with AsyncKVMemClient(server.target, name="other-async") as other:
                [o] = (await other.open(["o0"])).tolist()
                assert o == 3
                results = await asyncio.gather(
                    other.alloc([o], [1], expected_lens=[0]),  # row 3: [5]  len 1
                    kv.alloc([2], [1], expected_lens=[5]),  # row 2: [3, 4]  len 6
                )
                assert all(r.ok for r in results)
                st = await kv.stats(audit=True)
                assert st.audit.ok and st.num_used_pages == 5 and st.num_open_requests == 3
                by_name = {u.name: (u.num_requests, u.num_pages_held) for u in st.sessions}
                assert by_name == {"worker-async": (2, 4), "other-async": (1, 1)}
                assert await other.detach() == 1

            st = await kv.stats(audit=True)
            assert [u.name for u in st.sessions] == ["worker-async"] and st.num_used_pages == 4
            res = await kv.release([1])
            assert (res.num_pages_released, res.num_free_pages) == (2, TOTAL - 2)
            assert await kv.detach() == 1  # the detach releases what is still open
            with pytest.raises(SessionLost):
                await kv.stats()

        client = await AsyncKVMemClient.connect(server.target, name="connect")
        st = await client.stats(audit=True)
        assert [u.name for u in st.sessions] == ["connect"] and st.num_free_pages == TOTAL and st.audit.ok
        await client.close()
        await client.close()  # idempotent

    asyncio.run(main())


# ------------------------------------------------------------- health, reflection


def test_health_serving_for_liveness_and_readiness(server: ServerProcess) -> None:
    assert server.health("") == SERVING
    assert server.health(READINESS) == SERVING
    with grpc.insecure_channel(server.target) as channel:
        err = raw_error(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest(service="nope"))
    assert err.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvmem.v1.KVMemory"),
        ]
        listed, described = list(stub.ServerReflectionInfo(iter(requests), timeout=5))
    names = {s.name for s in listed.list_services_response.service}
    assert {"kvmem.v1.KVMemory", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]  # fmt: skip
    [kvmem_file] = [f for f in files if f.package == "kvmem.v1"]
    [service] = [s for s in kvmem_file.service if s.name == "KVMemory"]
    assert {m.name for m in service.method} >= {"Attach", "Detach", "KeepAlive", "Open", "Step", "Stats"}


# ---------------------------------------------------------- docs/DESIGN.md, Errors


@dataclasses.dataclass
class World:
    """Two sessions on the fixture's server:

    session A "alpha":  slot a = 1, row [1, 2]  len 6;   slot b = 2, row [3]  len 3
    session B "beta":   slot c = 3, row [4, 5]  len 5
    free pages 6..256 (251); free request slots 4..16 (13)
    """

    server: ServerProcess
    stub: kvmem_pb2_grpc.KVMemoryStub
    A: KVMemClient
    B: KVMemClient
    a: int = 1
    b: int = 2
    c: int = 3

    def probe(self) -> list[list[int]]:
        """Alloc one token on each open slot with a known state, then truncate it away:
        the kv_loc returned proves the rows and lengths are what the drawing says."""
        out = []
        for client, slot, length in ((self.A, self.a, 6), (self.A, self.b, 3), (self.B, self.c, 5)):
            res = client.alloc([slot], [1], expected_lens=[length])
            assert res.ok and res.new_pages.tolist() == [], res
            out.append(res.kv_loc.tolist())
            assert client.truncate([slot], [length]).num_pages_released == 0
        return out

    def expect_unchanged(self, before: dict[str, Any]) -> None:
        assert snapshot(self.stub) == before
        assert self.probe() == PROBE


PROBE = [[10], [15], [21]]  # token 6 of row [1, 2]; token 3 of [3]; token 5 of [4, 5]


@pytest.fixture
def world(server: ServerProcess) -> Iterator[World]:
    with (
        grpc.insecure_channel(server.target) as channel,
        KVMemClient(server.target, name="alpha") as A,
        KVMemClient(server.target, name="beta") as B,
    ):
        assert A.open(["a", "b"]).tolist() == [1, 2]
        assert B.open(["c"]).tolist() == [3]
        assert A.alloc([1, 2], [6, 3]).new_pages.tolist() == [1, 2, 3]
        assert B.alloc([3], [5]).new_pages.tolist() == [4, 5]
        w = World(server, stub_for(channel), A, B)
        assert w.probe() == PROBE
        yield w


def expect_error(
    w: World, cls: type[KVMemError], code: grpc.StatusCode, reason: str, call: Callable[[], Any], *named: object
) -> KVMemError:
    """``call`` raises ``cls`` with ``code`` and ``reason``, its message names every value
    in ``named``, and nothing changed on the server."""
    before = snapshot(w.stub)
    with pytest.raises(cls) as exc_info:
        call()
    err = exc_info.value
    assert err.code == code, err
    assert err.reason == reason, err
    for value in named:
        assert str(value) in err.message, f"{value!r} not named in {err.message!r}"
    w.expect_unchanged(before)
    return err


INVALID_STEPS: list[tuple[str, dict[str, Any], str, tuple[object, ...]]] = [
    # (case, step arguments of session A, reason, values the message must name)
    ("negative need", dict(alloc_slots=[1], alloc_needs=[-1]), "BAD_VALUE", ("alloc_needs[0]", -1)),
    ("negative need, 2nd item", dict(alloc_slots=[1, 2], alloc_needs=[1, -7]), "BAD_VALUE", ("alloc_needs[1]", -7)),
    ("2^40 need", dict(alloc_slots=[1], alloc_needs=[BIG]), "BAD_VALUE", ("alloc_needs[0]", BIG)),
    ("int64 max need", dict(alloc_slots=[1], alloc_needs=[2**63 - 1]), "BAD_VALUE", (2**63 - 1,)),
    ("int64 min need", dict(alloc_slots=[1], alloc_needs=[-(2**63)]), "BAD_VALUE", (-(2**63),)),
    ("negative truncate len", dict(truncate_slots=[1], truncate_lens=[-2]), "BAD_VALUE", ("truncate_lens[0]", -2)),
    (
        "expected len below -1",
        dict(alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[-5]),
        "BAD_VALUE",
        ("alloc_expected_lens[0]", -5),
    ),
    (
        "alloc lengths differ",
        dict(alloc_slots=[1, 2], alloc_needs=[1]),
        "LENGTH_MISMATCH",
        ("alloc_slots", "alloc_needs", 2, 1),
    ),
    (
        "truncate lengths differ",
        dict(truncate_slots=[1], truncate_lens=[1, 2]),
        "LENGTH_MISMATCH",
        ("truncate_slots", "truncate_lens", 1, 2),
    ),
    (
        "expected lengths differ",
        dict(alloc_slots=[1], alloc_needs=[1], alloc_expected_lens=[6, 3]),
        "LENGTH_MISMATCH",
        ("alloc_expected_lens", 2),
    ),
    # (a duplicate is named by its slot and by the index of one of its occurrences)
    (
        "duplicate alloc slot",
        dict(alloc_slots=[1, 2, 1], alloc_needs=[1, 1, 1]),
        "DUPLICATE_SLOT",
        ("alloc_slots[", "slot 1", "twice"),
    ),
    ("duplicate release slot", dict(release_slots=[2, 2]), "DUPLICATE_SLOT", ("release_slots[", "slot 2")),
    (
        "duplicate truncate slot",
        dict(truncate_slots=[1, 1], truncate_lens=[1, 1]),
        "DUPLICATE_SLOT",
        ("truncate_slots[", "slot 1"),
    ),
    ("many duplicates", dict(alloc_slots=[2] * 16, alloc_needs=[1] * 16), "DUPLICATE_SLOT", ("slot 2",)),
    (
        "column over max_requests",
        dict(alloc_slots=[2] * 40, alloc_needs=[1] * 40),
        "BAD_VALUE",
        ("alloc_slots has 40 items", "max_requests = 16"),
    ),
    # The step is validated whole: the valid release and truncate are not applied either.
    (
        "valid release, bad alloc",
        dict(release_slots=[2], truncate_slots=[1], truncate_lens=[1], alloc_slots=[1], alloc_needs=[-3]),
        "BAD_VALUE",
        ("alloc_needs[0]", -3),
    ),  # fmt: skip
]


def test_malformed_input_is_invalid_argument_and_changes_nothing(world: World) -> None:
    for case, args, reason, named in INVALID_STEPS:
        try:
            expect_error(world, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, reason,
                         lambda: world.A.step(**args), *named)  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"case {case!r}: {exc}") from exc

    # Other calls: request ids, session names.
    expect_error(world, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "BAD_VALUE",
                 lambda: world.A.open(["x", ""]), "request id #1")  # fmt: skip
    expect_error(world, InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT, "BAD_VALUE",
                 lambda: KVMemClient(world.server.target, name="n" * 300), 300)  # fmt: skip

    # On the wire: the status code and the ErrorInfo detail, through a raw stub.
    err = raw_error(world.stub.Step, kvmem_pb2.StepRequest(session_id=world.A.session_id, alloc_slots=[1],
                                                           alloc_needs=[BIG]))  # fmt: skip
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and str(BIG) in err.details()
    assert error_info(err).reason == "BAD_VALUE"
    world.expect_unchanged(snapshot(world.stub))


def test_unknown_session_is_failed_precondition(world: World) -> None:
    before = snapshot(world.stub)
    made_up = "made-up-session-id-0123456789abcdef"
    calls = [
        (world.stub.Open, kvmem_pb2.OpenRequest(session_id=made_up, request_ids=["x"])),
        (world.stub.Step, kvmem_pb2.StepRequest(session_id=made_up, release_slots=[1])),
        (world.stub.Step, kvmem_pb2.StepRequest(session_id=made_up, alloc_slots=[1], alloc_needs=[1])),
        (world.stub.Detach, kvmem_pb2.DetachRequest(session_id=made_up)),
        (world.stub.Step, kvmem_pb2.StepRequest(session_id="")),
    ]
    for call, request in calls:
        err = raw_error(call, request)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (request, err)
        assert "unknown session" in err.details(), err.details()
        assert error_info(err).reason == "UNKNOWN_SESSION"
        if request.session_id:
            assert made_up[:6] in err.details()  # recognisable ...
            assert made_up not in err.details()  # ... but an id is a credential: never echoed whole
        else:
            assert "''" in err.details()
    with pytest.raises(grpc.RpcError) as exc_info:
        list(world.stub.KeepAlive(iter([kvmem_pb2.KeepAliveRequest(session_id=made_up)]), timeout=5))
    assert exc_info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "unknown session" in exc_info.value.details()
    world.expect_unchanged(before)

    # A detached session is unknown too, to its client and on the wire.
    with KVMemClient(world.server.target, name="gone") as gone:
        gone.open(["g"])
        gone_id = gone.session_id
    err = raw_error(world.stub.Open, kvmem_pb2.OpenRequest(session_id=gone_id, request_ids=["x"]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "unknown session" in err.details()
    world.expect_unchanged(before)


def test_client_after_server_restart_gets_unknown_session(server: ServerProcess, tmpdir_short: str) -> None:
    plain = KVMemClient(server.target, name="no-keepalive", keepalive=False)
    kept = KVMemClient(server.target, name="keepalive")
    plain.alloc(plain.open(["p"]), [9])
    kept.alloc(kept.open(["k"]), [9])
    old_epoch = plain.epoch
    assert server.stop() == 0
    extra = server.args[server.args.index("--socket") + 2 :]
    again = start_server(tmpdir_short, *extra)
    try:
        with pytest.raises(SessionLost) as exc_info:
            plain.open(["p2"])
        err = exc_info.value
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.reason == "UNKNOWN_SESSION"
        assert "unknown session" in err.message and old_epoch not in err.message
        with pytest.raises(SessionLost):  # whether the keep-alive or the call noticed first
            kept.alloc([1], [1])
        with grpc.insecure_channel(again.target) as channel:
            st = snapshot(stub_for(channel))
        assert st["epoch"] != old_epoch and "sessions" not in st and st["numFreePages"] == str(TOTAL)
        plain.close()
        kept.close()
    finally:
        assert again.stop() == 0, again.log()


def test_slot_of_another_session_is_not_found_like_a_closed_slot(world: World) -> None:
    """B cannot tell A's open slot 1 from a slot nobody holds: same code, same words."""
    A_slot, closed = world.a, 9
    for what, step in (
        ("alloc_slots", lambda s: world.B.step(alloc_slots=[s], alloc_needs=[1])),
        ("truncate_slots", lambda s: world.B.step(truncate_slots=[s], truncate_lens=[0])),
        ("release_slots", lambda s: world.B.step(release_slots=[s])),
    ):
        errors = {}
        for slot in (A_slot, closed, 0, -1, MAX_REQUESTS + 1, BIG):
            err = expect_error(world, NotFound, grpc.StatusCode.NOT_FOUND, "SLOT_NOT_FOUND",
                               lambda: step(slot), f"{what}[0]", f"slot {slot}")  # fmt: skip
            errors[slot] = err
            assert "not open in this session" in err.message
        wording = {err.message.replace(f"slot {slot}", "slot N") for slot, err in errors.items()}
        assert len(wording) == 1, wording
        meta = {tuple(sorted((k, v) for k, v in err.metadata.items() if k != "slot")) for err in errors.values()}
        assert len(meta) == 1, meta
        assert all(err.metadata.get("slot") == str(slot) for slot, err in errors.items())

    # A's own slot in a list of B's: the item's index is named, nothing of A's state.
    err = expect_error(
        world,
        NotFound,
        grpc.StatusCode.NOT_FOUND,
        "SLOT_NOT_FOUND",
        lambda: world.B.step(alloc_slots=[world.c, A_slot], alloc_needs=[1, 1]),
        "alloc_slots[1]",
    )
    assert "alpha" not in err.message and "6" not in err.message  # A's name, A's alloced_len
    # Releasing and allocating one slot in one step: the alloc finds it gone.
    expect_error(world, NotFound, grpc.StatusCode.NOT_FOUND, "SLOT_NOT_FOUND",
                 lambda: world.A.step(release_slots=[world.b], alloc_slots=[world.b], alloc_needs=[1]),
                 "alloc_slots[0]", f"slot {world.b}")  # fmt: skip
    # Request ids are per session: B opening "a" gets a slot of its own.
    assert world.B.open(["a"]).tolist() == [4]
    assert world.probe() == PROBE


def test_alloced_len_mismatch_and_truncate_beyond_are_failed_precondition(world: World) -> None:
    FP = grpc.StatusCode.FAILED_PRECONDITION
    err = expect_error(world, FailedPrecondition, FP, "ALLOCED_LEN_MISMATCH",
                       lambda: world.A.alloc([world.a, world.b], [1, 1], expected_lens=[6, 4]),
                       "alloc_expected_lens[1]", "4", "alloced_len 3", f"slot {world.b}")  # fmt: skip
    assert not isinstance(err, SessionLost)
    assert err.metadata["alloced_len"] == "3"
    expect_error(world, FailedPrecondition, FP, "ALLOCED_LEN_MISMATCH",
                 lambda: world.A.alloc([world.a], [1], expected_lens=[BIG]), BIG, "alloced_len 6")  # fmt: skip
    # The expectation is checked after the step's truncates: 6 is stale once truncated to 4,
    # and the truncate is not applied either.
    expect_error(world, FailedPrecondition, FP, "ALLOCED_LEN_MISMATCH",
                 lambda: world.A.step(truncate_slots=[world.a], truncate_lens=[4], alloc_slots=[world.a],
                                      alloc_needs=[1], alloc_expected_lens=[6]),
                 "alloc_expected_lens[0] = 6", "alloced_len 4")  # fmt: skip
    err = expect_error(world, FailedPrecondition, FP, "TRUNCATE_BEYOND_ALLOCED",
                       lambda: world.A.truncate([world.b, world.a], [1, 7]),
                       "truncate_lens[1]", "7", "alloced_len 6", f"slot {world.a}")  # fmt: skip
    assert not isinstance(err, SessionLost)
    expect_error(world, FailedPrecondition, FP, "TRUNCATE_BEYOND_ALLOCED",
                 lambda: world.B.truncate([world.c], [BIG]), BIG, "alloced_len 5")  # fmt: skip
    # On the wire.
    err = raw_error(world.stub.Step, kvmem_pb2.StepRequest(session_id=world.B.session_id, truncate_slots=[3],
                                                           truncate_lens=[6]))  # fmt: skip
    assert err.code() == FP and "6" in err.details() and error_info(err).reason == "TRUNCATE_BEYOND_ALLOCED"


def test_no_free_request_slot_is_resource_exhausted(world: World) -> None:
    RE = grpc.StatusCode.RESOURCE_EXHAUSTED
    more = world.B.open([f"fill-{i}" for i in range(13)]).tolist()
    assert sorted(more) == list(range(4, 17))
    err = expect_error(world, NoFreeRequestSlot, RE, "NO_FREE_REQUEST_SLOT",
                       lambda: world.A.open(["one-more"]), "0 of 16")  # fmt: skip
    assert err.metadata == {"requested": "1", "free": "0"}
    assert world.A.open(["a", "b"]).tolist() == [1, 2]  # already open: no new slot needed

    err = raw_error(world.stub.Open, kvmem_pb2.OpenRequest(session_id=world.B.session_id, request_ids=["x"]))
    assert err.code() == RE and error_info(err).reason == "NO_FREE_REQUEST_SLOT"
    assert "no free request slot" in err.details()

    # All or nothing: with one slot free, asking for two takes none.
    world.B.release([more[0]])
    err = expect_error(world, NoFreeRequestSlot, RE, "NO_FREE_REQUEST_SLOT",
                       lambda: world.B.open(["x", "fill-1", "y"]), "2 new request(s)", "1 of 16")  # fmt: skip
    assert snapshot(world.stub)["numFreeRequestSlots"] == 1
    assert world.B.open(["x"]).tolist() == [more[0]]


def test_tcp_requires_bearer_token(tmpdir_short: str) -> None:
    port = free_tcp_port()
    token = "s3cret-token"
    srv = start_server(tmpdir_short, "--tcp", f"127.0.0.1:{port}", "--auth-token", token, "--page-size", "4",
                       "--num-pages", "257", "--max-context", "256", socket_name="tcp.sock")  # fmt: skip
    try:
        tcp = f"127.0.0.1:{port}"
        with grpc.insecure_channel(tcp) as channel, grpc.insecure_channel(srv.target) as unix:
            stub, local = stub_for(channel), stub_for(unix)
            before = snapshot(local)  # the unix socket (mode 0600) needs no token
            for metadata, words in (
                (None, "missing authorization"),
                ((("authorization", "Bearer wrong-token"),), "wrong bearer token"),
                ((("authorization", token),), "wrong bearer token"),  # no "Bearer " scheme
                # Compared whole, in constant time: a prefix, an extension, a case change, nothing.
                ((("authorization", f"Bearer {token[:-1]}"),), "wrong bearer token"),
                ((("authorization", f"Bearer {token}x"),), "wrong bearer token"),
                ((("authorization", f"Bearer {token.upper()}"),), "wrong bearer token"),
                ((("authorization", "Bearer "),), "wrong bearer token"),
            ):
                for call, request in (
                    (stub.Attach, kvmem_pb2.AttachRequest(name="intruder")),
                    (stub.Stats, kvmem_pb2.StatsRequest()),
                    (stub.Open, kvmem_pb2.OpenRequest(session_id="x", request_ids=["r"])),
                ):
                    err = raw_error(call, request, metadata=metadata)
                    assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
                    assert words in err.details() and token not in err.details()
                    assert "wrong-token" not in err.details()  # a secret is not echoed
                    assert error_info(err).reason == "BAD_TOKEN"
                with pytest.raises(grpc.RpcError) as exc_info:
                    list(stub.KeepAlive(iter([kvmem_pb2.KeepAliveRequest(session_id="x")]), timeout=5,
                                        metadata=metadata))  # fmt: skip
                assert exc_info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(Unauthenticated):
                KVMemClient(tcp, name="intruder", auth_token="wrong-token")
            assert snapshot(local) == before  # no session was created

            with KVMemClient(tcp, name="remote", auth_token=token) as kv:
                res = kv.alloc(kv.open(["r"]), [5])
                assert res.ok and res.kv_loc.tolist() == tokens([1, 2], 0, 5)
                assert [u.name for u in kv.stats(audit=True).sessions] == ["remote"]
                wait_keepalive_answered(kv)  # the keep-alive stream carries the token too
                assert kv.alloc([1], [1], expected_lens=[5]).ok
            assert snapshot(local) == before
    finally:
        assert srv.stop() == 0, srv.log()


# --------------------------------------------------------------- process life cycle


def test_sigterm_readiness_not_serving_attach_unavailable_exit_0(tmpdir_short: str) -> None:
    srv = start_server(tmpdir_short, "--page-size", "4", "--num-pages", "257", "--max-context", "256", "--lease-ms", "1500",
                       "--shutdown-grace-ms", "1000")  # fmt: skip
    try:
        kv = KVMemClient(srv.target, name="busy")
        kv.alloc(kv.open(["r"]), [10])
        with grpc.insecure_channel(srv.target) as channel:
            # A readiness watch: an in-flight call that sees the status change.
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=READINESS),
                                                              timeout=20)  # fmt: skip
            assert next(watch).status == SERVING
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING
            assert srv.proc.poll() is None  # still shutting down: the watch is in flight
            err = raw_error(stub_for(channel).Attach, kvmem_pb2.AttachRequest(name="late"))
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(Unavailable):
                KVMemClient(srv.target, name="late", timeout=2)
            with pytest.raises(grpc.RpcError) as exc_info:
                list(watch)  # cancelled when the grace period ends
            assert exc_info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert srv.proc.wait(timeout=10) == 0, srv.log()
        assert time.monotonic() - t0 < 1.0 + 5.0
        assert not os.path.exists(srv.socket_path)
        assert "shutting down" in srv.log()
        with pytest.raises(SessionLost):
            kv.alloc([1], [1])
        kv.close()
    finally:
        srv.stop()


def test_sigterm_with_attached_clients_exits_0_promptly_and_removes_its_socket(tmpdir_short: str) -> None:
    """Keep-alive streams are not in-flight work: after the drain (1 s by default, the
    session being still attached), the server ends them at once instead of waiting for
    them. The grace period is 30 s here: waiting for them would cost all of it."""
    server = start_server(tmpdir_short, "--num-pages", "65", "--page-size", "4", "--max-context", "64",
                          "--shutdown-grace-ms", "30000")  # fmt: skip
    assert stat.S_IMODE(os.stat(server.socket_path).st_mode) == 0o600
    kv = KVMemClient(server.target, name="attached")
    kv.alloc(kv.open(["r"]), [3])
    time.sleep(0.1)  # the keep-alive stream is open
    t0 = time.monotonic()
    assert server.stop() == 0, server.log()
    assert time.monotonic() - t0 < 10, server.log()  # drain 1 s, then no wait for the streams
    assert not os.path.exists(server.socket_path)
    deadline = time.monotonic() + 3
    while True:  # the keep-alive thread reports the end of the session
        try:
            kv.alloc([1], [1])
        except SessionLost as err:  # with the server's reason, from the keep-alive stream
            assert err.reason == "SHUTTING_DOWN" and err.code == grpc.StatusCode.UNAVAILABLE, err
            assert "keep-alive stream broke" in err.message and "shutting down" in err.message, err
            break
        except Unavailable:
            assert time.monotonic() < deadline, "the client never noticed the session ended"
            time.sleep(0.05)
    kv.close()


def test_keepalive_broken_without_a_reason_is_session_lost_unspecified(tmpdir_short: str) -> None:
    """A server that dies sends no reason: the keep-alive streams of both clients break,
    and the next call raises SessionLost with reason UNSPECIFIED and a message that says
    the stream broke and why. The client invents no reason for a detach either."""
    srv = start_server(tmpdir_short, "--num-pages", "17", "--max-context", "256", "--lease-ms", "1500")
    kv = KVMemClient(srv.target, name="sync")

    async def lost_async() -> SessionLost:
        async with AsyncKVMemClient(srv.target, name="async") as akv:
            await akv.open(["a"])
            srv.stop(signal.SIGKILL)
            deadline = time.monotonic() + 3
            while True:
                try:
                    await akv.stats()
                except SessionLost as err:
                    return err
                except Unavailable:
                    assert time.monotonic() < deadline, "the asyncio client never noticed the session ended"
                    await asyncio.sleep(0.05)

    def lost_sync() -> SessionLost:
        deadline = time.monotonic() + 3
        while True:
            try:
                kv.stats()
            except SessionLost as err:
                return err
            except Unavailable:
                assert time.monotonic() < deadline, "the client never noticed the session ended"
                time.sleep(0.05)

    try:
        kv.open(["s"])
        for err in (asyncio.run(lost_async()), lost_sync()):
            assert err.reason == "UNSPECIFIED" and err.raw_reason == "" and err.code == grpc.StatusCode.UNAVAILABLE
            assert err.message.startswith("the keep-alive stream broke: UNAVAILABLE: "), err
    finally:
        srv.stop(signal.SIGKILL)
        kv.close()

    other_srv = start_server(tmpdir_short, socket_name="other.sock")
    try:
        with KVMemClient(other_srv.target, name="detached") as other:
            assert other.detach() == 0
            with pytest.raises(SessionLost) as exc_info:
                other.open(["x"])
            assert exc_info.value.reason == "UNSPECIFIED" and "detached" in exc_info.value.message
    finally:
        assert other_srv.stop() == 0, other_srv.log()


def test_second_server_on_the_same_socket_is_refused(server: ServerProcess) -> None:
    inode = os.stat(server.socket_path).st_ino
    with KVMemClient(server.target, name="first") as kv:
        kv.alloc(kv.open(["r"]), [5])
        second = subprocess.run(
            [sys.executable, "-m", "kvmem.cli", "serve", "--socket", server.socket_path],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode != 0
        assert "in use" in second.stderr and server.socket_path in second.stderr, second.stderr
        assert os.stat(server.socket_path).st_ino == inode  # not stolen
        assert server.health() == SERVING
        res = kv.alloc([1], [1], expected_lens=[5])
        assert res.ok and res.kv_loc.tolist() == [9]
        assert kv.stats(audit=True).audit.ok


def test_dead_servers_socket_is_removed_at_next_start(tmpdir_short: str) -> None:
    first = start_server(tmpdir_short, "--num-pages", "17", "--max-context", "256", socket_name="s.sock")
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert stat.S_ISSOCK(os.lstat(first.socket_path).st_mode)  # left behind
    second = start_server(tmpdir_short, "--num-pages", "17", "--max-context", "256", socket_name="s.sock")
    try:
        assert "stale socket" in second.log()
        assert stat.S_IMODE(os.stat(second.socket_path).st_mode) == 0o600
        with KVMemClient(second.target, name="after") as kv:
            assert kv.alloc(kv.open(["r"]), [1]).ok
    finally:
        assert second.stop() == 0, second.log()
    assert not os.path.exists(second.socket_path)

    # A path that is not a socket is never replaced.
    path = os.path.join(tmpdir_short, "file.sock")
    with open(path, "w") as f:
        f.write("keep me")
    refused = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "serve", "--socket", path],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0 and "not a socket" in refused.stderr, refused.stderr
    with open(path) as f:
        assert f.read() == "keep me"
