"""KV geometry and pool sizing: the arithmetic of a KV layout and the one check of a pool.

:class:`KVGeometry` validates the layout (format, layers, heads, dtype, page size);
:class:`PoolSpec` validates a whole pool (a geometry, ``num_pages``, ``max_requests``,
``max_context_len``) and is the only place a pool is checked: the backends take one and
do not check it again. :func:`pages_for_budget` and :func:`parse_size` turn command-line
values into a pool. Every refusal is a :class:`GeometryError` naming the option and the
value. No torch: dtypes are torch's names, sized from a table (only
:attr:`KVGeometry.torch_dtype` imports torch, for the cuda backend and tests).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_INT32_MAX = 2**31 - 1

FORMATS = ("mha", "mla")
# Bytes per element of each KV dtype (torch's names). A table, not numpy: bfloat16 and the
# float8 types have no numpy dtype, and the server only sizes KV bytes, never computes on them.
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
DTYPES: tuple[str, ...] = tuple(_ITEMSIZE)


class GeometryError(ValueError):
    """A geometry or pool size that cannot work. The message names the command-line
    option and the value (``--kv-heads must be >= 1, got 0``)."""


class MemoryUnavailable(GeometryError):
    """The pool fits the device's memory, but not what is free of it now: memory held
    by someone else (e.g. a crashed server's allocation that clients' views still pin)
    may come back, so waiting can help. ``needed`` and ``free`` are bytes."""

    def __init__(self, message: str, needed: int, free: int) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free


def _as_int(value: Any, option: str) -> int:
    if isinstance(value, bool):
        raise GeometryError(f"{option} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise GeometryError(f"{option} must be an integer, got {value!r}") from None


def format_size(num_bytes: int) -> str:
    """``1610612736`` -> ``'1.50 GiB'`` (for messages)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV layout of every token slot. Fields not used by ``format`` (``kv_lora_rank``
    and ``rope_dim`` for mha; ``num_kv_heads`` and ``head_dim`` for mla) are set to 0, so
    command-line defaults of the other format do no harm.

    ``dtype`` is a torch dtype name (see :data:`DTYPES`), sized without torch
    (:attr:`itemsize`). Construction validates every field and raises
    :class:`GeometryError` naming the option (``--layers``, ``--kv-heads``,
    ``--head-dim``, ``--kv-lora-rank``, ``--rope-dim``, ``--dtype``, ``--format``,
    ``--page-size``). All methods are O(1).
    """

    format: str
    num_layers: int
    num_kv_heads: int = 0  # mha
    head_dim: int = 0  # mha
    kv_lora_rank: int = 0  # mla
    rope_dim: int = 0  # mla
    dtype: str = "bfloat16"
    page_size: int = 16

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.format not in FORMATS:
            raise GeometryError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.dtype not in DTYPES:
            raise GeometryError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        checks = [("num_layers", "--layers", 1), ("page_size", "--page-size", 1)]
        if self.format == "mha":
            checks += [("num_kv_heads", "--kv-heads", 1), ("head_dim", "--head-dim", 1)]
            unused = ("kv_lora_rank", "rope_dim")
        else:
            checks += [("kv_lora_rank", "--kv-lora-rank", 1), ("rope_dim", "--rope-dim", 0)]
            unused = ("num_kv_heads", "head_dim")
        for field, option, lowest in checks:
            value = _as_int(getattr(self, field), option)
            if value < lowest:
                raise GeometryError(f"{option} must be >= {lowest}, got {value}")
            set_(self, field, value)
        for field in unused:
            set_(self, field, 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # only here: the geometry itself needs no torch

        dtype: torch.dtype = getattr(torch, self.dtype)
        return dtype

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``, from a table (no torch)."""
        return _ITEMSIZE[self.dtype]

    @property
    def token_width(self) -> int:
        """Elements per token per layer and per K or V: ``heads * head_dim`` (mha) or
        ``kv_lora_rank + rope_dim`` (mla)."""
        if self.format == "mha":
            return self.num_kv_heads * self.head_dim
        return self.kv_lora_rank + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token slot over all layers (K and V for mha)."""
        kv = 2 if self.format == "mha" else 1
        return self.num_layers * kv * self.token_width * self.itemsize

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_token * self.page_size

    def kv_shape(self, num_tokens: int) -> tuple[int, ...]:
        """Shape of a KV allocation of ``num_tokens`` token slots: mha
        ``(layers, 2, tokens, kv_heads, head_dim)``, mla ``(layers, tokens, rank + rope)``."""
        if self.format == "mha":
            return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)
        return (self.num_layers, num_tokens, self.kv_lora_rank + self.rope_dim)


def max_pages_per_request(geometry: KVGeometry, max_context_len: int) -> int:
    return -(-max_context_len // geometry.page_size)


def block_table_shape(geometry: KVGeometry, max_requests: int, max_context_len: int) -> tuple[int, int]:
    """int32 ``(max_requests + 1, ceil(max_context_len / page_size))``; row 0 is padding."""
    return (max_requests + 1, max_pages_per_request(geometry, max_context_len))


def block_table_bytes(geometry: KVGeometry, max_requests: int, max_context_len: int) -> int:
    rows, cols = block_table_shape(geometry, max_requests, max_context_len)
    return rows * cols * 4


def _check_requests(max_requests: Any, max_context_len: Any) -> tuple[int, int]:
    """The request-slot part of :class:`PoolSpec`'s check (also what
    :func:`pages_for_budget` needs before it can size a pool)."""
    max_requests = _as_int(max_requests, "--max-requests")
    max_context_len = _as_int(max_context_len, "--max-context")
    if max_requests < 1:
        raise GeometryError(f"--max-requests must be >= 1, got {max_requests}")
    if max_context_len < 1:
        raise GeometryError(f"--max-context must be >= 1, got {max_context_len}")
    if max_requests > _INT32_MAX - 1:
        raise GeometryError(f"--max-requests must be < {_INT32_MAX}, got {max_requests}")
    return max_requests, max_context_len


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSpec:
    """A validated pool: the KV geometry, ``num_pages`` (including padding page 0),
    ``max_requests`` request slots and ``max_context_len`` tokens per request. The one
    place a pool is checked; the backends take a ``PoolSpec`` and trust it.

    Construction refuses a pool that cannot work, with a :class:`GeometryError` naming
    the option: fewer than 2 pages (page 0 is padding), token slots beyond int32
    (``kv_loc`` is int32), no request slot, or a ``--max-context`` longer than the pool's
    usable tokens (``(num_pages - 1) * page_size``): such a request could never be
    served. Integer fields are normalised to ``int``. O(1), like every method.
    """

    geometry: KVGeometry
    num_pages: int
    max_requests: int
    max_context_len: int

    def __post_init__(self) -> None:
        num_pages = _as_int(self.num_pages, "--num-pages")
        max_requests, max_context_len = _check_requests(self.max_requests, self.max_context_len)
        ps = self.geometry.page_size
        if num_pages < 2:
            raise GeometryError(f"--num-pages must be >= 2 (page 0 is padding), got {num_pages}")
        if num_pages > _INT32_MAX // ps:
            raise GeometryError(
                f"--num-pages {num_pages} with --page-size {ps} gives {num_pages * ps} token slots, "
                f"beyond int32 kv_loc; at most {_INT32_MAX // ps} pages"
            )
        pool_tokens = (num_pages - 1) * ps
        if max_context_len > pool_tokens:
            raise GeometryError(
                f"--max-context {max_context_len} exceeds the pool's {pool_tokens} tokens "
                f"({num_pages - 1} usable pages of {ps}); raise --num-pages/--memory or lower --max-context"
            )
        object.__setattr__(self, "num_pages", num_pages)
        object.__setattr__(self, "max_requests", max_requests)
        object.__setattr__(self, "max_context_len", max_context_len)

    @property
    def num_tokens(self) -> int:
        """Token slots: ``num_pages * page_size``."""
        return self.num_pages * self.geometry.page_size

    @property
    def max_pages_per_request(self) -> int:
        return max_pages_per_request(self.geometry, self.max_context_len)

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """Shape of one KV allocation (one per rank): ``geometry.kv_shape(num_tokens)``."""
        return self.geometry.kv_shape(self.num_tokens)

    @property
    def kv_bytes(self) -> int:
        return math.prod(self.kv_shape) * self.geometry.itemsize

    @property
    def block_table_shape(self) -> tuple[int, int]:
        """int32 ``(max_requests + 1, max_pages_per_request)``; row 0 is padding."""
        return block_table_shape(self.geometry, self.max_requests, self.max_context_len)

    @property
    def block_table_bytes(self) -> int:
        return block_table_bytes(self.geometry, self.max_requests, self.max_context_len)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip


def parse_size(text: str | int, option: str = "--memory") -> int:
    """Bytes from ``"40GiB"``, ``"512MiB"``, ``"1.5G"``, ``"123"`` (case-insensitive).

    ``K/M/G/T``, ``Ki/Mi/Gi/Ti`` and ``KiB/MiB/GiB/TiB`` are powers of 1024 (like
    ``docker --shm-size``); ``KB/MB/GB/TB`` are powers of 1000. Fractions are rounded
    down to whole bytes. Anything else raises :class:`GeometryError` naming ``option``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise GeometryError(f"{option} must be >= 0 bytes, got {text}")
        return text
    if not isinstance(text, str):
        raise GeometryError(f"{option} must be a size such as 40GiB, 512MiB or 123, got {text!r}")
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise GeometryError(f"{option} must be a size such as 40GiB, 512MiB, 1.5G or 123 (bytes), got {text!r}")
    number = m.group(1)
    whole, _, frac = number.partition(".")
    scale = _SIZE_UNITS[unit]
    # Exact integer arithmetic: no float rounding for large sizes.
    value = int(whole or "0") * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    return value


def pages_for_budget(memory_bytes: int, geometry: KVGeometry, max_requests: int, max_context_len: int) -> int:
    """The largest ``num_pages`` (including padding page 0) whose KV bytes
    (``num_pages * page_bytes``) plus the block table's bytes (int32
    ``[max_requests + 1, ceil(max_context_len / page_size)]``) fit in ``memory_bytes``,
    capped so token slots fit in int32. With the cuda backend the budget is per device
    (each rank holds a KV allocation and a block-table copy of this size).

    Refuses (:class:`GeometryError`) a budget below 2 pages, naming ``--memory``, its
    value and the size of one page, and any pool :class:`PoolSpec` refuses. O(1).
    """
    memory_bytes = _as_int(memory_bytes, "--memory")
    max_requests, max_context_len = _check_requests(max_requests, max_context_len)
    table = block_table_bytes(geometry, max_requests, max_context_len)
    page = geometry.page_bytes
    num_pages = max(memory_bytes - table, 0) // page
    if num_pages < 2:
        raise GeometryError(
            f"--memory {memory_bytes} bytes ({format_size(memory_bytes)}) holds {num_pages} page(s); "
            f"at least 2 are needed (page 0 is padding). One page is {page} bytes "
            f"({format_size(page)}: --page-size {geometry.page_size} x {geometry.bytes_per_token} bytes "
            f"per token) and the block table takes {table} bytes, so at least {2 * page + table} bytes"
        )
    num_pages = min(num_pages, _INT32_MAX // geometry.page_size)
    return PoolSpec(geometry, num_pages, max_requests, max_context_len).num_pages
