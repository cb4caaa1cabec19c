"""The layers stay layers: what each package may import, checked in a fresh interpreter
(what a module really pulls in) and in the source (what it names), and the size rule
that keeps modules readable."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a file imports by name (relative imports resolved one level)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def _modules_under(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("path", _modules_under("server/core"), ids=lambda p: p.name)
def test_the_core_names_no_grpc_torch_proto_or_outer_layer(path: pathlib.Path) -> None:
    banned = ("grpc", "torch", "google", "kvmem.v1", "kvmem.client", "kvmem.server.memory", "kvmem.server.sessions",
              "kvmem.server.service", "kvmem.server.app")  # fmt: skip
    bad = sorted(n for n in _imports(path) if n.startswith(banned))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _modules_under("client"), ids=lambda p: p.name)
def test_the_client_imports_nothing_from_the_server(path: pathlib.Path) -> None:
    bad = sorted(n for n in _imports(path) if n.startswith("kvmem.server"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_importing_the_core_loads_no_grpc_torch_or_proto() -> None:
    code = (
        "import sys, kvmem.server.core\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'torch', 'google') "
        "or m.startswith('kvmem.v1'))\n"
        "print(loaded)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout


def test_no_hand_written_module_over_450_lines() -> None:
    long = []
    for folder in ("server", "client"):
        for path in _modules_under(folder):
            lines = len(path.read_text(encoding="utf-8").splitlines())
            if lines > 450:
                long.append(f"{path.relative_to(ROOT)}: {lines}")
    assert not long, long
