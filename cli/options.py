"""The ``kvmem`` command line's option machinery: every option can also come from its
``KVMEM_*`` variable, read only for the command that runs (:func:`fill_from_env`), and
the value parsers that check each option (one line naming it when a value is bad).
Shared by the subcommands (``serve``: :mod:`kvmem.server.process.command`; ``health``
and ``stats``: :mod:`kvmem.client.command`; ``simulate``: :mod:`kvmem.engine.command`);
nothing here imports the server, the client or the engine."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, NoReturn

DEFAULT_SOCKET = "/tmp/kvmem.sock"


ENV_SPEC = "kvmem_env"  # attribute of an option's Action: (variable, built-in default, parse)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _env_name(flag: str) -> str:
    return "KVMEM_" + flag.lstrip("-").upper().replace("-", "_")


def switch(raw: str) -> bool:
    """An environment switch: 1/true/yes/on or 0/false/no/off."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"must be 1, true, yes, on, 0, false, no or off, got {raw!r}")


def integer(lowest: int, unit: str = "", why: str = "") -> Callable[[str], int]:
    """An integer option's parse: refuses anything but an integer >= ``lowest``."""
    noun = f"number of {unit}" if unit else "integer"
    what = f"a positive {noun}" if lowest == 1 else f"{'an' if noun[0] == 'i' else 'a'} {noun} >= {lowest}"

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < lowest:
            raise argparse.ArgumentTypeError(f"must be {what}{why}, got {raw!r}")
        return value

    parse.__name__ = "int"
    return parse


def positive_float(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {raw!r}")
    return value


def one_of(*names: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {raw!r}")
        return raw.lower()

    parse.__name__ = "choice"
    return parse


def octal(raw: str) -> int:
    """A file mode in octal (``0660``, ``660``, ``0o660``)."""
    try:
        return int(raw.removeprefix("0o"), 8)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an octal file mode such as 0660, got {raw!r}") from None


def address(raw: str) -> str:
    """HOST:PORT, the rule the server applies again when it listens (``--tcp``), checked
    here without importing the server (and torch) to parse a client's flag."""
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"must be HOST:PORT (port 0-65535), got {raw!r}")
    return raw


def device(raw: str) -> str:
    kind, colon, index = raw.partition(":")
    if raw in ("cpu", "none", "cuda") or (kind == "cuda" and colon and index.isdigit()):
        return raw
    raise argparse.ArgumentTypeError(f"must be cpu, none, cuda or cuda:N, got {raw!r}")


def option(p: argparse._ActionsContainer, flag: str, default: Any, help: str, type: Callable[[str], Any] = str) -> None:
    """An option that can also come from its KVMEM_* variable. The variable is read after
    parsing, and only for the command that was run (:func:`fill_from_env`), so a bad
    value of a serve option never breaks ``kvmem health`` or ``--help``."""
    env = _env_name(flag)
    shown = "none" if default is None else default
    action = p.add_argument(flag, type=type, default=argparse.SUPPRESS, help=f"{help} (default: {shown}; env {env})")
    setattr(action, ENV_SPEC, (env, default, type))


def command_parser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            sub: argparse.ArgumentParser = action.choices[command]
            return sub
    return None


def fill_from_env(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each option of the command run that the command line did not give: from its
    KVMEM_* variable when set (checked as the option is: a bad value ends the run with
    one line naming the variable and the value), else its default."""
    sub = command_parser(parser, args.command)
    if sub is None:
        return
    for action in sub._actions:
        spec = getattr(action, ENV_SPEC, None)
        if spec is None or hasattr(args, action.dest):
            continue
        env, value, parse = spec
        raw = os.environ.get(env, "")
        if raw != "":
            try:
                value = parse(raw)
            except argparse.ArgumentTypeError as exc:
                sub.error(f"{env} (for {action.option_strings[0]}): {exc}")
            except ValueError:
                name = getattr(parse, "__name__", "value")
                sub.error(f"{env} (for {action.option_strings[0]}): invalid {name} value: {raw!r}")
        setattr(args, action.dest, value)


def dash_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--memory -5GiB`` -> ``--memory=-5GiB``: argparse takes a value that starts with
    '-' (other than a plain negative number) for an unknown option and answers "expected
    one argument"; joined, the value reaches the option's own check. A following word
    that is an option of the command (or an abbreviation of one) is left alone."""
    command = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    sub = None if command is None else command_parser(parser, argv[command])
    if command is None or sub is None:
        return argv
    known = [o for a in sub._actions for o in a.option_strings]
    takes_value = [o for a in sub._actions if a.option_strings and a.nargs is None for o in a.option_strings]

    def is_option(word: str) -> bool:
        name = word.split("=", 1)[0]
        return word == "--" or name in known or (name.startswith("--") and any(o.startswith(name) for o in known))

    out = argv[: command + 1]
    rest = iter(argv[command + 1 :])
    for word in rest:
        matches = [o for o in takes_value if o == word] or [o for o in takes_value if o.startswith(word)]
        if word.startswith("--") and len(word) > 2 and len(matches) == 1:
            value = next(rest, None)
            if value is not None and value.startswith("-") and not is_option(value):
                out.append(f"{word}={value}")
                continue
            out.append(word)
            if value is not None:
                out.append(value)
            continue
        out.append(word)
        if word == "--":
            out.extend(rest)
    return out
