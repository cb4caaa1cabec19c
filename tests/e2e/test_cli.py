"""The ``kvmem`` command line, run as a real process: ``[python, -m, kvmem.cli, ...]``.

Every run starts from an environment without ``KVMEM_*`` variables, so a developer's
settings cannot change what the tests see; tests that are about the environment set
their variables explicitly.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pty
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import ServerProcess, start_server

from kvmem.client import KVMemClient
from kvmem.v1 import kvmem_pb2, kvmem_pb2_grpc

CLI = [sys.executable, "-m", "kvmem.cli"]
VERSION = importlib.metadata.version("kvmem")

# Every `kvmem serve` option and its default as the help shows it.
SERVE_OPTIONS = {
    "--socket": "/tmp/kvmem.sock",
    "--socket-mode": "0600",
    "--group": "none",
    "--tcp": "none",
    "--auth-token": "none",
    "--tls-cert": "none",
    "--tls-key": "none",
    "--tls-client-ca": "none",
    "--metrics": "none",
    "--health-port": "none",
    "--page-size": "16",
    "--num-pages": "4096",
    "--max-requests": "256",
    "--max-context": "8192",
    "--memory": "none",
    "--host-memory": "none",
    "--host-write-policy": "write-back",
    "--store": "none",
    "--store-password-file": "none",
    "--store-key-file": "none",
    "--store-timeout-ms": "200",
    "--store-write-queue": "1024",
    "--host-min-load-tokens": "1",
    "--device": "cpu",
    "--devices": "none",
    "--shm-dir": "/dev/shm",
    "--format": "mha",
    "--layers": "2",
    "--kv-heads": "2",
    "--head-dim": "64",
    "--kv-lora-rank": "512",
    "--rope-dim": "64",
    "--dtype": "bfloat16",
    "--max-sessions": "1024",
    "--lease-ms": "10000",
    "--quarantine-ms": "none",
    "--resume-ms": "none",
    "--handoff-ms": "30000",
    "--drain-ms": "1000",
    "--shutdown-grace-ms": "500",
    "--start-timeout-ms": "120000",
    "--prefix-hash": "xxh3-128",
    "--prefix-hash-seed": "none",
    "--kv-events-buffer": "4096",
    "--kv-events-zmq": "none",
    "--kv-events-replay": "none",
    "--kv-events-topic": "none",
    "--log-level": "info",
    "--log-format": "text",
}


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    env["COLUMNS"] = "200"  # argparse wraps help at the terminal width
    env.update(extra)
    return env


def kvmem(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env or clean_env(), timeout=timeout)


def option_entries(help_text: str) -> dict[str, str]:
    """Option -> its help entry (invocation and text, whitespace collapsed)."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in help_text.splitlines():
        m = re.match(r"^  (-[\w-]+)", line)  # "  --page-size PAGE_SIZE ..." or "  -h, --help ..."
        if m:
            current = entries.setdefault(m.group(1), [])
            current.append(line)
        elif current is not None and line.startswith("      "):
            current.append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


def env_name(flag: str) -> str:
    return "KVMEM_" + flag.lstrip("-").upper().replace("-", "_")


def stats_of(server: ServerProcess) -> kvmem_pb2.StatsResponse:
    with grpc.insecure_channel(server.target) as channel:
        return kvmem_pb2_grpc.KVMemoryStub(channel).Stats(kvmem_pb2.StatsRequest(), timeout=5)


# -------------------------------------------------------------------------- help


def test_top_level_help_lists_the_commands() -> None:
    run = kvmem("--help")
    assert run.returncode == 0, run.stderr
    for command in ("serve", "health", "stats"):
        assert re.search(rf"^\s+{command}\s+\S", run.stdout, re.M), run.stdout
    no_command = kvmem()
    assert no_command.returncode != 0 and "COMMAND" in no_command.stderr


def test_serve_help_names_every_option_with_its_default_and_env_var() -> None:
    run = kvmem("serve", "--help")
    assert run.returncode == 0, run.stderr
    entries = option_entries(run.stdout)
    switches = {"--debug-audit", "--no-prefix-cache", "--keep-state", "--discard-state"}
    assert set(entries) == {"-h", "--version", *switches, *SERVE_OPTIONS}, sorted(entries)
    for flag in ("--keep-state", "--discard-state"):
        assert f"(default: off; env {env_name(flag)})" in entries[flag], entries[flag]
    for flag, default in SERVE_OPTIONS.items():
        assert f"(default: {default}; env {env_name(flag)})" in entries[flag], entries[flag]
    assert "(default: off; env KVMEM_DEBUG)" in entries["--debug-audit"], entries["--debug-audit"]
    assert "(default: the cache is on; env KVMEM_NO_PREFIX_CACHE)" in entries["--no-prefix-cache"]
    for words in (("xxh3-128", "vllm-sha256-cbor"), ("PYTHONHASHSEED",), ("kvmem[events]", "tcp://")):
        flag = {"xxh3-128": "--prefix-hash", "PYTHONHASHSEED": "--prefix-hash-seed"}.get(words[0], "--kv-events-zmq")
        assert all(word in entries[flag] for word in words), entries[flag]
    assert "KVMEM_" in run.stdout.split("options:")[0]  # the description says env vars exist


@pytest.mark.parametrize("command", ["health", "stats"])
def test_client_command_help_names_defaults_and_env_vars(command: str) -> None:
    run = kvmem(command, "--help")
    assert run.returncode == 0, run.stderr
    entries = option_entries(run.stdout)
    for flag, default in (("--socket", "/tmp/kvmem.sock"), ("--tcp", "none"), ("--auth-token", "none")):
        assert f"(default: {default}; env {env_name(flag)})" in entries[flag], entries[flag]
    assert "(default: 3)" in entries["--timeout"]


def test_version_prints_the_package_version_and_the_runtime() -> None:
    for args in (["--version"], ["serve", "--version"]):
        run = kvmem(*args, env=clean_env(KVMEM_PAGE_SIZE="16k"))  # a bad serve value changes nothing
        assert run.returncode == 0 and run.stderr == "", (args, run.stderr)
        first, second = run.stdout.splitlines()
        assert first == f"kvmem {VERSION}", run.stdout
        assert second.startswith("python ") and "grpcio " in second and "numpy " in second, second


def test_version_without_metadata_is_the_source_trees(tmp_path: Path) -> None:
    """Run from a source tree that was never installed, the version is pyproject.toml's."""
    from kvmem.cli.version import UNKNOWN, _pyproject_version

    repo = Path(__file__).resolve().parents[2]
    assert _pyproject_version(repo / "pyproject.toml") == VERSION
    other = tmp_path / "pyproject.toml"
    for text in ('[project]\nname = "other"\nversion = "9.9"\n', '[project]\nname = "kvmem"\n', "not toml ["):
        other.write_text(text)
        assert _pyproject_version(other) == UNKNOWN, text
    assert _pyproject_version(tmp_path / "missing.toml") == UNKNOWN


# ------------------------------------------------------------------------ health


def test_health_exits_0_when_serving_and_1_with_a_reason_when_not(server: ServerProcess, tmpdir_short: str) -> None:
    ready = kvmem("health", "--socket", server.socket_path)
    assert ready.returncode == 0, ready.stderr
    assert "SERVING" in ready.stdout and "NOT_SERVING" not in ready.stdout
    alive = kvmem("health", "--socket", server.socket_path, "--service", "")
    assert alive.returncode == 0 and "liveness" in alive.stdout and "SERVING" in alive.stdout
    by_env = kvmem("health", env=clean_env(KVMEM_SOCKET=server.socket_path))
    assert by_env.returncode == 0, by_env.stderr

    missing = os.path.join(tmpdir_short, "nobody.sock")
    down = kvmem("health", "--socket", missing, "--timeout", "2")
    assert down.returncode != 0
    assert missing in down.stderr and "UNAVAILABLE" in down.stderr, down.stderr
    unknown = kvmem("health", "--socket", server.socket_path, "--service", "no.such.Service")
    assert unknown.returncode != 0 and "NOT_FOUND" in unknown.stderr, unknown.stderr


# ------------------------------------------------------------------------- stats


def test_stats_prints_a_table_and_json(server: ServerProcess) -> None:
    with KVMemClient(server.target, name="cli-worker", quota_pages=40, cache_namespace="model-a") as kv:
        kv.alloc(kv.open(["r0", "r1"]), [5, 9])  # 2 + 3 pages
        [probe] = kv.open(["probe"]).tolist()
        assert kv.match(probe, list(range(12))) == 0  # 12 query tokens, no hit
        kv.release([probe])
        # Both at once: each imports the client library (and torch), which takes a while.
        runs = {
            name: subprocess.Popen(
                [*CLI, "stats", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
            )  # fmt: skip
            for name, args in (
                ("table", ["--socket", server.socket_path, "--audit"]),
                ("json", ["--socket", server.socket_path, "--json"]),
            )
        }
        out = {name: (p.communicate(timeout=60), p.returncode) for name, p in runs.items()}

    (table, err), code = out["table"]
    assert code == 0, err
    assert table.startswith(f"kvmem {VERSION}   epoch "), table
    assert re.search(r"pages used 5 \(2\.0%\)\s+cached 0\s+free 251", table), table
    assert re.search(r"pool\s+256 pages x 4 tokens; max 16 requests, 256 tokens each", table), table
    assert re.search(r"request slots open 2\s+free 14", table), table
    assert re.search(r"prefix cache on\s+hash xxh3-128\s+entries 0\s+hit rate 0\.0% \(0 of 12 query tokens\)"
                     r"\s+evictions 0", table), table  # fmt: skip
    assert "audit OK" in table
    header, row = [line.split() for line in table.splitlines()[-2:]]
    assert header == ["#", "session", "requests", "pages", "quota", "idle", "namespace", "hit/query", "evicted"]
    assert row[1:5] == ["cli-worker", "2", "5", "40"], row
    assert row[6:] == ["model-a", "0/12", "0"], row

    (text, err), code = out["json"]
    assert code == 0, err
    d = json.loads(text)
    counters = {k: int(d[k]) for k in ("numPagesTotal", "numFreePages", "numUsedPages", "numCachedPages",
                                       "numFreeRequestSlots", "numOpenRequests")}  # fmt: skip
    assert counters == {"numPagesTotal": 256, "numFreePages": 251, "numUsedPages": 5, "numCachedPages": 0,
                        "numFreeRequestSlots": 14, "numOpenRequests": 2}  # fmt: skip
    assert d["geometry"]["pageSize"] == 4 and d["geometry"]["numPages"] == 257
    [session] = d["sessions"]
    assert session["name"] == "cli-worker" and int(session["numPagesHeld"]) == 5 and int(session["quotaPages"]) == 40
    assert session["cacheNamespace"] == "model-a" and int(session["prefixQueryTokens"]) == 12
    assert d["prefixCacheEnabled"] is True and d["prefixHash"] == "xxh3-128" and int(d["prefixQueryTokens"]) == 12
    assert d["audit"]["ran"] is False  # no --audit: the O(pool) audit did not run
    assert d["version"] == VERSION


def test_stats_watch_repeats_blocks_off_a_terminal_and_redraws_on_one(server: ServerProcess, tmpdir_short: str) -> None:
    """--watch: blocks one after another into a pipe (JSON Lines with --json), clear and
    redraw on a terminal; --count ends it; a server that does not answer is reported at
    each refresh (exit 1); Ctrl-C ends it with exit 0."""
    sock = ["--socket", server.socket_path]
    missing = ["--socket", os.path.join(tmpdir_short, "nobody.sock"), "--timeout", "0.5"]
    master, slave = pty.openpty()
    runs = {
        name: subprocess.Popen(
            [*CLI, "stats", *args],
            stdout=slave if name == "tty" else subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(PYTHONFAULTHANDLER="1"),  # SIGABRT dumps every thread's stack (see finish)
        )
        for name, args in (
            ("table", [*sock, "--watch", "0.1", "--count", "2"]),
            ("json", [*sock, "--json", "--count", "2", "--watch", "0.1"]),
            ("tty", [*sock, "--watch", "0.1", "--count", "2"]),
            ("down", [*missing, "--count", "2", "--watch", "0.1"]),
            ("interrupted", [*sock, "--watch", "0.1"]),
        )
    }
    os.close(slave)
    screen = b""
    while chunk := _read_pty(master):
        screen += chunk
    os.close(master)
    first = runs["interrupted"].stdout.readline()  # type: ignore[union-attr]
    assert first.startswith("# "), first
    runs["interrupted"].send_signal(signal.SIGINT)

    def finish(name: str, p: subprocess.Popen[str]) -> tuple[tuple[str, str], int | None]:
        try:
            return p.communicate(timeout=60), p.returncode
        except subprocess.TimeoutExpired:  # where it hangs: its threads' stacks
            p.send_signal(signal.SIGABRT)
            _, err = p.communicate(timeout=30)
            raise AssertionError(f"kvmem stats ({name}) did not exit within 60 s:\n{err[-6000:]}") from None

    out = {name: finish(name, p) for name, p in runs.items()}

    (text, err), code = out["table"]
    assert code == 0, err
    blocks = text.split("\n\n# ")
    assert len(blocks) == 2 and text.startswith("# "), text
    assert all(f"\nkvmem {VERSION}   epoch " in "\n" + b.split("\n", 1)[1] for b in blocks), text
    (text, err), code = out["json"]
    assert code == 0, err
    assert [json.loads(line)["version"] for line in text.splitlines()] == [VERSION, VERSION]
    assert out["tty"][1] == 0, out["tty"][0][1]
    shown = screen.decode()
    assert shown.count("\x1b[H\x1b[2J") == 2 and shown.count(f"kvmem {VERSION}   epoch ") == 2, shown
    (text, err), code = out["down"]
    assert code == 1 and text == "", text
    assert len(err.splitlines()) == 2 and all("nobody.sock" in line for line in err.splitlines()), err
    (_, err), code = out["interrupted"]
    assert code == 0 and "Traceback" not in err, err


def _read_pty(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every writer has closed the terminal
        return b""


# ------------------------------------------------------------------ serve options


def test_serve_honours_kvmem_env_vars_and_the_command_line_wins(tmpdir_short: str) -> None:
    by_env = start_server(tmpdir_short, env=clean_env(KVMEM_PAGE_SIZE="8", KVMEM_NUM_PAGES="33",
                                                      KVMEM_MAX_CONTEXT="256", KVMEM_LEASE_MS="2500",
                                                      KVMEM_DEBUG="1"),
                          socket_name="env.sock")  # fmt: skip
    both = start_server(tmpdir_short, "--page-size", "2", "--max-context", "4096", env=clean_env(KVMEM_PAGE_SIZE="8", KVMEM_DEBUG="1"),
                        socket_name="cli.sock")  # fmt: skip
    try:
        g = stats_of(by_env).geometry
        assert (g.page_size, g.num_pages, g.max_requests, g.max_context_len) == (8, 33, 256, 256)
        with grpc.insecure_channel(by_env.target) as channel:
            attached = kvmem_pb2_grpc.KVMemoryStub(channel).Attach(kvmem_pb2.AttachRequest(name="x"), timeout=5)
        assert attached.lease_ms == 2500
        assert stats_of(both).geometry.page_size == 2
        assert "audit_every_step=True" in by_env.log()  # KVMEM_DEBUG=1 turns the per-step audit on
    finally:
        assert by_env.stop() == 0, by_env.log()
        assert both.stop() == 0, both.log()


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args, named",
    [
        (["--page-size", "0"], ["--page-size", "0"]),
        (["--num-pages", "1"], ["--num-pages", "1"]),
        (["--max-requests", "0"], ["--max-requests", "0"]),
        (["--max-context", "0"], ["--max-context", "0"]),
        (["--lease-ms", "0"], ["--lease-ms", "0"]),
        (["--page-size", "many"], ["--page-size", "many"]),
        (["--socket", "none"], ["--socket", "--tcp"]),  # nothing to listen on
        (["--socket", "none", "--tcp", "0.0.0.0:{port}"], ["0.0.0.0", "--auth-token"]),  # beyond loopback, no token
        (["--tcp", "localhost"], ["--tcp", "HOST:PORT", "localhost"]),
        (["--metrics", "9400"], ["--metrics", "HOST:PORT", "9400"]),
        (["--metrics", "127.0.0.1:99999"], ["--metrics", "127.0.0.1:99999"]),
    ],
)
def test_serve_refuses_bad_options_naming_them(tmpdir_short: str, args: list[str], named: list[str]) -> None:
    path = os.path.join(tmpdir_short, "bad.sock")
    port = str(free_tcp_port())
    run = kvmem("serve", "--socket", path, *(a.replace("{port}", port) for a in args))
    assert run.returncode != 0
    for word in named:
        assert word in run.stderr, f"{word!r} not in {run.stderr!r}"
    assert "Traceback" not in run.stderr
    assert not os.path.exists(path)


def test_serve_refuses_a_bad_env_value_naming_the_variable(tmpdir_short: str) -> None:
    run = kvmem("serve", "--socket", os.path.join(tmpdir_short, "x.sock"), env=clean_env(KVMEM_PAGE_SIZE="lots"))
    assert run.returncode != 0
    assert "KVMEM_PAGE_SIZE" in run.stderr and "lots" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


# ------------------------------------------------------------- start-up refusals
#
# Every bad option or KVMEM_* value ends `kvmem serve` with exit 2 and one line on stderr
# naming the option (or variable) and the value, and leaves nothing behind: no socket
# file, no shm file, no listening port. Most are refused before anything is created;
# the rest (a port taken after the checks) undo what was created.


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that another socket listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def assert_refused(run: subprocess.CompletedProcess[str], named: list[str], sock: str, shm_dir: str) -> None:
    assert run.returncode == 2, (run.returncode, run.stderr)
    # One line, besides INFO lines and the line gRPC's core logs itself ("E1130 12:00:00.0 ... add_port.cc").
    errors = [line for line in run.stderr.splitlines() if " INFO " not in line and not re.match(r"E\d{4} ", line)]
    assert len(errors) == 1, run.stderr
    for word in named:
        assert word in errors[0], f"{word!r} not in {errors[0]!r}"
    assert "Traceback" not in run.stderr
    assert not os.path.exists(sock), f"{sock} left behind"
    assert os.listdir(shm_dir) == [], f"shm files left behind: {os.listdir(shm_dir)}"


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.parametrize(
    "args, env, named",
    [
        # issue 11's four
        (["--tcp", "127.0.0.1:{busy}"], {}, ["--tcp", "127.0.0.1:{busy}", "in use"]),
        (["--socket", "{dir}/missing/kvmem.sock"], {}, ["--socket", "{dir}/missing/kvmem.sock", "no such directory"]),
        (["--shutdown-grace-ms", "-1"], {}, ["--shutdown-grace-ms", "'-1'", ">= 0"]),
        (["--memory", "-5GiB"], {}, ["--memory", "'-5GiB'", "negative"]),
        # and more
        (["--memory=-5GiB"], {}, ["--memory", "'-5GiB'", "negative"]),
        (["--memory", "0"], {}, ["--memory", "'0'"]),
        (["--lease-ms", "-5"], {}, ["--lease-ms", "'-5'", "positive"]),
        (["--rope-dim", "-1"], {}, ["--rope-dim", "'-1'", ">= 0"]),
        (["--device", "gpu"], {}, ["--device", "'gpu'"]),
        (["--devices", "0,0"], {}, ["--devices", "'0,0'"]),
        (["--dtype", "int8"], {}, ["--dtype", "'int8'"]),
        (["--log-level", "loud"], {}, ["--log-level", "'loud'"]),
        (["--metrics", "127.0.0.1:{busy}"], {}, ["--metrics", "127.0.0.1:{busy}", "in use"]),
        (["--shm-dir", "{dir}/nowhere"], {}, ["--shm-dir", "{dir}/nowhere", "no such directory"]),
        (["--socket", "{dir}/" + "s" * 120], {}, ["--socket", "s" * 120, "107"]),
        ([], {"KVMEM_PAGE_SIZE": "16k"}, ["KVMEM_PAGE_SIZE", "'16k'", "positive integer"]),
        ([], {"KVMEM_SHUTDOWN_GRACE_MS": "-1"}, ["KVMEM_SHUTDOWN_GRACE_MS", "'-1'"]),
        ([], {"KVMEM_MEMORY": "-5GiB"}, ["KVMEM_MEMORY", "'-5GiB'", "negative"]),
        ([], {"KVMEM_DEBUG": "maybe"}, ["KVMEM_DEBUG", "'maybe'"]),
        ([], {"KVMEM_TCP": "127.0.0.1:{busy}"}, ["--tcp", "127.0.0.1:{busy}", "in use"]),
        # the prefix cache and its events
        (["--prefix-hash", "md5"], {}, ["--prefix-hash", "'md5'", "xxh3-128", "vllm-sha256-cbor"]),
        (["--prefix-hash-seed", "42"], {}, ["--prefix-hash-seed", "xxh3-128", "no seed"]),
        (["--kv-events-buffer", "0"], {}, ["--kv-events-buffer", "'0'", "positive"]),
        (["--kv-events-replay", "tcp://*:5558"], {}, ["--kv-events-replay", "tcp://*:5558", "--kv-events-zmq"]),
        (["--kv-events-zmq", "5557"], {}, ["--kv-events-zmq", "'5557'", "tcp://"]),
        ([], {"KVMEM_NO_PREFIX_CACHE": "maybe"}, ["KVMEM_NO_PREFIX_CACHE", "'maybe'"]),
        ([], {"KVMEM_PREFIX_HASH": "sha1"}, ["KVMEM_PREFIX_HASH", "'sha1'"]),
    ],
)
def test_serve_refuses_a_bad_value_in_one_line_leaving_nothing_behind(
    tmpdir_short: str, busy_port: int, args: list[str], env: dict[str, str], named: list[str]
) -> None:
    shm_dir = os.path.join(tmpdir_short, "shm")
    os.mkdir(shm_dir)
    sock = os.path.join(tmpdir_short, "kvmem.sock")

    def fill(text: str) -> str:
        return text.replace("{busy}", str(busy_port)).replace("{dir}", tmpdir_short)

    run = kvmem("serve", "--socket", sock, "--shm-dir", shm_dir, *map(fill, args),
                env=clean_env(**{k: fill(v) for k, v in env.items()}))  # fmt: skip
    assert_refused(run, [fill(word) for word in named], sock, shm_dir)


def test_a_port_taken_after_the_checks_undoes_the_start(tmpdir_short: str) -> None:
    """--tcp and --metrics on one port: both are free when checked; gRPC takes it when it
    starts listening, so the metrics listener, started last (after the shm files), fails:
    the socket file, the shm files and the gRPC listener must all go."""
    shm_dir = os.path.join(tmpdir_short, "shm")
    os.mkdir(shm_dir)
    sock = os.path.join(tmpdir_short, "kvmem.sock")
    port = free_tcp_port()
    address = f"127.0.0.1:{port}"
    run = kvmem("serve", "--socket", sock, "--shm-dir", shm_dir, "--tcp", address, "--metrics", address)
    assert_refused(run, ["cannot start", f"--metrics {address}"], sock, shm_dir)
    assert port_is_free(port)


def test_a_metrics_port_taken_after_the_checks_undoes_the_start(tmpdir_short: str, busy_port: int) -> None:
    """The metrics port taken between the check and the bind (the check is switched off
    here): the shm files, created before, must go."""
    shm_dir = os.path.join(tmpdir_short, "shm")
    os.mkdir(shm_dir)
    sock = os.path.join(tmpdir_short, "kvmem.sock")
    code = (
        "import sys, kvmem.server.process.startup as startup\n"
        "startup._probe_listen = lambda *a, **k: None\n"
        "from kvmem.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    address = f"127.0.0.1:{busy_port}"
    run = subprocess.run(
        [sys.executable, "-c", code, "serve", "--socket", sock, "--shm-dir", shm_dir, "--metrics", address],
        capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert_refused(run, ["cannot start", f"--metrics {address}"], sock, shm_dir)


def test_a_bad_serve_env_value_breaks_neither_help_nor_the_client_commands(server: ServerProcess) -> None:
    """Each command reads the KVMEM_* variables of its own options, and only when it runs:
    a bad serve value breaks no help and no client command; a bad value of the command
    run stops it with one line naming the variable."""
    env = clean_env(KVMEM_PAGE_SIZE="16k", KVMEM_MEMORY="-5GiB", KVMEM_DEBUG="maybe", KVMEM_LOG_FORMAT="xml")
    bad_tcp = clean_env(KVMEM_TCP="nowhere")
    runs = {
        name: subprocess.Popen(
            [*CLI, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=bad_tcp if name.endswith("bad tcp") else env,
        )
        for name, args in (
            ("--help", ["--help"]),
            ("serve --help", ["serve", "--help"]),
            ("health --help", ["health", "--help"]),
            ("stats --help", ["stats", "--help"]),
            ("health", ["health", "--socket", server.socket_path]),
            ("stats", ["stats", "--socket", server.socket_path]),
            ("serve --help, bad tcp", ["serve", "--help"]),
            ("health, bad tcp", ["health"]),
            ("stats, bad tcp", ["stats"]),
        )
    }
    for name, p in runs.items():
        out, err = p.communicate(timeout=60)
        if name in ("health, bad tcp", "stats, bad tcp"):
            assert p.returncode == 2 and out == "", (name, out, err)
            assert err.count("\n") == 1 and "KVMEM_TCP (for --tcp)" in err and "'nowhere'" in err, (name, err)
            continue
        assert p.returncode == 0, (name, err)
        assert "KVMEM_PAGE_SIZE" not in err and "KVMEM_LOG_FORMAT" not in err, (name, err)


def test_log_format_json_writes_one_json_object_a_line(tmpdir_short: str) -> None:
    srv = start_server(tmpdir_short, "--log-format", "json", "--page-size", "4", "--num-pages", "65",
                       "--max-context", "64", env=clean_env(KVMEM_DEBUG="1"))  # fmt: skip
    assert srv.stop() == 0, srv.log()
    records = [json.loads(line) for line in srv.log().splitlines()]  # every line parses
    assert records and all({"ts", "level", "logger", "message"} <= set(r) for r in records), records
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", r["ts"]) for r in records)
    messages = [r["message"] for r in records]
    assert f"kvmem {VERSION} (python " in messages[0], messages
    assert any(m.startswith("serving socket=") for m in messages) and messages[-1] == "stopped", messages
    assert {r["level"] for r in records} <= {"INFO", "WARNING"} and records[0]["logger"] == "kvmem.server"


def test_json_log_records_carry_the_exception_on_one_line() -> None:
    import logging

    from kvmem.cli.logs import JsonFormatter

    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.LogRecord("kvmem.x", logging.ERROR, __file__, 1, "failed %s", ("here",), sys.exc_info())
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["message"]) == ("ERROR", "kvmem.x", "failed here")
    assert entry["exception"].startswith("Traceback") and "ValueError: bad\nvalue" in entry["exception"]


def test_a_value_that_starts_with_a_dash_is_a_value_not_an_option(tmpdir_short: str) -> None:
    """`--tcp --auth-token x`: the option after --tcp is still an option (--tcp has no
    value); `--socket -x`: a value."""
    run = kvmem("serve", "--tcp", "--auth-token", "x")
    assert run.returncode == 2 and "--tcp: expected one argument" in run.stderr, run.stderr
    run = kvmem("serve", "--devices", "-1")
    assert run.returncode == 2 and "--devices" in run.stderr and "'-1'" in run.stderr, run.stderr


def test_kv_events_zmq_without_pyzmq_is_refused_naming_the_extra(tmpdir_short: str) -> None:
    """Where pyzmq is not installed (hidden here), --kv-events-zmq stops the start with
    the pip command, before anything is created."""
    shm_dir = os.path.join(tmpdir_short, "shm")
    os.mkdir(shm_dir)
    sock = os.path.join(tmpdir_short, "kvmem.sock")
    code = "import sys\nsys.modules['zmq'] = None\nfrom kvmem.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    run = subprocess.run(
        [sys.executable, "-c", code, "serve", "--socket", sock, "--shm-dir", shm_dir, "--kv-events-zmq", "tcp://*:0"],
        capture_output=True, text=True, env=clean_env(), timeout=60,
    )  # fmt: skip
    assert_refused(run, ["--kv-events-zmq", "pyzmq", "pip install 'kvmem[events]'"], sock, shm_dir)


def test_serve_with_vllm_keys_and_a_seed_reports_the_recipe(tmpdir_short: str) -> None:
    """vLLM's recipe with its seed: Attach and Stats name the recipe, and the cache works."""
    srv = start_server(tmpdir_short, "--page-size", "4", "--num-pages", "65", "--max-context", "64",
                       "--prefix-hash", "vllm-sha256-cbor", "--prefix-hash-seed", "0",
                       env=clean_env(KVMEM_DEBUG="1"))  # fmt: skip
    try:
        with KVMemClient(srv.target, name="vllm-keys") as kv:
            assert (kv.prefix_cache.enabled, kv.prefix_cache.hash) == (True, "vllm-sha256-cbor")
            [a, b] = kv.open(["a", "b"]).tolist()
            kv.alloc([a], [8])
            assert kv.release([a], [list(range(8))]).num_pages_cached == 2
            assert kv.match(b, list(range(8))) == 8
        assert stats_of(srv).prefix_hash == "vllm-sha256-cbor"
        assert "hash=vllm-sha256-cbor" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
