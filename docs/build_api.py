#!/usr/bin/env python3
"""Build the API reference, HTML made by pdoc from the docstrings and signatures:

    .venv/bin/python docs/build_api.py            # into build/api/ (open build/api/index.html)
    .venv/bin/python docs/build_api.py -o DIR     # elsewhere

It documents ``kvmem.client`` (every name of its ``__all__``: the two clients, their
results, the errors, the mapped memory, the calls without a session),
``kvmem.client.base`` (what both clients share: the constructor's arguments, the
session's attributes, the lease and the memory views, which the clients' pages link
to), ``kvmem.client.memory``, the drop-in ``kvmem.client.compat`` and ``kvmem.engine``
(not its deprecated aliases of moved modules).
Any warning (a signature pdoc cannot read, a module that fails to import, ...) is
printed and fails the build (exit 1); tests/client/test_api_docs.py runs it in CI and
checks what it wrote.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

MODULES = ("kvmem.client", "kvmem.client.base", "kvmem.client.memory", "kvmem.client.compat", "kvmem.engine")
ALIASES = ("kvmem.engine.attention", "kvmem.engine.hf_model", "kvmem.engine.models")  # deprecated, for one release
MODULES += tuple(f"!{name}" for name in (*ALIASES, "kvmem.engine._moved"))
DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "build" / "api"


def build(output: Path, modules: tuple[str, ...] = MODULES) -> list[str]:
    """Write the reference of ``modules`` (import names or file paths) into
    ``output``; the warnings raised meanwhile, as pdoc's command line prints them."""
    import pdoc  # the test extra's; imported here so --help works without it
    import pdoc.render

    pdoc.render.configure(docformat="restructuredtext", show_source=True, search=True)
    with warnings.catch_warnings():  # pdoc walks every submodule: the aliases' warning is theirs to give users
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in ALIASES:
            importlib.import_module(name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pdoc.pdoc(*modules, output_directory=output)
    return [f"Warn: {w.message} ({w.filename}:{w.lineno})" for w in caught]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUTPUT, help="the folder (default: build/api)")
    parser.add_argument("modules", nargs="*", default=list(MODULES), help="what to document (default: %(default)s)")
    args = parser.parse_args(argv)
    problems = build(args.output, tuple(args.modules))
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"the API reference has {len(problems)} warning(s): fix them", file=sys.stderr)
        return 1
    print(f"wrote {args.output}/index.html", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
