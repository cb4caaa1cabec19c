"""The server without torch where it needs none: ``kvmem serve --device cpu`` (shm) and
``--device none`` run in a Python where importing torch fails, and answer the normal
(torch) client as they always do; ``--device cuda:N`` there refuses to start in one
line that names torch. Only the client side of these tests has torch.

The torch-less interpreter is the real one with a ``sitecustomize`` (found first on
``PYTHONPATH``) that puts a finder at the head of ``sys.meta_path`` refusing ``torch``
and every ``torch.*`` module as an uninstalled package would: any import of torch,
direct or through another module, and ``importlib.util.find_spec``, fail in that process.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest
import torch
from conftest import ServerProcess, start_server

from kvmem.client import KVMemClient

NO_TORCH = textwrap.dedent(
    """
    import sys


    class _NoTorch:
        '''Torch is not installed, as far as this process can tell.'''

        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _NoTorch())
    """
)
POOL = ["--page-size", "4", "--num-pages", "64", "--max-requests", "8", "--max-context", "64", "--layers", "2",
        "--kv-heads", "2", "--head-dim", "8"]  # fmt: skip


@pytest.fixture
def no_torch_env() -> Iterator[dict[str, str]]:
    """Environment variables under which a Python process cannot import torch."""
    d = tempfile.mkdtemp(prefix="kvmem-notorch-")
    pathlib.Path(d, "sitecustomize.py").write_text(NO_TORCH, encoding="utf-8")
    path = os.environ.get("PYTHONPATH")
    yield {"PYTHONPATH": d if not path else f"{d}{os.pathsep}{path}"}
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir() -> Iterator[str]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else "/tmp"
    d = tempfile.mkdtemp(prefix="kvmem-test-", dir=base)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})}
    )


def _check_log(server: ServerProcess) -> str:
    log = server.log()
    assert not re.search(r" (ERROR|CRITICAL) |Traceback|ModuleNotFoundError|ImportError", log), log
    return log


def _stop(server: ServerProcess) -> None:
    code = server.stop()
    assert code == 0, f"server exited {code} after SIGTERM:\n{server.log()}"


def _torch_libraries(pid: int) -> list[str]:
    """Shared objects of torch mapped into process ``pid`` (none if torch was never loaded)."""
    maps = pathlib.Path(f"/proc/{pid}/maps")
    if not maps.exists():
        pytest.skip("no /proc: cannot list a process's mappings")
    return sorted({line.split()[-1] for line in maps.read_text().splitlines() if "torch" in line})


# ------------------------------------------------------------------ imports


def test_the_blocker_blocks(no_torch_env: dict[str, str]) -> None:
    """The environment the other tests rely on: torch cannot be imported or found."""
    run = _python("import importlib.util\nimportlib.util.find_spec('torch')\n", no_torch_env)
    assert run.returncode != 0 and "No module named 'torch'" in run.stderr, run.stderr
    run = _python("import torch", no_torch_env)
    assert run.returncode != 0 and "No module named 'torch'" in run.stderr, run.stderr


def test_importing_the_server_loads_no_torch() -> None:
    """In a clean interpreter (torch installed), the server's modules and its command
    line load no torch; the cuda backend, named, does."""
    code = textwrap.dedent(
        """
        import sys
        import kvmem.server.process.app, kvmem.server.process.startup, kvmem.cli, kvmem.client.command
        import kvmem.server.memory, kvmem.server.memory.shm, kvmem.server.memory.geometry
        from kvmem.server.memory import ShmBackend, KVGeometry, PoolSpec

        for command in kvmem.cli.COMMANDS:
            kvmem.cli.build_parser(command)
        print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))
        from kvmem.server.memory import CudaBackend
        print('torch' in sys.modules)
        """
    )
    run = _python(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["[]", "True"], run.stdout


def test_shm_backend_without_torch(no_torch_env: dict[str, str], shm_dir: str) -> None:
    """The backend sizes every dtype from its table, allocates, hands out handles and a
    flat uint8 view of the KV bytes, and removes its files: no torch; ``kv()`` (the
    torch view) says it needs torch."""
    code = textwrap.dedent(
        f"""
        import os
        from kvmem.server.memory import DTYPES, KVGeometry, PoolSpec, ShmBackend

        for dtype in DTYPES:
            g = KVGeometry("mha", 2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
            with ShmBackend(PoolSpec(g, 16, 4, 16), directory={shm_dir!r}) as b:
                raw = b.kv_raw()
                assert raw.dtype.name == "uint8" and raw.size == os.path.getsize(b.kv_path) == b.pool.kv_bytes
                assert raw.size == 2 * 2 * 64 * 2 * 8 * g.itemsize and not raw.any()
                raw[-1] = 7  # writable, and the file's bytes
                with open(b.kv_path, "rb") as f:
                    assert f.read()[-1] == 7
                kv = b.handles()[0]
                assert (kv.dtype, kv.shape, kv.size_bytes) == (dtype, (2, 2, 64, 2, 8), raw.size)
                try:
                    b.kv()
                except ModuleNotFoundError as exc:
                    assert "torch" in str(exc)
                else:
                    raise AssertionError("kv() without torch")
            assert os.listdir({shm_dir!r}) == []
        print("ok")
        """
    )
    run = _python(code, no_torch_env)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


# ------------------------------------------------------------------ a real server


def test_shm_server_without_torch_serves_the_torch_client(
    no_torch_env: dict[str, str], shm_dir: str, tmpdir_short: str
) -> None:
    server = start_server(tmpdir_short, "--device", "cpu", "--shm-dir", shm_dir, *POOL, env=no_torch_env)
    try:
        assert _torch_libraries(server.proc.pid) == []
        with KVMemClient(server.target, name="writer") as kv, KVMemClient(server.target, name="reader") as other:
            assert kv.memory.backend == "shm"
            (slot,) = kv.open(["req"]).tolist()
            res = kv.step(alloc_slots=[slot], alloc_needs=[6])
            assert res.status.tolist() == [0] and res.kv_loc.numel() == 6
            assert kv.block_table[slot, :2].tolist() == res.new_pages.tolist()
            loc = res.kv_loc.long()
            values = torch.arange(6 * 2 * 8, dtype=torch.float32).reshape(6, 2, 8).to(torch.bfloat16)
            k, v = kv.kv_cache()[1]
            assert k.dtype == torch.bfloat16 and k.shape == (64 * 4, 2, 8)
            k[loc] = values
            v[loc] = -values
            # Another session's own mapping of the same files sees the writes.
            k2, v2 = other.kv_cache()[1]
            assert torch.equal(k2[loc], values) and torch.equal(v2[loc], -values)
            assert not k2[~torch.isin(torch.arange(k2.shape[0]), loc)].any()
            assert torch.equal(other.block_table, kv.block_table)
            kv.step(release_slots=[slot])
        assert _torch_libraries(server.proc.pid) == []
    finally:
        _stop(server)
    log = _check_log(server)
    assert "shm backend" in log
    assert os.listdir(shm_dir) == []


def test_memoryless_server_without_torch(no_torch_env: dict[str, str], tmpdir_short: str) -> None:
    server = start_server(tmpdir_short, "--device", "none", *POOL, env=no_torch_env)
    try:
        with KVMemClient(server.target, name="scheduler") as kv:
            assert kv.memory_handles == []
            (slot,) = kv.open(["req"]).tolist()
            res = kv.step(alloc_slots=[slot], alloc_needs=[9])
            assert res.status.tolist() == [0] and res.kv_loc.numel() == 9 and res.new_pages.numel() == 3
        assert _torch_libraries(server.proc.pid) == []
    finally:
        _stop(server)
    _check_log(server)


@pytest.mark.parametrize("device", [["--device", "cuda:0"], ["--devices", "0,1"]], ids=["device", "devices"])
def test_cuda_without_torch_refuses_in_one_line(no_torch_env: dict[str, str], tmpdir_short: str, device) -> None:
    socket_path = os.path.join(tmpdir_short, "kvmem.sock")
    run = subprocess.run(
        [sys.executable, "-m", "kvmem.cli", "serve", "--socket", socket_path, *device, *POOL],
        capture_output=True, text=True, timeout=120, env={**os.environ, **no_torch_env},
    )  # fmt: skip
    assert run.returncode == 2, run.stderr
    # One line says what is wrong; the rest (the start-up line with the versions) is INFO.
    lines = [line for line in run.stderr.splitlines() if " INFO " not in line]
    assert len(lines) == 1, run.stderr
    option = " ".join(device)
    assert re.search(rf" ERROR .*cannot start: {option} needs torch .*No module named 'torch'", lines[0]), lines[0]
    assert "Traceback" not in run.stderr and not os.path.exists(socket_path)


def test_sigint_stops_a_torch_free_server(no_torch_env: dict[str, str], shm_dir: str, tmpdir_short: str) -> None:
    """SIGINT too: a clean exit without torch's teardown to lean on."""
    server = start_server(tmpdir_short, "--shm-dir", shm_dir, *POOL, env=no_torch_env)
    code = server.stop(signal.SIGINT)
    assert code == 0, server.log()
    _check_log(server)
    assert os.listdir(shm_dir) == []
