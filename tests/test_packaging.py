"""The wheel: built from what the Dockerfile copies, it carries every package and module of
the source trees, pyproject's explicit ``packages`` list names every package, and the
installed wheel (not the editable checkout) runs ``kvmem simulate --help`` and ``kvmem
generate --help`` and imports every one of its modules.

The build is pip's, non-editable, as the Dockerfile's ``pip install /src`` does it, but
without build isolation when the virtualenv's setuptools meets ``[build-system]
requires`` (torch and grpcio-tools require setuptools, so .ci/run's virtualenv has it):
offline and about twice as fast. setuptools builds in the source tree, leaving ``build/``
and ``kvmem.egg-info`` there (and ``build/lib`` is never cleaned: a deleted module would
live on in later wheels), so the source is a temporary copy of what the Dockerfile's
``COPY ... /src/...`` lines copy, which also proves that they copy everything the build needs.

The installed wheel runs in ``python -I -S`` with ``sys.path`` set by hand to the install
directory and the virtualenv's site-packages (for torch, grpc, ...): without ``site`` the
editable install's ``__editable__*.pth`` finder is never installed, and every ``kvmem``
module imported must come from the install directory.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
# What must be in the wheel besides the modules: the stubs, the contract and the markers.
SHIPPED_SUFFIXES = {".py", ".pyi", ".proto"}
SHIPPED_NAMES = {"py.typed"}
JUNK = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
PIP_ENV = {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1", "PIP_NO_CACHE_DIR": "1"}


def _source_dirs(root: Path) -> Iterator[Path]:
    """Every folder under ``root``, ``root`` included, but bytecode caches."""
    yield root
    for where, folders, _ in os.walk(root):
        folders[:] = sorted(f for f in folders if f != "__pycache__" and not f.startswith("."))
        yield from (Path(where) / f for f in folders)


def expected_packages() -> dict[str, Path]:
    """Every package of the source trees that pyproject's ``package-dir`` maps (server/,
    client/, engine/, cli/, proto/kvmem), by import name: each folder with an
    ``__init__.py``, however deep."""
    packages: dict[str, Path] = {}
    for name, folder in PACKAGE_DIR.items():
        top = ROOT / folder
        for where in _source_dirs(top):
            if (where / "__init__.py").is_file():
                packages[".".join([name, *where.relative_to(top).parts])] = where
    return packages


def expected_files(shipped_only: bool = True) -> dict[str, Path]:
    """Every module, stub, .proto and ``py.typed`` of the source trees (every file, but
    bytecode, with ``shipped_only`` false), by its path in the wheel
    (``engine/simulate/run.py`` -> ``kvmem/engine/simulate/run.py``)."""
    files: dict[str, Path] = {}
    for name, folder in PACKAGE_DIR.items():
        top = ROOT / folder
        for where in _source_dirs(top):
            for path in sorted(where.iterdir()):
                shipped = path.suffix in SHIPPED_SUFFIXES or path.name in SHIPPED_NAMES
                if path.is_file() and path.suffix != ".pyc" and (shipped or not shipped_only):
                    files["/".join([*name.split("."), *path.relative_to(top).parts])] = path
    return files


def test_the_source_trees_are_mapped() -> None:
    """The applications and the contract all have their folder in ``package-dir``."""
    assert {"kvmem", "kvmem.v1", "kvmem.server", "kvmem.client", "kvmem.engine", "kvmem.cli"} <= set(PACKAGE_DIR)
    for name, folder in PACKAGE_DIR.items():
        assert (ROOT / folder / "__init__.py").is_file(), f"package-dir maps {name} to {folder}/, no package there"


def test_pyproject_lists_every_package() -> None:
    """setuptools builds exactly the explicit ``packages`` list: a subpackage missing from
    it is missing from the wheel (and the Docker image), while the editable install,
    which maps whole folders, imports it happily."""
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    found = expected_packages()
    missing = sorted(set(found) - listed)
    assert not missing, (
        "pyproject.toml's [tool.setuptools] packages does not list "
        + ", ".join(f"{name} ({found[name].relative_to(ROOT)}/)" for name in missing)
        + ": add them, or the wheel leaves them out"
    )
    stale = sorted(listed - set(found))
    assert not stale, (
        f"pyproject.toml's [tool.setuptools] packages lists {stale}, which have no folder with __init__.py"
    )


def _dockerfile_copies() -> list[tuple[list[str], str]]:
    """The build stage's ``COPY <sources> /src...`` lines: (sources, destination)."""
    copies = []
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        *sources, destination = [w for w in words[1:] if not w.startswith("--")]
        if destination == "/src" or destination.startswith("/src/"):
            copies.append((sources, destination))
    assert copies, "the Dockerfile has no COPY ... /src line: update this test's idea of how the image builds"
    return copies


def copy_as_the_dockerfile_does(into: Path) -> Path:
    """The Dockerfile's ``/src`` as a folder under ``into`` (Docker's COPY: a folder's
    contents go to the destination; files go into it when it ends with / or there are
    several sources), leaving out bytecode and egg-info."""
    src = into / "src"
    for sources, destination in _dockerfile_copies():
        target = into / destination.lstrip("/")
        for source in sources:
            path = ROOT / source
            assert source not in (".", "./") and path.exists(), f"Dockerfile COPY {source}: update this test"
            if path.is_dir():
                shutil.copytree(path, target, ignore=JUNK, dirs_exist_ok=True)
            elif destination.endswith("/") or len(sources) > 1:
                target.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target / path.name)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
    assert (src / "pyproject.toml").is_file(), "the Dockerfile does not copy pyproject.toml to /src"
    return src


def _build_isolation_needed() -> bool:
    """Whether the virtualenv lacks what ``[build-system] requires`` names (then pip must
    fetch it into an isolated build environment, from the index)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip's own copy
        from pip._vendor.packaging.requirements import Requirement

    for text in PYPROJECT["build-system"]["requires"]:
        requirement = Requirement(text)
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            return True
        if not requirement.specifier.contains(installed, prereleases=True):
            return True
    return False


def _pip(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        env={**os.environ, **PIP_ENV}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


@dataclass
class Built:
    wheel: Path
    site: Path  # the wheel installed with pip --target


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """The wheel, built from a copy of the Dockerfile's /src, and installed into a folder."""
    tmp = tmp_path_factory.mktemp("packaging")
    try:
        src = copy_as_the_dockerfile_does(tmp)
        isolation = ["--no-build-isolation"] if not _build_isolation_needed() else []
        _pip("wheel", "--no-deps", *isolation, "-w", str(tmp / "dist"), str(src))
        wheels = list((tmp / "dist").glob("kvmem-*.whl"))
        assert len(wheels) == 1, f"pip wheel made {wheels}"
        site = tmp / "site"
        _pip("install", "--no-deps", "--no-index", "--target", str(site), str(wheels[0]))
        yield Built(wheels[0], site)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_wheel_carries_every_package_and_module(built: Built) -> None:
    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        scripts = wheel.read(entry_points).decode()
    packages = expected_packages()
    missing = sorted(name for name in packages if "/".join(name.split(".")) + "/__init__.py" not in names)
    assert not missing, f"the wheel lacks the packages {missing} (is pyproject.toml's packages list complete?)"
    files = expected_files()
    missing = sorted(path for path in files if path not in names)
    assert not missing, f"the wheel lacks {missing} (not in a package, or package-data does not name them?)"
    shipped = {n for n in names if n.startswith("kvmem/")}
    unknown = sorted(shipped - set(expected_files(shipped_only=False)))
    assert not unknown, f"the wheel carries {unknown}, which the source trees do not have"
    assert "kvmem/v1/kvmem_pb2.py" in names and "kvmem/v1/kvmem_pb2_grpc.py" in names
    assert "kvmem/v1/kvmem_pb2.pyi" in names
    assert re.search(r"^kvmem\s*=\s*kvmem\.cli:main$", scripts, re.MULTILINE), scripts


# Run in ``python -I -S``: argv is the install folder, the result file, "strict" or
# "lenient", then the folders of the dependencies.
CHILD = r"""
import contextlib, importlib, io, json, os, sys, traceback

site_dir, result_path, mode, *deps = sys.argv[1:]
sys.path[:0] = [site_dir, *deps]
result = {
    "editable": [repr(f) for f in sys.meta_path if "editable" in getattr(f, "__module__", "")]
    + [m for m in sys.modules if "editable" in m],
}

import kvmem, kvmem.cli, kvmem.engine
from kvmem.cli import COMMANDS, build_parser, main

result["files"] = {m.__name__: m.__file__ for m in (kvmem, kvmem.engine, kvmem.cli)}
result["help"] = {}
for command in ("simulate", "generate"):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([command, "--help"])
        except SystemExit as exit_:
            code = exit_.code
    parser = build_parser(command)
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    options = [
        option
        for action in sub.choices[command]._actions
        if action.help != "==SUPPRESS=="
        for option in action.option_strings
    ]
    result["help"][command] = {
        "code": code, "out": out.getvalue(), "err": err.getvalue(), "options": options, "module": COMMANDS[command][0]
    }

result["imported"], result["skipped"], result["failed"] = [], {}, {}
top = os.path.join(site_dir, "kvmem")
for where, folders, names in os.walk(top):
    folders[:] = sorted(f for f in folders if f != "__pycache__")
    for name in sorted(names):
        if not name.endswith(".py") or name == "__main__.py":  # __main__ runs the command
            continue
        parts = os.path.relpath(os.path.join(where, name[:-3]), site_dir).split(os.sep)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if mode == "lenient" and e.name and e.name.partition(".")[0] != "kvmem":
                result["skipped"][module] = e.name
            else:
                result["failed"][module] = traceback.format_exc()
        except BaseException:
            result["failed"][module] = traceback.format_exc()
        else:
            result["imported"].append(module)

result["modules"] = {
    name: getattr(m, "__file__", None)
    for name, m in list(sys.modules.items())
    if name == "kvmem" or name.startswith("kvmem.")
}
with open(result_path, "w") as f:
    json.dump(result, f)
"""


def _extras_installed() -> bool:
    """Whether every optional dependency (the extras but ``test``) is installed: then every
    module must import; otherwise one that needs a missing package may be skipped."""
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        if extra == "test":
            continue
        for text in requirements:
            name = re.match(r"[A-Za-z0-9._-]+", text)
            assert name is not None, text
            try:
                importlib.metadata.distribution(name.group())
            except importlib.metadata.PackageNotFoundError:
                return False
    return True


def test_installed_wheel_runs_and_imports(built: Built, tmp_path: Path) -> None:
    deps = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    (tmp_path / "child.py").write_text(CHILD, encoding="utf-8")
    result_path = tmp_path / "result.json"
    mode = "strict" if _extras_installed() else "lenient"
    done = subprocess.run(
        [sys.executable, "-I", "-S", str(tmp_path / "child.py"), str(built.site), str(result_path), mode, *deps],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, f"the installed wheel's interpreter failed:\n{done.stdout}\n{done.stderr}"
    result = json.loads(result_path.read_text(encoding="utf-8"))
    site = built.site.resolve()

    assert not result["editable"], f"the editable install's finder is active: {result['editable']}"
    for name, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(site), f"{name} is {file}, not the installed wheel's"
    elsewhere = {
        name: file
        for name, file in result["modules"].items()
        if file is None or not Path(file).resolve().is_relative_to(site)
    }
    assert not elsewhere, f"kvmem modules imported from outside the installed wheel: {elsewhere}"

    for command, usage in result["help"].items():
        text = usage["out"]
        assert usage["code"] in (0, None), f"kvmem {command} --help exited {usage['code']}:\n{text}{usage['err']}"
        assert f"usage: kvmem {command}" in text, text
        options = set(usage["options"]) - {"-h", "--help"}
        assert len(options) >= 3, f"kvmem {command} registered only {options}: its add_parser did not run"
        absent = sorted(o for o in options if o not in text)
        assert not absent, f"kvmem {command} --help does not mention {absent}:\n{text}"

    assert not result["failed"], "modules of the installed wheel fail to import:\n" + "\n".join(
        f"--- {name}\n{trace}" for name, trace in result["failed"].items()
    )
    # The commands' modules, and every engine package, import (skipped: a missing extra).
    wanted = {name for name in expected_packages() if name.startswith("kvmem.engine")}
    wanted |= {usage["module"] for usage in result["help"].values()}
    unimported = sorted(wanted - set(result["imported"]))
    assert not unimported, f"not imported: {unimported}; skipped for missing packages: {result['skipped']}"
