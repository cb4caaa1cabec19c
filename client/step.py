"""A Step on the wire: the caller's ints as the request's columns, and the response's
bytes as tensors without a copy (:class:`StepResult`). What both clients send and return
for every step; :meth:`kvmem.client.session.Session.step` builds the request."""

from __future__ import annotations

import ctypes
import enum
import sys
import warnings
from collections.abc import Sequence
from typing import Any, cast, overload

import numpy as np
import torch

from kvmem.v1 import kvmem_pb2

IntsLike = Sequence[int] | np.ndarray | torch.Tensor
TokensLike = Sequence[int] | np.ndarray | torch.Tensor  # one request's token ids (1-D, int32 range)
TokenLists = Sequence[TokensLike | None]  # per release item, the request's token ids (or None)
CacheItems = Sequence[tuple[int, TokensLike]]  # (slot, token_ids) per cache item
MatchItems = Sequence[tuple[int, TokensLike] | tuple[int, TokensLike, int | None]]  # (slot, token_ids[, max_tokens])

AllocStatus = enum.IntEnum(  # type: ignore[misc]
    "AllocStatus",
    {name.removeprefix("ALLOC_STATUS_"): value for name, value in kvmem_pb2.AllocStatus.items()},
)
AllocStatus.__doc__ = "Per-item result of an alloc (the proto's AllocStatus without its prefix)."

# The step tensors view the response's bytes, which are immutable: they are read-only by
# contract (copy one before writing to it). torch warns about that once per buffer;
# the warning is the contract restated, so it is silenced here, for this message only.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


NO_COLUMN: tuple[int, ...] = ()  # the columns' default: a column left at it is not sent


def as_ints(values: IntsLike) -> Any:
    """A list or tuple protobuf can extend a packed field with (type checks by identity
    first: ``isinstance`` against ``torch.Tensor`` goes through its metaclass)."""
    kind = type(values)
    if kind is list or kind is tuple:
        return values
    if kind is torch.Tensor or kind is np.ndarray or isinstance(values, (np.ndarray, torch.Tensor)):
        return cast("np.ndarray | torch.Tensor", values).tolist()
    return values


_NO_TOKENS = np.zeros(0, dtype=np.int32)
_INT32 = np.iinfo(np.int32)
_INT32_LE = np.dtype("<i4")
_INT8_LE = np.dtype("i1")
_LITTLE_ENDIAN = sys.byteorder == "little"  # on a little-endian host, the native int32 dtype object itself


def add_column(columns: dict[str, Any], name: str, values: IntsLike) -> None:
    """``values`` into ``columns`` as the StepRequest's column ``name``: a 1-D integer
    array or CPU tensor as its int32 LE bytes twin ``name_i32`` (no varint per item on
    either side), a list or tuple (or anything else) as the repeated field, where
    protobuf checks it. An array with a value outside int32 goes as the repeated field
    too, so the server names the value as it would any other bad one."""
    kind = type(values)
    if kind is list or kind is tuple:
        columns[name] = values
        return
    a: Any = values
    if kind is torch.Tensor or (kind is not np.ndarray and isinstance(a, torch.Tensor)):
        if _LITTLE_ENDIAN and a.dtype is torch.int32 and a.is_cpu and a.dim() == 1 and a.is_contiguous():
            # The common case (slots from open() are such tensors): the bytes in one copy,
            # straight from the tensor's memory (measured ~10 µs less than .numpy() when
            # the caches are cold between steps).
            columns[f"{name}_i32"] = ctypes.string_at(a.data_ptr(), a.nbytes) if a.numel() else b""
            return
        try:
            a = a.numpy()  # a CPU tensor that needs no grad: a view, no copy
        except (RuntimeError, TypeError):  # on a device, or requiring grad
            a = a.detach().cpu().numpy()
    if isinstance(a, np.ndarray) and a.ndim == 1:
        dtype = a.dtype
        if dtype is _INT32_LE:  # the common case (slots from open() are int32): one copy, no check
            columns[f"{name}_i32"] = a.tobytes()
            return
        if dtype.kind in "iu":
            if not a.size:
                columns[name] = ()
                return
            if int(a.min()) >= _INT32.min and int(a.max()) <= _INT32.max:
                columns[f"{name}_i32"] = a.astype(_INT32_LE).tobytes()
                return
    columns[name] = as_ints(values)


def _token_array(tokens: TokensLike, where: str) -> np.ndarray:
    """One token list as an int32 array (no copy when it is one already); ValueError or
    TypeError naming ``where`` for anything but a 1-D list of integers in int32."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    a = np.asarray(tokens)
    if a.size == 0:
        return _NO_TOKENS
    if a.ndim != 1:
        raise ValueError(f"{where} must be a 1-D list of token ids, got shape {tuple(a.shape)}")
    if a.dtype == np.int32:
        return a
    if a.dtype.kind not in "iu":
        raise TypeError(f"{where} must hold integer token ids, got dtype {a.dtype}")
    if int(a.min()) < _INT32.min or int(a.max()) > _INT32.max:
        raise ValueError(f"{where} holds a token id outside int32")
    return a.astype(np.int32)


def pack_tokens(lists: Sequence[TokensLike | None], name: str) -> tuple[bytes, bytes]:
    """Token lists as the wire's two fields: every list's int32 LE ids concatenated, and
    int32 LE offsets ``[n + 1]`` (list ``i`` is ``ids[off[i]:off[i + 1]]``); None is an
    empty list. numpy throughout: no Python loop over tokens."""
    parts = [_NO_TOKENS if t is None else _token_array(t, f"{name}[{i}]") for i, t in enumerate(lists)]
    offsets = np.zeros(len(parts) + 1, dtype="<i4")
    if not parts:
        return b"", offsets.tobytes()
    offsets[1:] = np.cumsum([p.size for p in parts])
    ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return ids.astype("<i4", copy=False).tobytes(), offsets.tobytes()


def prefix_columns(
    columns: dict[str, Any],
    release_token_ids: TokenLists | None,
    cache: CacheItems | None,
    match: MatchItems | None,
) -> None:
    """The Step's prefix-cache columns: slots as ints, token lists packed (int32 LE
    bytes with offsets), max tokens only when an item has one (-1: none)."""
    if release_token_ids is not None:
        columns["release_token_ids"], columns["release_token_offsets"] = pack_tokens(
            release_token_ids, "release_token_ids"
        )
    if cache:
        columns["cache_slots"] = [int(item[0]) for item in cache]
        columns["cache_token_ids"], columns["cache_token_offsets"] = pack_tokens([item[1] for item in cache], "cache")
    if match:
        columns["match_slots"] = [int(item[0]) for item in match]
        columns["match_token_ids"], columns["match_token_offsets"] = pack_tokens([item[1] for item in match], "match")
        limits = [-1 if len(item) < 3 or item[2] is None else int(item[2]) for item in match]
        if any(limit != -1 for limit in limits):
            columns["match_max_tokens"] = limits


def match_len_of(resp: kvmem_pb2.StepResponse) -> int:
    """The first match item's matched length (int32 LE), read without a tensor."""
    return int.from_bytes(resp.match_lens[:4], "little", signed=True)


def pages_switched_of(resp: kvmem_pb2.StepResponse) -> int:
    """The first cache item's pages switched (int32 LE), read without a tensor."""
    return int.from_bytes(resp.cache_switched[:4], "little", signed=True)


class _BytesView:
    """A read-only tensor view of one ``bytes`` field of the step response, made on
    first access and kept in the result's slot of the same name. A data descriptor
    (it refuses to be set), so doc tools show it as the attribute it is."""

    def __init__(self, field: str, dtype: torch.dtype, doc: str) -> None:
        self.field = field
        self.dtype = dtype
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> _BytesView: ...
    @overload
    def __get__(self, obj: StepResult, owner: type | None = None) -> torch.Tensor: ...
    def __get__(self, obj: StepResult | None, owner: type | None = None) -> torch.Tensor | _BytesView:
        if obj is None:
            return self
        tensor: torch.Tensor | None = getattr(obj, self.slot)
        if tensor is None:
            data: bytes = getattr(obj._resp, self.field)
            tensor = torch.frombuffer(data, dtype=self.dtype) if data else torch.empty(0, dtype=self.dtype)
            setattr(obj, self.slot, tensor)
        return tensor

    def __set__(self, obj: StepResult, value: object) -> None:
        raise AttributeError(f"StepResult.{self.slot[1:]} is a view of the response: read-only")


class _ZerosView(_BytesView):
    """A :class:`_BytesView` whose field a server may leave empty where every value is
    0: then zeros, one per item of the field ``like``."""

    def __init__(self, field: str, dtype: torch.dtype, doc: str, like: str) -> None:
        super().__init__(field, dtype, doc)
        self.like = like

    def __get__(self, obj: StepResult | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        tensor: torch.Tensor | None = getattr(obj, self.slot)
        if tensor is None:
            data: bytes = getattr(obj._resp, self.field)
            if data:
                tensor = torch.frombuffer(data, dtype=self.dtype)
            else:
                tensor = torch.zeros(len(getattr(obj._resp, self.like)) // 4, dtype=self.dtype)
            setattr(obj, self.slot, tensor)
        return tensor


class StepResult:
    """A step's outcome. Per alloc item ``i``: ``status[i]`` (an :class:`AllocStatus`
    value), its token slots ``kv_loc[kv_loc_offsets[i]:kv_loc_offsets[i + 1]]`` and its new
    pages likewise. The tensors are read-only int32/int8 views of the response's bytes
    (little-endian, as the proto says; every platform torch ships on is little-endian),
    made on first access: no copy, no loop, and nothing for what the caller never reads.
    """

    __slots__ = (
        "_adopt_lens",
        "_adopt_slots",
        "_cache_switched",
        "_kv_loc",
        "_kv_loc_offsets",
        "_match_fetching",
        "_match_lens",
        "_match_loading",
        "_new_page_offsets",
        "_new_pages",
        "_resp",
        "_status",
    )

    status = _BytesView("alloc_status", torch.int8, "int8 [n]: AllocStatus per alloc item.")
    kv_loc = _BytesView("kv_loc", torch.int32, "int32 [T]: the token slots of every alloc item, concatenated.")
    kv_loc_offsets = _BytesView("kv_loc_offsets", torch.int32, "int32 [n + 1].")
    new_pages = _BytesView("new_pages", torch.int32, "int32 [P]: the page ids the step took, concatenated per item.")
    new_page_offsets = _BytesView("new_page_offsets", torch.int32, "int32 [n + 1].")
    match_lens = _BytesView(
        "match_lens", torch.int32, "int32 [m]: per match item, the tokens it matched (whole pages); its row holds them."
    )
    match_loading = _ZerosView(
        "match_loading",
        torch.int32,
        "int32 [m]: per match item, of its match_lens, the last tokens still being copied in from the server's "
        "host tier when it answered (0 without one): wait for them (KVMemClient.wait_loads) before reading their K/V.",
        "match_lens",
    )
    match_fetching = _ZerosView(
        "match_fetching",
        torch.int32,
        "int32 [m]: per match item, tokens after its match_lens that the server is fetching from its store "
        "(kvmem serve --store; 0 without one): hold the request a bounded time and match it again to load them.",
        "match_lens",
    )
    cache_switched = _BytesView(
        "cache_switched",
        torch.int32,
        "int32 [c]: per cache item, the pages of its row switched to an equal cached page (the row changed).",
    )

    adopt_slots = _BytesView("adopt_slots", torch.int32, "int32 [a]: per adopt item, its request slot here.")
    adopt_lens = _BytesView("adopt_lens", torch.int32, "int32 [a]: per adopt item, its alloced_len (tokens).")

    def __init__(self, resp: kvmem_pb2.StepResponse) -> None:
        self._resp = resp
        self._status = self._kv_loc = self._kv_loc_offsets = None
        self._new_pages = self._new_page_offsets = None
        self._match_lens = self._match_loading = self._match_fetching = self._cache_switched = None
        self._adopt_slots = self._adopt_lens = None

    @property
    def tickets(self) -> list[str]:
        """Per hand-off item, its ticket: what another session adopts (unguessable, single-use)."""
        return list(self._resp.handoff_tickets)

    @property
    def adopt_states(self) -> list[bytes]:
        """Per adopt item, the state its request was handed off with (b"" if none)."""
        return list(self._resp.adopt_states)

    @property
    def num_pages_released(self) -> int:
        """Page references the step's releases and truncates dropped."""
        return self._resp.num_pages_released

    @property
    def num_pages_cached(self) -> int:
        """Pages this step inserted into the prefix cache (release and cache items)."""
        return self._resp.num_pages_cached

    @property
    def num_pages_evicted(self) -> int:
        """Cached pages this step's allocs evicted to make room."""
        return self._resp.num_pages_evicted

    @property
    def num_free_pages(self) -> int:
        """Free pages in the pool right after this step."""
        return self._resp.num_free_pages

    @property
    def ok(self) -> bool:
        """Every alloc item succeeded (read from the status bytes: no tensor needed)."""
        status = self._resp.alloc_status
        return status.count(0) == len(status)

    def array(self, name: str) -> np.ndarray:
        """Column ``name`` (a tensor attribute's name: ``"status"``, ``"kv_loc"``,
        ``"kv_loc_offsets"``, ``"new_pages"``, ``"new_page_offsets"``, ``"match_lens"``,
        ``"match_loading"``, ``"cache_switched"``, ``"adopt_slots"``, ``"adopt_lens"``) as a read-only numpy
        view of the response's bytes: no copy and no tensor made. For a caller that only
        reads a column with numpy: about a sixth of the tensor's cost plus its
        ``.numpy()`` on a client whose caches are cold between steps (measured 6 against
        36 µs for four columns of a 37-item decode). A ValueError names an unknown column."""
        column = _COLUMNS.get(name)
        if column is None:
            raise ValueError(f"StepResult has no column {name!r}: one of {', '.join(sorted(_COLUMNS))}")
        field, dtype = column
        data = getattr(self._resp, field)
        if not data and field == "match_loading":  # a server without a host tier: none loading
            return np.zeros(len(self._resp.match_lens) // 4, dtype=dtype)
        return np.frombuffer(data, dtype=dtype)

    def kv_loc_of(self, i: int) -> torch.Tensor:
        """The token slots of alloc item ``i`` (a view; empty if it failed)."""
        return self.kv_loc[int(self.kv_loc_offsets[i]) : int(self.kv_loc_offsets[i + 1])]

    def new_pages_of(self, i: int) -> torch.Tensor:
        """The page ids alloc item ``i`` took (a view; empty if it took none or failed)."""
        return self.new_pages[int(self.new_page_offsets[i]) : int(self.new_page_offsets[i + 1])]

    def __repr__(self) -> str:
        return (
            f"StepResult(status={self.status.tolist()}, kv_loc={self.kv_loc.tolist()[:32]}"
            f"{'...' if self.kv_loc.numel() > 32 else ''}, new_pages={self.new_pages.tolist()[:32]}, "
            f"num_free_pages={self.num_free_pages})"
        )


# A column's response field and numpy dtype, by its attribute's name (StepResult.array).
_COLUMNS: dict[str, tuple[str, np.dtype[Any]]] = {
    name: (view.field, _INT8_LE if view.dtype is torch.int8 else _INT32_LE)
    for name, view in vars(StepResult).items()
    if isinstance(view, _BytesView)
}
