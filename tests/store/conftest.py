"""Real stores for the cluster tier's tests, started here on free loopback ports and
stopped by process id (kill, then wait): one Redis (plain, with ``requirepass``, with
``maxmemory``), Redis over TLS, a three-master Redis Cluster, and Mooncake Store (a
master and a process that holds the store's memory). Only 127.0.0.1 anywhere.

Each store is an object that can be stopped and started again on the same ports (the
server-side tests kill a store mid-run and restart it): ``stop()`` kills its processes,
``start()`` brings them back and waits until the store answers (``restart()``: both), and
``freeze()`` / ``thaw()`` make it stop answering and answer again (SIGSTOP, SIGCONT: a
store slower than any timeout). Start-up waits are bounded; a store that does not come up
fails with its log's tail.

A fixture skips only where a binary is missing (``redis-server``, ``redis-cli``,
``openssl``: Debian packages; Mooncake: the ``kvmem[mooncake-cpu]`` wheel and the
libraries it loads), saying what to install; ``bash .ci/system-packages`` installs the
Debian ones, and CI has them all.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

LOCAL = "127.0.0.1"
START_TIMEOUT_S = 30.0
DEBIAN = "apt-get install redis-server (or: bash .ci/system-packages)"


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOCAL, 0))
        return int(s.getsockname()[1])


def binary(name: str, install: str) -> str:
    """The path of ``name``, or skip the test saying what to install."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed: {install}")
    return path


@dataclasses.dataclass
class ServerProcess:
    """One server process: started with ``argv``, its output appended to ``log``."""

    name: str
    argv: list[str]
    log: Path
    cwd: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert not self.running, f"{self.name} is running already"
        with self.log.open("ab") as out:
            out.write(f"--- start: {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=self.cwd
            )

    def stop(self) -> None:
        """Kill it by its process id and wait until it is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def freeze(self) -> None:
        """SIGSTOP: it keeps its sockets and answers nothing (a store slower than any timeout)."""
        assert self.proc is not None and self.proc.poll() is None, f"{self.name} is not running"
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT: it answers again (what it was asked meanwhile included)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except FileNotFoundError:
            return f"[{self.name}: no log]"
        return f"[{self.name}: {self.log}]\n" + "\n".join(text.splitlines()[-lines:])


def wait_until(
    what: str, ready: Callable[[], bool], servers: list[ServerProcess], timeout: float = START_TIMEOUT_S
) -> None:
    """Poll ``ready`` (exceptions count as not yet) until it is true; RuntimeError with
    the servers' log tails when one of them exits or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        for server in servers:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"{what}: {server.name} exited with {server.proc.returncode}\n{server.tail()}")
        try:
            if ready():
                return
        except Exception as exc:  # not up yet: refused, loading, cluster still forming
            last = exc
        if time.monotonic() > deadline:
            tails = "\n".join(s.tail() for s in servers)
            raise RuntimeError(f"{what}: not ready after {timeout:.0f} s (last: {last!r})\n{tails}")
        time.sleep(0.05)


# --- Redis -------------------------------------------------------------------------------


@dataclasses.dataclass
class RedisServer:
    """One ``redis-server`` (plain or TLS) on 127.0.0.1; ``url`` without a password
    (``password`` is what the store takes from ``--store-password-file``)."""

    process: ServerProcess
    port: int
    password: str | None = None
    tls: dict[str, str] | None = None  # ca, cert, key file names when it speaks TLS

    @property
    def url(self) -> str:
        if self.tls is None:
            return f"redis://{LOCAL}:{self.port}"
        return f"rediss://{LOCAL}:{self.port}?ca={self.tls['ca']}"

    def client(self) -> Any:
        """A redis-py client straight to this server (not through kvmem)."""
        import redis

        tls: dict[str, Any] = {"ssl": True, "ssl_ca_certs": self.tls["ca"]} if self.tls else {}
        return redis.Redis(host=LOCAL, port=self.port, password=self.password, socket_timeout=5, **tls)

    def start(self) -> None:
        self.process.start()

        def ready() -> bool:
            with self.client() as c:
                return bool(c.ping())

        wait_until(f"redis-server on {self.port}", ready, [self.process])

    def stop(self) -> None:
        self.process.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def freeze(self) -> None:
        """It stops answering (SIGSTOP) until :meth:`thaw`."""
        self.process.freeze()

    def thaw(self) -> None:
        self.process.thaw()


RedisFactory = Callable[..., RedisServer]


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisFactory]:
    """``start(requirepass=None, maxmemory=None, policy="allkeys-lru", tls=None)``: a
    new redis-server; each is stopped at the test's end."""
    exe = binary("redis-server", DEBIAN)
    started: list[RedisServer] = []

    def start(
        requirepass: str | None = None,
        maxmemory: str | None = None,
        policy: str = "allkeys-lru",
        tls: dict[str, str] | None = None,
    ) -> RedisServer:
        d = tmp_path_factory.mktemp("redis")
        port = free_port()
        args = [exe, "--bind", LOCAL, "--save", "", "--appendonly", "no", "--dir", str(d)]
        if tls is None:
            args += ["--port", str(port)]
        else:
            args += ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls["cert"], "--tls-key-file",
                     tls["key"], "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no"]  # fmt: skip
        if requirepass is not None:
            args += ["--requirepass", requirepass]
        if maxmemory is not None:
            args += ["--maxmemory", maxmemory, "--maxmemory-policy", policy]
        server = RedisServer(ServerProcess(f"redis-server:{port}", args, d / "redis.log", d), port, requirepass, tls)
        started.append(server)
        server.start()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(redis_factory: RedisFactory) -> RedisServer:
    """One plain redis-server, for this test."""
    return redis_factory()


def openssl(*args: str, cwd: Path) -> None:
    run = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA (ca.pem) and a server certificate it signed for 127.0.0.1 and localhost
    (server.pem, server.key), made with the openssl command line as in
    tests/server/test_tls.py."""
    binary("openssl", "apt-get install openssl")
    d = tmp_path_factory.mktemp("store-tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=kvmem store test ca", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            "-subj", "/CN=server", cwd=d)  # fmt: skip
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "server.pem", "-days", "2", "-extfile", "server.ext", cwd=d)  # fmt: skip
    return {"ca": str(d / "ca.pem"), "cert": str(d / "server.pem"), "key": str(d / "server.key")}


@pytest.fixture
def redis_tls(redis_factory: RedisFactory, certs: dict[str, str]) -> RedisServer:
    """A redis-server that speaks TLS only (no client certificates asked); its ``url``
    is ``rediss://127.0.0.1:PORT?ca=CA.pem``."""
    return redis_factory(tls=certs)


@dataclasses.dataclass
class RedisClusterServers:
    """Three Redis Cluster masters on 127.0.0.1 (no replicas): ``url`` names two of them
    (the client learns the third)."""

    processes: list[ServerProcess]
    ports: list[int]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{LOCAL}:{p}" for p in self.ports[:2])

    def clients(self) -> list[Any]:
        """A redis-py client straight to each master."""
        import redis

        return [redis.Redis(host=LOCAL, port=p, socket_timeout=5) for p in self.ports]

    def _state_ok(self) -> bool:
        for c in self.clients():
            with c:
                if b"cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                    return False
        return True

    def start(self) -> None:
        """Start the masters (again: they read their nodes-PORT.conf and form the same cluster)
        and wait for cluster_state:ok on each."""
        for p in self.processes:
            p.start()
        for p, port in zip(self.processes, self.ports, strict=True):
            wait_until(f"redis cluster node {port}", functools.partial(_ping, port), [p])
        wait_until("redis cluster state ok", self._state_ok, self.processes)

    def stop(self) -> None:
        for p in self.processes:
            p.stop()

    def freeze(self) -> None:
        """Every master stops answering (SIGSTOP) until :meth:`thaw`."""
        for p in self.processes:
            p.freeze()

    def thaw(self) -> None:
        for p in self.processes:
            p.thaw()

    def restart(self) -> None:
        self.stop()
        self.start()


def _ping(port: int) -> bool:
    import redis

    with redis.Redis(host=LOCAL, port=port, socket_timeout=5) as c:
        return bool(c.ping())


def start_redis_cluster(d: Path) -> RedisClusterServers:
    exe = binary("redis-server", DEBIAN)
    cli = binary("redis-cli", DEBIAN)
    ports = [free_port() for _ in range(3)]
    bus = [free_port() for _ in range(3)]
    processes = []
    for port, bus_port in zip(ports, bus, strict=True):
        argv = [exe, "--port", str(port), "--bind", LOCAL, "--save", "", "--appendonly", "no", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", str(d / f"nodes-{port}.conf"),
                "--cluster-node-timeout", "2000", "--cluster-port", str(bus_port)]  # fmt: skip
        processes.append(ServerProcess(f"redis-cluster:{port}", argv, d / f"redis-{port}.log", d))
    cluster = RedisClusterServers(processes, ports)
    try:
        for p in processes:
            p.start()
        for p, port in zip(processes, ports, strict=True):
            wait_until(f"redis cluster node {port}", functools.partial(_ping, port), [p])
        create = subprocess.run(
            [cli, "--cluster", "create", *(f"{LOCAL}:{p}" for p in ports), "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if create.returncode != 0:
            tails = "\n".join(p.tail() for p in processes)
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout}{create.stderr}\n{tails}")
        wait_until("redis cluster state ok", cluster._state_ok, processes)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    """A three-master Redis Cluster, shared by a module's tests (keys are per test)."""
    cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], RedisClusterServers]]:
    """``start()``: a cluster of this test's own (one to kill); stopped at the test's end."""
    started: list[RedisClusterServers] = []

    def start() -> RedisClusterServers:
        cluster = start_redis_cluster(tmp_path_factory.mktemp("redis-cluster"))
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()


# --- Mooncake Store ----------------------------------------------------------------------

MOONCAKE_INSTALL = (
    "pip install 'kvmem[mooncake-cpu]' (mooncake-transfer-engine-non-cuda) and the Debian packages "
    "libibverbs1 libnuma1 libcurl4 (bash .ci/system-packages)"
)


def mooncake_binaries() -> tuple[str, str]:
    """The wheel's mooncake_master and mooncake_client, after checking its Python client
    loads (it needs libibverbs1 and friends); else skip, saying what to install."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"Mooncake Store is not installed: {MOONCAKE_INSTALL}")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = []
    for name in ("mooncake_master", "mooncake_client"):
        path = folder / name
        if not path.is_file():
            pytest.skip(f"{name} is missing from the mooncake wheel at {folder}: {MOONCAKE_INSTALL}")
        if not os.access(path, os.X_OK):
            path.chmod(path.stat().st_mode | 0o111)  # what the wheel's own launcher does
        found.append(str(path))
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"Mooncake's Python client does not load ({exc}): {MOONCAKE_INSTALL}")
    return found[0], found[1]


@dataclasses.dataclass
class MooncakeServers:
    """A Mooncake master and a holder process (``mooncake_client``, which mounts
    ``segment`` of memory for the store: a store client's own segment goes when its
    process does). ``address`` is the master's ``127.0.0.1:PORT``; ``url`` the
    ``mooncake://`` URL kvmem takes (kvmem contributes no memory: ``segment=0``)."""

    master: ServerProcess
    holder: ServerProcess
    address: str

    @property
    def url(self) -> str:
        return f"mooncake://{self.address}?protocol=tcp&metadata=P2PHANDSHAKE"

    def start(self) -> None:
        """Start the master, then the holder, and wait until a client can put and get."""
        self.master.start()
        host, port = self.address.split(":")
        wait_until(f"mooncake_master on {self.address}", lambda: _listening(host, int(port)), [self.master])
        self.holder.start()
        wait_until(f"mooncake store at {self.address}", self._put_and_get, [self.master, self.holder])

    def _put_and_get(self) -> bool:
        from mooncake.store import MooncakeDistributedStore

        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
        client = MooncakeDistributedStore()
        if client.setup(LOCAL, "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.address) != 0:
            return False
        try:
            key = f"kvmem-test-probe-{uuid.uuid4().hex}"
            return bool(client.put(key, b"probe") == 0 and client.get(key) == b"probe")
        finally:
            client.close()

    def stop(self) -> None:
        """Kill the holder and the master (the store's objects are gone with them)."""
        self.holder.stop()
        self.master.stop()

    def restart(self) -> None:
        self.stop()
        self.start()

    def freeze(self) -> None:
        """The master stops answering (SIGSTOP) until :meth:`thaw` (the holder goes on:
        a hung master is what a slow Mooncake Store is)."""
        self.master.freeze()

    def thaw(self) -> None:
        self.master.thaw()


def _listening(host: str, port: int) -> bool:
    with socket.create_connection((host, port), timeout=1):
        return True


def start_mooncake(d: Path, segment: str = "256 MB", master_args: tuple[str, ...] = ()) -> MooncakeServers:
    master_exe, client_exe = mooncake_binaries()
    rpc, metrics, holder_port = free_port(), free_port(), free_port()
    address = f"{LOCAL}:{rpc}"
    master = ServerProcess(
        f"mooncake_master:{rpc}",
        [master_exe, f"--rpc_address={LOCAL}", f"--rpc_port={rpc}", f"--metrics_host={LOCAL}",
         f"--metrics_port={metrics}", "--enable_http_metadata_server=false", *master_args],
        d / "master.log",
        d,
    )  # fmt: skip
    holder = ServerProcess(
        f"mooncake_client:{holder_port}",
        [client_exe, f"--host={LOCAL}", f"--port={holder_port}", f"--global_segment_size={segment}",
         "--local_buffer_size=16 MB", "--metadata_server=P2PHANDSHAKE", f"--master_server_address={address}",
         "--protocol=tcp"],
        d / "holder.log",
        d,
    )  # fmt: skip
    servers = MooncakeServers(master, holder, address)
    try:
        servers.start()
    except BaseException:
        servers.stop()
        raise
    return servers


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeServers]:
    """A Mooncake master and a holder of 256 MB, shared by a module's tests: ``.address``
    is the master's, ``.url`` the ``mooncake://`` URL."""
    servers = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield servers
    servers.stop()


@pytest.fixture
def mooncake_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., MooncakeServers]]:
    """``start(segment="256 MB", master_args=())``: a store of this test's own (one to
    kill, or a small one that must evict); stopped at the test's end."""
    started: list[MooncakeServers] = []

    def start(segment: str = "256 MB", master_args: tuple[str, ...] = ()) -> MooncakeServers:
        servers = start_mooncake(tmp_path_factory.mktemp("mooncake"), segment, master_args)
        started.append(servers)
        return servers

    yield start
    for servers in started:
        servers.stop()


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One plain redis-server shared by a module's tests (each test its own keys: the
    cluster tier's keys are content addressed, so distinct prompts never meet)."""
    exe = binary("redis-server", DEBIAN)
    d = tmp_path_factory.mktemp("redis")
    port = free_port()
    args = [exe, "--port", str(port), "--bind", LOCAL, "--save", "", "--appendonly", "no", "--dir", str(d)]
    server = RedisServer(ServerProcess(f"redis-server:{port}", args, d / "redis.log", d), port)
    server.start()
    yield server
    server.stop()
