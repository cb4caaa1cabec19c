"""What kvmem puts in a store: content keys and self-checking values.

**Keys.** A page's store key names the model and KV layout, the cache namespace and
the page's whole token prefix, through SHA-256 whatever the local ``--prefix-hash``
(a local key may be XXH3-128, which an adversary can collide; a store is shared by
nodes, so its keys must not be)::

    fingerprint = SHA-256(canonical JSON of the layout: format, dtype, layers, heads,
                  head_dim / kv_lora_rank, rope_dim, page_size, rank, ranks,
                  prefix_hash recipe and seed, model id with its weights revision)
    root        = SHA-256("kvmem/store/v1\\0" || fingerprint || namespace)
    digest(p)   = SHA-256(digest(parent) || page's token ids as int32 LE)   (root for a first page)
    key         = "kvmem/" + hex(digest)

so two nodes serving the same weights in the same namespace share every page, and
nothing else ever collides (another model, layout, rank or namespace has another root).

**Values.** A value is a fixed header (:data:`HEADER_BYTES`) then one rank's page, all
layers (a host page's bytes: ``[planes][row]``). The header carries the format
version, its own key's digest, the fingerprint, the page size, the dtype, the
payload's size and an XXH3-64 checksum of it, and, with ``--store-key-file``, an
HMAC-SHA-256 over the header (MAC zeroed) and the payload. :func:`check` finds what is
wrong with a value read back (one reason of :data:`REASONS`): a value that fails is a
miss, never loaded.

The checksum catches corruption, not a writer: anyone who can write the store can plant
K/V with a right checksum. With a key, a value without the right MAC is a miss
(docs/DEPLOY.md, The store's trust boundary).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct

import numpy as np
import xxhash

from kvmem.server.memory.geometry import KVGeometry

MAGIC = b"KVMEMPG\0"
VERSION = 1
# magic, version, header bytes, flags, page size, payload bytes, dtype, fingerprint,
# digest, checksum, MAC; zero padding to HEADER_BYTES.
_LAYOUT = struct.Struct("<8sHHIIQ16s32s32sQ32s")
HEADER_BYTES = 160
_MAC_AT = _LAYOUT.size - 32
FLAG_MAC = 1

# Why a value read back is refused (stats, metrics, the log's first line of each).
REASONS = ("size", "header", "fingerprint", "key", "checksum", "mac")


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """The layout a value's bytes are in, and the model they came from; ``digest`` is its
    SHA-256 (in every key's root and every header)."""

    fields: dict[str, object]
    digest: bytes

    @classmethod
    def of(
        cls,
        geometry: KVGeometry,
        rank: int,
        ranks: int,
        prefix_hash: str,
        seed: str | None,
        model_id: str,
    ) -> Fingerprint:
        fields: dict[str, object] = {
            "version": VERSION,
            "format": geometry.format,
            "dtype": geometry.dtype,
            "layers": geometry.num_layers,
            "page_size": geometry.page_size,
            "page_bytes": geometry.page_bytes,
            "rank": rank,
            "ranks": ranks,
            "prefix_hash": prefix_hash,
            "seed": seed or "",
            "model": model_id,
        }
        if geometry.format == "mha":
            fields.update(kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim)
        else:
            fields.update(kv_lora_rank=geometry.kv_lora_rank, rope_dim=geometry.rope_dim)
        text = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
        return cls(fields, hashlib.sha256(text).digest())


def root(fingerprint: bytes, namespace: str) -> bytes:
    """The digest a chain's first page chains from."""
    return hashlib.sha256(b"kvmem/store/v1\0" + fingerprint + namespace.encode("utf-8", "surrogatepass")).digest()


def chain(parent: bytes, tokens: np.ndarray, num_pages: int, page_size: int) -> list[bytes]:
    """The digests of the first ``num_pages`` full pages of ``tokens`` after ``parent``
    (a root or a page's digest). A loop over pages, never tokens: about 1 µs a page."""
    data = np.ascontiguousarray(tokens[: num_pages * page_size], dtype="<i4").tobytes()
    step = 4 * page_size
    out = []
    digest = parent
    for start in range(0, num_pages * step, step):
        digest = hashlib.sha256(digest + data[start : start + step]).digest()
        out.append(digest)
    return out


def key_of(digest: bytes) -> str:
    """The store key of a page digest."""
    return "kvmem/" + digest.hex()


class Codec:
    """Headers for one rank's values: :meth:`header` writes one, :meth:`check` reads one
    back against its payload. ``mac_key``: the ``--store-key-file`` key (None: no MAC)."""

    def __init__(self, fingerprint: Fingerprint, geometry: KVGeometry, mac_key: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self.page_size = geometry.page_size
        self.payload_bytes = geometry.page_bytes
        self.dtype = geometry.dtype.encode()[:16].ljust(16, b"\0")
        self.mac_key = mac_key
        self.flags = FLAG_MAC if mac_key is not None else 0

    def header(self, digest: bytes, payload: np.ndarray, out: np.ndarray) -> None:
        """Write the header of ``payload`` (one page's bytes) under ``digest`` into
        ``out`` (``HEADER_BYTES`` of uint8). O(payload) for the checksum (and the MAC)."""
        checksum = xxhash.xxh3_64_intdigest(payload.data)
        packed = _LAYOUT.pack(
            MAGIC, VERSION, HEADER_BYTES, self.flags, self.page_size, self.payload_bytes, self.dtype,
            self.fingerprint.digest, digest, checksum, bytes(32),
        )  # fmt: skip
        out[: _LAYOUT.size] = np.frombuffer(packed, dtype=np.uint8)
        out[_LAYOUT.size :] = 0
        if self.mac_key is not None:
            out[_MAC_AT : _MAC_AT + 32] = np.frombuffer(self._mac(out, payload), dtype=np.uint8)

    def _mac(self, header: np.ndarray, payload: np.ndarray) -> bytes:
        """HMAC-SHA-256 over the header with its MAC zeroed, then the payload."""
        blank = header.copy()
        blank[_MAC_AT : _MAC_AT + 32] = 0
        mac = hmac.new(self.mac_key or b"", blank.data, hashlib.sha256)
        mac.update(payload.data)
        return mac.digest()

    def check(self, digest: bytes, size: int, header: np.ndarray, payload: np.ndarray) -> str | None:
        """None when the value read back (``size`` bytes in all, its ``header`` and
        ``payload`` buffers) is the page ``digest`` names in this layout; else the
        reason (one of :data:`REASONS`). The cheap checks first; the checksum and the
        MAC read the payload once each."""
        if size != HEADER_BYTES + self.payload_bytes:
            return "size"
        try:
            magic, version, hbytes, flags, page_size, payload_bytes, dtype, fp, got, checksum, mac = _LAYOUT.unpack(
                header[: _LAYOUT.size].tobytes()
            )
        except struct.error:
            return "header"
        if magic != MAGIC or version != VERSION or hbytes != HEADER_BYTES or header[_LAYOUT.size :].any():
            return "header"
        if page_size != self.page_size or payload_bytes != self.payload_bytes or dtype != self.dtype:
            return "fingerprint"
        if fp != self.fingerprint.digest:
            return "fingerprint"
        if got != digest:
            return "key"
        if self.mac_key is not None and (
            not flags & FLAG_MAC or not hmac.compare_digest(mac, self._mac(header, payload))
        ):
            return "mac"
        if xxhash.xxh3_64_intdigest(payload.data) != checksum:
            return "checksum"
        return None
