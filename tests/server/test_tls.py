"""TLS on the ``--tcp`` port (``--tls-cert``, ``--tls-key``, ``--tls-client-ca``) and the
clients' ``tls_ca``: a real ``kvmem serve`` with certificates made here by the
``openssl`` command line (a CA, a server certificate for 127.0.0.1 and localhost, a
client certificate, and a second CA that signed none of them).

A mismatch (plaintext against TLS, either way; a CA that did not sign the server's
certificate; a name the certificate lacks; no client certificate where one is required)
fails at once with a :class:`~kvmem.client.channel.TLSError` that says TLS, although the
clients otherwise wait up to their timeout for a server that cannot be reached.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from conftest import ServerProcess, keepalive_answered_since, start_server, wait_keepalive_answered

from kvmem.client import AsyncKVMemClient, KVMemClient, Unavailable
from kvmem.client.admin import stats, watch_events
from kvmem.client.channel import TLSError
from kvmem.server.process.startup import ServerConfig, StartupError, plan_tls

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")

TOKEN = "tls-test-token"
CLI = [sys.executable, "-m", "kvmem.cli"]
SMALL = ("--page-size", "4", "--num-pages", "65", "--max-requests", "4", "--max-context", "64", "--lease-ms", "3000")


def openssl(*args: str, cwd: Path) -> None:
    run = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def make_ca(d: Path, name: str) -> None:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
            "-days", "2", "-subj", f"/CN=kvmem test {name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)  # fmt: skip


def make_leaf(d: Path, name: str, ca: str, extensions: str) -> None:
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    (d / f"{name}.ext").write_text(extensions)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def certs() -> Iterator[Path]:
    """ca.pem signed server.pem (127.0.0.1, localhost; key server.key) and client.pem
    (client.key); other.pem is a CA that signed nothing here; stray.key matches nothing;
    locked.key is server.key under a passphrase."""
    d = Path(tempfile.mkdtemp(prefix="kvmem-tls-"))
    make_ca(d, "ca")
    make_ca(d, "other")
    make_leaf(d, "server", "ca", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    make_leaf(d, "client", "ca", "extendedKeyUsage=clientAuth\n")
    openssl("genrsa", "-out", "stray.key", "2048", cwd=d)
    openssl("rsa", "-in", "server.key", "-aes256", "-passout", "pass:secret", "-out", "locked.key", cwd=d)
    (d / "junk.pem").write_text("not a certificate\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def free_tcp_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tls_server(certs: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A server whose --tcp port speaks TLS (the unix socket stays plaintext), and that port."""
    d = tempfile.mkdtemp(prefix="kvmem-", dir="/tmp")
    address = f"127.0.0.1:{free_tcp_port()}"
    srv = start_server(d, "--tcp", address, "--auth-token", TOKEN, "--tls-cert", str(certs / "server.pem"),
                       "--tls-key", str(certs / "server.key"), *SMALL)  # fmt: skip
    yield srv, address
    code = srv.stop()
    shutil.rmtree(d, ignore_errors=True)
    assert code == 0, srv.log()


def assert_prompt(err: BaseException, started: float, *words: str) -> None:
    """A TLSError (an Unavailable) that says TLS and ``words``, raised well before the
    client's 10 s timeout (no waiting for readiness)."""
    assert isinstance(err, TLSError) and isinstance(err, Unavailable), repr(err)
    assert "TLS" in str(err) and all(word in str(err) for word in words), str(err)
    assert time.monotonic() - started < 5, f"took {time.monotonic() - started:.1f}s"


# ----------------------------------------------------------------- clients over TLS


def test_sync_client_attaches_opens_and_steps_over_tls(tls_server: tuple[ServerProcess, str], certs: Path) -> None:
    srv, address = tls_server
    log = srv.log()
    assert f"--tcp {address}: TLS (no client certificates)" in log, log
    with KVMemClient(address, name="tls-sync", auth_token=TOKEN, tls_ca=str(certs / "ca.pem")) as kv:
        slots = kv.open(["a", "b"])
        res = kv.step(alloc_slots=slots, alloc_needs=[5, 3])
        assert res.ok and res.kv_loc_of(0).numel() == 5
        wait_keepalive_answered(kv)  # keep-alive messages cross the TLS connection too
        assert kv.step(release_slots=slots[:1]).ok
        assert [s.name for s in kv.stats().sessions] == ["tls-sync"]
    # PEM bytes, a pathlib path, and a name the certificate has instead of the host
    pem = (certs / "ca.pem").read_bytes()
    with KVMemClient(address, auth_token=TOKEN, tls_ca=pem, tls_server_name="localhost") as kv:
        assert kv.open(["c"]).numel() == 1
    with KVMemClient(f"localhost:{address.rpartition(':')[2]}", auth_token=TOKEN, tls_ca=certs / "ca.pem") as kv:
        assert kv.step(alloc_slots=kv.open(["d"]), alloc_needs=[4]).ok
    assert stats(address, auth_token=TOKEN, tls_ca=certs / "ca.pem").num_used_pages == 0
    with watch_events(address, auth_token=TOKEN, tls_ca=certs / "ca.pem") as events:
        assert next(events).epoch


def test_asyncio_client_attaches_opens_and_steps_over_tls(tls_server: tuple[ServerProcess, str], certs: Path) -> None:
    _, address = tls_server

    async def run() -> None:
        async with AsyncKVMemClient(address, name="tls-aio", auth_token=TOKEN, tls_ca=certs / "ca.pem") as kv:
            slots = await kv.open(["a"])
            res = await kv.step(alloc_slots=slots, alloc_needs=[6])
            assert res.ok and res.kv_loc_of(0).numel() == 6
            since, deadline = kv.lease_valid_until, time.monotonic() + 30
            while not keepalive_answered_since(kv, since):  # keep-alive messages cross TLS too
                assert time.monotonic() < deadline, "no keep-alive answer within 30 s"
                await asyncio.sleep(0.02)
            assert (await kv.step(release_slots=slots)).ok
        started = time.monotonic()
        with pytest.raises(TLSError) as exc_info:
            await AsyncKVMemClient.connect(address, auth_token=TOKEN)  # plaintext against TLS
        assert_prompt(exc_info.value, started, "tls_ca")

    asyncio.run(run())


def test_the_unix_socket_stays_plaintext(tls_server: tuple[ServerProcess, str], certs: Path) -> None:
    srv, _ = tls_server
    with KVMemClient(srv.target, name="local") as kv:
        assert kv.open(["x"]).numel() == 1
    with pytest.raises(ValueError, match="plaintext"):
        KVMemClient(srv.target, tls_ca=certs / "ca.pem")


# ------------------------------------------------------------------- mismatches


def test_a_plaintext_client_against_tls_fails_at_once_saying_tls(tls_server: tuple[ServerProcess, str]) -> None:
    _, address = tls_server
    started = time.monotonic()
    with pytest.raises(TLSError) as exc_info:
        KVMemClient(address, auth_token=TOKEN)
    assert_prompt(exc_info.value, started, "--tls-cert", "tls_ca")
    started = time.monotonic()
    with pytest.raises(TLSError) as exc_info:
        stats(address, auth_token=TOKEN)
    assert_prompt(exc_info.value, started, "tls_ca")


def test_a_ca_that_did_not_sign_the_certificate_fails_at_once(
    tls_server: tuple[ServerProcess, str], certs: Path
) -> None:
    _, address = tls_server
    started = time.monotonic()
    with pytest.raises(TLSError) as exc_info:
        KVMemClient(address, auth_token=TOKEN, tls_ca=certs / "other.pem")
    assert_prompt(exc_info.value, started, "not signed by a CA in tls_ca")
    started = time.monotonic()
    with pytest.raises(TLSError) as exc_info:
        KVMemClient(address, auth_token=TOKEN, tls_ca=True)  # gRPC's default roots: not our test CA
    assert_prompt(exc_info.value, started, "not signed")
    started = time.monotonic()
    with pytest.raises(TLSError) as exc_info, watch_events(address, auth_token=TOKEN, tls_ca=certs / "other.pem") as s:
        next(s)
    assert_prompt(exc_info.value, started, "not signed")


def test_a_name_the_certificate_lacks_fails_at_once(tls_server: tuple[ServerProcess, str], certs: Path) -> None:
    _, address = tls_server
    started = time.monotonic()
    with pytest.raises(TLSError) as exc_info:
        KVMemClient(address, auth_token=TOKEN, tls_ca=certs / "ca.pem", tls_server_name="kvmem.example")
    assert_prompt(exc_info.value, started, "'kvmem.example'", "tls_server_name")


def test_a_tls_client_against_a_plaintext_port_fails_at_once(certs: Path) -> None:
    plain = grpc.server(futures.ThreadPoolExecutor(1))
    port = plain.add_insecure_port("127.0.0.1:0")
    plain.start()
    try:
        started = time.monotonic()
        with pytest.raises(TLSError) as exc_info:
            KVMemClient(f"127.0.0.1:{port}", tls_ca=certs / "ca.pem")
        assert_prompt(exc_info.value, started, "does not speak TLS", "without tls_ca")
    finally:
        plain.stop(None)


def test_bad_client_tls_arguments_are_refused_naming_them(certs: Path) -> None:
    for kwargs, words in (
        ({"tls_ca": certs / "missing.pem"}, "tls_ca"),
        ({"tls_ca": certs / "junk.pem"}, "no PEM certificate"),
        ({"tls_ca": b"junk"}, "the PEM bytes given"),
        ({"tls_server_name": "localhost"}, "needs tls_ca"),
        ({"tls_ca": certs / "ca.pem", "tls_cert": certs / "client.pem"}, "go together"),
        ({"tls_ca": certs / "ca.pem", "tls_cert": certs / "client.pem", "tls_key": certs / "client.pem"}, "tls_key"),
    ):
        with pytest.raises(ValueError, match=words):
            KVMemClient("127.0.0.1:1", **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------ mutual TLS


def test_mutual_tls_requires_a_client_certificate(certs: Path, tmpdir_short: str) -> None:
    address = f"127.0.0.1:{free_tcp_port()}"
    srv = start_server(tmpdir_short, "--tcp", address, "--auth-token", TOKEN, "--tls-cert", str(certs / "server.pem"),
                       "--tls-key", str(certs / "server.key"), "--tls-client-ca", str(certs / "ca.pem"),
                       *SMALL)  # fmt: skip
    try:
        ca = certs / "ca.pem"
        with KVMemClient(address, auth_token=TOKEN, tls_ca=ca, tls_cert=certs / "client.pem",
                         tls_key=certs / "client.key") as kv:  # fmt: skip
            assert kv.step(alloc_slots=kv.open(["m"]), alloc_needs=[2]).ok
        started = time.monotonic()
        with pytest.raises(TLSError) as exc_info:
            KVMemClient(address, auth_token=TOKEN, tls_ca=ca)
        assert_prompt(exc_info.value, started, "client certificate", "tls_cert")
        started = time.monotonic()
        with pytest.raises(TLSError) as exc_info:  # a certificate its CA did not sign
            KVMemClient(address, auth_token=TOKEN, tls_ca=ca, tls_cert=certs / "other.pem", tls_key=certs / "other.key")
        assert_prompt(exc_info.value, started, "client certificate", "this one is not")
    finally:
        assert srv.stop() == 0, srv.log()


# --------------------------------------------------------------- the command line


def kvmem(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=60)


def test_health_and_stats_over_tls(tls_server: tuple[ServerProcess, str], certs: Path) -> None:
    _, address = tls_server
    ca = str(certs / "ca.pem")
    run = kvmem("health", "--tcp", address, "--tls-ca", ca)
    assert run.returncode == 0 and "SERVING" in run.stdout, (run.stdout, run.stderr)
    run = kvmem("health", "--tcp", f"localhost:{address.rpartition(':')[2]}", "--tls-ca", ca)
    assert run.returncode == 0, run.stderr
    run = kvmem("stats", "--tcp", address, "--tls-ca", ca, "--auth-token", TOKEN, "--json")
    assert run.returncode == 0 and '"numPagesTotal"' in run.stdout, run.stderr
    run = kvmem("health", "--tcp", address)  # plaintext against TLS
    assert run.returncode == 1 and "TLS" in run.stderr and "--tls-ca" in run.stderr, run.stderr
    run = kvmem("stats", "--tcp", address, "--auth-token", TOKEN, "--tls-ca", str(certs / "other.pem"))
    assert run.returncode == 1 and "TLS" in run.stderr and "not signed" in run.stderr, run.stderr
    run = kvmem("health", "--tls-ca", ca)  # the socket: plaintext
    assert run.returncode == 2 and "--tls-ca needs --tcp" in run.stderr, run.stderr
    run = kvmem("health", "--tcp", address, "--tls-ca", str(certs / "missing.pem"))
    assert run.returncode == 2 and "--tls-ca" in run.stderr and "cannot read" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


# --------------------------------------------------------------- start-up refusals


@pytest.mark.parametrize(
    "cert, key, client_ca, tcp, words",
    [
        ("missing.pem", "server.key", None, True, ["--tls-cert", "missing.pem", "cannot read"]),
        ("server.pem", "missing.key", None, True, ["--tls-key", "missing.key", "cannot read"]),
        ("junk.pem", "server.key", None, True, ["--tls-cert", "junk.pem", "no PEM certificate"]),
        ("server.pem", "junk.pem", None, True, ["--tls-key", "junk.pem", "no PEM private key"]),
        ("server.pem", "server.pem", None, True, ["--tls-key", "no PEM private key"]),
        ("server.pem", "stray.key", None, True, ["--tls-key", "stray.key", "does not match", "--tls-cert"]),
        ("server.pem", "locked.key", None, True, ["--tls-key", "locked.key", "encrypted"]),
        ("server.pem", None, None, True, ["--tls-cert", "needs --tls-key"]),
        (None, "server.key", None, True, ["--tls-key", "needs --tls-cert"]),
        (None, None, "ca.pem", True, ["--tls-client-ca", "needs --tls-cert"]),
        ("server.pem", "server.key", "junk.pem", True, ["--tls-client-ca", "junk.pem", "no PEM certificate"]),
        ("server.pem", "server.key", None, False, ["--tls-cert", "--tcp", "plaintext"]),
    ],
)
def test_bad_tls_options_are_refused_naming_the_option(
    certs: Path, cert: str | None, key: str | None, client_ca: str | None, tcp: bool, words: list[str]
) -> None:
    def path(name: str | None) -> str | None:
        return None if name is None else str(certs / name)

    cfg = ServerConfig(tcp="127.0.0.1:0" if tcp else None, tls_cert=path(cert), tls_key=path(key),
                       tls_client_ca=path(client_ca))  # fmt: skip
    with pytest.raises(StartupError) as exc_info:
        plan_tls(cfg)
    message = str(exc_info.value)
    assert "\n" not in message and all(word in message for word in words), message


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/stray.key"], ["--tls-key", "does not match"]),
        (["--tls-cert", "{d}/server.pem", "--tls-key", "{d}/server.key", "--socket", "{sock}"], ["--tcp"]),
    ],
)
def test_serve_refuses_bad_tls_files_in_one_line(
    certs: Path, tmpdir_short: str, extra: list[str], words: list[str]
) -> None:
    sock = os.path.join(tmpdir_short, "kvmem.sock")
    tcp = [] if "--socket" in extra else ["--tcp", f"127.0.0.1:{free_tcp_port()}"]
    args = [a.replace("{d}", str(certs)).replace("{sock}", sock) for a in extra]
    run = kvmem("serve", "--socket", sock, *tcp, *args, "--device", "none")
    assert run.returncode == 2, (run.returncode, run.stderr)
    lines = [line for line in run.stderr.splitlines() if " INFO " not in line and not re.match(r"[EIW]\d{4} ", line)]
    assert len(lines) == 1 and "cannot start" in lines[0], run.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert not os.path.exists(sock)
