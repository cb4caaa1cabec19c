"""The store adapters (kvmem.server.store.redis_store, .mooncake_store) against real
stores over real sockets, started by tests/store/conftest.py on 127.0.0.1: one Redis,
Redis over TLS, a three-master Redis Cluster, Mooncake Store (a master and a process
holding its memory). And the ``--store`` URL rules, which need no server.

A value is two parts, as kvmem writes them: a 64-byte header and a 4 KiB page, read back
into two separate numpy buffers. For Mooncake the buffers are registered, so values
move with no copy; one test takes its copying path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import pytest

from kvmem.server.store.base import DEFAULT_PORTS, Store, StoreError, StoreURL, StoreURLError, open_store, redact

if TYPE_CHECKING:  # tests/store/conftest.py: the fixtures' types
    from .conftest import MooncakeServers, RedisClusterServers, RedisFactory, RedisServer

HEADER = 64
PAGE = 4096
SIZE = HEADER + PAGE
TIMEOUT_S = 5.0
PASSWORD = "s3cret-Pa55/word+x"  # a base64-like password: "/" and "+" in it


class Slots:
    """``n`` values' memory: the headers in one array, the pages in another; value ``i``
    is ``[headers[i], pages[i]]``."""

    def __init__(self, n: int, page: int = PAGE, seed: int | None = None) -> None:
        self.headers = np.zeros((n, HEADER), np.uint8)
        self.pages = np.zeros((n, page), np.uint8)
        if seed is not None:
            rng = np.random.default_rng(seed)
            self.headers[:] = rng.integers(0, 256, self.headers.shape, dtype=np.uint8)
            self.pages[:] = rng.integers(0, 256, self.pages.shape, dtype=np.uint8)

    def values(self) -> list[list[memoryview]]:
        return [[memoryview(h), memoryview(p)] for h, p in zip(self.headers, self.pages, strict=True)]

    def buffers(self) -> list[np.ndarray]:
        return [self.headers, self.pages]

    def same(self, other: Slots) -> bool:
        return np.array_equal(self.headers, other.headers) and np.array_equal(self.pages, other.pages)

    def blank(self) -> bool:
        return not self.headers.any() and not self.pages.any()


def new_keys(n: int) -> list[str]:
    run = uuid.uuid4().hex
    return [f"kvmem-test/{run}/{i}" for i in range(n)]


def connected(url: str, password: str | None = None, timeout_s: float = TIMEOUT_S) -> Store:
    store = open_store(url, password, timeout_s)
    store.connect()
    return store


@pytest.fixture(params=["redis", "cluster", "mooncake"])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """A connected adapter to each kind of store (tests register their buffers: Mooncake
    then moves values straight from and into them; Redis ignores it)."""
    fixture = {"redis": "redis_server", "cluster": "redis_cluster", "mooncake": "mooncake"}[request.param]
    s = connected(request.getfixturevalue(fixture).url)
    yield s
    s.close()


def test_store_round_trip_of_two_part_values(store: Store) -> None:
    keys, src, dst = new_keys(2), Slots(2, seed=1), Slots(2)
    store.register([*src.buffers(), *dst.buffers()])
    assert store.put(keys, src.values()) == [True, True]
    assert store.exists(keys) == [True, True]
    assert store.get_into(keys, dst.values()) == [SIZE, SIZE]
    assert dst.same(src)


def test_store_keeps_the_first_value_of_a_key(store: Store) -> None:
    keys, first, second, dst = new_keys(2), Slots(2, seed=2), Slots(2, seed=3), Slots(2)
    store.register([*first.buffers(), *second.buffers(), *dst.buffers()])
    assert store.put(keys[:1], first.values()[:1]) == [True]
    assert store.put(keys, second.values()) == [True, True]  # the existing key counts as stored
    assert store.get_into(keys, dst.values()) == [SIZE, SIZE]
    assert np.array_equal(dst.pages[0], first.pages[0]) and np.array_equal(dst.headers[0], first.headers[0])
    assert np.array_equal(dst.pages[1], second.pages[1])


def test_store_missing_key_is_minus_one_and_not_present(store: Store) -> None:
    keys, src, dst = new_keys(3), Slots(3, seed=4), Slots(3)
    store.register([*src.buffers(), *dst.buffers()])
    assert store.put(keys[1:2], src.values()[1:2]) == [True]
    assert store.exists(keys) == [False, True, False]
    assert store.get_into(keys, dst.values()) == [-1, SIZE, -1]
    assert not dst.headers[0].any() and not dst.pages[2].any()
    assert np.array_equal(dst.pages[1], src.pages[1])
    assert store.get_into(keys[:1], dst.values()[:1]) == [-1]  # a batch of misses only


def test_store_reports_a_value_of_another_size_and_copies_nothing(store: Store) -> None:
    keys, short, long, dst = new_keys(2), Slots(1, page=2048, seed=5), Slots(1, page=8192, seed=6), Slots(2)
    store.register([*short.buffers(), *long.buffers(), *dst.buffers()])
    assert store.put(keys, [short.values()[0], long.values()[0]]) == [True, True]
    assert store.get_into(keys, dst.values()) == [HEADER + 2048, HEADER + 8192]
    if store.name != "mooncake":  # Redis copies only a value of the right size; Mooncake's failed transfer may touch it
        assert dst.blank()


def test_store_batch_of_32_keys(store: Store) -> None:
    keys, src, dst = new_keys(32), Slots(32, seed=7), Slots(32)
    store.register([*src.buffers(), *dst.buffers()])
    assert store.put(keys, src.values()) == [True] * 32
    assert store.exists(keys) == [True] * 32
    assert store.get_into(keys, dst.values()) == [SIZE] * 32
    assert dst.same(src)
    assert store.put([], []) == [] and store.exists([]) == [] and store.get_into([], []) == []


@pytest.mark.parametrize("kind", ["redis", "cluster", "mooncake"])
def test_store_killed_is_a_store_error_then_connect_works_again(kind: str, request: pytest.FixtureRequest) -> None:
    """The store's processes killed: each call is a StoreError naming the store by its
    redacted URL and never the password; restarted on the same ports, connect() works."""
    password = None
    servers: RedisServer | RedisClusterServers | MooncakeServers
    if kind == "redis":
        password = PASSWORD
        factory: RedisFactory = request.getfixturevalue("redis_factory")
        servers = factory(requirepass=password)
        url = servers.url.replace("redis://", "redis://default@")
    elif kind == "cluster":
        servers = request.getfixturevalue("redis_cluster_factory")()
        url = servers.url
    else:
        servers = request.getfixturevalue("mooncake_factory")()
        url = servers.url
    store = connected(url, password, timeout_s=2.0)
    try:
        keys, src, dst = new_keys(4), Slots(4, seed=8), Slots(4)
        store.register([*src.buffers(), *dst.buffers()])
        assert store.put(keys[:2], src.values()[:2]) == [True, True]
        servers.stop()
        calls: list[Callable[[], object]] = [
            lambda: store.get_into(keys[:2], dst.values()[:2]),
            lambda: store.put(keys[2:], src.values()[2:]),
        ]
        if kind != "mooncake":  # each Mooncake call against a dead master takes its RPC timeout (~4 s)
            calls.append(lambda: store.exists(keys))
        for call in calls:
            with pytest.raises(StoreError) as failed:
                call()
            message = str(failed.value)
            assert redact(url) in message and store.name in message, message
            assert password is None or password not in message, message
        servers.start()
        store.connect()
        assert store.put(keys[2:], src.values()[2:]) == [True, True]
        assert store.get_into(keys[2:], dst.values()[2:]) == [SIZE, SIZE]
        assert np.array_equal(dst.pages[2:], src.pages[2:])
    finally:
        store.close()


@pytest.mark.parametrize("kind", ["redis", "cluster", "mooncake"])
def test_store_slower_than_its_timeout_is_a_store_error_in_time(kind: str, request: pytest.FixtureRequest) -> None:
    """A store that stops answering (SIGSTOP): each call is a StoreError after about the
    timeout (a cluster: up to one per master), and once it answers again the same client
    gets exact answers (no reply to an abandoned call is taken for a later one's)."""
    fixture = {"redis": "redis_server", "cluster": "redis_cluster", "mooncake": "mooncake"}[kind]
    servers = request.getfixturevalue(fixture)
    timeout_s = 0.5
    bound = timeout_s * (3 if kind == "cluster" else 1) + 1.0
    store = connected(servers.url, timeout_s=timeout_s)
    try:
        keys, src, dst = new_keys(3), Slots(3, seed=15), Slots(3)
        store.register([*src.buffers(), *dst.buffers()])
        assert store.put(keys[:2], src.values()[:2]) == [True, True]
        servers.freeze()
        try:
            calls: list[tuple[str, Callable[[], object]]] = [
                ("get", lambda: store.get_into(keys[:2], dst.values()[:2])),
                ("put", lambda: store.put(keys[2:], src.values()[2:])),
                ("exists", lambda: store.exists(keys)),
            ]
            for name, call in calls:
                started = time.monotonic()
                try:
                    answer = call()
                except StoreError as exc:
                    took = time.monotonic() - started
                    assert took < bound, f"{name}: {took:.2f} s: {exc}"
                    assert redact(servers.url) in str(exc)
                else:
                    # A Mooncake client that read these keys' places before may read them
                    # from the holder without asking the master: then the bytes are right.
                    assert kind == "mooncake" and name == "get" and answer == [SIZE, SIZE], (name, answer)
                    assert np.array_equal(dst.pages[:2], src.pages[:2])
        finally:
            servers.thaw()
        # The put that timed out may still land when the store wakes (it had the bytes):
        # whole, then.
        landed = store.exists([*keys, "kvmem-test/absent"])
        assert landed[:2] == [True, True] and landed[3] is False, landed
        assert store.get_into(keys, dst.values()) == [SIZE, SIZE, SIZE if landed[2] else -1]
        assert np.array_equal(dst.pages[:2], src.pages[:2])
        assert np.array_equal(dst.pages[2], src.pages[2]) if landed[2] else not dst.pages[2].any()
    finally:
        store.close()


def test_redis_store_full_with_and_without_eviction(redis_factory: RedisFactory) -> None:
    """``maxmemory`` with ``allkeys-lru``: every put is stored (older keys go); with
    ``noeviction``: the keys past the limit are not stored, and a batch of nothing but
    refusals (OOM) is a StoreError."""
    src = Slots(64, page=64 * 1024, seed=16)  # 4 MiB
    evicting = connected(redis_factory(maxmemory="2mb").url)
    keys = new_keys(64)
    for start in range(0, 64, 8):
        assert evicting.put(keys[start : start + 8], src.values()[start : start + 8]) == [True] * 8
    present = evicting.exists(keys)
    assert 0 < sum(present) < 64 and present[-1], present
    evicting.close()
    full = connected(redis_factory(maxmemory="2mb", policy="noeviction").url)
    stored = full.put(keys[:48], src.values()[:48])
    assert stored[0] and not stored[-1] and stored == sorted(stored, reverse=True), stored
    with pytest.raises(StoreError, match="put of 8 keys failed: OutOfMemoryError"):
        full.put(keys[48:56], src.values()[48:56])
    full.close()


def test_redis_store_with_a_password(redis_factory: RedisFactory) -> None:
    server = redis_factory(requirepass=PASSWORD)
    store = connected(server.url, PASSWORD)
    keys, src, dst = new_keys(1), Slots(1, seed=9), Slots(1)
    assert store.put(keys, src.values()) == [True]
    assert store.get_into(keys, dst.values()) == [SIZE] and dst.same(src)
    store.close()
    for wrong in ("not-" + PASSWORD, None):
        with pytest.raises(StoreError) as failed:
            connected(server.url, wrong)
        message = str(failed.value)
        assert server.url in message and "connect" in message, message
        assert PASSWORD not in message, message
    with pytest.raises(StoreError, match="not connected"):
        store.exists(keys)


def test_redis_store_over_tls_with_ca(redis_tls: RedisServer, certs: dict[str, str]) -> None:
    store = connected(redis_tls.url)
    keys, src, dst = new_keys(2), Slots(2, seed=10), Slots(2)
    assert store.put(keys, src.values()) == [True, True]
    assert store.get_into(keys, dst.values()) == [SIZE, SIZE] and dst.same(src)
    store.close()
    assert redis_tls.client().exists(*keys) == 2
    # Without ca= the system's CAs do not trust the test CA; plaintext gets no answer.
    for url in (f"rediss://127.0.0.1:{redis_tls.port}", f"redis://127.0.0.1:{redis_tls.port}"):
        with pytest.raises(StoreError) as failed:
            connected(url, timeout_s=2.0)
        assert url in str(failed.value)


def test_redis_cluster_store_spreads_keys_over_its_masters(redis_cluster: RedisClusterServers) -> None:
    store = connected(redis_cluster.url)
    assert store.name == "redis-cluster"
    keys, src, dst = new_keys(32), Slots(32, seed=11), Slots(32)
    assert store.put(keys, src.values()) == [True] * 32
    assert store.get_into(keys, dst.values()) == [SIZE] * 32 and dst.same(src)
    store.close()
    prefix = keys[0].rsplit("/", 1)[0]
    held = []
    for client in redis_cluster.clients():
        with client:
            held.append(len(client.keys(f"{prefix}/*")))
    assert sum(held) == 32, held
    assert sum(1 for n in held if n) >= 2, held  # 32 keys over 16384 slots in three ranges


def test_mooncake_store_zero_copy_through_registered_memory(mooncake: MooncakeServers) -> None:
    store = connected(mooncake.url)
    try:
        keys, src, dst = new_keys(8), Slots(8, seed=12), Slots(8)
        loose_src, loose_dst = Slots(8, seed=12), Slots(8)  # not registered: the copying path
        store.register([*src.buffers(), *dst.buffers()])
        store.register([*src.buffers(), *dst.buffers()])  # again (as after each reconnect): harmless
        assert all(store.zero_copy(v) for v in [*src.values(), *dst.values()])  # type: ignore[attr-defined]
        assert not any(store.zero_copy(v) for v in loose_src.values())  # type: ignore[attr-defined]
        assert store.put(keys, src.values()) == [True] * 8
        assert store.get_into(keys, dst.values()) == [SIZE] * 8 and dst.same(src)
        # Read through the copying path what went in with no copy, and a mixed batch.
        assert store.get_into(keys, loose_dst.values()) == [SIZE] * 8 and loose_dst.same(src)
        mixed = [dst.values()[i] if i % 2 else loose_dst.values()[i] for i in range(8)]
        dst.pages[:] = 0
        loose_dst.pages[:] = 0
        assert store.get_into(keys, mixed) == [SIZE] * 8
        assert np.array_equal(dst.pages[1::2], src.pages[1::2]) and np.array_equal(loose_dst.pages[::2], src.pages[::2])
        # A reconnect registers the kept buffers again.
        store.connect()
        assert all(store.zero_copy(v) for v in dst.values())  # type: ignore[attr-defined]
        dst.pages[:] = 0
        assert store.get_into(keys, dst.values()) == [SIZE] * 8 and dst.same(src)
    finally:
        store.close()


def test_mooncake_store_copying_path(mooncake: MooncakeServers) -> None:
    """Values outside registered memory: joined and put, read and copied; a miss and a
    value of another size as on the zero-copy path."""
    store = connected(mooncake.url)
    try:
        keys, src, dst = new_keys(3), Slots(2, seed=13), Slots(3)
        short = Slots(1, page=1000, seed=14)
        assert store.put(keys[:2], src.values()) == [True, True]
        assert store.put(keys[2:], short.values()) == [True]
        assert store.put(keys[:1], short.values()) == [True]  # exists: keeps its first value
        assert store.exists([*keys, "kvmem-test/absent"]) == [True, True, True, False]
        assert store.get_into([*keys[:2], "kvmem-test/absent"], dst.values()) == [SIZE, SIZE, -1]
        assert np.array_equal(dst.pages[:2], src.pages) and not dst.pages[2].any()
        fresh = Slots(1)
        assert store.get_into(keys[2:], fresh.values()) == [HEADER + 1000]
        assert fresh.blank()
    finally:
        store.close()


def test_mooncake_store_after_close_refuses_calls(mooncake: MooncakeServers) -> None:
    """Mooncake's client crashes the process when called after close(): the adapter drops it."""
    store = connected(mooncake.url)
    store.close()
    store.close()
    with pytest.raises(StoreError, match="not connected"):
        store.exists(["kvmem-test/any"])


# --- the --store URL (no server) -------------------------------------------------------


def mooncake_adapter() -> None:
    try:
        import kvmem.server.store.mooncake_store  # noqa: F401
    except ImportError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@127.0.0.1:6379",
        "rediss://kvmem:s3cret@127.0.0.1:6380/0",
        "redis+cluster://kvmem:s3cret@127.0.0.1:7000,127.0.0.1:7001",
        "valkey://kvmem:s3cret/with+slash@127.0.0.1:6379",
        "redis://kvmem:s3cret?query-like@127.0.0.1:6379",
        "mooncake://kvmem:s3cret#x@127.0.0.1:50051",
    ],
    ids=["redis", "rediss", "cluster", "valkey-slash", "redis-question-mark", "mooncake-hash"],
)
def test_store_url_with_a_password_is_refused_without_printing_it(url: str) -> None:
    with pytest.raises(StoreURLError) as refused:
        StoreURL.parse(url, DEFAULT_PORTS)
    message = str(refused.value)
    assert "--store-password-file" in message and "KVMEM_STORE_PASSWORD" in message, message
    assert "s3cret" not in message, message
    assert "***" in message


def test_store_url_redaction() -> None:
    assert redact("redis://kvmem:pw@127.0.0.1:6379/1") == "redis://kvmem:***@127.0.0.1:6379/1"
    assert redact("redis://:pw@127.0.0.1:6379") == "redis://:***@127.0.0.1:6379"
    assert redact("redis://kvmem:p@w/x?y@127.0.0.1:6379/1") == "redis://kvmem:***@127.0.0.1:6379/1"
    assert redact("redis://kvmem@127.0.0.1:6379") == "redis://kvmem@127.0.0.1:6379"  # a user is no secret
    assert redact("rediss://127.0.0.1:6379?ca=/a@b/ca.pem") == "rediss://127.0.0.1:***@b/ca.pem"  # over, not under
    assert redact("redis+cluster://127.0.0.1:7000,127.0.0.1:7001") == "redis+cluster://127.0.0.1:7000,127.0.0.1:7001"
    parsed = StoreURL.parse("rediss+cluster://kvmem@127.0.0.1:7000,127.0.0.1?ca=/tmp/ca.pem", DEFAULT_PORTS)
    assert parsed.hosts == (("127.0.0.1", 7000), ("127.0.0.1", 6379))
    assert parsed.username == "kvmem" and parsed.query == {"ca": "/tmp/ca.pem"}
    store = open_store("redis://kvmem@127.0.0.1:6379/2", PASSWORD, 1.0)
    assert store.describe() == "redis redis://kvmem@127.0.0.1:6379/2" and PASSWORD not in store.describe()


def test_store_url_unknown_scheme() -> None:
    with pytest.raises(StoreURLError, match=r"unknown scheme 'memcached'.*mooncake.*redis"):
        open_store("memcached://127.0.0.1:11211", None, 1.0)
    with pytest.raises(StoreURLError, match="unknown scheme ''"):
        open_store("127.0.0.1:6379", None, 1.0)


def test_store_url_missing_port_where_there_is_no_default() -> None:
    assert StoreURL.parse("redis://127.0.0.1", DEFAULT_PORTS).hosts == (("127.0.0.1", 6379),)
    with pytest.raises(StoreURLError, match=r"'127\.0\.0\.1' has no port"):
        StoreURL.parse("mooncake://127.0.0.1", DEFAULT_PORTS)
    with pytest.raises(StoreURLError, match="port must be 1-65535, got '99999'"):
        StoreURL.parse("redis://127.0.0.1:99999", DEFAULT_PORTS)
    with pytest.raises(StoreURLError, match="Invalid IPv6 URL"):
        open_store("redis://[::1", None, 1.0)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://127.0.0.1:6379?timeout=5", r"unknown query parameter\(s\) \['timeout'\].*rediss://"),
        ("rediss://127.0.0.1:6379?ca=/tmp/ca.pem&verify=no", r"\['verify'\].*ca="),
        ("rediss://127.0.0.1:6379?ca=/nonexistent/ca.pem", r"ca='/nonexistent/ca.pem' is not a file"),
        ("redis://127.0.0.1:6379/zero", r"the path names the database, a number, got '/zero'"),
        ("redis://127.0.0.1:6379,127.0.0.1:6380", r"names one server, got 2.*redis\+cluster://"),
        ("redis+cluster://127.0.0.1:7000/1", r"database 0 only, got '/1'"),
        ("redis://127.0.0.1:6379?ca=1&ca=2", r"'ca' given 2 times"),
    ],
    ids=["redis-unknown", "rediss-unknown", "rediss-missing-ca", "redis-db", "redis-two-hosts", "cluster-db", "twice"],
)
def test_store_url_bad_query_or_path_redis(url: str, says: str) -> None:
    with pytest.raises(StoreURLError, match=says):
        open_store(url, None, 1.0)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("mooncake://127.0.0.1:50051?protocl=tcp", r"unknown query parameter\(s\) \['protocl'\]; known: protocol"),
        ("mooncake://127.0.0.1:50051?protocol=udp", r"protocol='udp'; choose one of tcp, rdma"),
        ("mooncake://127.0.0.1:50051?segment=lots", r"segment= must be a size.*got 'lots'"),
        ("mooncake://127.0.0.1:50051?local_buffer=-1", r"local_buffer= must be a size.*got '-1'"),
        ("mooncake://10.0.0.5:50051", r"local_hostname= is required when the master \(10.0.0.5\).*connect to"),
        ("mooncake://127.0.0.1:50051/db", r"no path"),
        ("mooncake://kvmem@127.0.0.1:50051", r"no users or passwords"),
    ],
    ids=["unknown", "protocol", "segment", "buffer", "hostname", "path", "user"],
)
def test_store_url_bad_query_or_path_mooncake(url: str, says: str) -> None:
    mooncake_adapter()
    with pytest.raises(StoreURLError, match=says):
        open_store(url, None, 1.0)


def test_store_url_mooncake_defaults_and_sizes() -> None:
    mooncake_adapter()
    store = open_store("mooncake://localhost:50051?segment=1GiB&local_buffer=32MB", None, 1.0)
    assert store.name == "mooncake"
    assert (store.local_hostname, store.protocol, store.metadata) == ("127.0.0.1", "tcp", "P2PHANDSHAKE")  # type: ignore[attr-defined]
    assert (store.segment, store.local_buffer) == (1 << 30, 32_000_000)  # type: ignore[attr-defined]
    remote = open_store("mooncake://10.0.0.5:50051?local_hostname=10.0.0.6&protocol=rdma&rdma_devices=mlx5_0", None, 1)
    assert (remote.local_hostname, remote.protocol, remote.rdma_devices) == ("10.0.0.6", "rdma", "mlx5_0")  # type: ignore[attr-defined]
    assert remote.segment == 0  # type: ignore[attr-defined]
    with pytest.raises(StoreURLError, match="no users or passwords"):
        open_store("mooncake://127.0.0.1:50051", "a-password", 1.0)
