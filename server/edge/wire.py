"""Proto <-> core conversions of the service: the request bodies as core values, the core's
answers as response messages, and a refusal as its gRPC status. No state, no I/O.

The parse half keeps the decode hot path cheap: a Step without prefix-cache items pays
a few emptiness tests for the prefix columns and builds none of them.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmem.server.core import CoreConfig, StepBatch, StepOutcome
from kvmem.server.core.batch import TokenLists
from kvmem.server.core.config import HostTierStats
from kvmem.server.errors import ErrorKind, KVMemError, Reason
from kvmem.server.memory import HandleInfo, KVGeometry
from kvmem.server.sessions import ServerStats
from kvmem.v1 import kvmem_pb2

ERROR_DOMAIN = "kvmem.v1"
STATUS_CODE = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
_REASON_PREFIX = "ERROR_REASON_"
# Each Reason's ErrorInfo.reason: the name of its value in the proto's ErrorReason, less
# the prefix. Looked up here, at import, so a reason the proto does not list stops the
# server from starting (ValueError) instead of reaching a client as a name it cannot read.
_WIRE_REASON = {
    reason: kvmem_pb2.ErrorReason.Name(kvmem_pb2.ErrorReason.Value(_REASON_PREFIX + reason.name))[len(_REASON_PREFIX) :]
    for reason in Reason
}


def status_proto(err: KVMemError) -> status_pb2.Status:
    """The ``google.rpc.Status`` of a refused call: the kind's code, the message, and the
    reason (a name of the proto's ErrorReason) with the offending values as an ErrorInfo.
    A unary call fails with it (:func:`to_status`); on StepStream it is the answer's
    ``error`` (:func:`refused_step`)."""
    info = error_details_pb2.ErrorInfo(reason=_WIRE_REASON[err.reason], domain=ERROR_DOMAIN, metadata=err.metadata)
    detail = any_pb2.Any()
    detail.Pack(info)
    return status_pb2.Status(code=STATUS_CODE[err.kind].value[0], message=err.message, details=[detail])


def to_status(err: KVMemError) -> grpc.Status:
    """The status a unary call (or a stream's end) fails with for ``err``."""
    return rpc_status.to_status(status_proto(err))


def refused_step(err: KVMemError, epoch: str) -> kvmem_pb2.StepResponse:
    """StepStream's in-band answer to a refused step: the epoch and the status only."""
    return kvmem_pb2.StepResponse(epoch=epoch, error=status_proto(err))


# ------------------------------------------------------------------ geometry

_FORMAT = {"mha": kvmem_pb2.KV_FORMAT_MHA, "mla": kvmem_pb2.KV_FORMAT_MLA}


def layout_to_proto(g: KVGeometry) -> kvmem_pb2.KVLayout:
    return kvmem_pb2.KVLayout(
        format=_FORMAT[g.format],
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        kv_lora_rank=g.kv_lora_rank,
        rope_dim=g.rope_dim,
        dtype=g.dtype,
        bytes_per_token=g.bytes_per_token,
    )


def geometry_to_proto(core: CoreConfig, kv: KVGeometry | None) -> kvmem_pb2.PoolGeometry:
    """The pool geometry Attach and Stats report; ``kv`` is None without KV memory."""
    msg = kvmem_pb2.PoolGeometry(
        num_pages=core.num_pages,
        page_size=core.page_size,
        max_requests=core.max_requests,
        max_context_len=core.max_context_len,
        max_pages_per_request=core.max_pages_per_request,
    )
    if kv is not None:
        msg.layout.CopyFrom(layout_to_proto(kv))
    return msg


def handle_to_proto(h: HandleInfo) -> kvmem_pb2.MemoryHandle:
    """A backend's handle as the explicit proto fields (no pickle on the wire)."""
    msg = kvmem_pb2.MemoryHandle(
        name=h.name,
        rank=h.rank,
        dtype=h.dtype,
        shape=list(h.shape),
        size_bytes=h.size_bytes,
        offset_bytes=h.offset_bytes,
    )
    if h.cuda is not None:
        msg.cuda.CopyFrom(kvmem_pb2.CudaIpcHandle(**dataclasses.asdict(h.cuda)))
    else:
        msg.shm.path = h.shm_path or ""
    return msg


# ------------------------------------------------------------ request bodies


class Malformed:
    """What a handler receives instead of a request whose body does not parse: gRPC
    would otherwise fail the call inside its own code (UNKNOWN, and a traceback in the
    log per call). The handler refuses it as INVALID_ARGUMENT (:meth:`error`)."""

    __slots__ = ("problem", "size", "type_name")

    def __init__(self, type_name: str, size: int, problem: str) -> None:
        self.type_name = type_name
        self.size = size
        self.problem = problem

    def error(self, method: str) -> KVMemError:
        return KVMemError(
            Reason.BAD_VALUE,
            f"{method}: the request body ({self.size} bytes) is not a valid {self.type_name}: {self.problem}",
            size=self.size,
        )


def deserializer(cls: Any) -> Callable[[bytes], Any]:
    """``cls.FromString``, returning a :class:`Malformed` instead of raising."""
    parse, type_name = cls.FromString, cls.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:  # "Error parsing message with type '...': Wire format was corrupt"
            return Malformed(type_name, len(data), str(exc).rpartition("': ")[2] or "it does not parse")
        except Exception as exc:  # any other failure of the parser: still the caller's bytes
            return Malformed(type_name, len(data), f"{type(exc).__name__}: {exc}")

    return deserialize


def column(field: Any, packed: bytes, name: str) -> np.ndarray:
    """A Step column, from its repeated field or its int32 LE bytes twin (``name_i32``),
    as an int64 array (the core's :class:`StepBatch` columns are int64: its checks read
    them so). Both given, or bytes that are not whole int32 values: BAD_VALUE
    naming the field."""
    if not packed:
        return array(field)
    if len(field):
        raise KVMemError(
            Reason.BAD_VALUE,
            f"{name} came both as the repeated field ({len(field)} items) and as {name}_i32 "
            f"({len(packed)} bytes): send one",
            field=name,
        )
    if len(packed) % 4:
        raise KVMemError(
            Reason.BAD_VALUE,
            f"{name}_i32 holds {len(packed)} bytes: not whole int32 little-endian values",
            field=f"{name}_i32",
            size=len(packed),
        )
    return np.frombuffer(packed, dtype="<i4").astype(np.int64)


def array(field: Any) -> np.ndarray:
    """A packed repeated int field as an int64 array, without a Python loop. Up to 128
    items ``np.fromiter`` (which walks the field in C) costs half of protobuf's numpy
    conversion on a server whose caches are cold between calls; beyond, the conversion
    wins (measured in the server: 20 vs 40 µs for two 32-item fields, 45 vs 50 µs for
    two of 256)."""
    n = len(field)
    if not n:
        return _EMPTY
    return np.fromiter(field, np.int64, n) if n <= 128 else np.array(field, dtype=np.int64)


_EMPTY = np.zeros(0, dtype=np.int64)


def le_bytes(a: np.ndarray) -> bytes:
    """An int32 array as the little-endian bytes the proto promises."""
    return a.tobytes() if _LITTLE_ENDIAN else a.astype("<i4").tobytes()


_LITTLE_ENDIAN = sys.byteorder == "little"


def carries_prefix(request: kvmem_pb2.StepRequest) -> bool:
    """Whether a StepRequest sets any prefix-cache field (release tokens, cache or match
    items): decided once per step, and handed to :func:`step_batch` (which reads those
    columns only then) and :func:`step_response` (which answers them only then)."""
    return bool(
        request.release_token_offsets
        or request.release_token_ids
        or len(request.cache_slots)
        or request.cache_token_offsets
        or request.cache_token_ids
        or len(request.match_slots)
        or request.match_token_offsets
        or request.match_token_ids
        or len(request.match_max_tokens)
    )


def step_batch(request: kvmem_pb2.StepRequest, prefix: bool | None = None) -> StepBatch:
    """A StepRequest's columns as a :class:`StepBatch` (lengths and values are the
    core's to check; each of the first six from its repeated field or its ``_i32``
    bytes). The prefix-cache columns are read only when ``prefix`` (the caller's
    :func:`carries_prefix`; None: decided here)."""
    expected = column(request.alloc_expected_lens, request.alloc_expected_lens_i32, "alloc_expected_lens")
    batch = StepBatch(
        column(request.release_slots, request.release_slots_i32, "release_slots"),
        column(request.truncate_slots, request.truncate_slots_i32, "truncate_slots"),
        column(request.truncate_lens, request.truncate_lens_i32, "truncate_lens"),
        column(request.alloc_slots, request.alloc_slots_i32, "alloc_slots"),
        column(request.alloc_needs, request.alloc_needs_i32, "alloc_needs"),
        expected if expected.size else None,
        request.atomic,
    )
    if carries_prefix(request) if prefix is None else prefix:
        _prefix_columns(request, batch)
    if request.handoff_slots or request.handoff_states or request.adopt_tickets or request.adopt_request_ids:
        batch.handoff_slots = array(request.handoff_slots)
        batch.handoff_states = tuple(request.handoff_states)
        batch.adopt_tickets = tuple(request.adopt_tickets)
        batch.adopt_request_ids = tuple(request.adopt_request_ids)
    return batch


def _prefix_columns(request: kvmem_pb2.StepRequest, batch: StepBatch) -> None:
    """Release tokens, cache and match items into ``batch``. Token lists that are not
    int32 LE with offsets [n + 1] from 0 to their total are refused here, naming the
    field (BAD_VALUE or LENGTH_MISMATCH)."""
    batch.release_tokens = TokenLists.from_wire(
        request.release_token_ids, request.release_token_offsets, batch.release_slots.size, "release_token"
    )
    batch.cache_slots = array(request.cache_slots)
    batch.cache_tokens = TokenLists.from_wire(
        request.cache_token_ids, request.cache_token_offsets, batch.cache_slots.size, "cache_token"
    )
    batch.match_slots = array(request.match_slots)
    batch.match_tokens = TokenLists.from_wire(
        request.match_token_ids, request.match_token_offsets, batch.match_slots.size, "match_token"
    )
    limits = request.match_max_tokens
    batch.match_max_tokens = array(limits) if len(limits) else None


def step_response(
    result: StepOutcome, epoch: str, num_free_pages: int, prefix: bool, seq: int = 0
) -> kvmem_pb2.StepResponse:
    """The StepResponse of an applied step; the prefix-cache fields only where the request
    carried prefix items (``prefix``: :func:`carries_prefix`; a decode step's allocs may
    still evict: that count is always set)."""
    resp = kvmem_pb2.StepResponse(
        epoch=epoch,
        alloc_status=result.alloc_status.tobytes(),
        kv_loc=le_bytes(result.kv_loc),
        kv_loc_offsets=le_bytes(result.kv_loc_offsets),
        new_pages=le_bytes(result.new_pages),
        new_page_offsets=le_bytes(result.new_page_offsets),
        num_pages_released=result.num_pages_released,
        num_free_pages=num_free_pages,
        num_pages_evicted=result.num_pages_evicted,
        seq=seq,
    )
    if result.tickets:
        resp.handoff_tickets.extend(result.tickets)
    if result.adopt_slots.size:
        resp.adopt_slots = le_bytes(result.adopt_slots)
        resp.adopt_lens = le_bytes(result.adopt_lens)
        resp.adopt_states.extend(result.adopt_states)
    if prefix:
        resp.match_lens = le_bytes(result.match_lens.astype(np.int32, copy=False))
        resp.cache_switched = le_bytes(result.cache_switched.astype(np.int32, copy=False))
        resp.num_pages_cached = result.num_pages_cached
        if result.match_loading.size:
            resp.match_loading = le_bytes(result.match_loading)
        if result.match_fetching.size:
            resp.match_fetching = le_bytes(result.match_fetching)
    return resp


# ------------------------------------------------------------------- answers


def stats_response(
    stats: ServerStats, epoch: str, geometry: kvmem_pb2.PoolGeometry, memory_backend: str, num_quarantined: int
) -> kvmem_pb2.StatsResponse:
    """Stats: the pool's counters, the prefix cache's totals, per-session usage, the audit."""
    pool = stats.pool
    now = time.monotonic()
    rows = []
    for row in stats.sessions:
        session = row.session
        usage = kvmem_pb2.SessionUsage(
            name=session.name,
            index=session.owner,
            num_requests=row.num_requests,
            num_pages_held=row.num_pages_held,
            idle_ms=int((now - session.last_seen) * 1000),
            cache_namespace=session.cache_namespace,
            prefix_query_tokens=row.prefix_query_tokens,
            prefix_hit_tokens=row.prefix_hit_tokens,
            num_evictions=row.num_evictions,
        )
        if session.quota_pages is not None:
            usage.quota_pages = session.quota_pages
        rows.append(usage)
    audit = kvmem_pb2.AuditResult(ran=stats.audit is not None)
    if stats.audit is not None:
        audit.ok = stats.audit.ok
        audit.problems.extend(stats.audit.problems)
    return kvmem_pb2.StatsResponse(
        epoch=epoch,
        geometry=geometry,
        num_pages_total=pool.num_pages_total,
        num_free_pages=pool.num_free_pages,
        num_cached_pages=pool.num_cached_pages,
        num_used_pages=pool.num_used_pages,
        num_quarantined_pages=pool.num_quarantined_pages,
        num_quarantined_sessions=num_quarantined,
        num_free_request_slots=pool.num_free_request_slots,
        num_open_requests=pool.num_open_requests,
        sessions=rows,
        audit=audit,
        num_steps=stats.num_steps,
        memory_backend=memory_backend,
        uptime_ms=int(stats.uptime_s * 1000),
        num_evictions=pool.num_evictions,
        prefix_hit_tokens=pool.prefix_hit_tokens,
        prefix_query_tokens=pool.prefix_query_tokens,
        prefix_cache_enabled=stats.prefix_cache_enabled,
        prefix_hash=stats.prefix_hash,
        num_cache_entries=pool.num_cache_entries,
        origin=_origin(stats),
        num_handoff_tickets=pool.num_handoff_tickets,
        num_handoff_pages=pool.num_handoff_pages,
        num_handed_off=stats.handoffs[0],
        num_adopted=stats.handoffs[1],
        num_handoffs_expired=stats.handoffs[2],
        num_handoffs_given_up=stats.handoffs[3],
        host_tier=_host_tier(pool.host),
        store=None if pool.store is None else kvmem_pb2.StoreStats(**pool.store),  # type: ignore[arg-type]
    )


def _host_tier(host: HostTierStats | None) -> kvmem_pb2.HostTierStats | None:
    if host is None:
        return None
    return kvmem_pb2.HostTierStats(
        num_pages=host.num_pages,
        num_free_pages=host.num_free_pages,
        num_cached_pages=host.num_cached_pages,
        page_bytes=host.page_bytes,
        num_demoted=host.num_demoted,
        num_loaded=host.num_loaded,
        num_evicted=host.num_evicted,
        num_dropped=host.num_dropped,
        hit_tokens=host.hit_tokens,
        num_loading_pages=host.num_loading_pages,
        load_ms_p50=host.load_ms_p50,
        load_ms_p99=host.load_ms_p99,
        load_gib_per_s=host.load_gib_per_s,
    )


def _origin(stats: ServerStats) -> kvmem_pb2.StateOrigin:
    origin = stats.origin
    if origin is None:
        return kvmem_pb2.StateOrigin(kind="fresh")
    out = kvmem_pb2.StateOrigin(kind=origin.kind, adopt_ms=origin.restore_ms)
    a = origin.restoration
    if a is not None:
        out.owners, out.requests, out.pages_in_rows = a.owners, a.requests, a.pages_in_rows
        out.cached_pages, out.quarantined_pages = a.cached_pages, a.quarantined_pages
        out.repaired.extend(a.repaired)
        out.sessions, out.undone = len([s for s in a.sessions if s.session_id]), a.undone
        out.resumed, out.not_resumed, out.waiting = stats.num_resumed, stats.num_not_resumed, stats.num_dormant
    return out
