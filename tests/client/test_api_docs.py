"""The client's API reference: docs/API.md is what docs/gen_api.py makes from the
docstrings now (CI fails when it is stale, as for the generated gRPC code), and it
documents every public name, the clients' generated methods included."""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "gen_api.py"
COMMITTED = ROOT / "docs" / "API.md"


def _gen_api() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvmem_docs_gen_api", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> str:
    text: str = _gen_api().render()
    return text


def test_api_reference_is_current(tmp_path: Path) -> None:
    """Regenerated into a temporary file by a fresh interpreter (another hash seed: the
    output must not depend on set order), it equals the committed docs/API.md."""
    out = tmp_path / "API.md"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--output", str(out)], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    fresh, committed = out.read_text(), COMMITTED.read_text()
    if fresh != committed:
        diff = difflib.unified_diff(committed.splitlines(), fresh.splitlines(), "docs/API.md", "generated", lineterm="")
        pytest.fail("docs/API.md is stale: run `.venv/bin/python docs/gen_api.py`\n" + "\n".join(list(diff)[:80]))


def test_check_tells_a_stale_file(tmp_path: Path, generated: str, capsys: pytest.CaptureFixture[str]) -> None:
    gen_api = _gen_api()
    current = tmp_path / "current.md"
    current.write_text(generated)
    assert gen_api.main(["--check", "--output", str(current)]) == 0
    stale = tmp_path / "stale.md"
    stale.write_text(generated.replace("Idempotent.", "Idempotent, once.", 1))
    assert gen_api.main(["--check", "--output", str(stale)]) == 1
    assert "gen_api.py" in capsys.readouterr().out
    assert gen_api.main(["--check", "--output", str(tmp_path / "missing.md")]) == 1


def test_every_public_name_is_documented(generated: str) -> None:
    import kvmem.client
    from kvmem.client import compat, memory

    headings = {line[4:] for line in generated.splitlines() if line.startswith("### ")}
    for name in [*kvmem.client.__all__, *compat.__all__, *memory.__all__]:
        assert name in headings, name
    assert "Regenerate: .venv/bin/python docs/gen_api.py" in generated


def test_client_methods_show_their_session_method(generated: str) -> None:
    """Each Operation of the clients: the Session method's docstring, its parameters
    less the session, what its Call returns; awaitable on the asyncio client."""
    from kvmem.client.session import Session
    from kvmem.client.surface import ClientBase, Operation

    operations = [name for name, value in vars(ClientBase).items() if isinstance(value, Operation)]
    assert {"open", "step", "alloc", "release", "detach"} <= set(operations)
    sections = generated.split("\n#### ")
    for name in operations:
        build = getattr(Session, name)
        first_line = inspect.cleandoc(build.__doc__).splitlines()[0]
        for client, prefix in (("KVMemClient", "def "), ("AsyncKVMemClient", "async def ")):
            (section,) = [s for s in sections if s.startswith(f"{client}.{name}\n")]
            assert f"{prefix}{name}(" in section and first_line in section, section
            assert "self" not in section.split("```")[1], section  # the session is not a parameter
            assert ("Awaitable" in section) == (client == "AsyncKVMemClient"), section
    (alloc,) = [s for s in sections if s.startswith("KVMemClient.alloc\n")]
    assert ") -> StepResult\n" in alloc  # Call[StepResult]: what the method returns


def test_errors_say_which_class_for_which_code_and_reason(generated: str) -> None:
    assert "- [`SessionLost`](#sessionlost): reason `UNKNOWN_SESSION`" in generated
    assert "- [`Unavailable`](#unavailable): gRPC `UNAVAILABLE`" in generated
    assert "| `NOT_READY` | `UNAVAILABLE` | [`Unavailable`](#unavailable) |" in generated


def test_no_addresses_or_local_paths(generated: str) -> None:
    assert " at 0x" not in generated
    assert str(ROOT) not in generated
    home = str(Path.home())
    assert len(home) < 2 or home not in generated
