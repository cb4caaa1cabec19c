"""The generated gRPC code is current with the .proto (CI fails when it is stale)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_has_stubs_and_package_imports() -> None:
    gen = ROOT / "proto" / "kvmem" / "v1"
    for name in ("kvmem_pb2.py", "kvmem_pb2.pyi", "kvmem_pb2_grpc.py"):
        assert (gen / name).is_file(), name
    # Chosen package path: the generated modules import each other as kvmem.v1.*.
    assert "from kvmem.v1 import kvmem_pb2" in (gen / "kvmem_pb2_grpc.py").read_text()
