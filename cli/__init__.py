"""The ``kvmem`` command: one small dispatcher over the subcommands of the three
applications, each imported only when it runs (so ``kvmem --help`` and ``kvmem health``
load no server, and ``kvmem serve`` loads no client or engine).

=========  ====================================  =================================
command    module (``add_parser`` and ``run``)   what it is
=========  ====================================  =================================
serve      :mod:`kvmem.server.process.command`   the sidecar
health     :mod:`kvmem.client.command`           a probe (Docker HEALTHCHECK)
stats      :mod:`kvmem.client.command`           pool and per-session usage
simulate   :mod:`kvmem.engine.simulate.command`  schedulers against a server
generate   :mod:`kvmem.engine.generate.command`  a real model on kvmem
=========  ====================================  =================================

The option machinery the subcommands share (``KVMEM_*`` variables, one-line errors) is
:mod:`kvmem.cli.options`; this package imports none of the server, the client or the
engine but the chosen subcommand's module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

from kvmem.cli.logs import configure as configure_logging
from kvmem.cli.options import Parser, dash_values, fill_from_env
from kvmem.cli.version import VersionAction

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvmem.server.process.command", "run the server (until SIGTERM/SIGINT)"),
    "health": ("kvmem.client.command", "check a server's health (exit 0 when serving; for a Docker HEALTHCHECK)"),
    "stats": ("kvmem.client.command", "print pool and per-session usage"),
    "simulate": (
        "kvmem.engine.simulate.command",
        "run scheduler workers against a server and show what kvmem does (a live view, a report)",
    ),
    "generate": (
        "kvmem.engine.generate.command",
        "generate text with a real model on kvmem from several engine processes, checked against transformers",
    ),
}


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand the command line names: its first word that is not an option (the
    top level's options, --help and --version, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvmem`` parser. Only ``command``'s module is imported and registers its full
    options; the others are listed by name and help (``kvmem --help``), and an unknown
    command gets argparse's one-line error naming the choices."""
    parser = Parser(
        prog="kvmem",
        description="kvmem: a KV-cache memory manager for LLM inference. One server per GPU node owns the "
        "KV page pool and the block tables; scheduler workers attach over gRPC.",
        epilog="Run 'kvmem COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        if name == command:
            importlib.import_module(module).add_parser(sub, name)
        else:
            sub.add_parser(name, help=text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line, fill options from ``KVMEM_*``, configure the log, run the
    subcommand; its return value is the exit status."""
    words = list(sys.argv[1:] if argv is None else argv)
    command = _command_of(words)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(dash_values(parser, words))
    fill_from_env(parser, args)
    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    module: Any = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args))
    except BrokenPipeError:  # `kvmem stats | head`: the reader left; not an error of ours
        sys.stderr.close()
        return 0
