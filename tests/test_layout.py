"""The house's rules: which application may import which, checked in the source (every
import a module names, lazy ones inside functions included) and in fresh interpreters
where the forbidden packages cannot be imported at all; and the size rule that keeps
modules readable.

The applications and the one direction their dependencies point:

* ``kvmem.server`` (the sidecar) imports neither the client nor the engine;
* ``kvmem.client`` (the library schedulers import) imports nothing of the server or the
  engine;
* ``kvmem.engine`` (schedulers, ``kvmem simulate``) imports the client, never the
  server (it starts one as a process: ``python -m kvmem.cli serve``);
* ``kvmem.cli`` (the ``kvmem`` dispatcher and the option machinery the subcommands
  share) names none of them; it imports the chosen subcommand's module by name;
* ``kvmem.v1`` (the generated wire contract) is shared by all.
"""

from __future__ import annotations

import ast
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"kvmem.server": "server", "kvmem.client": "client", "kvmem.engine": "engine", "kvmem.cli": "cli"}
MAY_IMPORT = {
    "kvmem.server": ("kvmem.server", "kvmem.cli", "kvmem.v1"),
    "kvmem.client": ("kvmem.client", "kvmem.cli", "kvmem.v1"),
    "kvmem.engine": ("kvmem.engine", "kvmem.client", "kvmem.cli", "kvmem.v1"),
    "kvmem.cli": ("kvmem.cli",),
}


def _module_name(path: pathlib.Path) -> str:
    """``server/edge/service.py`` -> ``kvmem.server.edge.service`` (a package: its name)."""
    folder = path.relative_to(ROOT).parts[0]
    package = next(name for name, where in PACKAGES.items() if where == folder)
    rest = list(path.relative_to(ROOT / folder).with_suffix("").parts)
    if rest[-1] == "__init__":
        rest.pop()
    return ".".join([package, *rest])


def _imports(path: pathlib.Path) -> set[str]:
    """Every kvmem module a file imports by name, anywhere in it (relative imports
    resolved against the file's package)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                names.add(node.module)
    return {n for n in names if n == "kvmem" or n.startswith("kvmem.")}


def _modules_under(folder: str) -> list[pathlib.Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _hand_written() -> list[pathlib.Path]:
    return [p for folder in PACKAGES.values() for p in _modules_under(folder)]


@pytest.mark.parametrize("path", _hand_written(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_application_imports_only_what_its_layer_may(path: pathlib.Path) -> None:
    package = next(name for name, where in PACKAGES.items() if where == path.relative_to(ROOT).parts[0])
    allowed = MAY_IMPORT[package]
    bad = sorted(n for n in _imports(path) if n != "kvmem" and not n.startswith(allowed))
    assert not bad, f"{path.relative_to(ROOT)} ({package}) imports {bad}; it may import only {allowed}"


@pytest.mark.parametrize("path", _modules_under("server/core"), ids=lambda p: p.name)
def test_the_core_names_no_grpc_torch_proto_or_outer_layer(path: pathlib.Path) -> None:
    banned = ("grpc", "torch", "google", "kvmem.v1", "kvmem.client", "kvmem.server.memory", "kvmem.server.sessions",
              "kvmem.server.edge", "kvmem.server.process", "kvmem.server.observe", "kvmem.cli")  # fmt: skip
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    bad = sorted(n for n in names if n.startswith(banned))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_dispatcher_routes_each_command_to_its_application() -> None:
    from kvmem.cli import COMMANDS

    owners = {name: module.split(".")[1] for name, (module, _) in COMMANDS.items()}
    assert owners == {
        "serve": "server",
        "health": "client",
        "stats": "client",
        "simulate": "engine",
        "generate": "engine",
    }


# A fresh interpreter in which the named packages cannot be imported at all (a meta path
# finder refuses them before any other finder looks), so a lazy import that the source
# rule above missed would fail here.
BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{{name}} is blocked in this test")
        return None
sys.meta_path.insert(0, Block())
"""


def _python(blocked: tuple[str, ...], code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    source = BLOCKER.format(blocked=blocked) + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=timeout)


def _importable(folder: str) -> list[str]:
    names = [_module_name(p) for p in _modules_under(folder)]
    return [n for n in names if not n.endswith(".__main__") and n != "kvmem.server.memory.cuda"]


@pytest.mark.parametrize(
    ("folder", "blocked", "command"),
    [
        ("server", ("kvmem.client", "kvmem.engine"), ["serve", "--page-size", "8"]),
        ("client", ("kvmem.server", "kvmem.engine"), ["stats", "--json"]),
        ("engine", ("kvmem.server",), ["simulate", "--workers", "2"]),
    ],
    ids=["server-without-client-and-engine", "client-without-server-and-engine", "engine-without-server"],
)
def test_every_module_of_an_application_imports_without_what_it_may_not(
    folder: str, blocked: tuple[str, ...], command: list[str]
) -> None:
    """Every module of the application imports, and its subcommand's options parse, in an
    interpreter where the packages it may not import cannot be imported at all."""
    run = _python(
        blocked,
        f"""
        import importlib
        for name in {_importable(folder)!r}:
            importlib.import_module(name)
        from kvmem.cli import build_parser
        print(build_parser({command[0]!r}).parse_args({command!r}).command)
        """,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == command[0], run.stdout


def test_kvmem_help_loads_no_application() -> None:
    run = _python(
        (),
        """
        import contextlib, io, sys
        from kvmem.cli import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["--help"])
        print(sorted(m for m in sys.modules if m.startswith(("kvmem.server", "kvmem.client", "kvmem.engine"))))
        """,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "[]", run.stdout


def test_kvmem_serve_runs_without_the_client_or_the_engine(tmp_path: pathlib.Path) -> None:
    """The sidecar needs no client code: a real ``kvmem serve`` in an interpreter where
    kvmem.client and kvmem.engine cannot be imported comes up, answers a health check and
    stops cleanly on SIGTERM."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    sock = tmp_path / "kvmem.sock"
    code = BLOCKER.format(blocked=("kvmem.client", "kvmem.engine")) + (
        "import sys\nfrom kvmem.cli import main\n"
        f"sys.exit(main(['serve', '--socket', {str(sock)!r}, '--num-pages', '65', '--max-context', '512',\n"
        f"    '--shm-dir', {str(tmp_path)!r}]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMEM_")}
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, env=env)
    try:
        status = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            if sock.exists():
                with grpc.insecure_channel(f"unix:{sock}") as channel:
                    try:
                        answer = health_pb2_grpc.HealthStub(channel).Check(
                            health_pb2.HealthCheckRequest(service="kvmem.v1.KVMemory"), timeout=5
                        )
                        status = answer.status
                    except grpc.RpcError:
                        status = None
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            time.sleep(0.05)
        assert status == health_pb2.HealthCheckResponse.SERVING, proc.stderr.read() if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert "is blocked in this test" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_readme_test_command_is_what_ci_runs() -> None:
    """The README's second command and .ci/run's last line are the same command (the test
    command installs the store tests' Debian packages first: .ci/system-packages)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    starts = ("python3 -m venv .venv", "bash .ci/system-packages && python3 -m venv .venv")
    commands = [line for line in readme.splitlines() if line.startswith(starts)]
    assert len(commands) >= 2, commands
    assert commands[1] == ci, f"README: {commands[1]}\n.ci/run: {ci}"


def test_the_readme_is_a_users_page_and_its_links_resolve() -> None:
    """At most 200 lines (the rest is in docs/); every relative link of the README and
    the docs names a file of the repository (no reference points outside it)."""
    import re

    readme = ROOT / "README.md"
    assert len(readme.read_text(encoding="utf-8").splitlines()) <= 200
    broken = []
    for page in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_no_hand_written_module_over_800_lines() -> None:
    """The limit flags a module that has become several things; a file that is one thing stays whole."""
    long = []
    for path in _hand_written():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > 800:
            long.append(f"{path.relative_to(ROOT)}: {lines}")
    assert not long, long


# The engine's products: the simulator (engine/simulate/), the real-model engine
# (engine/generate/), and what both use beside them (the scheduler, the request, the
# backends, the model seam, the hand-off policy, the process runtime).
ENGINE_SHARED = [p for p in _modules_under("engine") if p.parent == ROOT / "engine"]
DEPRECATED_ALIASES = {"attention.py", "hf_model.py", "models.py"}  # kvmem.engine.X -> kvmem.engine.generate.X


def _third_party(path: pathlib.Path) -> set[str]:
    """The top-level names of every absolute import a file makes, lazy ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("path", _modules_under("engine/simulate"), ids=lambda p: p.name)
def test_the_simulator_imports_no_transformers_and_nothing_of_the_real_model_engine(path: pathlib.Path) -> None:
    bad = sorted(n for n in _imports(path) if n.startswith("kvmem.engine.generate"))
    assert not bad and "transformers" not in _third_party(path), f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _modules_under("engine/generate"), ids=lambda p: p.name)
def test_the_real_model_engine_imports_nothing_of_the_simulator(path: pathlib.Path) -> None:
    bad = sorted(n for n in _imports(path) if n.startswith("kvmem.engine.simulate"))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", ENGINE_SHARED, ids=lambda p: p.name)
def test_what_both_engines_use_imports_neither_product(path: pathlib.Path) -> None:
    if path.name in DEPRECATED_ALIASES:  # the one-release aliases of moved modules
        assert _imports(path) <= {"kvmem.engine._moved"}
        return
    bad = sorted(n for n in _imports(path) if n.startswith(("kvmem.engine.simulate", "kvmem.engine.generate")))
    assert not bad and "transformers" not in _third_party(path), f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize(
    ("folder", "blocked"),
    [("engine/simulate", ("transformers", "kvmem.engine.generate")), ("engine/generate", ("kvmem.engine.simulate",))],
    ids=["simulate-without-transformers-and-generate", "generate-without-simulate"],
)
def test_each_engine_product_imports_without_the_other(folder: str, blocked: tuple[str, ...]) -> None:
    run = _python(
        blocked,
        f"""
        import importlib
        for name in {_importable(folder)!r}:
            importlib.import_module(name)
        print("ok")
        """,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_the_generate_command_and_its_router_load_no_torch() -> None:
    """``kvmem generate``'s parent (its options, its run module) and the hand-off router
    import in an interpreter where torch and transformers cannot be imported at all."""
    run = _python(
        ("torch", "transformers"),
        """
        import multiprocessing
        import kvmem.engine.generate.command
        from kvmem.cli import build_parser
        from kvmem.engine.generate.moves import Router
        args = build_parser("generate").parse_args(["generate", "--workers", "2"])
        router = Router(multiprocessing.get_context("spawn"), ["prefill", "decode"])
        print(args.command, sorted(router.inboxes))
        """,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "generate [1]", run.stdout


def test_the_deprecated_engine_paths_are_the_moved_modules_with_a_warning() -> None:
    import importlib
    import warnings

    for name in sorted(DEPRECATED_ALIASES):
        stem = name.removesuffix(".py")
        sys.modules.pop(f"kvmem.engine.{stem}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            alias = importlib.import_module(f"kvmem.engine.{stem}")
        assert alias is importlib.import_module(f"kvmem.engine.generate.{stem}")  # a re-export, not a copy
        said = [str(w.message) for w in caught if w.category is DeprecationWarning]
        assert any(f"kvmem.engine.generate.{stem}" in message for message in said), said
