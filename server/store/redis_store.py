"""Redis, Valkey and Redis Cluster as kvmem's store, over redis-py (the sync client; it
parses replies with hiredis when that is installed: ``pip install 'kvmem[store]'``).

* ``redis://HOST[:PORT][/DB]``, ``valkey://...`` (the same protocol), ``rediss://...``
  (TLS; ``?ca=PATH`` the CA to trust, ``&cert=PATH&key=PATH`` a client certificate);
* ``redis+cluster://H1:P1,H2:P2,...`` and ``rediss+cluster://...`` (TLS): some of the
  cluster's nodes, the client learns the rest.

A value is one string: the parts joined on the way out (``SET key value NX``: a key
that exists keeps its first value), split into the parts on the way in (``MGET``). One
call is one round trip per server: a non-transactional pipeline, or ``MGET`` (a
cluster: each master's keys in one pipeline of its own). Every call is bounded by
``timeout_s`` (the socket timeouts; a cluster: per master) and the client does not retry
on its own: a failure is a :class:`StoreError` at once, and the caller reconnects with
backoff.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from kvmem.server.store.base import (
    SCHEMES,
    Parts,
    Store,
    StoreError,
    StoreURL,
    StoreURLError,
    scatter,
    total_bytes,
)

try:
    import redis
    import redis.cluster
    import redis.exceptions
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError as exc:
    raise ImportError(f"redis:// and redis+cluster:// need redis-py ({exc}): pip install 'kvmem[store]'") from exc

TLS_SCHEMES = ("rediss", "rediss+cluster")
TLS_PARAMETERS = {"ca": "the CA certificate (PEM) to trust", "cert": "the client certificate", "key": "its key"}
# Everything redis-py raises for a failed call: its own errors (ConnectionError, TimeoutError,
# ResponseError, AuthenticationError, the cluster's ResponseError kinds), the cluster's
# client-side ones (no node reachable, slots not covered), and what the socket or TLS layer
# lets through.
FAILURES: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError,
    redis.exceptions.RedisClusterException,
    OSError,
)


def _tls_options(url: StoreURL) -> dict[str, Any]:
    """redis-py's TLS arguments from the URL's query; :class:`StoreURLError` for a
    parameter it does not know, one a plaintext URL cannot use, or a file that is not there."""
    tls = url.scheme in TLS_SCHEMES
    allowed = set(TLS_PARAMETERS) if tls else set()
    unknown = sorted(set(url.query) - allowed)
    if unknown:
        what = (
            f"known: {', '.join(f'{k}= ({v})' for k, v in TLS_PARAMETERS.items())}"
            if tls
            else f"a {url.scheme}:// URL takes none (ca=, cert= and key= are for TLS: rediss://)"
        )
        raise StoreURLError(f"--store {url.redacted()!r}: unknown query parameter(s) {unknown}; {what}")
    if not tls:
        return {}
    for name in ("ca", "cert", "key"):
        path = url.query.get(name)
        if path is not None and not os.path.isfile(path):
            raise StoreURLError(f"--store {url.redacted()!r}: {name}={path!r} is not a file")
    if ("cert" in url.query) != ("key" in url.query):
        raise StoreURLError(f"--store {url.redacted()!r}: a client certificate needs both cert= and key=")
    return {
        "ssl": True,
        "ssl_ca_certs": url.query.get("ca"),
        "ssl_certfile": url.query.get("cert"),
        "ssl_keyfile": url.query.get("key"),
    }


def _db(url: StoreURL) -> int:
    """The database number of the URL's path (``/3``; none: 0)."""
    text = url.path.strip("/")
    if not text:
        return 0
    if not text.isdigit():
        raise StoreURLError(f"--store {url.redacted()!r}: the path names the database, a number, got {url.path!r}")
    return int(text)


class RedisStore(Store):
    """One Redis or Valkey server (``redis://``, ``valkey://``, ``rediss://``)."""

    name = "redis"

    def __init__(self, url: StoreURL, password: str | None, timeout_s: float) -> None:
        super().__init__(url, password, timeout_s)
        if len(url.hosts) != 1:
            raise StoreURLError(
                f"--store {url.redacted()!r}: {url.scheme}:// names one server, got {len(url.hosts)}; "
                "a Redis Cluster is redis+cluster://H1:P1,H2:P2"
            )
        self._options: dict[str, Any] = {
            "db": _db(url),
            **_common_options(url, password, timeout_s),
            **_tls_options(url),
        }
        self._client: redis.Redis | None = None

    def connect(self) -> None:
        self.close()
        host, port = self.url.hosts[0]
        client = redis.Redis(host=host, port=port, **self._options)
        try:
            client.ping()
        except FAILURES as exc:
            client.close()
            raise self._error("connect", exc) from None
        self._client = client

    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[bool]:
        if not keys:
            return []
        client = self._connected("put")
        try:
            pipe = client.pipeline(transaction=False)
            for key, parts in zip(keys, values, strict=True):
                pipe.set(key, b"".join(parts), nx=True)
            replies = pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            raise self._error(f"put of {len(keys)} keys", exc) from None
        return _stored(self, replies, len(keys))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        client = self._connected("exists")
        try:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            replies = pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            raise self._error(f"exists of {len(keys)} keys", exc) from None
        return _present(self, replies, len(keys))

    def get_into(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        if not keys:
            return []
        client = self._connected("get")
        try:
            found = client.mget(list(keys))
        except FAILURES as exc:
            raise self._error(f"get of {len(keys)} keys", exc) from None
        return _copy_into(found, values)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*FAILURES):  # dropping a connection that already broke
                client.close()

    def _connected(self, what: str) -> redis.Redis:
        if self._client is None:
            raise StoreError(f"{self.describe()}: {what}: not connected")
        return self._client

    def _error(self, what: str, exc: BaseException) -> StoreError:
        return _error(self, what, exc)


class RedisClusterStore(Store):
    """A Redis (or Valkey) Cluster (``redis+cluster://``, ``rediss+cluster://``): the URL
    names one or more of its nodes (name several: :meth:`connect` needs one of them up);
    the client learns the slots and the other masters.

    A call sends each master its keys in one non-transactional pipeline, on that
    master's own connection, one master after the other: at most ``timeout_s`` per
    master. (redis-py's cluster pipeline and ``mget_nonatomic`` resend each command that
    timed out one by one, and so take a timeout per key on a slow cluster.) A key whose
    slot moved (MOVED, ASK: a resharding) fails this call and the slot table is read
    again; a master that cannot be reached fails the whole call (:class:`StoreError`), and
    the caller's reconnect reads the cluster anew."""

    name = "redis-cluster"

    def __init__(self, url: StoreURL, password: str | None, timeout_s: float) -> None:
        super().__init__(url, password, timeout_s)
        if _db(url) != 0:
            raise StoreURLError(f"--store {url.redacted()!r}: a Redis Cluster has database 0 only, got {url.path!r}")
        self._options = {**_common_options(url, password, timeout_s), **_tls_options(url)}
        self._client: redis.cluster.RedisCluster | None = None

    def connect(self) -> None:
        self.close()
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in self.url.hosts]
        try:
            # The constructor reaches a node and reads the slot table (CLUSTER SLOTS).
            client = redis.cluster.RedisCluster(startup_nodes=nodes, **self._options)
        except FAILURES as exc:
            raise self._error("connect", exc) from None
        try:
            client.ping()  # every master (the default target of PING)
        except FAILURES as exc:
            client.close()
            raise self._error("connect", exc) from None
        self._client = client

    def put(self, keys: Sequence[str], values: Sequence[Parts]) -> list[bool]:
        if not keys:
            return []
        if len(values) != len(keys):
            raise ValueError(f"put: {len(keys)} keys, {len(values)} values")
        replies = self._per_master("put", keys, lambda pipe, i: pipe.set(keys[i], b"".join(values[i]), nx=True))
        return _stored(self, replies, len(keys))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        replies = self._per_master("exists", keys, lambda pipe, i: pipe.exists(keys[i]))
        return _present(self, replies, len(keys))

    def get_into(self, keys: Sequence[str], values: Sequence[Parts]) -> list[int]:
        if not keys:
            return []
        if len(values) != len(keys):
            raise ValueError(f"get_into: {len(keys)} keys, {len(values)} values")
        replies = self._per_master("get", keys, lambda pipe, i: pipe.get(keys[i]))
        failure = _first_failure(replies)
        if failure is not None and all(isinstance(r, BaseException) for r in replies):
            raise self._error(f"get of {len(keys)} keys", failure)
        return _copy_into(replies, values)

    def _per_master(self, what: str, keys: Sequence[str], add: Callable[[Any, int], object]) -> list[object]:
        """Each key's reply (an exception for a key that failed), from one pipeline per master."""
        client = self._connected(what)
        replies: list[object] = [None] * len(keys)
        masters: dict[str, tuple[redis.Redis, list[int]]] = {}
        try:
            for i, key in enumerate(keys):
                node = client.get_node_from_key(key)
                if node is None or node.redis_connection is None:
                    raise redis.exceptions.SlotNotCoveredError(f"no master for key {key!r}")
                masters.setdefault(node.name, (node.redis_connection, []))[1].append(i)
            for master, index in masters.values():
                pipe = master.pipeline(transaction=False)
                for i in index:
                    add(pipe, i)
                for i, reply in zip(index, pipe.execute(raise_on_error=False), strict=True):
                    replies[i] = reply
            if any(isinstance(r, (redis.exceptions.MovedError, redis.exceptions.AskError)) for r in replies):
                client.nodes_manager.initialize()  # slots moved: read the table again for the next call
        except FAILURES as exc:
            raise self._error(f"{what} of {len(keys)} keys", exc) from None
        return replies

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(*FAILURES):
                client.close()

    def _connected(self, what: str) -> redis.cluster.RedisCluster:
        if self._client is None:
            raise StoreError(f"{self.describe()}: {what}: not connected")
        return self._client

    def _error(self, what: str, exc: BaseException) -> StoreError:
        return _error(self, what, exc)


def _common_options(url: StoreURL, password: str | None, timeout_s: float) -> dict[str, Any]:
    """What both clients take: the credentials, the timeouts, and no retries of their own
    (a call is bounded by ``timeout_s``; the caller reconnects with backoff)."""
    return {
        "username": url.username,
        "password": password,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }


def _error(store: Store, what: str, exc: BaseException) -> StoreError:
    """A :class:`StoreError` naming the store (redacted URL), what failed and why, with the
    password (should a reply ever quote it) masked."""
    reason = f"{type(exc).__name__}: {exc}"
    if store.password:
        reason = reason.replace(store.password, "***")
    return StoreError(f"{store.describe()}: {what} failed: {reason}")


def _first_failure(replies: Sequence[object]) -> BaseException | None:
    return next((r for r in replies if isinstance(r, BaseException)), None)


def _stored(store: Store, replies: Sequence[object], n: int) -> list[bool]:
    """Per key of a ``SET NX`` pipeline: stored (True: set now; None: it was there, and
    keeps its value). A reply that is an error (e.g. OOM under ``maxmemory`` with
    ``noeviction``) is that key not stored; all of them errors is the batch failing."""
    failure = _first_failure(replies)
    if failure is not None and all(isinstance(r, BaseException) for r in replies):
        raise _error(store, f"put of {n} keys", failure)
    return [not isinstance(r, BaseException) for r in replies]


def _present(store: Store, replies: Sequence[object], n: int) -> list[bool]:
    failure = _first_failure(replies)
    if failure is not None and all(isinstance(r, BaseException) for r in replies):
        raise _error(store, f"exists of {n} keys", failure)
    return [not isinstance(r, BaseException) and bool(r) for r in replies]


def _copy_into(found: Sequence[object], values: Sequence[Parts]) -> list[int]:
    """Per key: -1 (missing, or a reply that is an error), the value's size when it
    differs from the parts' total (nothing copied), else the value copied into the parts
    and its size."""
    sizes = []
    for value, parts in zip(found, values, strict=True):
        if not isinstance(value, bytes):
            sizes.append(-1)
            continue
        if len(value) == total_bytes(parts):
            scatter(value, parts)
        sizes.append(len(value))
    return sizes


SCHEMES.update(
    {
        "redis": RedisStore,
        "rediss": RedisStore,
        "valkey": RedisStore,
        "redis+cluster": RedisClusterStore,
        "rediss+cluster": RedisClusterStore,
    }
)
