"""The version of kvmem, as ``kvmem --version``, Stats and the start-up log report it.

:func:`version` reads the installed package's metadata; a source tree run without
installing (``python -m kvmem.cli`` with ``PYTHONPATH`` set up by hand) has none,
and then the ``version`` line of the ``pyproject.toml`` beside the package is read. Both
are read once per process. Nothing here imports grpc, numpy or torch: the versions of
those come from their metadata too, so ``kvmem --version`` stays instant.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import platform
import sys
from pathlib import Path
from typing import Any

DISTRIBUTION = "kvmem"
UNKNOWN = "0+unknown"  # neither metadata nor a pyproject.toml: still a valid PEP 440 version


@functools.cache
def version() -> str:
    """kvmem's version: the installed metadata's, else the source tree's pyproject.toml's."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return _pyproject_version(Path(__file__).resolve().parent.parent / "pyproject.toml")


def _pyproject_version(path: Path) -> str:
    """The ``version`` of the ``[project]`` table of ``path``; :data:`UNKNOWN` without one."""
    import tomllib

    try:
        with path.open("rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return UNKNOWN
    found = project.get("version") if project.get("name") == DISTRIBUTION else None
    return found if isinstance(found, str) and found.strip() else UNKNOWN


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def runtime() -> str:
    """The versions kvmem runs with, in one line: ``python 3.11.9, grpcio 1.85.3, numpy
    2.4.6, torch 2.13.0`` (torch only where it is installed: the shm backend needs none)."""
    parts = [f"python {platform.python_version()}"]
    for name in ("grpcio", "numpy", "protobuf", "torch"):
        found = _installed(name)
        if found is not None:
            parts.append(f"{name} {found}")
    return ", ".join(parts)


class VersionAction(argparse.Action):
    """``--version``: print ``kvmem <version>`` and the runtime line, exit 0. Unlike
    argparse's own, it looks the versions up only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print kvmem's version (and python's, grpcio's, numpy's) and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        sys.stdout.write(f"kvmem {version()}\n{runtime()}\n")
        parser.exit(0)
