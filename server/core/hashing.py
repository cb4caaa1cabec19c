"""Page keys of the prefix cache: how a chain of full pages is named.

A page's key chains its parent's key, its ``page_size`` token ids and the cache
namespace through a well-kept hash, so equal keys mean equal token prefixes (in one
namespace), across processes and restarts. Two recipes:

* :class:`XXH3Keys` (the default, ``"xxh3-128"``): ``key = XXH3-128(parent_key ||
  tokens as int32 LE)``, 16 bytes; the first page's parent is ``XXH3-128("kvmem/v1
  namespace" || 0 || namespace as UTF-8)``. About 0.15 µs a page.
* :class:`VllmSha256CborKeys` (``"vllm-sha256-cbor"``): vLLM's ``sha256_cbor`` block
  hashes, so a router that recomputes vLLM's keys from a request's tokens (with the
  same seed) scores kvmem's events correctly. About 30x slower; opt-in.

Each recipe yields keys lazily (:meth:`PageKeys.keys`), so a match stops hashing at
its first miss. Cost O(pages hashed): a Python loop over pages, never over tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import xxhash

_NAMESPACE_TAG = b"kvmem/v1 namespace\0"


class PageKeys(Protocol):
    """A key recipe. ``name`` is what Attach and Stats report."""

    name: str

    def root(self, namespace: str) -> bytes:
        """The parent key of a chain's first page in ``namespace`` (never a page's key)."""
        ...

    def keys(self, namespace: str, root: bytes, tokens: np.ndarray, num_pages: int, page_size: int) -> Iterator[bytes]:
        """The keys of the first ``num_pages`` full pages of ``tokens`` (int32, at least
        ``num_pages * page_size`` long), in chain order, lazily. ``root`` is
        :meth:`root` of ``namespace`` (passed in: callers keep it)."""
        ...


class XXH3Keys:
    """The default recipe: XXH3-128 over the parent key and the page's int32 LE tokens."""

    name = "xxh3-128"

    def root(self, namespace: str) -> bytes:
        return xxhash.xxh3_128_digest(_NAMESPACE_TAG + namespace.encode("utf-8", "surrogatepass"))

    def keys(self, namespace: str, root: bytes, tokens: np.ndarray, num_pages: int, page_size: int) -> Iterator[bytes]:
        data = _le_int32(tokens[: num_pages * page_size]).tobytes()
        step = 4 * page_size
        digest = xxhash.xxh3_128_digest
        key = root
        for start in range(0, num_pages * step, step):
            key = digest(key + data[start : start + step])
            yield key


def _le_int32(tokens: np.ndarray) -> np.ndarray:
    """``tokens`` as contiguous little-endian int32 (no copy when it already is)."""
    return np.ascontiguousarray(tokens, dtype="<i4")


class VllmSha256CborKeys:
    """vLLM v1's block hashes by its ``sha256_cbor`` recipe, so a router that recomputes
    them from a request's tokens (llm-d, with the engines' seed) finds kvmem's pages.

    As ``vllm/v1/core/kv_cache_utils.py`` builds them (``hash_block_tokens``,
    ``init_none_hash``, ``generate_block_hash_extra_keys``) with ``sha256_cbor`` of
    ``vllm/utils/hashing.py`` (``cbor2.dumps(obj, canonical=True)``, then SHA-256)::

        key  = SHA-256(CBOR([parent, [page's token ids], extra_keys]))    # 32 bytes
        root = NONE_HASH = SHA-256(CBOR(seed))                            # a first page's parent

    ``extra_keys`` is ``[namespace]`` on a chain's first page when the namespace is not
    empty (vLLM's ``cache_salt``, which vLLM adds to the first block only) and null on
    every other page (kvmem has no LoRA, multimodal or prompt-embedding keys), so the
    root is the same for every namespace. ``seed`` is the text vLLM derives NONE_HASH
    from: its ``PYTHONHASHSEED`` (newer vLLM, unset, with sha256: ``"vllm-none-hash"``).
    Needs ``cbor2`` (the ``events`` extra). About 3 µs a page of 16 tokens.
    """

    name = "vllm-sha256-cbor"

    def __init__(self, seed: str) -> None:
        self._dumps = _cbor_dumps()
        self._none_hash = hashlib.sha256(self._dumps(seed)).digest()

    def root(self, namespace: str) -> bytes:
        return self._none_hash  # the namespace enters the first page's key as its extra key

    def keys(self, namespace: str, root: bytes, tokens: np.ndarray, num_pages: int, page_size: int) -> Iterator[bytes]:
        ids = np.asarray(tokens[: num_pages * page_size]).tolist()
        dumps, sha256 = self._dumps, hashlib.sha256
        extra: tuple[str, ...] | None = (namespace,) if namespace else None
        key = root
        for start in range(0, num_pages * page_size, page_size):
            key = sha256(dumps((key, tuple(ids[start : start + page_size]), extra))).digest()
            extra = None
            yield key


def _cbor_dumps() -> Callable[[Any], bytes]:
    """``cbor2.dumps`` in canonical form, imported only when vLLM's recipe is chosen."""
    try:
        import cbor2
    except ImportError as e:
        raise ImportError(
            "the vllm-sha256-cbor prefix hash needs the cbor2 package: pip install 'kvmem[events]'"
        ) from e

    def dumps(obj: Any) -> bytes:
        return cbor2.dumps(obj, canonical=True)

    return dumps


RECIPES: dict[str, type] = {XXH3Keys.name: XXH3Keys, VllmSha256CborKeys.name: VllmSha256CborKeys}


def make_keys(name: str, seed: str | None = None) -> PageKeys:
    """The recipe called ``name`` (``seed``: only for vLLM's, and required there: the
    text vLLM derives its NONE_HASH from, i.e. the engines' PYTHONHASHSEED)."""
    if name == XXH3Keys.name:
        if seed is not None:
            raise ValueError(f"the {name} recipe takes no seed (its keys are fixed by the tokens and namespace)")
        return XXH3Keys()
    if name == VllmSha256CborKeys.name:
        if seed is None:
            raise ValueError(
                f"the {name} recipe needs a seed: the PYTHONHASHSEED the vLLM engines and routers use "
                "(vLLM versions that fix a default for sha256 when it is unset use 'vllm-none-hash'); "
                "without one vLLM draws random bytes and no one could recompute the keys"
            )
        return VllmSha256CborKeys(seed)
    raise ValueError(f"unknown prefix hash {name!r}: choose one of {sorted(RECIPES)}")
