"""What a kvmem pool must share with a model, without torch or transformers: the model's
KV geometry (:class:`Geometry`), the check of a server's pool against it
(:func:`check_geometry`), the ``kvmem serve`` flags it needs (:func:`serve_flags`), and
the model's config read without loading it (:func:`model_config`).

``kvmem generate``'s parent uses this module: it reads a model's geometry from its
``config.json`` or from its GGUF metadata (:func:`gguf_metadata`, the file's header:
no tensor is read), and leaves torch, transformers and the weights to its workers.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import pathlib
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from kvmem.v1 import kvmem_pb2

from .models import ModelNotFound, model_path

__all__ = [
    "Geometry",
    "GeometryMismatch",
    "ModelConfig",
    "check_geometry",
    "gguf_metadata",
    "model_config",
    "serve_flags",
]


class GeometryMismatch(ValueError):
    """The pool's KV layout is not the model's; the message gives the serve flags."""


class Geometry(NamedTuple):
    """What a pool must share with a model: per token, ``layers`` x (K, V) of
    ``kv_heads`` x ``head_dim`` elements of ``dtype`` (a torch dtype name)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def of_model(cls, config: Any, dtype: Any = None) -> Geometry:
        """The geometry a model's config needs (a transformers config or a
        :class:`ModelConfig`; ``dtype``: the weights' dtype, a torch dtype or its name;
        default the config's, else float32)."""
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(int(config.num_hidden_layers), int(kv_heads), int(head_dim), _dtype_name(dtype or config.dtype))

    @classmethod
    def of_pool(cls, geometry: kvmem_pb2.PoolGeometry) -> Geometry | None:
        """A server's geometry (its Attach answer); None: no MHA KV memory."""
        layout = geometry.layout
        if not geometry.HasField("layout") or layout.format != kvmem_pb2.KV_FORMAT_MHA:
            return None
        return cls(int(layout.num_layers), int(layout.num_kv_heads), int(layout.head_dim), layout.dtype)

    @classmethod
    def of_tensors(cls, kv_cache: Sequence[tuple[Any, Any]]) -> Geometry:
        """The geometry of per-layer ``(K, V)`` tensors ``[num_tokens, kv_heads, head_dim]``."""
        k = kv_cache[0][0]
        return cls(len(kv_cache), int(k.shape[1]), int(k.shape[2]), _dtype_name(k.dtype))


def _dtype_name(dtype: Any) -> str:
    """``torch.float32``, ``"torch.float32"`` or ``"float32"``: ``"float32"`` (None too)."""
    if dtype is None:
        return "float32"
    return str(dtype).removeprefix("torch.")


def serve_flags(config: Any, dtype: Any = None) -> str:
    """The ``kvmem serve`` flags of a pool for this model, e.g. ``--format mha
    --layers 30 --kv-heads 3 --head-dim 64 --dtype float32``."""
    g = Geometry.of_model(config, dtype)
    return f"--format mha --layers {g.layers} --kv-heads {g.kv_heads} --head-dim {g.head_dim} --dtype {g.dtype}"


def check_geometry(config: Any, pool: kvmem_pb2.PoolGeometry | Geometry, dtype: Any = None) -> None:
    """Refuse a pool whose KV layout is not the model's, in one line that names what
    differs and the ``kvmem serve`` flags the model needs."""
    want = Geometry.of_model(config, dtype)
    have = pool if isinstance(pool, Geometry) else Geometry.of_pool(pool)
    if have == want:
        return
    if have is None:
        differs = "the server has no MHA KV memory"
    else:
        differs = ", ".join(
            f"{name.replace('_', ' ')} {h} (the model's {w})"
            for name, h, w in zip(Geometry._fields, have, want, strict=True)
            if h != w
        )
        differs = f"the pool has {differs}"
    raise GeometryMismatch(
        f"the kvmem pool does not fit this model: {differs}; start the server with: kvmem serve "
        f"{serve_flags(config, dtype)}"
    )


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """What the geometry needs of a model's config, under transformers' names (so
    :meth:`Geometry.of_model` reads it as it reads a transformers config): ``head_dim``
    None is ``hidden_size // num_attention_heads``, ``num_key_value_heads`` None is
    ``num_attention_heads``, ``dtype`` None is float32. ``source``: the file it was read
    from."""

    num_hidden_layers: int
    num_attention_heads: int
    hidden_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    dtype: str | None = None
    vocab_size: int | None = None
    source: str = ""


def model_config(model: str | os.PathLike[str] | None) -> ModelConfig:
    """The config of ``--model`` (None: the bundled SmolLM2), read without loading the
    model, torch or transformers: a directory's ``config.json``, or a ``.gguf`` file's
    metadata. A GGUF's ``dtype`` is None: the workers de-quantise it to float32."""
    path = model_path(model)
    if path.is_dir():
        return _from_config_json(path / "config.json")
    return _from_gguf(path)


# config.json: transformers' names, then the older names some configs use (what
# transformers' attribute_map gives them, e.g. GPT-2's n_head).
_CONFIG_KEYS = {
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_key_value_heads": ("num_key_value_heads", "num_kv_heads"),
    "head_dim": ("head_dim",),
    "dtype": ("dtype", "torch_dtype"),
    "vocab_size": ("vocab_size",),
}
_REQUIRED = ("num_hidden_layers", "num_attention_heads", "hidden_size")


def _from_config_json(path: pathlib.Path) -> ModelConfig:
    if not path.is_file():
        raise ModelNotFound(
            f"model {str(path.parent)!r} has no config.json: pass a transformers model directory or a .gguf file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {' '.join(str(err).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    found = {
        field: next((data[k] for k in keys if data.get(k) is not None), None) for field, keys in _CONFIG_KEYS.items()
    }
    missing = [field for field in _REQUIRED if found[field] is None]
    if missing:
        raise ValueError(f"{path} has no {', '.join(missing)}: not the config of a transformers decoder model")
    try:
        return _config(found, str(path))
    except (TypeError, ValueError):
        raise ValueError(f"{path}: the model's geometry is not whole numbers: {_shown(found)}") from None


def _from_gguf(path: pathlib.Path) -> ModelConfig:
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: its GGUF metadata names no general.architecture")
    keys = {
        "num_hidden_layers": "block_count",
        "num_attention_heads": "attention.head_count",
        "hidden_size": "embedding_length",
        "num_key_value_heads": "attention.head_count_kv",
        # the size of the weights' K heads: transformers reads it as head_dim for some
        # architectures (gemma2, qwen3_moe, ...); for the others it derives the same value
        "head_dim": "attention.key_length",
        "vocab_size": "vocab_size",
    }
    found: dict[str, Any] = {field: meta.get(f"{arch}.{key}") for field, key in keys.items()}
    missing = [f"{arch}.{keys[field]}" for field in _REQUIRED if found[field] is None]
    if missing:
        raise ValueError(f"{path}: its GGUF metadata has no {', '.join(missing)}")
    for field, value in found.items():
        if isinstance(value, tuple):  # per layer (a few architectures): one geometry needs one value
            if len(set(value)) != 1:
                raise ValueError(f"{path}: {arch}.{keys[field]} differs between layers, {_shown(value)}: not supported")
            found[field] = value[0]
    if found["vocab_size"] is None:
        found["vocab_size"] = meta.get("tokenizer.ggml.tokens")  # the token list's length (see gguf_metadata)
    try:
        return _config(found, str(path))
    except (TypeError, ValueError):
        raise ValueError(f"{path}: the model's geometry is not whole numbers: {_shown(found)}") from None


def _config(found: dict[str, Any], source: str) -> ModelConfig:
    vocab = found.get("vocab_size")
    dtype = found.get("dtype")
    return ModelConfig(
        num_hidden_layers=_whole(found, "num_hidden_layers"),
        num_attention_heads=_whole(found, "num_attention_heads"),
        hidden_size=_whole(found, "hidden_size"),
        num_key_value_heads=_whole(found, "num_key_value_heads"),
        head_dim=_whole(found, "head_dim"),
        dtype=None if dtype is None else _dtype_name(dtype),
        vocab_size=int(vocab) if isinstance(vocab, int) and not isinstance(vocab, bool) else None,
        source=source,
    )


def _whole(found: dict[str, Any], field: str) -> Any:
    """``found[field]`` as a positive int (None stays None); ValueError otherwise."""
    value = found.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
        raise ValueError(field)
    return int(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# GGUF (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): "GGUF", a uint32
# version, uint64 tensor and key-value counts, then the key-value pairs: a string key, a
# uint32 value type, the value. Strings are a uint64 length and UTF-8 bytes; an array is
# a uint32 item type, a uint64 count and the items. Little-endian, or big-endian when
# the version reads byte-swapped.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_VERSIONS = (2, 3)
_ARRAY_KEPT = 4096  # numeric arrays up to this many items are read (per-layer values); longer ones are skipped


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The key-value metadata of a GGUF file (versions 2 and 3), read from its header
    alone: scalars and strings as Python values, numeric arrays of up to 4096 items as
    tuples; a longer array, or an array of strings (the tokenizer's vocabulary) or of
    arrays, as its length. Raises ValueError naming the file when it is not a readable
    GGUF."""
    name = os.fspath(path)
    try:
        f = open(name, "rb")  # noqa: SIM115 (closed below, after the map)
    except OSError as err:
        raise ValueError(f"cannot read {name}: {err.strerror or err}") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            raise ValueError(f"{name}: not a GGUF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                return _read_gguf(buf, name)
            except struct.error:
                raise ValueError(f"{name}: its GGUF metadata runs past the end of the file") from None
            except UnicodeDecodeError:
                raise ValueError(f"{name}: a key or string of its GGUF metadata is not UTF-8") from None


def _read_gguf(buf: mmap.mmap, name: str) -> dict[str, Any]:
    if buf[:4] != b"GGUF":
        raise ValueError(f"{name}: not a GGUF file (it starts with {bytes(buf[:4])!r}, not b'GGUF')")
    order = "<"
    (version,) = struct.unpack_from("<I", buf, 4)
    if version & 0xFFFF == 0:  # written on a big-endian machine
        order = ">"
        (version,) = struct.unpack_from(">I", buf, 4)
    if version not in _GGUF_VERSIONS:
        raise ValueError(f"{name}: GGUF version {version} is not supported (only 2 and 3)")
    u32, u64 = struct.Struct(order + "I"), struct.Struct(order + "Q")
    (count,) = u64.unpack_from(buf, 16)  # after the magic, the version and the tensor count
    at = 24
    size = len(buf)

    def string(at: int) -> tuple[str, int]:
        (n,) = u64.unpack_from(buf, at)
        end = at + 8 + n
        if end > size:
            raise struct.error("past the end")
        return buf[at + 8 : end].decode("utf-8"), end

    def value(kind: int, at: int, keep: bool) -> tuple[Any, int]:
        """The value of type ``kind`` at ``at`` (an array's length when not ``keep``) and where it ends."""
        if kind == _GGUF_STRING:
            return string(at)
        if kind in _GGUF_SCALARS:
            scalar = struct.Struct(order + _GGUF_SCALARS[kind])
            return scalar.unpack_from(buf, at)[0], at + scalar.size
        if kind != _GGUF_ARRAY:
            raise ValueError(f"{name}: its GGUF metadata has a value of unknown type {kind}")
        (item,) = u32.unpack_from(buf, at)
        (n,) = u64.unpack_from(buf, at + 4)
        at += 12
        if item in _GGUF_SCALARS:
            code = _GGUF_SCALARS[item]
            end = at + n * struct.calcsize(code)
            if end > size:
                raise struct.error("past the end")
            if keep and n <= _ARRAY_KEPT:
                return struct.unpack_from(f"{order}{n}{code}", buf, at), end
            return n, end
        for _ in range(n):  # strings or arrays: skipped, each one's length says where the next starts
            at = value(item, at, False)[1]
        return n, at

    meta: dict[str, Any] = {}
    for _ in range(count):
        key, at = string(at)
        (kind,) = u32.unpack_from(buf, at)
        meta[key], at = value(kind, at + 4, True)
    return meta
