"""Who may attach and map: ``--socket-mode`` and ``--group``. An engine running as
another user of the server's chosen group attaches and maps the KV memory; without the
group it cannot even connect. Real processes, the client's user switched with
setuid/setgid (so these run as root, as CI does; elsewhere they skip), and the option
checks that need no other user.

The other user may be unable to read the interpreter and the packages (a checkout in a
private directory, a pyenv under ``/root``), so the client imports everything it uses as
root, then switches, then refuses any further import: a late import would fail the test
for the environment's sake, not kvmem's. It reports ``READY`` once switched, and only
then is its success or its refusal judged. Each user-switching test runs twice: with the
interpreter where it is installed, and reached through a fresh mode-0700 directory."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest
from conftest import short_tmpdir, start_server

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="switching the client's user needs root")
GROUP = 54321
OTHER_USER = 54322

CLIENT = r"""
import os, sys
# Everything the client uses is imported while still root; grpc imports its channel
# module lazily, inside insecure_channel, so it is named here.
import grpc._channel  # noqa: F401
import kvmem.client.errors, kvmem.client.memory, kvmem.client.step, kvmem.client.sync  # noqa: F401
from kvmem.client import KVMemClient

late = []


class NoImportAfterSwitch:
    def find_spec(self, name, path=None, target=None):
        late.append(name)
        raise ImportError(f"{name} imported after the user switch")


target, uid, groups, probe = sys.argv[1], int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")], sys.argv[4]
os.setgroups(groups)
os.setgid(groups[0])
os.setuid(uid)
sys.meta_path.insert(0, NoImportAfterSwitch())
print("READY", os.getuid(), os.getgid(), flush=True)
try:
    if probe == "late-import":
        import colorsys  # noqa: F401  (the guard's own check: this must be refused)
    with KVMemClient(target, name="other-user", timeout=5, wait_for_ready=False) as kv:
        [slot] = kv.open(["r"]).tolist()
        r = kv.alloc([slot], [4])
        k, v = kv.kv_cache()[0]
        k[r.kv_loc_of(0).long()] = 1
        print("OK", int(kv.block_table[slot][0]), flush=True)
except Exception as exc:
    print("FAILED", type(exc).__name__, exc, flush=True)
    sys.exit(1)
finally:
    print("LATE", ",".join(late), flush=True)
"""


class Outcome:
    """What the other user's client said: that it switched (``READY``, imports done), its
    ``OK`` or ``FAILED`` line, and the modules it tried to import after the switch."""

    def __init__(self, done: subprocess.CompletedProcess[str]) -> None:
        self.returncode = done.returncode
        self.transcript = f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
        said = {line.split(" ", 1)[0]: line for line in done.stdout.splitlines()}
        assert said.get("READY", "").startswith(f"READY {OTHER_USER} "), "no user switch:\n" + self.transcript
        assert "LATE" in said, self.transcript
        self.late = [name for name in said["LATE"][len("LATE ") :].split(",") if name]
        self.result = said.get("OK") or said.get("FAILED") or ""

    def succeeded(self) -> bool:
        return self.returncode == 0 and self.result.startswith("OK ") and not self.late

    def refused(self) -> bool:
        """Refused by the modes kvmem set: the socket (or the shared memory) said so."""
        return self.returncode == 1 and self.result.startswith("FAILED ") and "Permission denied" in self.result


@pytest.fixture(params=["installed", "private-dir"])
def python(request: pytest.FixtureRequest) -> Iterator[str]:
    """The interpreter the other user's client runs: ``sys.executable`` as installed, or
    the same one reached through a fresh mode-0700 directory (a link to ``sys.prefix``),
    so that its packages, grpc's among them, are out of the other user's reach, as in a
    checkout cloned under a private directory."""
    if request.param == "installed":
        yield sys.executable
        return
    where = os.path.relpath(sys.executable, sys.prefix)
    assert not where.startswith(".."), f"{sys.executable} lies outside sys.prefix {sys.prefix}"
    private = tempfile.mkdtemp(prefix="kvmem-private-")
    link = os.path.join(private, "env")
    try:
        assert stat.S_IMODE(os.stat(private).st_mode) == 0o700
        os.symlink(sys.prefix, link)
        python = os.path.join(link, where)
        grpc_file = subprocess.run(
            [python, "-c", "import grpc; print(grpc.__file__)"], capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        assert grpc_file.startswith(private + os.sep), f"grpc is not reached through {private}: {grpc_file}"
        yield python
    finally:
        if os.path.islink(link):
            os.unlink(link)
        os.rmdir(private)


def run_as(python: str, uid: int, groups: list[int], target: str, probe: str = "-") -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    args = [python, "-c", CLIENT, target, str(uid), ",".join(map(str, groups)), probe]
    return Outcome(subprocess.run(args, env=env, capture_output=True, text=True, timeout=60))


def open_dir() -> str:
    directory = short_tmpdir()
    os.chmod(directory, 0o755)  # a directory of the test's own: the files' modes decide
    return directory


@ROOT_ONLY
def test_a_member_of_the_group_attaches_and_maps(python: str) -> None:
    directory = open_dir()
    srv = start_server(directory, "--shm-dir", directory, "--socket-mode", "0660", "--group", str(GROUP))
    try:
        st = os.stat(srv.socket_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP
        for name in os.listdir(directory):
            if name.endswith((".kv", ".bt")):
                st = os.stat(os.path.join(directory, name))
                assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP, name
        member = run_as(python, OTHER_USER, [GROUP], srv.socket_path)
        assert member.succeeded(), member.transcript
        stranger = run_as(python, OTHER_USER, [OTHER_USER], srv.socket_path)
        assert stranger.refused() and not stranger.late, stranger.transcript
    finally:
        assert srv.stop() == 0, srv.log()


@ROOT_ONLY
def test_by_default_only_the_servers_user(python: str) -> None:
    directory = open_dir()
    srv = start_server(directory, "--shm-dir", directory)
    try:
        assert stat.S_IMODE(os.stat(srv.socket_path).st_mode) == 0o600
        for name in os.listdir(directory):
            if name.endswith((".kv", ".bt")):
                assert stat.S_IMODE(os.stat(os.path.join(directory, name)).st_mode) == 0o600, name
        refused = run_as(python, OTHER_USER, [GROUP], srv.socket_path)
        assert refused.refused() and not refused.late, refused.transcript
    finally:
        assert srv.stop() == 0, srv.log()


@ROOT_ONLY
def test_an_import_after_the_user_switch_is_refused_and_reported() -> None:
    """The guard the tests above rely on: a client that imports after switching fails on
    that import, and names it, before it reaches the server."""
    done = run_as(sys.executable, OTHER_USER, [GROUP], "unix:/nonexistent/kvmem.sock", probe="late-import")
    assert done.returncode == 1 and done.late == ["colorsys"], done.transcript
    assert "colorsys imported after the user switch" in done.result, done.transcript


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--socket-mode", "0666"], "--socket-mode must be 0600 or 0660"),
        (["--socket-mode", "0640"], "--socket-mode must be 0600 or 0660"),
        (["--group", "0"], "use 0660"),
        (["--socket-mode", "0660", "--group", "no-such-group-kvmem"], "no such group"),
        (["--socket-mode", "rw"], "octal file mode"),
    ],
)
def test_bad_access_options_are_refused_in_one_line(args: list[str], words: str) -> None:
    directory = short_tmpdir()
    cmd = [sys.executable, "-m", "kvmem.cli", "serve", "--socket", os.path.join(directory, "s.sock"), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and words in done.stderr, done.stderr
    assert not os.path.exists(os.path.join(directory, "s.sock"))
