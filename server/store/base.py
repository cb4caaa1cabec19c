"""The cluster tier's store interface (``kvmem serve --store URL``): what kvmem asks of an
existing distributed KV store, and how a store URL is read.

kvmem never runs a store of its own: it puts its pages, under content keys, into one
that exists (Mooncake Store, Redis, Redis Cluster, Valkey), through that store's own
Python client. An adapter is one file in this package that subclasses :class:`Store`
and registers its URL schemes in :data:`SCHEMES` (see :func:`open_store`).

Values are opaque here: a value is the concatenation of its *parts* (kvmem's header and
a host page's bytes: ``kvmem.server.store.value``). A store that can read into and write
from memory it registered (Mooncake's ``register_buffer``) moves the parts with no
extra copy; one that cannot (Redis) joins them on the way out and splits them on the
way in.

Every call may raise :class:`StoreError` (the store is down, a timeout, a refused
call); the caller (``kvmem.server.store.link``) counts it, reconnects with backoff,
and turns it into misses: a store never fails a client's call.
"""

from __future__ import annotations

import abc
import dataclasses
import urllib.parse
from collections.abc import Callable, Sequence

import numpy as np


class StoreError(Exception):
    """A store call failed (unreachable, timed out, refused). The message names the
    store (its redacted URL) and what failed, never a password."""


class StoreURLError(ValueError):
    """A ``--store`` URL that cannot be used; the message says why and quotes the URL
    redacted."""


@dataclasses.dataclass(frozen=True, slots=True)
class StoreURL:
    """A parsed ``--store`` URL: ``scheme://[user@]host:port[,host:port...][/db][?query]``.

    A password in the URL is refused (``ps`` would show it): it comes from
    ``--store-password-file`` or ``KVMEM_STORE_PASSWORD``. ``text`` is the URL as given
    (no password in it, by construction)."""

    scheme: str
    hosts: tuple[tuple[str, int], ...]
    path: str
    query: dict[str, str]
    username: str | None
    text: str

    @classmethod
    def parse(cls, text: str, default_ports: dict[str, int] | None = None) -> StoreURL:
        """Parse ``text``; :class:`StoreURLError` naming what is wrong. ``default_ports``:
        a port per scheme for hosts given without one."""
        found = _userinfo(text)
        if found is not None and ":" in found[1]:
            raise StoreURLError(
                f"--store {redact(text)!r}: a password in the URL would show in ps and logs: give it with "
                "--store-password-file FILE or the KVMEM_STORE_PASSWORD environment variable"
                + (" (an '@' in a query value is written %40)" if "=" in found[1] else "")
            )
        try:
            split = urllib.parse.urlsplit(text)
        except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 address
            raise StoreURLError(f"--store {redact(text)!r}: {exc}") from None
        scheme = split.scheme.lower()
        if not scheme or not split.netloc:
            raise StoreURLError(f"--store {redact(text)!r}: expected scheme://host:port, e.g. redis://127.0.0.1:6379")
        netloc = split.netloc
        username = None
        if "@" in netloc:
            userinfo, netloc = netloc.rsplit("@", 1)
            username = urllib.parse.unquote(userinfo) or None
        hosts = []
        for part in netloc.split(","):
            host, sep, port_text = part.rpartition(":")
            if not sep:
                host, port_text = part, ""
            host = host.strip("[]")
            if not host:
                raise StoreURLError(f"--store {redact(text)!r}: empty host in {part!r}")
            if port_text:
                if not port_text.isdigit() or not 0 < int(port_text) < 65536:
                    raise StoreURLError(f"--store {redact(text)!r}: port must be 1-65535, got {port_text!r}")
                port = int(port_text)
            elif default_ports and scheme in default_ports:
                port = default_ports[scheme]
            else:
                raise StoreURLError(f"--store {redact(text)!r}: {part!r} has no port")
            hosts.append((host, port))
        query = {}
        for key, values in urllib.parse.parse_qs(split.query, keep_blank_values=True).items():
            if len(values) != 1:
                raise StoreURLError(f"--store {redact(text)!r}: query parameter {key!r} given {len(values)} times")
            query[key] = values[0]
        return cls(scheme, tuple(hosts), split.path, query, username, text)

    def redacted(self) -> str:
        """The URL as logs, stats and health details show it (:func:`redact`)."""
        return redact(self.text)


def redact(text: str) -> str:
    """``text`` with any password in its user info replaced by ``***`` (a URL kvmem
    refuses, but might still have to name in the refusal)."""
    found = _userinfo(text)
    if found is None or ":" not in found[1]:
        return text
    head, userinfo, tail = found
    return f"{head}{userinfo.split(':', 1)[0]}:***@{tail}"


def _userinfo(text: str) -> tuple[str, str, str] | None:
    """``("scheme://", user info, what follows its '@')``, or None when ``text`` has no
    user info. Read from the raw text up to its *last* ``@``, not from a URL parser's idea
    of the host part: a password with an unencoded ``/``, ``?`` or ``#`` (base64 passwords
    have ``/``) ends a parser's host part early and would leave the rest of the password
    in the path, query or fragment. An ``@`` in a query value (a file name) is then taken
    for the end of user info too: safe, since a URL with a password is refused anyway,
    and ``%40`` writes it."""
    head, sep, rest = text.partition("://")
    if not sep or "@" not in rest:
        return None
    at = rest.rindex("@")
    return head + sep, rest[:at], rest[at + 1 :]


Parts = Sequence[memoryview]  # one value: the concatenation of these, in order


def total_bytes(parts: Parts) -> int:
    """A value's size: its parts' bytes."""
    return sum(part.nbytes for part in parts)


def scatter(value: bytes, parts: Parts) -> None:
    """Copy ``value`` (exactly the parts' total size) into the parts, in order (what an
    adapter whose client returns bytes does for :meth:`Store.get_into`)."""
    source = np.frombuffer(value, dtype=np.uint8)
    offset = 0
    for part in parts:
        n = part.nbytes
        if n:
            np.frombuffer(part, dtype=np.uint8)[:] = source[offset : offset + n]
        offset += n


class Store(abc.ABC):
    """One store, as the server's store thread uses it (never the event loop: every
    call may block up to ``timeout_s``). Not thread-safe: one thread calls it.

    ``url``: the parsed URL; ``password``: from ``--store-password-file`` or the
    environment (None: none); ``timeout_s``: the bound of any one call
    (``--store-timeout-ms``)."""

    name: str  # "redis", "redis-cluster", "mooncake": stats, metrics, logs

    def __init__(self, url: StoreURL, password: str | None, timeout_s: float) -> None:
        self.url = url
        self.password = password
        self.timeout_s = timeout_s

    @abc.abstractmethod
    def connect(self) -> None:
        """Connect (or reconnect after a failure: drop any old connection first);
        :class:`StoreError` when the store cannot be reached."""

    def register(self, buffers: Sequence[np.ndarray]) -> None:  # noqa: B027 (optional: most stores need nothing)
        """Memory that later calls' parts will lie in (the host tier's pages, kvmem's
        header buffers: contiguous ``uint8`` arrays that live as long as the store), for a
        store that reads and writes registered memory directly. Called after
        :meth:`connect`, again after each reconnect. Default: nothing."""

    @abc.abstractmethod
    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[bool]:
        """Store each value under its key (a value is its parts joined), in one batch
        where the store can. A key that exists already keeps its value (keys name their
        content) and counts as stored. Per key: stored. :class:`StoreError` when the
        whole batch failed."""

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key: whether the store holds it now (it may be gone by the next call)."""

    @abc.abstractmethod
    def get_into(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        """Read each key's value into its parts (filled in order; the parts' sizes add up
        to the size kvmem expects). Per key: the value's size in bytes when it was read
        (a size other than the parts' total means nothing, or only part, was copied: the
        caller rejects it), -1 when the store lacks it. :class:`StoreError` when the
        whole batch failed."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drop the connection. Idempotent."""

    def describe(self) -> str:
        """``name`` and the redacted URL, for logs and stats."""
        return f"{self.name} {self.url.redacted()}"


# scheme -> the adapter's constructor; each adapter module adds its own (see open_store).
SCHEMES: dict[str, Callable[[StoreURL, str | None, float], Store]] = {}

# The adapter module of each scheme, imported on first use (their clients are optional extras).
ADAPTERS = {
    "redis": "kvmem.server.store.redis_store",
    "rediss": "kvmem.server.store.redis_store",
    "redis+cluster": "kvmem.server.store.redis_store",
    "rediss+cluster": "kvmem.server.store.redis_store",
    "valkey": "kvmem.server.store.redis_store",
    "mooncake": "kvmem.server.store.mooncake_store",
}


def open_store(text: str, password: str | None, timeout_s: float) -> Store:
    """The store ``text`` names (not connected yet). :class:`StoreURLError` for a URL no
    adapter takes or one its adapter refuses; ImportError (naming the extra to install)
    when the store's Python client is missing."""
    import importlib

    try:
        scheme = urllib.parse.urlsplit(text).scheme.lower()
    except ValueError as exc:  # e.g. an unclosed "[" of an IPv6 address
        raise StoreURLError(f"--store {redact(text)!r}: {exc}") from None
    module = ADAPTERS.get(scheme)
    if module is None:
        raise StoreURLError(f"--store {redact(text)!r}: unknown scheme {scheme!r}; choose one of {sorted(ADAPTERS)}")
    importlib.import_module(module)
    return SCHEMES[scheme](StoreURL.parse(text, DEFAULT_PORTS), password, timeout_s)


DEFAULT_PORTS = {"redis": 6379, "rediss": 6379, "redis+cluster": 6379, "rediss+cluster": 6379, "valkey": 6379}
