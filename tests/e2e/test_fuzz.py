"""The wire fuzzer (issue 11, "the reliability record"; the prefix cache since issue 12):
hypothesis drives random sequences of valid, boundary and invalid calls against a real
``kvmem serve`` process (``KVMEM_DEBUG=1``: the full audit after every step, so a broken
invariant fails the call as INTERNAL), through the generated stub and as raw bodies
(random bytes, truncated, mutated and hand-made malformed encodings of every method's
request) through a generic channel.

The fuzzer keeps a model of what the server should hold: the core's, the reference
model ``tests/kvmodel.py`` that the core's property tests share (each session's open
requests with their lengths and rows, the server's stack of free request slots, each
page's reference count, the prefix cache per namespace -- cached chains keyed by the
whole token prefix up to each page's end, every cached page held or not -- the LRU of
evictable pages, the free pages, the prefix counters; see its docstring for the rules),
its owners the sessions by id; and here the sessions layer's part: each session's name,
quota (which the core is given capped at the pool) and the index Stats shows. From the
model it knows, for each call it makes, whether the call is valid, and if not, which
refusals the design allows (docs/DESIGN.md, Errors: the ``ErrorInfo`` reason, and the
gRPC code that reason comes with; the token lists' format is checked before the session
is looked up: the wire's own refusals, here). After every call it checks:

* the status is OK, INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION or
  RESOURCE_EXHAUSTED -- never UNKNOWN, INTERNAL or UNAVAILABLE -- and a refusal carries a
  ``kvmem.v1`` ErrorInfo whose reason is one the model expects for that input, with the
  gRPC code the proto gives that reason, and a message;
* a valid call's result agrees with the model: Open's slots (exactly: the model follows
  the server's free slot stack), each alloc item's status (greedy admission against the
  free and evictable pages: context limit, quota, pool; ``atomic``), its ``kv_loc``
  (length and values, through the row), its new pages (the page ids of free pages cannot
  be predicted, so they are read from the answer: distinct free pages, and when the free
  ones do not suffice, all of them followed by exactly the evicted pages the model
  predicts, in LRU order), the pages released, the free count; and the prefix fields:
  ``match_lens``, ``cache_switched``, ``num_pages_cached``, ``num_pages_evicted``;
* the server's state agrees with the model, so a refused call changed nothing: Stats
  (free, used, quarantined and cached pages, cache entries, evictions, prefix query and
  hit tokens, open requests, free slots, each session's name, requests, pages held,
  quota, namespace and prefix counters) and the block table in shared memory (each open
  request's row is its pages then zeros -- matched and switched pages included; every
  other row is zeros);
* every few calls, and at the end of each example, Stats(audit=True) holds, with
  free + used + quarantined + cached = total.

Each test runs one server (one geometry: page size 4, and 3, which is not a power of
two) and, at the end, checks that it still serves (health, an audited Stats), that it
exits 0 on SIGTERM, and that its log holds no traceback and no ERROR line.

The sequences are hypothesis examples (``@given(st.data())``) of 40 calls (100 in the
long profile), drawn op by op from the model's state: Step (general, decode-shaped for
the server's fast path, and prefix steps), Open, Attach (in one of two cache namespaces,
now and then a long or bad one), Detach, Stats, KeepAlive streams (one that names a
session and closes ends it; a second session on one stream is refused) and raw bodies
(of prefix steps too). A prefix step combines, in the server's order, releases with
token ids (the request's own tokens: its cached pages' and then its matched prompt's,
or a shared prompt's so that keys repeat across requests and sessions, or random ones;
whole, fewer, partial pages, none), truncates (to page boundaries, and into the middle
of a cached page), cache items on running requests, match items on fresh requests (a
shared prompt, a chain the cache holds, the same tokens as another item, random; with
and without max tokens, alone or with an alloc of the same slot for the request's whole
length) and other allocs. One in three prefix steps also draws faults on purpose: token
bytes not a multiple of 4, offsets one too many or too few, out of order, not from 0 to
the token count, tokens beyond ``alloced_len``, tokens that differ from those a row's
page is cached with, a match on a request that is not fresh, duplicate, bad and released
slots, an expected length on a matched alloc, a truncate into a cached page
(PAGE_SHARED), ``match_max_tokens`` below -1, of the wrong length or without match items,
cache items without token lists. Each must be refused with its reason and change nothing.
Hand-off Steps (slots of the session, or bad, repeated ones; states per item, none, of
the wrong count or too long) and adopt Steps (open tickets in their order of issue,
forged, used, junk and empty ones, repeated; new request ids, ids the session has open,
empty or too long ones): a valid one moves the model's request to the holder or to the
adopter (the ticket read from the answer), a wrong one is refused as the model says.

Every example starts from the same state: two sessions in the default namespace ("fuzz",
and "tight" with a quota of a third of the pool, whose matches stop at it), no cached
page, the free request slots in their first order (:meth:`Fuzzer.settle`, at the end of
each example: the cache's LRU depends on slot numbers, since a Detach releases its
requests in slot order, and the draws may depend only on earlier draws). Raw bodies
cannot desync the model: those of Step, Open, Detach and KeepAlive name a fixed unknown
session (so they change nothing whatever they parse to), those of Attach are handled as
the request they parse to, and Stats after every call would show any change the model
did not make. After a failed example (hypothesis shrinks it on the same server)
:meth:`Fuzzer.resync` brings the server back to that state without the model's help.

Profiles (fuzz calls, split evenly between the two geometries, at least this many: whole
examples run; the Stats calls of the checks are not counted; hypothesis's profiles in
``tests/conftest.py`` do not change them). Both print, per geometry, the calls by
method and outcome, the alloc items by status, what valid steps did to the prefix cache
(items, pages cached, switched, matched and evicted) and the refused Steps by reason and
kind:

* quick, the default (CI): ``KVMEM_FUZZ_CALLS`` unset = 3,000 calls (about 4,000 with
  the resets), 12-15 s here (2 cores, shared);
* long: ``KVMEM_FUZZ_CALLS=100000 .venv/bin/python -m pytest tests/e2e/test_fuzz.py -q -s``
  (see docs/RELIABILITY.md for its last run), printing progress every 10,000 calls. Its
  time is bounded: it grows linearly with the count (each example is at most 100 calls
  plus its reset), and the tests' pytest timeout with it.

Reproducible: hypothesis runs with fixed seeds and no example database, and the draws
depend only on earlier draws (slots are drawn in the order their requests were opened,
not by the numbers the server gave them, and cached chains by their tokens, never by
page ids). A failure prints the draws of the shrunk example (shrinking replays it against
the same server, for up to 5 minutes) and the last calls made with their outcomes and the
server log's tail.

Not covered here: lease expiry and quarantine (the model has no clock; see
``tests/e2e/test_fencing.py``), the message-size limit (256 MiB bodies; ``test_limits.py``),
concurrent callers (each call is one critical section on the server's event loop),
``--no-prefix-cache`` and WatchEvents (``tests/server/test_service_prefix.py``,
``tests/server/test_kv_events.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import math
import os
import shutil
import signal
import struct
import sys
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import ServerProcess, short_tmpdir, start_server
from google.protobuf import text_format
from google.protobuf.message import Message
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from kvmodel import MAX_REQUEST_ID_BYTES, Answer, KVModel, Request, Step, ceil_div, split

from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

# ------------------------------------------------------------------------ profiles

DEFAULT_CALLS = 3000
TOTAL_CALLS = int(os.environ.get("KVMEM_FUZZ_CALLS") or DEFAULT_CALLS)
OPS_PER_EXAMPLE = 40 if TOTAL_CALLS <= DEFAULT_CALLS else 100
PROGRESS_EVERY = 10_000
AUDIT_EVERY = 8  # calls between two audited Stats (the server audits every step anyway)
RPC_TIMEOUT = 10.0
UNKNOWN_SESSION_ID = "u" * 32  # the length of a real session id; no server hands it out

# ------------------------------------------------------------------------ geometry


@dataclasses.dataclass(frozen=True)
class Geometry:
    page_size: int
    num_pages: int  # including the padding page 0
    max_requests: int
    max_context: int
    max_sessions: int

    @property
    def total(self) -> int:
        return self.num_pages - 1

    @property
    def width(self) -> int:
        return -(-self.max_context // self.page_size)

    def args(self) -> list[str]:
        return [
            "--page-size", str(self.page_size), "--num-pages", str(self.num_pages),
            "--max-requests", str(self.max_requests), "--max-context", str(self.max_context),
            "--max-sessions", str(self.max_sessions),
            "--lease-ms", "3600000",  # nothing expires during a run: the model has no clock
            "--layers", "1", "--kv-heads", "1", "--head-dim", "8",
        ]  # fmt: skip


# Small pools, so that the pool, the quotas, the request slots and the session limit run
# out often: 16 and 14 pages per request against 24 and 20 pages.
GEOMETRIES = {
    "ps4": Geometry(page_size=4, num_pages=25, max_requests=6, max_context=64, max_sessions=3),
    "ps3": Geometry(page_size=3, num_pages=21, max_requests=5, max_context=40, max_sessions=4),
}

# ------------------------------------------------------------------ the contract

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_NAME_CHARS = 256  # sessions.MAX_NAME_CHARS (characters)
MAX_NAMESPACE_CHARS = 256  # sessions.MAX_NAMESPACE_CHARS (characters)

Code = grpc.StatusCode
ALLOWED_CODES = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED}
# The gRPC code each ErrorReason comes with (the proto's comments).
REASON_CODE = {
    "BAD_VALUE": Code.INVALID_ARGUMENT,
    "LENGTH_MISMATCH": Code.INVALID_ARGUMENT,
    "DUPLICATE_SLOT": Code.INVALID_ARGUMENT,
    "SLOT_NOT_FOUND": Code.NOT_FOUND,
    "UNKNOWN_SESSION": Code.FAILED_PRECONDITION,
    "ALLOCED_LEN_MISMATCH": Code.FAILED_PRECONDITION,
    "TRUNCATE_BEYOND_ALLOCED": Code.FAILED_PRECONDITION,
    "NO_FREE_REQUEST_SLOT": Code.RESOURCE_EXHAUSTED,
    "TOO_MANY_SESSIONS": Code.RESOURCE_EXHAUSTED,
    "PAGE_SHARED": Code.FAILED_PRECONDITION,
    "TICKET_NOT_FOUND": Code.NOT_FOUND,
    "NAMESPACE_MISMATCH": Code.FAILED_PRECONDITION,
    "QUOTA_EXCEEDED": Code.RESOURCE_EXHAUSTED,
    "MODEL_MISMATCH": Code.FAILED_PRECONDITION,
}

# What a refused Step's message says, for the summary of refusals by kind.
FAULT_KINDS = [
    "unknown session", "not a multiple of 4", "_token_offsets has", "must run from 0", "is below", "appears twice",
    "is not open", "released earlier", "items, at most", "but match_max_tokens has", "items but",
    "must be in [0, 2^31)", "must be >= 0", "is beyond", "differs from alloced_len", "is matched in this step",
    "a match needs a fresh", "beyond alloced_len", "differ from those it is cached", "prefix cache that other requests",
    "no open hand-off ticket", "repeats adopt_tickets", "already open in this session", "another namespace",
    "over its quota", "handoff_states",
]  # fmt: skip

UNARY = ("Attach", "Detach", "Open", "Step", "Stats")
REQUEST_TYPE = {
    "Attach": kvmem_pb2.AttachRequest,
    "Detach": kvmem_pb2.DetachRequest,
    "Open": kvmem_pb2.OpenRequest,
    "Step": kvmem_pb2.StepRequest,
    "Stats": kvmem_pb2.StatsRequest,
    "KeepAlive": kvmem_pb2.KeepAliveRequest,
}
RESPONSE_TYPE = {
    "Attach": kvmem_pb2.AttachResponse,
    "Detach": kvmem_pb2.DetachResponse,
    "Open": kvmem_pb2.OpenResponse,
    "Step": kvmem_pb2.StepResponse,
    "Stats": kvmem_pb2.StatsResponse,
}

# Hand-made malformed (or surprising) encodings; each is sent alone or after a valid
# body. Whether it parses is decided by the same protobuf runtime the server uses.
CRAFTED = [
    b"\x0a\x02\xff\xfe",  # field 1 (a string in every request but Stats) holding bad UTF-8
    b"\x12\x02\xc3\x28",  # field 2: bad UTF-8 in Open's request_ids; packed int64 in Step
    b"\x0a\x05ab",  # a length beyond the end
    b"\x0a\x80\x80\x80\x80\x10",  # a length of 2^32
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a tag varint beyond 64 bits
    b"\x08" + b"\xff" * 10 + b"\x01",  # a value varint beyond 64 bits
    b"\x00",  # field number 0
    b"\x0b",  # a group that never ends
    b"\x0c",  # a group end with no start
    b"\x0f",  # wire type 7
    b"\x0e",  # wire type 6
    b"\x10\x01",  # field 2 as a varint (Attach's quota 1, Stats' nothing, Open's wrong wire type)
    b"\x2a\x0a" + b"\xff" * 9 + b"\x01",  # Step alloc_slots [2^64 - 1 = -1]
    b"\x32\x0a" + b"\xff" * 9 + b"\x7f",  # Step alloc_needs: a varint overflowing 64 bits
    b"\x32\x05" + b"\x80" * 5,  # Step alloc_needs: a packed varint cut short
    b"\x2a\x01\x01\x32\x01\x01",  # Step alloc_slots [1], alloc_needs [1]
    b"\x2a\x01\x01\x32\x0a" + b"\x80" * 9 + b"\x01",  # Step alloc_slots [1], alloc_needs [2^63 = -2^63]
    b"\x1a\x01\x01\x22\x0a" + b"\xff" * 8 + b"\x7f\x00",  # Step truncate [1] to 2^63 - 1, an extra 0 len
    b"\x12\x0a" + b"\xff" * 9 + b"\x01",  # Step release_slots [2^64 - 1 = -1]
    b"\x40\x02",  # Step atomic = 2
    b"\x15\x00\x00\x00\x00",  # field 2 as fixed32
    b"\x11" + b"\x00" * 8,  # field 2 as fixed64
    b"\x1a\x00",  # field 3, empty length-delimited
    b"\xa2\x06\x03abc",  # an unknown field 100
]


def int32s(data: bytes) -> list[int]:
    assert len(data) % 4 == 0, f"an int32 bytes field of {len(data)} bytes"
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def short(msg: Any, limit: int = 600) -> str:
    text = text_format.MessageToString(msg, as_one_line=True) if isinstance(msg, Message) else repr(msg)
    return text if len(text) <= limit else text[:limit] + "…"


# ------------------------------------------------------- sessions and the wire


@dataclasses.dataclass
class SessionModel:
    """A session: what the sessions layer adds to its owner in the core's model (the
    model's owner is the session id)."""

    model: KVModel
    sid: str
    name: str
    quota: int | None
    namespace: str = ""
    index: int | None = None  # learnt from the Stats after its Attach

    @property
    def requests(self) -> dict[int, Request]:
        """Its open requests by slot, in the order they were opened."""
        return self.model.requests_of(self.sid)

    @property
    def ids(self) -> dict[str, int]:
        """Request id -> slot."""
        return {r.rid: slot for slot, r in self.requests.items()}

    @property
    def quota_pages(self) -> int | None:
        """The quota the core is given (the sessions layer caps it at the pool)."""
        return None if self.quota is None else min(self.quota, self.model.num_pages)


def parse_tokens(ids: bytes, offsets: bytes, n: int) -> tuple[list[list[int]] | None, str | None]:
    """A token list field pair as the server's wire layer reads it (``TokenLists.from_wire``):
    (None, None) when both are empty; else the items, or the reason it is refused."""
    if not ids and not offsets:
        return None, None
    if len(ids) % 4 or len(offsets) % 4:
        return None, "BAD_VALUE"
    off = int32s(offsets)
    if len(off) != n + 1:
        return None, "LENGTH_MISMATCH"
    tokens = int32s(ids)
    if off[0] != 0 or off[-1] != len(tokens) or any(b < a for a, b in itertools.pairwise(off)):
        return None, "BAD_VALUE"
    return [tokens[a:b] for a, b in itertools.pairwise(off)], None


def step_of(req: kvmem_pb2.StepRequest) -> tuple[Step, set[str]]:
    """A StepRequest's columns, its token lists parsed (None: absent or refused), and
    the reasons the wire layer refuses it for."""
    lists, wire = {}, set()
    for name, n in (
        ("release", len(req.release_slots)),
        ("cache", len(req.cache_slots)),
        ("match", len(req.match_slots)),
    ):
        lists[name], reason = parse_tokens(getattr(req, f"{name}_token_ids"), getattr(req, f"{name}_token_offsets"), n)
        if reason is not None:
            wire.add(reason)
    step = Step(
        list(req.release_slots), lists["release"], list(req.truncate_slots), list(req.truncate_lens),
        list(req.cache_slots), lists["cache"], list(req.match_slots), lists["match"], list(req.match_max_tokens),
        list(req.alloc_slots), list(req.alloc_needs), list(req.alloc_expected_lens), req.atomic,
    )  # fmt: skip
    return step, wire


def answer_of(resp: kvmem_pb2.StepResponse, n: int) -> Answer:
    """A StepResponse to ``n`` alloc items, as the model reads a result."""
    return Answer(
        list(resp.alloc_status), split(int32s(resp.kv_loc), int32s(resp.kv_loc_offsets), n, "kv_loc"),
        split(int32s(resp.new_pages), int32s(resp.new_page_offsets), n, "new_pages"), resp.num_pages_released,
        int32s(resp.match_lens), int32s(resp.cache_switched), resp.num_pages_cached, resp.num_pages_evicted,
    )  # fmt: skip


@dataclasses.dataclass
class Refusal:
    code: grpc.StatusCode
    reason: str | None  # the kvmem ErrorInfo reason, None without one
    message: str


class Fuzzer:
    """The model, the channel, the calls and the checks."""

    def __init__(self, server: ServerProcess, geometry: Geometry, label: str, budget: int) -> None:
        self.server = server
        self.g = geometry
        self.label = label
        self.budget = budget
        self.channel = grpc.insecure_channel(server.target)
        self.stub = kvmem_pb2_grpc.KVMemoryStub(self.channel)
        self.raw = {
            m: self.channel.unary_unary(f"/kvmem.v1.KVMemory/{m}", request_serializer=None, response_deserializer=None)
            for m in UNARY
        }
        self.raw_keepalive = self.channel.stream_stream(
            "/kvmem.v1.KVMemory/KeepAlive", request_serializer=None, response_deserializer=None
        )
        self.sessions: dict[str, SessionModel] = {}
        self.dead: list[str] = []  # ids of ended sessions
        self.used_tickets: list[str] = []  # tickets adopt items named (adopted, or refused)
        self.model = self.fresh_model()  # the core's state; its owners are the sessions, by id
        self.epoch: str | None = None
        self.block_table: tuple[str, tuple[int, ...]] | None = None  # shm path, shape
        self.calls = 0  # fuzz calls
        self.check_calls = 0  # Stats calls of the checks
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        self.alloc_items: collections.Counter[str] = collections.Counter()  # by AllocStatus name
        self.prefix: collections.Counter[str] = collections.Counter()  # what the valid steps did to the cache
        self.faults: collections.Counter[tuple[str | None, str]] = collections.Counter()  # refused Steps, by kind
        self.transcript: collections.deque[str] = collections.deque(maxlen=12)
        self.since_audit = 0
        self.resetting = False
        self.broken = False  # an example failed: the model no longer knows the server's state
        self.settled = False  # the server is as an example starts (see settle)

    # ------------------------------------------------------------ model views

    @property
    def done(self) -> bool:
        return self.calls >= self.budget

    def fresh_model(self) -> KVModel:
        g = self.g
        return KVModel(g.num_pages, g.page_size, g.max_requests, g.max_context)

    @contextlib.contextmanager
    def checking(self, what: str) -> Iterator[None]:
        """The model's checks of an answer, failing with the transcript and the log."""
        try:
            yield
        except AssertionError as err:
            raise AssertionError(self.fail(f"{what}: {err}")) from None

    # ------------------------------------------------------------------ calls

    def _count(self) -> None:
        self.calls += 1
        if self.calls % PROGRESS_EVERY == 0:
            print(f"fuzz[{self.label}]: {self.calls} calls", file=sys.stderr, flush=True)

    def call(self, method: str, request: Message, body: bytes | None = None) -> tuple[Any, Refusal | None]:
        """One fuzz call through the stub, or with ``body`` as a raw body; returns the
        response (parsed) or the refusal, after the status-code check."""
        self._count()
        how = "raw " + body[:80].hex() if body is not None else short(request)
        try:
            if body is None:
                resp = getattr(self.stub, method)(request, timeout=RPC_TIMEOUT)
            else:
                resp = RESPONSE_TYPE[method].FromString(self.raw[method](body, timeout=RPC_TIMEOUT))
        except grpc.RpcError as err:
            ref = self.refusal(err)
            self.note(method, how, f"{ref.code.name} {ref.reason}: {ref.message[:200]}")
            self.outcomes[(method, f"{ref.code.name}/{ref.reason}")] += 1
            self.check_code(method, request if body is None else body, ref)
            return None, ref
        self.note(method, how, "OK")
        self.outcomes[(method, "OK")] += 1
        if self.epoch is None:
            self.epoch = resp.epoch
        assert resp.epoch == self.epoch, self.fail(f"{method}: epoch {resp.epoch!r}, before {self.epoch!r}")
        return resp, None

    @staticmethod
    def refusal(err: grpc.RpcError) -> Refusal:
        reason = None
        status = rpc_status.from_call(err)
        if status is not None:
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info) and info.domain == "kvmem.v1":
                    reason = info.reason
        return Refusal(err.code(), reason, err.details() or "")

    def note(self, method: str, how: str, outcome: str) -> None:
        self.transcript.append(f"#{self.calls} {method}({how[:300]}) -> {outcome}")

    def fail(self, what: str) -> str:
        return (
            f"[{self.label}] {what}\nlast calls:\n  " + "\n  ".join(self.transcript)
            + f"\nserver log (tail):\n{self.server.log()[-3000:]}"
        )  # fmt: skip

    def check_code(self, method: str, request: Any, ref: Refusal) -> None:
        assert ref.code in ALLOWED_CODES, self.fail(
            f"{method} answered {ref.code.name} ({ref.message!r}); the design allows OK, INVALID_ARGUMENT, NOT_FOUND, "
            f"FAILED_PRECONDITION, RESOURCE_EXHAUSTED here (request {short(request)})"
        )

    def expect(self, method: str, ref: Refusal | None, reasons: set[str]) -> None:
        """OK when the model finds nothing wrong (``reasons`` empty); else a refusal with
        one of ``reasons``, its code, and a message."""
        if not reasons:
            assert ref is None, self.fail(f"{method}: a valid call was refused: {ref}")
            return
        assert ref is not None, self.fail(f"{method}: an invalid call (expected one of {sorted(reasons)}) succeeded")
        assert ref.reason in reasons, self.fail(f"{method}: refused with {ref}, expected one of {sorted(reasons)}")
        assert ref.code == REASON_CODE[ref.reason], self.fail(f"{method}: reason {ref.reason} with {ref.code.name}")
        assert ref.message.strip(), self.fail(f"{method}: a refusal without a message: {ref}")

    # ---------------------------------------------------------------- methods

    def attach(self, req: kvmem_pb2.AttachRequest, body: bytes | None = None) -> None:
        reasons = set()
        if len(self.sessions) >= self.g.max_sessions:
            reasons.add("TOO_MANY_SESSIONS")
        if len(req.name) > MAX_NAME_CHARS or len(req.cache_namespace) > MAX_NAMESPACE_CHARS:
            reasons.add("BAD_VALUE")
        resp, ref = self.call("Attach", req, body)
        self.expect("Attach", ref, reasons)
        if resp is None:
            return
        assert resp.session_id and resp.session_id not in self.sessions and resp.session_id not in self.dead
        quota = req.quota_pages if req.HasField("quota_pages") else None
        self.sessions[resp.session_id] = SessionModel(self.model, resp.session_id, req.name, quota, req.cache_namespace)
        self.model.add_owner(resp.session_id, req.cache_namespace)
        g = resp.geometry
        assert (g.num_pages, g.page_size, g.max_requests, g.max_context_len, g.max_pages_per_request) == (
            self.g.num_pages, self.g.page_size, self.g.max_requests, self.g.max_context, self.g.width,
        ), self.fail(f"Attach: geometry {short(g)}")  # fmt: skip
        info = resp.prefix_cache
        assert (info.enabled, info.hash, info.cache_namespace) == (True, "xxh3-128", req.cache_namespace), self.fail(
            f"Attach: prefix_cache {short(info)}, asked for namespace {req.cache_namespace!r}"
        )
        if self.block_table is None:
            for h in resp.memory:
                if h.name == "block_table" and h.WhichOneof("handle") == "shm":
                    self.block_table = (h.shm.path, tuple(h.shape))

    def detach(self, req: kvmem_pb2.DetachRequest, body: bytes | None = None) -> None:
        s = self.sessions.get(req.session_id)
        resp, ref = self.call("Detach", req, body)
        self.expect("Detach", ref, set() if s is not None else {"UNKNOWN_SESSION"})
        if resp is not None and s is not None:
            assert resp.num_requests_released == len(s.requests), self.fail(
                f"Detach released {resp.num_requests_released} requests, the session had {len(s.requests)}"
            )
            self.end(s)

    def end(self, s: SessionModel) -> None:
        """A session ended: its requests are released as one release of its slots in
        ascending order, without token ids."""
        self.model.remove_owner(s.sid)
        del self.sessions[s.sid]
        self.dead.append(s.sid)
        del self.dead[:-8]

    def open(self, req: kvmem_pb2.OpenRequest, body: bytes | None = None) -> None:
        ids = list(req.request_ids)
        reasons = self.model.open_faults(req.session_id, ids)
        resp, ref = self.call("Open", req, body)
        self.expect("Open", ref, reasons)
        if resp is None:
            return
        # New ids take the free slots from the top of the server's stack, in order.
        slots, want = list(resp.slots), self.model.open(req.session_id, ids)
        assert slots == want, self.fail(f"Open: slots {slots} for ids {ids}, the model {want}")

    def step(self, req: kvmem_pb2.StepRequest, body: bytes | None = None) -> None:
        """A Step: the model says whether it is valid (else which refusals it allows)
        and, if so, all it does but the free pages its allocs take, which the answer
        names (checked: free ones, then the evicted ones in the model's order)."""
        s = self.sessions.get(req.session_id)
        step, wire = step_of(req)
        # The token lists are read before the session is looked up.
        reasons = wire | self.model.step_faults(s.sid, step) if s is not None else wire or {"UNKNOWN_SESSION"}
        resp, ref = self.call("Step", req, body)
        self.expect("Step", ref, reasons)
        if ref is not None:
            self.faults[(ref.reason, next((k for k in FAULT_KINDS if k in ref.message), "other"))] += 1
        if resp is None:
            return
        assert s is not None
        with self.checking("Step"):
            fx = self.model.step(s.sid, step, s.quota_pages, answer_of(resp, len(step.alloc_slots)))
        for x, tokens in zip(step.match_slots, step.match_tokens or [], strict=True):
            self.model.requests[x].script = tokens  # for the draws
        self.alloc_items.update(kvmem_pb2.AllocStatus.Name(x).removeprefix("ALLOC_STATUS_") for x in resp.alloc_status)
        hits = sum(int32s(resp.match_lens))
        self.prefix.update(
            {
                "release items with tokens": len(step.release_slots) if step.release_tokens is not None else 0,
                "cache items": len(step.cache_slots),
                "match items": len(step.match_slots),
                "match items that hit": sum(1 for m in int32s(resp.match_lens) if m),
                "match items capped by the quota": fx.capped,
                "matched pages": hits // self.g.page_size,
                "pages cached": fx.inserted,
                "pages switched": sum(int32s(resp.cache_switched)),
                "pages evicted by resets" if self.resetting else "pages evicted": len(fx.evicted),
            }
        )
        assert resp.num_free_pages == len(self.model.free), self.fail(
            f"Step: num_free_pages {resp.num_free_pages}, the model {len(self.model.free)}"
        )

    def move(self, req: kvmem_pb2.StepRequest) -> None:
        """A Step of hand-off items or of adopt items only: valid ones move the model's
        requests (the tickets read from the answer), wrong ones change nothing."""
        s = self.sessions.get(req.session_id)
        sid = req.session_id if s is not None else None
        slots, states, tickets, rids = (list(req.handoff_slots), list(req.handoff_states), list(req.adopt_tickets),
                                        list(req.adopt_request_ids))  # fmt: skip
        if slots or states:
            reasons = self.model.handoff_faults(sid, slots, states)
        else:
            reasons = self.model.adopt_faults(sid, tickets, rids, None if s is None else s.quota_pages)
        resp, ref = self.call("Step", req)
        self.expect("Step", ref, reasons)
        if ref is not None:
            self.faults[(ref.reason, next((k for k in FAULT_KINDS if k in ref.message), "other"))] += 1
        if resp is None:
            return
        if slots:
            self.model.hand_off(sid, slots, list(resp.handoff_tickets))
            self.prefix["requests handed off"] += len(slots)
        else:
            got = self.model.adopt(sid, tickets, rids)
            answer = list(zip(int32s(resp.adopt_slots), int32s(resp.adopt_lens), strict=True))
            assert answer == got, self.fail(f"Step: adopted {answer}, the model {got}")
            assert list(resp.adopt_states) == [b""] * len(got) or len(resp.adopt_states) == len(got)
            self.prefix["requests adopted"] += len(got)

    def stats(self, req: kvmem_pb2.StatsRequest, body: bytes | None = None) -> None:
        resp, ref = self.call("Stats", req, body)
        self.expect("Stats", ref, set())
        assert resp.audit.ran == req.audit, self.fail(f"Stats(audit={req.audit}): audit.ran {resp.audit.ran}")
        if req.audit:
            assert resp.audit.ok, self.fail(f"Stats: the audit failed: {list(resp.audit.problems)}")
        self.compare(resp)

    def keepalive(self, messages: list[bytes], expect: set[str], ends: SessionModel | None) -> None:
        """One KeepAlive stream of raw ``messages``; ``ends`` is the session the stream
        ends (it names it and the client closes it)."""
        self._count()
        how = "raw " + " ".join(m[:40].hex() for m in messages)
        try:
            replies = list(self.raw_keepalive(iter(messages), timeout=RPC_TIMEOUT))
        except grpc.RpcError as err:
            ref = self.refusal(err)
            self.note("KeepAlive", how, f"{ref.code.name} {ref.reason}: {ref.message[:200]}")
            self.outcomes[("KeepAlive", f"{ref.code.name}/{ref.reason}")] += 1
            self.check_code("KeepAlive", messages, ref)
            self.expect("KeepAlive", ref, expect)
            return
        self.note("KeepAlive", how, f"OK, {len(replies)} replies")
        self.outcomes[("KeepAlive", "OK")] += 1
        self.expect("KeepAlive", None, expect)
        assert len(replies) == len(messages), self.fail(f"KeepAlive: {len(replies)} replies to {len(messages)}")
        if ends is not None:
            self.end(ends)

    # ----------------------------------------------------------------- checks

    # ----------------------------------------------------------------- checks

    def compare(self, st_: kvmem_pb2.StatsResponse) -> None:
        """The server's Stats against the model."""
        model = self.model
        with self.checking("the model"):
            model.check()
        want = model.stats()
        got = {name: getattr(st_, name) for name in want}
        assert got == want, self.fail(f"Stats {got}, the model {want}")
        got_c = (st_.prefix_cache_enabled, st_.prefix_hash)
        assert got_c == (True, "xxh3-128"), self.fail(f"Stats (prefix cache enabled, hash) = {got_c}")
        by_index = {u.index: u for u in st_.sessions}
        known = {s.index for s in self.sessions.values() if s.index is not None}
        fresh = sorted(set(by_index) - known)
        unplaced = [s for s in self.sessions.values() if s.index is None]
        assert len(fresh) == len(unplaced), self.fail(
            f"Stats shows sessions {sorted(by_index)}, the model knows {sorted(known)} and {len(unplaced)} new"
        )
        for s, index in zip(unplaced, fresh, strict=True):
            s.index = index
        assert len(by_index) == len(self.sessions), self.fail(
            f"Stats: {len(by_index)} sessions, the model {len(self.sessions)}"
        )
        for s in self.sessions.values():
            u = by_index[s.index]
            got_u = (u.name, u.quota_pages if u.HasField("quota_pages") else None, u.num_requests, u.num_pages_held,
                     u.cache_namespace, u.prefix_query_tokens, u.prefix_hit_tokens, u.num_evictions)  # fmt: skip
            want_u = (s.name or f"session-{s.index}", s.quota_pages, *model.usage(s.sid))
            assert got_u == want_u, self.fail(
                f"Stats: session {s.index} (name, quota, requests, pages, namespace, query tokens, hit tokens, "
                f"evictions) = {got_u}, the model {want_u}"
            )

    def check_block_table(self) -> None:
        if self.block_table is None:
            return
        path, shape = self.block_table
        table = np.fromfile(path, dtype=np.int32, count=math.prod(shape)).reshape(shape)
        want = self.model.table(shape)
        bad = np.flatnonzero((table != want).any(axis=1))
        assert not bad.size, self.fail(
            f"block table rows {bad.tolist()} differ from the model: "
            + "; ".join(f"row {r}: {table[r].tolist()} vs {want[r].tolist()}" for r in bad[:3])
        )

    def verify(self, audit: bool = False) -> None:
        """The server's state against the model: Stats (audited every few calls, or
        when asked) and the block table."""
        self.since_audit += 1
        audit = audit or self.since_audit >= AUDIT_EVERY
        self.check_calls += 1
        try:
            resp = self.stub.Stats(kvmem_pb2.StatsRequest(audit=audit), timeout=RPC_TIMEOUT)
        except grpc.RpcError as err:
            raise AssertionError(self.fail(f"Stats (the check) failed: {self.refusal(err)}")) from None
        if audit:
            self.since_audit = 0
            assert resp.audit.ran and resp.audit.ok, self.fail(f"the audit failed: {list(resp.audit.problems)}")
            total = resp.num_free_pages + resp.num_used_pages + resp.num_quarantined_pages + resp.num_cached_pages
            assert total == resp.num_pages_total, self.fail(f"free + used + quarantined + cached = {total}")
        self.compare(resp)
        self.check_block_table()

    def resync(self) -> None:
        """After a failed example (hypothesis then shrinks it, replaying examples against
        this server): end every session the model knows, without checks, and bring the
        server to a state the model knows without having followed it: no session, no
        cached page (an alloc of every page evicts them all), the request slots in their
        first order; the prefix totals as Stats says. Not counted as fuzz calls."""
        g, stub, t = self.g, self.stub, RPC_TIMEOUT
        for s in self.sessions.values():
            with contextlib.suppress(grpc.RpcError):
                stub.Detach(kvmem_pb2.DetachRequest(session_id=s.sid), timeout=t)
        self.sessions.clear()
        assert not stub.Stats(kvmem_pb2.StatsRequest(), timeout=t).sessions, "sessions the model never knew of"
        sid = stub.Attach(kvmem_pb2.AttachRequest(name="resync"), timeout=t).session_id
        ids = [f"resync{i}" for i in range(g.max_requests)]
        slots = list(stub.Open(kvmem_pb2.OpenRequest(session_id=sid, request_ids=ids), timeout=t).slots)
        needs = [min(max(g.total - i * g.width, 0) * g.page_size, g.max_context) for i in range(len(slots))]
        stub.Step(kvmem_pb2.StepRequest(session_id=sid, alloc_slots=slots, alloc_needs=needs), timeout=t)
        stub.Step(kvmem_pb2.StepRequest(session_id=sid, release_slots=sorted(slots, reverse=True)), timeout=t)
        stub.Detach(kvmem_pb2.DetachRequest(session_id=sid), timeout=t)
        st_ = stub.Stats(kvmem_pb2.StatsRequest(audit=True), timeout=t)
        assert st_.audit.ok and st_.num_free_pages == g.total and not st_.num_cache_entries, short(st_)
        self.model = self.fresh_model()
        self.model.query_tokens, self.model.hit_tokens = st_.prefix_query_tokens, st_.prefix_hit_tokens
        self.model.evictions = st_.num_evictions
        self.broken = self.settled = False

    def reset(self) -> None:
        """Start an example from a known state (see :meth:`settle`), which the last
        example left, or a failed one's :meth:`resync` and a settle."""
        if self.broken:
            self.resync()
        if not self.settled:
            self.settle()
        self.settled = False

    def settle(self) -> None:
        """End an example (checked like any call): every session detached, two attached
        ("fuzz" and "tight", with a quota), the cache empty and the server's free request
        slots in their first order.

        The draws of an example may depend only on draws before it (hypothesis checks),
        and what the cache holds decides match lengths and so request lengths, which
        later draws read. The cache's evictable queue depends on request slot numbers
        (a Detach releases its slots in ascending order), so those must be the same
        whenever the draws are: an alloc of every page (which evicts every cached one,
        in the order the model predicts) empties the cache, and a release of every slot
        in descending order makes Open hand out 1, 2, 3, ... again. Done at the end of
        an example, not the start of the next, so that a failure there belongs to the
        example whose calls led to it (hypothesis replays that one)."""
        for s in list(self.sessions.values()):
            self.detach(kvmem_pb2.DetachRequest(session_id=s.sid))
        self.dead.clear()  # the draws of an example depend on nothing before it
        self.verify(audit=True)
        self.attach(kvmem_pb2.AttachRequest(name="fuzz"))
        assert self.block_table is not None, "no shared-memory block table in Attach's memory handles"
        (s,) = self.sessions.values()
        g = self.g
        ids = [f"reset{i}" for i in range(g.max_requests)]
        self.open(kvmem_pb2.OpenRequest(session_id=s.sid, request_ids=ids))
        slots = [s.ids[rid] for rid in ids]
        if self.model.key:
            self.resetting = True
            left, al, an = g.total, [], []
            for x in slots:
                if left > 0:
                    need = min(left * g.page_size, g.max_context)
                    al.append(x)
                    an.append(need)
                    left -= ceil_div(need, g.page_size)
            self.step(kvmem_pb2.StepRequest(session_id=s.sid, alloc_slots=al, alloc_needs=an))
            assert not self.model.key, self.fail("the reset's alloc left cached pages")
            self.resetting = False
        self.step(kvmem_pb2.StepRequest(session_id=s.sid, release_slots=sorted(slots, reverse=True)))
        stack = self.model.slot_stack
        assert stack == list(range(g.max_requests, 0, -1)), self.fail(f"slot stack {stack}")
        # A second session in the same namespace with a tight quota: its matches of what
        # "fuzz" caches stop at its quota.
        self.attach(kvmem_pb2.AttachRequest(name="tight", quota_pages=g.total // 3))
        self.verify(audit=True)
        self.settled = True


# ---------------------------------------------------------------------- generation

EDGE_VALUES = [-1, -2, 2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**62, INT64_MAX, INT64_MIN, -(2**31), -(2**32)]
NAMES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "w", "a" * MAX_NAME_CHARS, "a" * (MAX_NAME_CHARS + 1), "é" * MAX_NAME_CHARS,
                     "😀" * (MAX_NAME_CHARS + 1), "x" * 10_000]),
)  # fmt: skip
PLAIN_IDS_LIST = ["r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7"]
PLAIN_IDS = st.sampled_from(PLAIN_IDS_LIST)
REQUEST_IDS = st.one_of(
    PLAIN_IDS,
    st.sampled_from([
        "", "\x00", " ", "x" * MAX_REQUEST_ID_BYTES, "x" * (MAX_REQUEST_ID_BYTES + 1),
        "é" * (MAX_REQUEST_ID_BYTES // 2), "é" * (MAX_REQUEST_ID_BYTES // 2 + 1),  # 2 bytes each
        "😀" * (MAX_REQUEST_ID_BYTES // 4), "😀" * (MAX_REQUEST_ID_BYTES // 4 + 1),  # 4 bytes each
        "€" * 85 + "x", "€" * 85 + "xy", "y" * 100_000,
    ]),
    st.text(max_size=6),
)  # fmt: skip

NAMESPACES = ["", "", "b", "b", "edge"]  # two namespaces, and now and then a long or bad one
EDGE_NAMESPACES = ["n" * MAX_NAMESPACE_CHARS, "n" * (MAX_NAMESPACE_CHARS + 1), "😀" * (MAX_NAMESPACE_CHARS + 1), "é"]
# Prompts that requests share, so that keys repeat within and across sessions: the
# second branches off the first after 8 tokens, the third holds int32's extremes, the
# fourth one token throughout (its pages differ only by their place in the chain).
PROMPTS = [
    [1000 + i for i in range(72)],
    [1000 + i for i in range(8)] + [2000 + i for i in range(40)],
    [INT32_MIN, INT32_MAX, 0, -1] * 12,
    [7] * 48,
]
# Token ids of random content: mostly from two values (keys still repeat), or any int32.
TOKEN_KINDS = [st.integers(0, 1), st.integers(0, 1), st.integers(INT32_MIN, INT32_MAX)]

# Which kinds of items a prefix step has, weighted: releases 1 in 3, truncates 1 in 3,
# cache items 1 in 2, match items 2 in 3 (when there is a fresh request), other allocs 1 in 2.
PREFIX_SHAPES = list(itertools.product((1, 0, 0), (1, 0, 0), (1, 0), (1, 1, 0), (1, 0)))

OPS = (
    ["step"] * 5 + ["prefix"] * 12 + ["open"] * 4 + ["decode"] * 3 + ["raw"] * 3 + ["handoff"] * 2 + ["adopt"] * 3
    + ["attach", "detach", "stats", "keepalive"]
)  # fmt: skip


class Generator:
    """Draws calls from hypothesis data, guided by the model (mostly valid, with
    boundary and invalid values mixed in)."""

    def __init__(self, fz: Fuzzer, data: st.DataObject) -> None:
        self.fz, self.data, self.g = fz, data, fz.g
        self.faulty = True  # whether a prefix step draws faults on purpose

    def draw(self, strategy: st.SearchStrategy[Any], label: str) -> Any:
        return self.data.draw(strategy, label=label)

    def pick(self, options: list[Any], label: str) -> Any:
        return self.draw(st.sampled_from(options), label)

    def session(self, busy: bool = False) -> tuple[str, SessionModel | None]:
        """A live session mostly (one with requests first; with ``busy``, mostly one of
        those); else an ended one, an empty id or garbage."""
        live = sorted(self.fz.sessions.values(), key=lambda s: not s.requests)  # stable
        kind = self.pick(["live"] * 24 + ["dead", "empty", "garbage"], "session kind") if live else None
        if kind == "live":
            with_requests = [s for s in live if s.requests]
            if busy and with_requests and not self.chance(6, "any session"):
                live = with_requests
            s = self.pick(live, "session")
            return s.sid, s
        if kind == "dead" and self.fz.dead:
            return self.pick(self.fz.dead, "dead session"), None
        if kind == "empty":
            return "", None
        garbage = ["x", "not-a-session", "A" * 32, "é", "s" * 5000]
        if live:
            garbage.append(live[0].sid[:-1] + ("A" if live[0].sid[-1] != "A" else "B"))
        return self.pick(garbage, "garbage session"), None

    def slot(self, s: SessionModel | None) -> int:
        # Slots in the order their requests were opened, not by number: which numbers the
        # server hands out depends on earlier examples, and the draws must not.
        mine = list(s.requests) if s is not None else []
        others = [x for o in self.fz.sessions.values() if o is not s for x in o.requests]
        closed = [x for x in range(1, self.g.max_requests + 1) if x not in self.fz.model.requests]
        edges = [0, -1, self.g.max_requests + 1, self.g.max_requests + 2, *EDGE_VALUES]
        kind = self.pick(["mine"] * 6 + ["other", "closed", "edge"], "slot kind")
        pool = {"mine": mine, "other": others, "closed": closed, "edge": edges}[kind] or edges
        return self.pick(pool, "slot")

    def slots_column(self, s: SessionModel | None, what: str, none: int = 0) -> list[int]:
        """Mostly distinct slots of the session (none, in ``none`` of 8 + ``none``
        cases); sometimes a bad one, a duplicate, any slots, or more items than
        max_requests."""
        mine = list(s.requests) if s is not None else []
        mode = self.pick(["none"] * none + ["distinct"] * 6 + ["any", "oversize"], f"{what} mode")
        if mode == "none":
            return []
        if mode == "distinct":
            column = self.draw(st.lists(st.sampled_from(mine), min_size=1, unique=True), what) if mine else []
            flaw = self.pick([None] * 6 + ["bad", "duplicate"], f"{what} flaw")
            if flaw == "bad":
                column.insert(self.draw(st.integers(0, len(column)), "at"), self.slot(s))
            elif flaw == "duplicate" and column:
                column.insert(self.draw(st.integers(0, len(column)), "at"), self.pick(column, "duplicate"))
            return column
        if mode == "any":
            return [self.slot(s) for _ in range(self.draw(st.integers(0, 4), f"{what} count"))]
        return [self.slot(s) for _ in range(self.g.max_requests + self.draw(st.integers(1, 2), "over"))]

    def length_near(self, cur: int, what: str) -> int:
        options = [0, cur, cur, max(cur - 1, 0), cur // 2, cur + 1, -1, *EDGE_VALUES]
        kind = self.pick(["range", "pick"], f"{what} kind")
        if kind == "range":
            return self.draw(st.integers(0, max(cur, 0)), what)
        return self.pick(options, what)

    def need(self) -> int:
        ps, ctx = self.g.page_size, self.g.max_context
        kind = self.pick(["small"] * 4 + ["medium"] * 2 + ["edge", "huge"], "need kind")
        if kind == "small":
            return self.draw(st.integers(0, ps + 1), "need")
        if kind == "medium":
            return self.draw(st.integers(0, ctx), "need")
        if kind == "edge":
            return self.pick([0, 1, ps - 1, ps, ps + 1, ctx - 1, ctx, ctx + 1], "need")
        return self.pick([INT32_MAX, 2**31, 2**32, INT64_MAX, -1, INT64_MIN, -(2**31)], "need")

    @staticmethod
    def mangle(values: list[int], draw: Callable[[], int]) -> list[int]:
        """One item more or one fewer: a column whose length does not match."""
        return values[:-1] if values else [draw()]

    # ------------------------------------------------------------- requests

    def attach_request(self) -> kvmem_pb2.AttachRequest:
        req = kvmem_pb2.AttachRequest(name=self.draw(NAMES, "name"))
        namespace = self.pick(NAMESPACES, "namespace")
        req.cache_namespace = self.pick(EDGE_NAMESPACES, "edge namespace") if namespace == "edge" else namespace
        quota = self.pick(["none"] * 3 + ["small", "edge"], "quota kind")
        if quota == "small":
            req.quota_pages = self.draw(st.integers(0, self.g.total + 2), "quota")
        elif quota == "edge":
            t = self.g.total
            req.quota_pages = self.pick([0, 1, t - 1, t, t + 1, self.g.num_pages, 2**32, 2**63, 2**64 - 1], "quota")
        return req

    def detach_request(self) -> kvmem_pb2.DetachRequest:
        return kvmem_pb2.DetachRequest(session_id=self.session()[0])

    def open_request(self) -> kvmem_pb2.OpenRequest:
        sid, s = self.session()
        kind = self.pick(["plain"] * 6 + ["mixed"] * 3 + ["mine", "many", "too many"], "open kind")
        if kind == "plain":
            ids = self.draw(st.lists(PLAIN_IDS, min_size=1, max_size=4), "request ids")
        elif kind == "mixed":
            ids = self.draw(st.lists(REQUEST_IDS, min_size=1, max_size=4), "request ids")
        elif kind == "mine" and s is not None and s.ids:
            ids = self.draw(st.lists(st.sampled_from(sorted(s.ids)), max_size=3), "own ids")
            ids += self.draw(st.lists(REQUEST_IDS, max_size=1), "and")
        elif kind == "too many":
            ids = [f"m{i}" for i in range(self.g.max_requests + 1)]
        else:
            ids = [f"n{i}" for i in range(self.draw(st.integers(0, self.g.max_requests), "id count"))]
        return kvmem_pb2.OpenRequest(session_id=sid, request_ids=ids)

    def step_request(self) -> kvmem_pb2.StepRequest:
        sid, s = self.session()
        mine = s.requests if s is not None else {}
        rel = self.slots_column(s, "release", none=120)
        tr = self.slots_column(s, "truncate", none=24)
        tl = [self.length_near(mine[x].length if x in mine else 0, "truncate len") for x in tr]
        al = self.slots_column(s, "alloc", none=1)
        an = [self.need() for _ in al]
        after = dict(zip(reversed(tr), reversed(tl), strict=True))
        expected_mode = self.pick(["none"] * 3 + ["right", "unset", "mixed"], "expected mode")
        ae: list[int] = []
        if expected_mode == "right":
            ae = [after.get(x, mine[x].length if x in mine else 0) for x in al]
        elif expected_mode == "unset":
            ae = [-1] * len(al)
        elif expected_mode == "mixed":
            for x in al:
                cur = after.get(x, mine[x].length if x in mine else 0)
                wrong = [cur + 1, max(cur - 1, 0), INT64_MIN, INT64_MAX]  # cur may be a (bad) truncate len
                ae.append(self.pick([v for v in [cur, cur, -1, -2, *wrong] if INT64_MIN <= v <= INT64_MAX], "expect"))
        mismatch = self.pick([None] * 12 + ["truncate", "alloc", "expected"], "mismatch")
        if mismatch == "truncate":
            tl = self.mangle(tl, lambda: 0)
        elif mismatch == "alloc":
            an = self.mangle(an, lambda: 1)
        elif mismatch == "expected" and al:
            ae = self.mangle(ae or [-1] * len(al), lambda: -1)
        return kvmem_pb2.StepRequest(
            session_id=sid, release_slots=rel, truncate_slots=tr, truncate_lens=tl, alloc_slots=al, alloc_needs=an,
            alloc_expected_lens=ae, atomic=self.draw(st.booleans(), "atomic"),
        )  # fmt: skip

    def handoff_request(self) -> kvmem_pb2.StepRequest:
        """Hand-off items: mostly distinct slots of the session, sometimes bad ones; states
        one per item, none, of the wrong count or too long."""
        sid, s = self.session(busy=True)
        slots = self.slots_column(s, "handoff")
        kind = self.pick(["none"] * 4 + ["each"] * 4 + ["mismatch", "too long"], "handoff states")
        states = {"none": [], "each": [b"s%d" % i for i in range(len(slots))], "mismatch": [b"x"] * (len(slots) + 1),
                  "too long": [b"y" * (256 * 1024 + 1)] * len(slots)}[kind]  # fmt: skip
        return kvmem_pb2.StepRequest(session_id=sid, handoff_slots=slots, handoff_states=states)

    def adopt_request(self) -> kvmem_pb2.StepRequest:
        """Adopt items: open tickets (by their order of issue), or forged, adopted or junk
        ones, repeated; new request ids, ids the session has open, empty or too long ones."""
        sid, s = self.session()
        open_tickets = list(self.fz.model.tickets)
        wrong = [f"1.{'0' * 32}", "junk", "", *self.fz.used_tickets[-2:]]
        tickets = []
        for _ in range(self.pick([1, 1, 1, 2], "adopt count")):
            right = open_tickets and self.pick([True] * 5 + [False] * 2, "an open ticket")
            tickets.append(self.pick(open_tickets if right else wrong, "ticket"))
        rids = [f"adopted{self.fz.calls}.{i}" for i in range(len(tickets))]
        flaw = self.pick([None] * 10 + ["open id", "empty id", "long id", "repeat id", "mismatch"], "adopt flaw")
        if flaw == "open id" and s is not None and s.ids:
            rids[0] = self.pick(sorted(s.ids), "open id")
        elif flaw == "empty id":
            rids[0] = ""
        elif flaw == "long id":
            rids[0] = "z" * (MAX_REQUEST_ID_BYTES + 1)
        elif flaw == "repeat id" and len(rids) > 1:
            rids[1] = rids[0]
        elif flaw == "mismatch":
            rids = rids[:-1]
        self.fz.used_tickets.extend(t for t in tickets if t in open_tickets)
        return kvmem_pb2.StepRequest(session_id=sid, adopt_tickets=tickets, adopt_request_ids=rids)

    def decode_request(self) -> kvmem_pb2.StepRequest:
        """The decode step (the server's fast path): one token for some or all of the
        session's requests, maybe with their lengths."""
        sid, s = self.session()
        slots = list(s.requests) if s is not None else []
        if slots and self.draw(st.booleans(), "subset"):
            slots = self.draw(st.lists(st.sampled_from(slots), unique=True, min_size=1), "decode slots")
        req = kvmem_pb2.StepRequest(session_id=sid, alloc_slots=slots, alloc_needs=[1] * len(slots))
        if s is not None and self.draw(st.booleans(), "with lengths"):
            req.alloc_expected_lens.extend(s.requests[x].length for x in slots)
            if slots and self.draw(st.integers(0, 5), "wrong length") == 0:
                req.alloc_expected_lens[-1] += 1
        return req

    # ---------------------------------------------------------- prefix items

    def chance(self, n: int, label: str) -> bool:
        """True once in ``n``."""
        return self.draw(st.integers(0, n - 1), label) == 0

    def flaw(self, flaws: list[str], weight: int, label: str) -> str | None:
        """One of ``flaws`` once in ``weight + len(flaws)`` draws, in a faulty step; else None."""
        return self.pick([None] * weight + flaws, label) if self.faulty else None

    def own_slots(
        self, s: SessionModel | None, cands: list[int], strays: list[int], what: str, most: int = 2
    ) -> list[int]:
        """Distinct slots out of ``cands`` (the ones the item suits); now and then a bad
        slot, a duplicate, or a stray (one of the session's that the item does not suit:
        released in the step, not fresh, ...)."""
        column = []
        if cands:
            column = self.draw(st.lists(st.sampled_from(cands), min_size=1, max_size=most, unique=True), what)
        flaw = self.flaw(["bad", "duplicate", "stray"], 9, f"{what} flaw")
        if flaw == "bad":
            column.insert(self.draw(st.integers(0, len(column)), "at"), self.slot(s))
        elif flaw == "duplicate" and column:
            column.insert(self.draw(st.integers(0, len(column)), "at"), self.pick(column, "duplicate"))
        elif flaw == "stray" and strays:
            column.insert(self.draw(st.integers(0, len(column)), "at"), self.pick(strays, "stray"))
        return column

    def random_tokens(self, n: int, what: str) -> list[int]:
        kind = self.pick(TOKEN_KINDS, f"{what} token kind")
        return self.draw(st.lists(kind, min_size=n, max_size=n), f"{what} tokens")

    def extend(self, known: list[int], length: int, what: str, script: list[int] | None = None) -> list[int]:
        """``length`` token ids that start with ``known`` (cut to it when shorter): the
        rest from the request's ``script`` or a shared prompt that agrees with ``known``,
        or random."""
        if length <= len(known):
            return known[:length]
        fits = [p for p in PROMPTS if len(p) >= length and p[: len(known)] == known]
        if script and len(script) >= length and script[: len(known)] == known:
            fits = [script] * max(len(fits), 1) * 2 + fits
        base = self.pick([*fits, "random"], f"{what} source") if fits else "random"
        if base == "random":
            return known + self.random_tokens(length - len(known), what)
        return list(base[:length])

    def item_tokens(self, s: SessionModel | None, x: int, have: int, what: str) -> list[int]:
        """Token ids for a release or cache item of slot ``x``, whose length is ``have``:
        its whole length mostly (agreeing with the pages its row has cached), fewer
        (partial pages too), none; or, as faults, more than ``have``, or tokens that
        differ from those a cached page of its row holds."""
        ps = self.g.page_size
        r = s.requests.get(x) if s is not None else None
        have = min(max(have, 0), self.g.max_context)
        kind = self.pick(["all"] * 6 + ["less", "less", "pages", "empty"], f"{what} length")
        kind = self.flaw(["over", "differ", "differ"], 5, f"{what} fault") or kind
        if kind == "less":
            length = self.draw(st.integers(0, have), f"{what} length")
        elif kind == "pages":
            length = have // ps * ps
        elif kind == "empty":
            length = 0
        elif kind == "over":
            length = have + self.draw(st.integers(1, ps), f"{what} excess")
        else:
            length = have
        known = self.fz.model.cached_prefix(r.pages) if r is not None else []
        tokens = self.extend(known, length, what, r.script if r is not None else None)
        limit = min(len(known), length // ps * ps)
        if kind == "differ" and limit:
            at = self.draw(st.integers(0, limit - 1), f"{what} differs at")
            tokens[at] ^= 1
        return tokens

    def match_tokens(self, s: SessionModel | None, before: list[list[int]]) -> list[int]:
        """A match item's token ids: a prefix of a shared prompt, a chain the cache
        holds in the session's namespace (and more), the tokens of an item ``before`` it
        (two requests that will hold copies of the same pages), a tail of random tokens
        after a prompt, random, or none."""
        ps, ctx = self.g.page_size, self.g.max_context
        ns = s.namespace if s is not None else ""
        chains = sorted(k[1] for k in self.fz.model.index if k[0] == ns)
        kinds = ["cached"] * 6 if chains else []
        kind = self.pick([*kinds, "prompt", "prompt", "prompt", "same", "tail", "random", "empty"], "match kind")
        if kind == "same" and before:
            return list(self.pick(before, "same as"))
        if kind == "cached":
            known = list(self.pick(chains, "cached chain"))
            return self.extend(known, len(known) + self.draw(st.integers(0, 2 * ps), "and more"), "match")
        if kind == "random":
            return self.random_tokens(self.draw(st.integers(0, ctx), "match length"), "match")
        if kind == "empty":
            return []
        prompt = self.pick(PROMPTS, "prompt")
        tokens = prompt[: self.draw(st.integers(0, min(len(prompt), ctx + ps)), "prompt length")]
        if kind == "tail":
            tokens = tokens + self.random_tokens(self.draw(st.integers(1, ps), "tail length"), "tail")
        return tokens

    def truncate_len(self, r: Request | None) -> int:
        """Mostly to a page boundary or anywhere below the length; into the middle of a
        cached page (PAGE_SHARED); or near the length (beyond it, negative, ...)."""
        ps = self.g.page_size
        cur = r.length if r is not None else 0
        cached = len(self.fz.model.cached_prefix(r.pages)) // ps if r is not None else 0
        kind = self.pick(["boundary", "boundary", "any"], "truncate kind")
        kind = self.flaw(["mid cached", "mid cached", "near"], 2, "truncate fault") or kind
        if kind == "boundary":
            return self.draw(st.integers(0, cur // ps), "truncate pages") * ps
        if kind == "any":  # past the cached pages
            return self.draw(st.integers(min(cached * ps, cur), max(cur, 0)), "truncate len")
        if kind == "mid cached" and cached and ps > 1:
            page = self.draw(st.integers(0, cached - 1), "truncate page")
            return page * ps + self.draw(st.integers(1, ps - 1), "into it")
        return self.length_near(cur, "truncate len")

    def encode(self, lists: list[list[int]], what: str) -> tuple[bytes, bytes]:
        """Token lists as int32 LE ids and offsets; now and then malformed: ids or
        offsets not a multiple of 4 bytes, offsets one too many or too few, out of
        order, or not from 0 to the token count."""
        ids = b"".join(struct.pack(f"<{len(t)}i", *t) for t in lists)
        off = [0]
        for t in lists:
            off.append(off[-1] + len(t))
        flaw = self.flaw(["ids bytes", "offsets bytes", "count", "order", "bounds"], 20, f"{what} encoding")
        if flaw == "ids bytes":
            ids += b"\x00" * self.draw(st.integers(1, 3), "extra bytes")
        elif flaw == "count":
            off = off[:-1] if self.draw(st.booleans(), "fewer") else [*off, off[-1]]
        elif flaw == "order" and len(off) >= 3:
            off[1] = off[-1] + 1
        elif flaw in ("order", "bounds"):
            if self.draw(st.booleans(), "first"):
                off[0] = 1
            else:
                off[-1] += 1
        offsets = struct.pack(f"<{len(off)}i", *off)
        if flaw == "offsets bytes":
            offsets += b"\x00" * self.draw(st.integers(1, 3), "extra bytes")
        return ids, offsets

    def match_limits(self, lists: list[list[int]]) -> list[int]:
        """match_max_tokens: none, per item (no limit, one token short of the prompt, any
        number), or an edge value (below -1: BAD_VALUE); now and then one too few or too
        many."""
        mode = self.pick(["none"] * 3 + ["some", "some"], "limits mode")
        mode = self.flaw(["edge"], 3, "limits fault") or mode
        limits: list[int] = []
        if mode == "some":
            for t in lists:
                kind = self.pick(["none", "short", "any"], "limit kind")
                if kind == "none":
                    limits.append(-1)
                elif kind == "short":
                    limits.append(max(len(t) - 1, 0))
                else:
                    limits.append(self.draw(st.integers(0, len(t) + self.g.page_size), "limit"))
        elif mode == "edge" and lists:
            limits = [-1] * len(lists)
            limits[self.draw(st.integers(0, len(lists) - 1), "edge at")] = self.pick(
                [-2, INT64_MIN, 0, INT32_MAX, INT64_MAX], "edge limit"
            )
        if limits and self.flaw(["mismatch"], 12, "limits mismatch"):
            limits = self.mangle(limits, lambda: -1)
        return limits

    def prefix_request(self, sid: str | None = None, s: SessionModel | None = None) -> kvmem_pb2.StepRequest:
        """A step with prefix-cache items, in any combination: releases with their
        token ids, truncates (into cached pages too), cache items on running requests,
        match items on fresh requests with an alloc of the remainder, other allocs;
        mostly valid, with the faults of each kind mixed in."""
        if sid is None:
            sid, s = self.session(busy=True)
        self.faulty = self.chance(3, "faulty")  # else no fault drawn on purpose (some may still be)
        mine = s.requests if s is not None else {}
        order = list(mine)  # open order (the draws must not depend on slot numbers)
        req = kvmem_pb2.StepRequest(session_id=sid, atomic=self.chance(4, "atomic"))
        # Which kinds of items (one draw): releases, truncates, cache items, match items, other allocs.
        has_rel, has_tr, has_cache, has_match, has_alloc = self.pick(PREFIX_SHAPES, "shape")
        rel: list[int] = []
        if has_rel:  # mostly of running requests (their pages are cached)
            rel = self.own_slots(s, [x for x in order if mine[x].length] or order, order, "release")
            req.release_slots.extend(rel)
            if rel and not self.chance(6, "releases without token ids"):
                lists = [self.item_tokens(s, x, mine[x].length if x in mine else 0, "release") for x in rel]
                req.release_token_ids, req.release_token_offsets = self.encode(lists, "release")
        left = [x for x in order if x not in rel]
        after = {x: mine[x].length for x in left}
        if has_tr:
            tr = self.own_slots(s, [x for x in left if after[x] > 0], rel, "truncate", most=1)
            tl = [self.truncate_len(mine.get(x)) for x in tr]
            req.truncate_slots.extend(tr)
            req.truncate_lens.extend(tl)
            after.update((x, n) for x, n in zip(tr, tl, strict=True) if x in after)
        running = [x for x in left if after[x] > 0]
        fresh = [x for x in left if after[x] == 0]
        if has_cache:
            cs = self.own_slots(s, running, rel + fresh, "cache")
            lists = [self.item_tokens(s, x, after.get(x, 0), "cache") for x in cs]
            req.cache_slots.extend(cs)
            if not self.flaw(["no token ids"], 12, "cache token ids"):
                req.cache_token_ids, req.cache_token_offsets = self.encode(lists, "cache")
        ms: list[int] = []
        if has_match and (fresh or self.faulty):
            ms = self.own_slots(s, fresh, rel + running, "match")
            prompts: list[list[int]] = []
            for _ in ms:
                prompts.append(self.match_tokens(s, prompts))
            req.match_slots.extend(ms)
            if ms or self.chance(2, "empty match tokens"):
                req.match_token_ids, req.match_token_offsets = self.encode(prompts, "match")
            req.match_max_tokens.extend(self.match_limits(prompts))
            # An alloc of a matched request asks for its whole length (or one token less).
            for x, t in zip(ms, prompts, strict=True):
                if not self.chance(4, "match alone"):
                    req.alloc_slots.append(x)
                    kind = self.pick(["whole"] * 4 + ["short", "short", "more", "any"], "matched need")
                    need = len(t)
                    if kind == "short":  # it must compute at least one token
                        need = max(len(t) - 1, 0)
                    elif kind == "more":
                        need = len(t) + self.draw(st.integers(1, self.g.page_size), "more")
                    elif kind == "any":
                        need = self.need()
                    req.alloc_needs.append(need)
        elif self.flaw(["limits alone"], 12, "match_max_tokens alone"):
            req.match_max_tokens.extend(self.draw(st.lists(st.integers(-1, 8), min_size=1, max_size=2), "limits"))
        if has_alloc:
            others = self.own_slots(s, [x for x in running if x not in req.alloc_slots], [], "alloc")
            req.alloc_slots.extend(others)
            req.alloc_needs.extend(self.draw(st.integers(0, 3 * self.g.page_size), "need") for _ in others)
        al = list(req.alloc_slots)
        mode = self.pick(["omit"] * 4 + ["unset", "right"], "expected mode")
        mode = self.flaw(["fault"], 6, "expected fault") or mode
        if mode != "omit" and al:
            right = [-1 if x in ms else after.get(x, 0) for x in al]
            if mode == "unset":
                right = [-1] * len(al)
            elif mode == "fault":
                at = self.draw(st.integers(0, len(al) - 1), "wrong at")
                right[at] = after.get(al[at], 0) if al[at] in ms else right[at] + 1
            req.alloc_expected_lens.extend(right)
        return req

    def stats_request(self) -> kvmem_pb2.StatsRequest:
        return kvmem_pb2.StatsRequest(audit=self.draw(st.booleans(), "audit"))

    def request(self, method: str) -> Message:
        if method == "Step" and self.draw(st.booleans(), "prefix step"):
            return self.prefix_request()
        if method == "KeepAlive":
            return kvmem_pb2.KeepAliveRequest(session_id=self.pick(["", "x", "garbage-id"], "keep-alive id"))
        return getattr(self, f"{method.lower()}_request")()

    # ------------------------------------------------------------------ ops

    def run_op(self) -> None:
        op = self.pick(OPS if self.fz.sessions else ["attach"] * 6 + ["step", "open", "raw"], "op")
        if op in ("step", "decode", "prefix") and not self.fz.model.requests:  # mostly open something first
            op = self.pick(["open"] * 3 + [op], "instead")
        fz = self.fz
        if op == "step":
            fz.step(self.step_request())
        elif op == "decode":
            fz.step(self.decode_request())
        elif op == "prefix":
            sid, s = self.session(busy=True)
            fresh = s is not None and any(not r.length for r in s.requests.values())
            if s is not None and not fresh and fz.model.slot_stack and self.draw(st.integers(0, 2), "open first") < 2:
                # New requests for the prefix steps to match (ids it has not open, in order).
                new_ids = [rid for rid in PLAIN_IDS_LIST if rid not in s.ids][: self.draw(st.integers(1, 2), "new")]
                fz.open(kvmem_pb2.OpenRequest(session_id=sid, request_ids=new_ids))
                fz.verify()
                return
            fz.step(self.prefix_request(sid, s))
        elif op == "handoff":
            fz.move(self.handoff_request())
        elif op == "adopt" and not fz.model.tickets and self.draw(st.integers(0, 3), "hand off first"):
            fz.move(self.handoff_request())  # a ticket for the adoptions to come
        elif op == "adopt":
            fz.move(self.adopt_request())
        elif op == "open":
            fz.open(self.open_request())
        elif op == "attach":
            fz.attach(self.attach_request())
        elif op == "detach":
            fz.detach(self.detach_request())
        elif op == "stats":
            fz.stats(self.stats_request())
        elif op == "keepalive":
            self.keepalive()
        else:
            self.raw()
        fz.verify()

    def keepalive(self) -> None:
        sid, s = self.session()
        kind = self.pick(["one", "several", "switch", "none"], "keep-alive kind")
        msg = kvmem_pb2.KeepAliveRequest(session_id=sid).SerializeToString()
        if kind == "none":
            self.fz.keepalive([], set(), None)
        elif s is None:  # no such session: refused, whatever follows
            self.fz.keepalive([msg], {"UNKNOWN_SESSION"}, None)
        elif kind == "one":  # the client closes the stream: the session ends
            self.fz.keepalive([msg], set(), s)
        elif kind == "several":  # later messages may name no session
            self.fz.keepalive([msg, b"", msg], set(), s)
        else:  # a second session on one stream: refused by the server, the session lives on
            other = kvmem_pb2.KeepAliveRequest(session_id="another-session").SerializeToString()
            self.fz.keepalive([msg, other], {"BAD_VALUE"}, None)

    def raw(self) -> None:
        """A raw body for any method: random bytes, a valid request cut short, with a
        byte changed, with bytes after it, or a hand-made malformed encoding. The same
        protobuf runtime as the server's says whether it parses: if not, it must be
        refused as INVALID_ARGUMENT (BAD_VALUE); if so, the model handles it as the
        request it parses to (a truncated Step may still be a valid step)."""
        method = self.pick([*UNARY, "KeepAlive"], "raw method")
        kind = self.pick(["random", "truncated", "changed", "suffix", "crafted"], "raw kind")
        if kind == "random":
            body = self.draw(st.binary(max_size=48), "body")
        else:
            request = self.request(method)
            if "session_id" in request.DESCRIPTOR.fields_by_name:
                # A fixed unknown id: what a mutated body does must not depend on the
                # server's random session ids or on its slot numbering, which differ
                # with the examples run before (hypothesis replays prefixes of draws and
                # checks they lead to the same draws). Valid sessions' bodies are the
                # typed calls' business.
                request.session_id = UNKNOWN_SESSION_ID
            base = request.SerializeToString()
            if kind == "truncated":
                body = base[: self.draw(st.integers(0, max(len(base) - 1, 0)), "cut at")]
            elif kind == "changed" and base:
                at = self.draw(st.integers(0, len(base) - 1), "at")
                body = base[:at] + bytes([self.draw(st.integers(0, 255), "byte")]) + base[at + 1 :]
            elif kind == "suffix":
                body = base + self.draw(st.binary(min_size=1, max_size=8), "suffix")
            else:
                prefix = base if self.draw(st.booleans(), "after a valid body") else b""
                body = prefix + self.pick(CRAFTED, "crafted")
        try:
            parsed = REQUEST_TYPE[method].FromString(body)
        except Exception:
            parsed = None
        fz = self.fz
        if method == "KeepAlive":
            if parsed is None:
                fz.keepalive([body], {"BAD_VALUE"}, None)
            elif parsed.session_id not in fz.sessions:
                fz.keepalive([body], {"UNKNOWN_SESSION"}, None)
            return
        if parsed is None:
            _, ref = fz.call(method, REQUEST_TYPE[method](), body)
            fz.expect(method, ref, {"BAD_VALUE"})
            return
        getattr(fz, method.lower())(parsed, body)


# --------------------------------------------------------------------------- tests


@pytest.fixture(params=sorted(GEOMETRIES))
def fuzz_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, Geometry, ServerProcess]]:
    """One server per test; killed if the test failed before stopping it."""
    label = request.param
    geometry = GEOMETRIES[label]
    directory = short_tmpdir()
    server = start_server(directory, *geometry.args())
    try:
        yield label, geometry, server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


def run_fuzzer(fz: Fuzzer) -> None:
    """Hypothesis examples, each from a reset server, until the budget of calls is
    spent; rounds of examples with fixed seeds (reproducible, no database)."""
    rounds = 0
    while not fz.done:
        assert rounds < 100, fz.fail("no progress")
        examples = -(-(fz.budget - fz.calls) // OPS_PER_EXAMPLE)

        @seed(20260 + rounds)
        @settings(
            max_examples=examples, deadline=None, database=None, derandomize=False, print_blob=False,
            suppress_health_check=list(HealthCheck),
        )  # fmt: skip
        @given(st.data())
        def example(data: st.DataObject) -> None:
            # Always a whole example: stopping at the budget would make the draws depend
            # on more than the draws before them (hypothesis checks that they do not).
            try:
                fz.reset()
                gen = Generator(fz, data)
                for _ in range(OPS_PER_EXAMPLE):
                    gen.run_op()
                fz.settle()
            except BaseException:
                fz.broken = True  # the model may be half-updated: the next reset starts over
                raise

        example()
        rounds += 1


def final_checks(fz: Fuzzer, server: ServerProcess) -> None:
    """Still serving, exits 0 on SIGTERM, and its log holds no traceback or ERROR."""
    assert server.health("") == health_pb2.HealthCheckResponse.SERVING
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    fz.verify(audit=True)
    fz.channel.close()
    code = server.stop(signal.SIGTERM)
    log = server.log()
    assert code == 0, f"the server exited {code} after SIGTERM:\n{log[-4000:]}"
    assert "Traceback" not in log, log[-8000:]
    assert " ERROR " not in log, [line for line in log.splitlines() if " ERROR " in line][:20]


CALLS_PER_TEST = -(-TOTAL_CALLS // len(GEOMETRIES))


# Room for hypothesis to shrink a failure (up to 5 minutes) on top of the run itself.
@pytest.mark.timeout(600 + CALLS_PER_TEST // 25)
def test_wire_fuzz(fuzz_server: tuple[str, Geometry, ServerProcess]) -> None:
    label, geometry, server = fuzz_server
    fz = Fuzzer(server, geometry, label, CALLS_PER_TEST)
    run_fuzzer(fz)
    summary = ", ".join(f"{m} {o}: {n}" for (m, o), n in sorted(fz.outcomes.items()))
    items = ", ".join(f"{k}: {n}" for k, n in sorted(fz.alloc_items.items()))
    prefix = ", ".join(f"{k}: {n}" for k, n in sorted(fz.prefix.items()))
    faults = ", ".join(f"{r} ({k}): {n}" for (r, k), n in sorted(fz.faults.items(), key=str))
    print(
        f"\nfuzz[{label}]: {fz.calls} calls (+{fz.check_calls} Stats checks): {summary}; alloc items {items}; "
        f"prefix cache {prefix}; refused Steps by kind {faults}"
    )
    final_checks(fz, server)
    assert fz.calls >= CALLS_PER_TEST, f"{fz.calls} calls, {CALLS_PER_TEST} planned"
