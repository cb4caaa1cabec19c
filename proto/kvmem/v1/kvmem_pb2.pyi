from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FORMAT_UNSPECIFIED: _ClassVar[KVFormat]
    KV_FORMAT_MHA: _ClassVar[KVFormat]
    KV_FORMAT_MLA: _ClassVar[KVFormat]

class AllocStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ALLOC_STATUS_OK: _ClassVar[AllocStatus]
    ALLOC_STATUS_OUT_OF_PAGES: _ClassVar[AllocStatus]
    ALLOC_STATUS_CONTEXT_TOO_LONG: _ClassVar[AllocStatus]
    ALLOC_STATUS_QUOTA_EXCEEDED: _ClassVar[AllocStatus]
    ALLOC_STATUS_ABORTED: _ClassVar[AllocStatus]

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    ERROR_REASON_BAD_VALUE: _ClassVar[ErrorReason]
    ERROR_REASON_LENGTH_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_DUPLICATE_SLOT: _ClassVar[ErrorReason]
    ERROR_REASON_SLOT_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_UNKNOWN_SESSION: _ClassVar[ErrorReason]
    ERROR_REASON_ALLOCED_LEN_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_TRUNCATE_BEYOND_ALLOCED: _ClassVar[ErrorReason]
    ERROR_REASON_NO_FREE_REQUEST_SLOT: _ClassVar[ErrorReason]
    ERROR_REASON_BAD_TOKEN: _ClassVar[ErrorReason]
    ERROR_REASON_SHUTTING_DOWN: _ClassVar[ErrorReason]
    ERROR_REASON_CORRUPTION: _ClassVar[ErrorReason]
    ERROR_REASON_TOO_MANY_SESSIONS: _ClassVar[ErrorReason]
    ERROR_REASON_NOT_READY: _ClassVar[ErrorReason]
    ERROR_REASON_PAGE_SHARED: _ClassVar[ErrorReason]
    ERROR_REASON_TICKET_NOT_FOUND: _ClassVar[ErrorReason]
    ERROR_REASON_NAMESPACE_MISMATCH: _ClassVar[ErrorReason]
    ERROR_REASON_QUOTA_EXCEEDED: _ClassVar[ErrorReason]
    ERROR_REASON_MODEL_MISMATCH: _ClassVar[ErrorReason]
KV_FORMAT_UNSPECIFIED: KVFormat
KV_FORMAT_MHA: KVFormat
KV_FORMAT_MLA: KVFormat
ALLOC_STATUS_OK: AllocStatus
ALLOC_STATUS_OUT_OF_PAGES: AllocStatus
ALLOC_STATUS_CONTEXT_TOO_LONG: AllocStatus
ALLOC_STATUS_QUOTA_EXCEEDED: AllocStatus
ALLOC_STATUS_ABORTED: AllocStatus
ERROR_REASON_UNSPECIFIED: ErrorReason
ERROR_REASON_BAD_VALUE: ErrorReason
ERROR_REASON_LENGTH_MISMATCH: ErrorReason
ERROR_REASON_DUPLICATE_SLOT: ErrorReason
ERROR_REASON_SLOT_NOT_FOUND: ErrorReason
ERROR_REASON_UNKNOWN_SESSION: ErrorReason
ERROR_REASON_ALLOCED_LEN_MISMATCH: ErrorReason
ERROR_REASON_TRUNCATE_BEYOND_ALLOCED: ErrorReason
ERROR_REASON_NO_FREE_REQUEST_SLOT: ErrorReason
ERROR_REASON_BAD_TOKEN: ErrorReason
ERROR_REASON_SHUTTING_DOWN: ErrorReason
ERROR_REASON_CORRUPTION: ErrorReason
ERROR_REASON_TOO_MANY_SESSIONS: ErrorReason
ERROR_REASON_NOT_READY: ErrorReason
ERROR_REASON_PAGE_SHARED: ErrorReason
ERROR_REASON_TICKET_NOT_FOUND: ErrorReason
ERROR_REASON_NAMESPACE_MISMATCH: ErrorReason
ERROR_REASON_QUOTA_EXCEEDED: ErrorReason
ERROR_REASON_MODEL_MISMATCH: ErrorReason

class KVLayout(_message.Message):
    __slots__ = ("format", "num_layers", "num_kv_heads", "head_dim", "kv_lora_rank", "rope_dim", "dtype", "bytes_per_token")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    format: KVFormat
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_lora_rank: int
    rope_dim: int
    dtype: str
    bytes_per_token: int
    def __init__(self, format: _Optional[_Union[KVFormat, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_lora_rank: _Optional[int] = ..., rope_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., bytes_per_token: _Optional[int] = ...) -> None: ...

class PoolGeometry(_message.Message):
    __slots__ = ("num_pages", "page_size", "max_requests", "max_context_len", "max_pages_per_request", "layout")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_PAGES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    page_size: int
    max_requests: int
    max_context_len: int
    max_pages_per_request: int
    layout: KVLayout
    def __init__(self, num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., max_requests: _Optional[int] = ..., max_context_len: _Optional[int] = ..., max_pages_per_request: _Optional[int] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "ipc_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class MemoryHandle(_message.Message):
    __slots__ = ("name", "rank", "dtype", "shape", "size_bytes", "offset_bytes", "shm", "cuda")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    size_bytes: int
    offset_bytes: int
    shm: ShmHandle
    cuda: CudaIpcHandle
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ..., cuda: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("name", "quota_pages", "cache_namespace", "resume_session_id", "model_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    QUOTA_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RESUME_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    quota_pages: int
    cache_namespace: str
    resume_session_id: str
    model_id: str
    def __init__(self, name: _Optional[str] = ..., quota_pages: _Optional[int] = ..., cache_namespace: _Optional[str] = ..., resume_session_id: _Optional[str] = ..., model_id: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("epoch", "session_id", "lease_ms", "geometry", "memory", "prefix_cache", "resume_ms", "resumed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    RESUME_MS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    session_id: str
    lease_ms: int
    geometry: PoolGeometry
    memory: _containers.RepeatedCompositeFieldContainer[MemoryHandle]
    prefix_cache: PrefixCacheInfo
    resume_ms: int
    resumed: ResumedSession
    def __init__(self, epoch: _Optional[str] = ..., session_id: _Optional[str] = ..., lease_ms: _Optional[int] = ..., geometry: _Optional[_Union[PoolGeometry, _Mapping]] = ..., memory: _Optional[_Iterable[_Union[MemoryHandle, _Mapping]]] = ..., prefix_cache: _Optional[_Union[PrefixCacheInfo, _Mapping]] = ..., resume_ms: _Optional[int] = ..., resumed: _Optional[_Union[ResumedSession, _Mapping]] = ...) -> None: ...

class ResumedSession(_message.Message):
    __slots__ = ("applied_seq", "last_step_answer", "answer_kept", "num_requests")
    APPLIED_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ANSWER_FIELD_NUMBER: _ClassVar[int]
    ANSWER_KEPT_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    applied_seq: int
    last_step_answer: bytes
    answer_kept: bool
    num_requests: int
    def __init__(self, applied_seq: _Optional[int] = ..., last_step_answer: _Optional[bytes] = ..., answer_kept: _Optional[bool] = ..., num_requests: _Optional[int] = ...) -> None: ...

class PrefixCacheInfo(_message.Message):
    __slots__ = ("enabled", "hash", "cache_namespace")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    hash: str
    cache_namespace: str
    def __init__(self, enabled: _Optional[bool] = ..., hash: _Optional[str] = ..., cache_namespace: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ("epoch", "num_requests_released")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_RELEASED_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    num_requests_released: int
    def __init__(self, epoch: _Optional[str] = ..., num_requests_released: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    def __init__(self, epoch: _Optional[str] = ...) -> None: ...

class OpenRequest(_message.Message):
    __slots__ = ("session_id", "request_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class OpenResponse(_message.Message):
    __slots__ = ("epoch", "slots")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "release_slots", "truncate_slots", "truncate_lens", "alloc_slots", "alloc_needs", "alloc_expected_lens", "atomic", "release_token_ids", "release_token_offsets", "cache_slots", "cache_token_ids", "cache_token_offsets", "match_slots", "match_token_ids", "match_token_offsets", "match_max_tokens", "release_slots_i32", "truncate_slots_i32", "truncate_lens_i32", "alloc_slots_i32", "alloc_needs_i32", "alloc_expected_lens_i32", "seq", "handoff_slots", "handoff_states", "adopt_tickets", "adopt_request_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_LENS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_NEEDS_FIELD_NUMBER: _ClassVar[int]
    ALLOC_EXPECTED_LENS_FIELD_NUMBER: _ClassVar[int]
    ATOMIC_FIELD_NUMBER: _ClassVar[int]
    RELEASE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MATCH_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MATCH_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MATCH_TOKEN_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MATCH_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_SLOTS_I32_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_SLOTS_I32_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    ALLOC_SLOTS_I32_FIELD_NUMBER: _ClassVar[int]
    ALLOC_NEEDS_I32_FIELD_NUMBER: _ClassVar[int]
    ALLOC_EXPECTED_LENS_I32_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_STATES_FIELD_NUMBER: _ClassVar[int]
    ADOPT_TICKETS_FIELD_NUMBER: _ClassVar[int]
    ADOPT_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    release_slots: _containers.RepeatedScalarFieldContainer[int]
    truncate_slots: _containers.RepeatedScalarFieldContainer[int]
    truncate_lens: _containers.RepeatedScalarFieldContainer[int]
    alloc_slots: _containers.RepeatedScalarFieldContainer[int]
    alloc_needs: _containers.RepeatedScalarFieldContainer[int]
    alloc_expected_lens: _containers.RepeatedScalarFieldContainer[int]
    atomic: bool
    release_token_ids: bytes
    release_token_offsets: bytes
    cache_slots: _containers.RepeatedScalarFieldContainer[int]
    cache_token_ids: bytes
    cache_token_offsets: bytes
    match_slots: _containers.RepeatedScalarFieldContainer[int]
    match_token_ids: bytes
    match_token_offsets: bytes
    match_max_tokens: _containers.RepeatedScalarFieldContainer[int]
    release_slots_i32: bytes
    truncate_slots_i32: bytes
    truncate_lens_i32: bytes
    alloc_slots_i32: bytes
    alloc_needs_i32: bytes
    alloc_expected_lens_i32: bytes
    seq: int
    handoff_slots: _containers.RepeatedScalarFieldContainer[int]
    handoff_states: _containers.RepeatedScalarFieldContainer[bytes]
    adopt_tickets: _containers.RepeatedScalarFieldContainer[str]
    adopt_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_id: _Optional[str] = ..., release_slots: _Optional[_Iterable[int]] = ..., truncate_slots: _Optional[_Iterable[int]] = ..., truncate_lens: _Optional[_Iterable[int]] = ..., alloc_slots: _Optional[_Iterable[int]] = ..., alloc_needs: _Optional[_Iterable[int]] = ..., alloc_expected_lens: _Optional[_Iterable[int]] = ..., atomic: _Optional[bool] = ..., release_token_ids: _Optional[bytes] = ..., release_token_offsets: _Optional[bytes] = ..., cache_slots: _Optional[_Iterable[int]] = ..., cache_token_ids: _Optional[bytes] = ..., cache_token_offsets: _Optional[bytes] = ..., match_slots: _Optional[_Iterable[int]] = ..., match_token_ids: _Optional[bytes] = ..., match_token_offsets: _Optional[bytes] = ..., match_max_tokens: _Optional[_Iterable[int]] = ..., release_slots_i32: _Optional[bytes] = ..., truncate_slots_i32: _Optional[bytes] = ..., truncate_lens_i32: _Optional[bytes] = ..., alloc_slots_i32: _Optional[bytes] = ..., alloc_needs_i32: _Optional[bytes] = ..., alloc_expected_lens_i32: _Optional[bytes] = ..., seq: _Optional[int] = ..., handoff_slots: _Optional[_Iterable[int]] = ..., handoff_states: _Optional[_Iterable[bytes]] = ..., adopt_tickets: _Optional[_Iterable[str]] = ..., adopt_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("epoch", "alloc_status", "kv_loc", "kv_loc_offsets", "new_pages", "new_page_offsets", "num_pages_released", "num_free_pages", "match_lens", "cache_switched", "num_pages_cached", "num_pages_evicted", "error", "seq", "handoff_tickets", "adopt_slots", "adopt_lens", "adopt_states", "match_loading", "match_fetching")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ALLOC_STATUS_FIELD_NUMBER: _ClassVar[int]
    KV_LOC_FIELD_NUMBER: _ClassVar[int]
    KV_LOC_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    MATCH_LENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SWITCHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_EVICTED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_TICKETS_FIELD_NUMBER: _ClassVar[int]
    ADOPT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ADOPT_LENS_FIELD_NUMBER: _ClassVar[int]
    ADOPT_STATES_FIELD_NUMBER: _ClassVar[int]
    MATCH_LOADING_FIELD_NUMBER: _ClassVar[int]
    MATCH_FETCHING_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    alloc_status: bytes
    kv_loc: bytes
    kv_loc_offsets: bytes
    new_pages: bytes
    new_page_offsets: bytes
    num_pages_released: int
    num_free_pages: int
    match_lens: bytes
    cache_switched: bytes
    num_pages_cached: int
    num_pages_evicted: int
    error: _status_pb2.Status
    seq: int
    handoff_tickets: _containers.RepeatedScalarFieldContainer[str]
    adopt_slots: bytes
    adopt_lens: bytes
    adopt_states: _containers.RepeatedScalarFieldContainer[bytes]
    match_loading: bytes
    match_fetching: bytes
    def __init__(self, epoch: _Optional[str] = ..., alloc_status: _Optional[bytes] = ..., kv_loc: _Optional[bytes] = ..., kv_loc_offsets: _Optional[bytes] = ..., new_pages: _Optional[bytes] = ..., new_page_offsets: _Optional[bytes] = ..., num_pages_released: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., match_lens: _Optional[bytes] = ..., cache_switched: _Optional[bytes] = ..., num_pages_cached: _Optional[int] = ..., num_pages_evicted: _Optional[int] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., seq: _Optional[int] = ..., handoff_tickets: _Optional[_Iterable[str]] = ..., adopt_slots: _Optional[bytes] = ..., adopt_lens: _Optional[bytes] = ..., adopt_states: _Optional[_Iterable[bytes]] = ..., match_loading: _Optional[bytes] = ..., match_fetching: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("audit",)
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    audit: bool
    def __init__(self, audit: _Optional[bool] = ...) -> None: ...

class SessionUsage(_message.Message):
    __slots__ = ("name", "index", "num_requests", "num_pages_held", "quota_pages", "idle_ms", "cache_namespace", "prefix_query_tokens", "prefix_hit_tokens", "num_evictions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_HELD_FIELD_NUMBER: _ClassVar[int]
    QUOTA_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    index: int
    num_requests: int
    num_pages_held: int
    quota_pages: int
    idle_ms: int
    cache_namespace: str
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    def __init__(self, name: _Optional[str] = ..., index: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_pages_held: _Optional[int] = ..., quota_pages: _Optional[int] = ..., idle_ms: _Optional[int] = ..., cache_namespace: _Optional[str] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., num_evictions: _Optional[int] = ...) -> None: ...

class AuditResult(_message.Message):
    __slots__ = ("ran", "ok", "problems")
    RAN_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    ran: bool
    ok: bool
    problems: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ran: _Optional[bool] = ..., ok: _Optional[bool] = ..., problems: _Optional[_Iterable[str]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("epoch", "geometry", "num_pages_total", "num_free_pages", "num_cached_pages", "num_used_pages", "num_free_request_slots", "num_open_requests", "sessions", "audit", "num_steps", "num_evictions", "prefix_hit_tokens", "prefix_query_tokens", "memory_backend", "uptime_ms", "num_quarantined_pages", "num_quarantined_sessions", "prefix_cache_enabled", "prefix_hash", "num_cache_entries", "version", "origin", "num_handoff_tickets", "num_handoff_pages", "num_handed_off", "num_adopted", "num_handoffs_expired", "num_handoffs_given_up", "host_tier", "store")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_REQUEST_SLOTS_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    AUDIT_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BACKEND_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_ENABLED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFF_TICKETS_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFF_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    NUM_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    NUM_HANDOFFS_GIVEN_UP_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    geometry: PoolGeometry
    num_pages_total: int
    num_free_pages: int
    num_cached_pages: int
    num_used_pages: int
    num_free_request_slots: int
    num_open_requests: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionUsage]
    audit: AuditResult
    num_steps: int
    num_evictions: int
    prefix_hit_tokens: int
    prefix_query_tokens: int
    memory_backend: str
    uptime_ms: int
    num_quarantined_pages: int
    num_quarantined_sessions: int
    prefix_cache_enabled: bool
    prefix_hash: str
    num_cache_entries: int
    version: str
    origin: StateOrigin
    num_handoff_tickets: int
    num_handoff_pages: int
    num_handed_off: int
    num_adopted: int
    num_handoffs_expired: int
    num_handoffs_given_up: int
    host_tier: HostTierStats
    store: StoreStats
    def __init__(self, epoch: _Optional[str] = ..., geometry: _Optional[_Union[PoolGeometry, _Mapping]] = ..., num_pages_total: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_free_request_slots: _Optional[int] = ..., num_open_requests: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionUsage, _Mapping]]] = ..., audit: _Optional[_Union[AuditResult, _Mapping]] = ..., num_steps: _Optional[int] = ..., num_evictions: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., memory_backend: _Optional[str] = ..., uptime_ms: _Optional[int] = ..., num_quarantined_pages: _Optional[int] = ..., num_quarantined_sessions: _Optional[int] = ..., prefix_cache_enabled: _Optional[bool] = ..., prefix_hash: _Optional[str] = ..., num_cache_entries: _Optional[int] = ..., version: _Optional[str] = ..., origin: _Optional[_Union[StateOrigin, _Mapping]] = ..., num_handoff_tickets: _Optional[int] = ..., num_handoff_pages: _Optional[int] = ..., num_handed_off: _Optional[int] = ..., num_adopted: _Optional[int] = ..., num_handoffs_expired: _Optional[int] = ..., num_handoffs_given_up: _Optional[int] = ..., host_tier: _Optional[_Union[HostTierStats, _Mapping]] = ..., store: _Optional[_Union[StoreStats, _Mapping]] = ...) -> None: ...

class HostTierStats(_message.Message):
    __slots__ = ("num_pages", "num_free_pages", "num_cached_pages", "page_bytes", "num_demoted", "num_loaded", "num_evicted", "num_dropped", "hit_tokens", "num_loading_pages", "load_ms_p50", "load_ms_p99", "load_gib_per_s")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOADING_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_P50_FIELD_NUMBER: _ClassVar[int]
    LOAD_MS_P99_FIELD_NUMBER: _ClassVar[int]
    LOAD_GIB_PER_S_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    num_free_pages: int
    num_cached_pages: int
    page_bytes: int
    num_demoted: int
    num_loaded: int
    num_evicted: int
    num_dropped: int
    hit_tokens: int
    num_loading_pages: int
    load_ms_p50: float
    load_ms_p99: float
    load_gib_per_s: float
    def __init__(self, num_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_cached_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., num_demoted: _Optional[int] = ..., num_loaded: _Optional[int] = ..., num_evicted: _Optional[int] = ..., num_dropped: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., num_loading_pages: _Optional[int] = ..., load_ms_p50: _Optional[float] = ..., load_ms_p99: _Optional[float] = ..., load_gib_per_s: _Optional[float] = ...) -> None: ...

class StoreStats(_message.Message):
    __slots__ = ("url", "kind", "reachable", "connects", "failures", "last_error", "model_id", "pages_written", "bytes_written", "write_dropped", "write_failed", "fetches", "pages_found", "pages_read", "bytes_read", "rejected", "no_room", "writes_pending", "fetch_ms_p50", "fetch_ms_p99")
    class RejectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    URL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    CONNECTS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    WRITE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    WRITE_FAILED_FIELD_NUMBER: _ClassVar[int]
    FETCHES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FOUND_FIELD_NUMBER: _ClassVar[int]
    PAGES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    NO_ROOM_FIELD_NUMBER: _ClassVar[int]
    WRITES_PENDING_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_P50_FIELD_NUMBER: _ClassVar[int]
    FETCH_MS_P99_FIELD_NUMBER: _ClassVar[int]
    url: str
    kind: str
    reachable: bool
    connects: int
    failures: int
    last_error: str
    model_id: str
    pages_written: int
    bytes_written: int
    write_dropped: int
    write_failed: int
    fetches: int
    pages_found: int
    pages_read: int
    bytes_read: int
    rejected: _containers.ScalarMap[str, int]
    no_room: int
    writes_pending: int
    fetch_ms_p50: float
    fetch_ms_p99: float
    def __init__(self, url: _Optional[str] = ..., kind: _Optional[str] = ..., reachable: _Optional[bool] = ..., connects: _Optional[int] = ..., failures: _Optional[int] = ..., last_error: _Optional[str] = ..., model_id: _Optional[str] = ..., pages_written: _Optional[int] = ..., bytes_written: _Optional[int] = ..., write_dropped: _Optional[int] = ..., write_failed: _Optional[int] = ..., fetches: _Optional[int] = ..., pages_found: _Optional[int] = ..., pages_read: _Optional[int] = ..., bytes_read: _Optional[int] = ..., rejected: _Optional[_Mapping[str, int]] = ..., no_room: _Optional[int] = ..., writes_pending: _Optional[int] = ..., fetch_ms_p50: _Optional[float] = ..., fetch_ms_p99: _Optional[float] = ...) -> None: ...

class StateOrigin(_message.Message):
    __slots__ = ("kind", "owners", "requests", "pages_in_rows", "cached_pages", "quarantined_pages", "repaired", "adopt_ms", "sessions", "resumed", "not_resumed", "waiting", "undone")
    KIND_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_IN_ROWS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    ADOPT_MS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    NOT_RESUMED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    UNDONE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    owners: int
    requests: int
    pages_in_rows: int
    cached_pages: int
    quarantined_pages: int
    repaired: _containers.RepeatedScalarFieldContainer[str]
    adopt_ms: float
    sessions: int
    resumed: int
    not_resumed: int
    waiting: int
    undone: str
    def __init__(self, kind: _Optional[str] = ..., owners: _Optional[int] = ..., requests: _Optional[int] = ..., pages_in_rows: _Optional[int] = ..., cached_pages: _Optional[int] = ..., quarantined_pages: _Optional[int] = ..., repaired: _Optional[_Iterable[str]] = ..., adopt_ms: _Optional[float] = ..., sessions: _Optional[int] = ..., resumed: _Optional[int] = ..., not_resumed: _Optional[int] = ..., waiting: _Optional[int] = ..., undone: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq", "epoch")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    epoch: str
    def __init__(self, from_seq: _Optional[int] = ..., epoch: _Optional[str] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("epoch", "seq", "ts", "events", "snapshot", "snapshot_done", "fell_behind")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_DONE_FIELD_NUMBER: _ClassVar[int]
    FELL_BEHIND_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    ts: float
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    snapshot: bool
    snapshot_done: bool
    fell_behind: bool
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., ts: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., snapshot_done: _Optional[bool] = ..., fell_behind: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    stored: PagesStored
    removed: PagesRemoved
    cleared: AllCleared
    def __init__(self, stored: _Optional[_Union[PagesStored, _Mapping]] = ..., removed: _Optional[_Union[PagesRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class PagesStored(_message.Message):
    __slots__ = ("keys", "parent_key", "token_ids", "page_size", "cache_namespace", "medium")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_key: bytes
    token_ids: bytes
    page_size: int
    cache_namespace: str
    medium: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., parent_key: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., page_size: _Optional[int] = ..., cache_namespace: _Optional[str] = ..., medium: _Optional[str] = ...) -> None: ...

class PagesRemoved(_message.Message):
    __slots__ = ("keys", "medium")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
