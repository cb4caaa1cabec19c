"""Who may attach and map: ``--socket-mode`` and ``--group``. An engine running as
another user of the server's chosen group attaches and maps the KV memory; without the
group it cannot even connect. Real processes, the client's user switched with
setuid/setgid (so these run as root, as CI does; elsewhere they skip), and the option
checks that need no other user."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from conftest import short_tmpdir, start_server

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="switching the client's user needs root")
GROUP = 54321
OTHER_USER = 54322

CLIENT = r"""
import os, sys
import kvmem.client.errors, kvmem.client.memory, kvmem.client.step, kvmem.client.sync  # noqa: F401
from kvmem.client import KVMemClient
# The interpreter lives under a directory only root may read: import first, then become
# the other user (the switch the test is about), then attach and map.
uid, groups = int(sys.argv[2]), [int(g) for g in sys.argv[3].split(",")]
os.setgroups(groups)
os.setgid(groups[0])
os.setuid(uid)
with KVMemClient(sys.argv[1], name="other-user", timeout=5, wait_for_ready=False) as kv:
    [slot] = kv.open(["r"]).tolist()
    r = kv.alloc([slot], [4])
    k, v = kv.kv_cache()[0]
    k[r.kv_loc_of(0).long()] = 1
    print("OK", int(kv.block_table[slot][0]))
"""


def run_as(uid: int, groups: list[int], target: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    args = [sys.executable, "-c", CLIENT, target, str(uid), ",".join(map(str, groups))]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)


def open_dir() -> str:
    directory = short_tmpdir()
    os.chmod(directory, 0o755)  # the files' own modes decide, not the directory's
    return directory


@ROOT_ONLY
def test_a_member_of_the_group_attaches_and_maps() -> None:
    directory = open_dir()
    srv = start_server(directory, "--shm-dir", directory, "--socket-mode", "0660", "--group", str(GROUP))
    try:
        st = os.stat(srv.socket_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP
        for name in os.listdir(directory):
            if name.endswith((".kv", ".bt")):
                st = os.stat(os.path.join(directory, name))
                assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP, name
        done = run_as(OTHER_USER, [GROUP], srv.socket_path)
        assert done.returncode == 0 and done.stdout.startswith("OK"), done.stderr[-2000:]
        refused = run_as(OTHER_USER, [OTHER_USER], srv.socket_path)
        assert refused.returncode != 0 and "Permission denied" in refused.stderr + refused.stdout
    finally:
        assert srv.stop() == 0, srv.log()


@ROOT_ONLY
def test_by_default_only_the_servers_user() -> None:
    directory = open_dir()
    srv = start_server(directory, "--shm-dir", directory)
    try:
        assert stat.S_IMODE(os.stat(srv.socket_path).st_mode) == 0o600
        refused = run_as(OTHER_USER, [GROUP], srv.socket_path)
        assert refused.returncode != 0
    finally:
        assert srv.stop() == 0, srv.log()


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
