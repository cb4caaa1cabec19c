#!/usr/bin/env python3
"""Generate docs/API.md, the API reference of the client (``kvmem.client``), from its
docstrings and signatures (``inspect``; stdlib only). Usage:

    .venv/bin/python docs/gen_api.py            # write docs/API.md
    .venv/bin/python docs/gen_api.py --check    # exit 1 if docs/API.md is stale

Documented: every name of ``kvmem.client.__all__``, and the other names the modules that
define them export in their own ``__all__`` (e.g. ``kvmem.client.compat``'s result
types). A class shows its constructor and every public method, property and attribute of
its own and of its kvmem base classes; a client method generated from a ``Session``
method (an ``Operation``) shows that method's signature, less the session, and its
docstring. The errors get their hierarchy: which class for which gRPC code and reason.
The output is deterministic: no memory address, no path of this machine.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import enum
import importlib
import importlib.resources
import inspect
import re
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUTPUT = ROOT / "docs" / "API.md"
PACKAGE = "kvmem.client"
COMMAND = ".venv/bin/python docs/gen_api.py"

# Modules in reading order (a module not listed follows, sorted by name), with a title.
MODULES = {
    "kvmem.client.sync": "The blocking client",
    "kvmem.client.aio": "The asyncio client",
    "kvmem.client.step": "A step's result",
    "kvmem.client.memory": "The mapped KV memory",
    "kvmem.client.admin": "Calls without a session",
    "kvmem.client.events": "The prefix cache's event stream",
    "kvmem.client.errors": "Errors",
    "kvmem.client.channel": "Channels and TLS",
    "kvmem.client.compat": "The reference allocator's interface (drop-in)",
}
# The proto enum each client enum is built from: its values' comments document the members.
PROTO_ENUMS = {"AllocStatus": "AllocStatus", "Reason": "ErrorReason"}
# Dunder methods that give an object a protocol worth saying.
PROTOCOLS = {
    "__enter__": "`with`",
    "__aenter__": "`async with`",
    "__iter__": "iteration",
    "__aiter__": "`async for`",
    "__len__": "`len()`",
    "__getitem__": "indexing (`[...]`)",
    "__bool__": "`bool()`",
    "__int__": "`int()`",
    "__index__": "`operator.index()`",
    "__eq__": "`==`",
    "__torch_function__": "torch functions (`__torch_function__`)",
}
WIDTH = 100  # a signature longer than this is written one parameter per line


# ------------------------------------------------------------------ what is documented


class Entry:
    """One documented name, its defining module, and whether ``kvmem.client`` exports
    it (else only its module does: ``kvmem.client.compat.PendingInt``)."""

    def __init__(self, name: str, module: str, obj: Any, top_level: bool) -> None:
        self.name = name
        self.module = module
        self.obj = obj
        self.top_level = top_level

    @property
    def heading(self) -> str:
        return self.name

    @property
    def import_line(self) -> str:
        return f"from {PACKAGE if self.top_level else self.module} import {self.name}"


def collect() -> list[Entry]:
    """Every documented name, with the module that defines it."""
    package = importlib.import_module(PACKAGE)
    where: dict[str, str] = {}
    for name in package.__all__:
        obj = getattr(package, name)  # resolves the lazy name
        where[name] = _home(obj, name)
    entries = [Entry(name, where[name], getattr(package, name), True) for name in sorted(package.__all__)]
    for module_name in sorted(set(where.values())):
        module = importlib.import_module(module_name)
        for name in sorted(getattr(module, "__all__", ())):
            if name in where:
                if where[name] != module_name:
                    raise SystemExit(f"{name} is exported by {module_name} and {where[name]}")
                continue
            where[name] = module_name
            entries.append(Entry(name, module_name, getattr(module, name), False))
    return entries


def _home(obj: Any, name: str) -> str:
    """The module that defines ``obj`` (for an alias or an enum made by a call: the
    module whose global it is)."""
    module = getattr(obj, "__module__", None)
    if isinstance(module, str) and module.startswith(PACKAGE + ".") and getattr(sys.modules[module], name, None) is obj:
        return module
    holders = sorted(
        m for m, module in sys.modules.items() if m.startswith(PACKAGE + ".") and getattr(module, name, None) is obj
    )
    assigned = re.compile(rf"^{re.escape(name)}\s*(?::[^=\n]*)?=", re.M)
    for module_name in holders:  # the module that assigns it, not one that imports it
        if assigned.search(inspect.getsource(sys.modules[module_name])):
            return module_name
    if holders:
        return holders[0]
    raise SystemExit(f"cannot tell which module of {PACKAGE} defines {name}")


# ------------------------------------------------------------------ text


ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`]+)`")


class Writer:
    """The page being written, and what it links to."""

    def __init__(self, entries: list[Entry]) -> None:
        self.lines: list[str] = []
        self.anchors: dict[str, str] = {}  # documented name (short and dotted) -> anchor
        self.used_anchors: set[str] = set()
        self.aliases: dict[str, Any] = {}  # type aliases seen in signatures
        self.member_anchors: set[str] = set()  # anchors of the documented classes' members
        self.context = ""  # the class being documented: its members' bare names link
        self.classes = {e.name: e.obj for e in entries if inspect.isclass(e.obj)}
        for e in entries:
            self.anchors[e.name] = anchor(e.heading)
            self.anchors[f"{e.module}.{e.name}"] = anchor(e.heading)

    def add(self, *lines: str) -> None:
        self.lines.extend(lines)

    def heading(self, level: int, text: str) -> None:
        a = anchor(text)
        if a in self.used_anchors:
            raise SystemExit(f"two headings make the anchor #{a}")
        self.used_anchors.add(a)
        self.add(f"{'#' * level} {text}", "")

    def link(self, name: str, shown: str | None = None) -> str:
        shown = shown or name
        target = self.anchors.get(name)
        return f"[`{shown}`](#{target})" if target else f"`{shown}`"

    def roles(self, text: str) -> str:
        """Sphinx cross-references as code spans, linked when the page documents them."""

        def one(m: re.Match[str]) -> str:
            short, target = m.group(1), m.group(2)
            shown = target.split(".")[-1] if short else target
            if target in self.anchors:
                return self.link(target, shown)
            if "." not in target and self.context and anchor(f"{self.context}.{target}") in self.member_anchors:
                return f"[`{shown}`](#{anchor(f'{self.context}.{target}')})"
            if "." in target and target.rsplit(".", 1)[0] in self.anchors:  # a member of a documented class
                owner, member = target.rsplit(".", 1)
                a = anchor(f"{owner.split('.')[-1]}.{member}")
                if a in self.member_anchors:
                    return f"[`{shown}`](#{a})"
            return f"`{shown}`"

        return ROLE.sub(one, text)

    def doc(self, text: str | None, missing: str = "*No docstring.*") -> None:
        self.add(*markdown(text, self.roles) if text else [missing], "")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def markdown(doc: str, roles: Callable[[str], str]) -> list[str]:
    """A docstring as Markdown: dedented; doctest blocks and literal blocks (after
    ``::``, or indented after a blank line) fenced; cross-references as code spans."""
    lines = inspect.cleandoc(doc).splitlines()
    out: list[str] = []
    i = 0
    literal_next = False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i])
                i += 1
            out.extend(["```python", *textwrap.dedent("\n".join(block)).splitlines(), "```"])
            continue
        starts_block = (
            line.startswith("    ") and (not out or not out[-1].strip()) and (literal_next or not _in_list(out))
        )
        if starts_block:
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            out.extend(["```python", *textwrap.dedent("\n".join(block)).splitlines(), "```"])
            if i < len(lines):
                out.append("")
            literal_next = False
            continue
        if line.rstrip().endswith("::"):
            literal_next = True
            line = line.rstrip()[:-1]
            if line.endswith(" :"):
                line = line[:-2] + ":"
        elif line.strip():
            literal_next = False
        out.append(roles(line))
        i += 1
    return out


def _in_list(out: list[str]) -> bool:
    """Whether the paragraph before the blank line is a list item (then an indented
    line continues it, it is no code block)."""
    for line in reversed(out[:-1] if out and not out[-1].strip() else out):
        if not line.strip():
            return False
        if re.match(r"\s*([*\-+]|\d+\.)\s", line):
            return True
    return False


# ------------------------------------------------------------------ signatures


def value_repr(value: Any) -> str:
    """A default value as written: its repr, or its type's name for a repr that names
    a memory address."""
    text = repr(value)
    if " at 0x" in text:
        return type(value).__qualname__
    return text


def type_text(annotation: Any) -> str:
    """An annotation as written in the source (postponed annotations are strings), or a
    runtime type shortly."""
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type) and annotation.__module__ == "builtins":
        return annotation.__qualname__
    text = inspect.formatannotation(annotation)
    text = re.sub(r"\bkvmem\.v1\.kvmem_pb2\.", "kvmem_pb2.", text)
    return re.sub(r"\bkvmem\.client\.[a-z_]+\.", "", text)


def _note_aliases(w: Writer, annotation: str, namespace: dict[str, Any]) -> None:
    """Record the type aliases (``IntsLike``...) an annotation names."""
    for word in re.findall(r"[A-Za-z_][A-Za-z_0-9]*", annotation):
        value = namespace.get(word)
        if value is not None and not isinstance(value, type) and typing.get_origin(value) is not None:
            w.aliases.setdefault(word, value)


def signature_text(
    w: Writer,
    name: str,
    sig: inspect.Signature,
    namespace: dict[str, Any],
    *,
    drop_first: bool = False,
    prefix: str = "",
    returns: str | None = None,
) -> str:
    """``prefix name(params) -> returns`` on one line, or one parameter per line when long."""
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    parts: list[str] = []
    kinds = inspect.Parameter
    star_done = False
    for j, p in enumerate(params):
        if p.kind is kinds.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        if p.kind is kinds.VAR_POSITIONAL:
            star_done = True
        text = {kinds.VAR_POSITIONAL: "*", kinds.VAR_KEYWORD: "**"}.get(p.kind, "") + p.name
        if p.annotation is not inspect.Parameter.empty:
            ann = type_text(p.annotation)
            _note_aliases(w, ann, namespace)
            text += f": {ann}"
            if p.default is not inspect.Parameter.empty:
                text += f" = {value_repr(p.default)}"
        elif p.default is not inspect.Parameter.empty:
            text += f"={value_repr(p.default)}"
        parts.append(text)
        nxt = params[j + 1] if j + 1 < len(params) else None
        if p.kind is kinds.POSITIONAL_ONLY and (nxt is None or nxt.kind is not kinds.POSITIONAL_ONLY):
            parts.append("/")
    if returns is None and sig.return_annotation is not inspect.Signature.empty:
        returns = type_text(sig.return_annotation)
    if returns:
        _note_aliases(w, returns, namespace)
    tail = f" -> {returns}" if returns else ""
    one_line = f"{prefix}{name}({', '.join(parts)}){tail}"
    if len(one_line) <= WIDTH or not parts:
        return one_line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{prefix}{name}(\n{body}){tail}"


def code(text: str) -> list[str]:
    return ["```python", *text.splitlines(), "```", ""]


# ------------------------------------------------------------------ classes


def kvmem_mro(cls: type) -> list[type]:
    """The class and its bases that are kvmem's (not object, Exception, Generic...)."""
    return [c for c in cls.__mro__ if c.__module__.startswith("kvmem.")]


def own_mro(w: Writer, cls: type) -> list[type]:
    """``kvmem_mro`` up to the first base the page documents itself (its members are
    documented there)."""
    classes = []
    for c in kvmem_mro(cls):
        if c is not cls and c.__name__ in w.anchors:
            break
        classes.append(c)
    return classes


def documented_base(w: Writer, cls: type) -> type | None:
    return next((c for c in kvmem_mro(cls)[1:] if c.__name__ in w.anchors), None)


def is_operation(value: Any) -> bool:
    from kvmem.client.surface import Operation

    return isinstance(value, Operation)


def operation_build(op: Any) -> Callable[..., Any]:
    """The ``Session`` method an Operation calls (its method wraps it)."""
    build: Callable[..., Any] = op._method.__wrapped__
    return build


def call_result(annotation: Any) -> str | None:
    """``Call[T]`` (a build function's return) as ``T``: what the client method returns."""
    text = type_text(annotation) if annotation is not inspect.Signature.empty else ""
    m = re.fullmatch(r"Call\[(.*)\]", text)
    return m.group(1) if m else (text or None)


class Member:
    def __init__(self, name: str, kind: str, signature: str, doc: str | None, owner: type) -> None:
        self.name = name
        self.kind = kind  # "method" or "attribute"
        self.signature = signature
        self.doc = doc
        self.owner = owner


def members(w: Writer, cls: type) -> list[Member]:
    """The public methods, properties and attributes of ``cls`` and its kvmem bases
    (the nearest definition of each name)."""
    awaiting = inspect.iscoroutinefunction(getattr(cls, "_invoke", None))
    seen: set[str] = set()
    found: list[Member] = []
    for owner in own_mro(w, cls):
        for name, raw in owner.__dict__.items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(cls, enum.EnumMeta) and name in cls.__members__:
                continue
            m = _member(w, cls, owner, name, raw, awaiting)
            if m is not None:
                found.append(m)
    return sorted(found, key=lambda m: m.name)


def _member(w: Writer, cls: type, owner: type, name: str, raw: Any, awaiting: bool) -> Member | None:
    module_ns = vars(sys.modules[owner.__module__])
    if is_operation(raw):
        build = operation_build(raw)
        sig = inspect.signature(build)
        returns = call_result(sig.return_annotation)
        text = signature_text(
            w, name, sig, build.__globals__, drop_first=True, prefix="async def " if awaiting else "def ",
            returns=returns,
        )  # fmt: skip
        return Member(name, "awaitable" if awaiting else "method", text, raw.__doc__, owner)
    if isinstance(raw, (staticmethod, classmethod)):
        func = raw.__func__
        prefix = "async def " if inspect.iscoroutinefunction(func) else "def "
        prefix = ("@classmethod\n" if isinstance(raw, classmethod) else "@staticmethod\n") + prefix
        sig = inspect.signature(func)
        text = signature_text(w, name, sig, func.__globals__, drop_first=isinstance(raw, classmethod), prefix=prefix)
        return Member(name, "method", text, func.__doc__, owner)
    if inspect.isfunction(raw):
        prefix = "async def " if inspect.iscoroutinefunction(raw) else "def "
        sig = inspect.signature(raw)
        return Member(name, "method", signature_text(w, name, sig, raw.__globals__, drop_first=True, prefix=prefix),
                      raw.__doc__, owner)  # fmt: skip
    if isinstance(raw, property):
        ann = inspect.signature(raw.fget).return_annotation if raw.fget else inspect.Signature.empty
        text = name
        if ann is not inspect.Signature.empty:
            text += f": {type_text(ann)}"
            _note_aliases(w, type_text(ann), raw.fget.__globals__ if raw.fget else module_ns)
        text += "  # property" if raw.fset else "  # read-only property"
        return Member(name, "attribute", text, raw.__doc__, owner)
    if hasattr(type(raw), "__get__") and not callable(raw):
        text = name
        ann = _descriptor_type(raw)
        if ann:
            text += f": {ann}"
        text += "  # read-only attribute" if _read_only(raw) else "  # attribute"
        return Member(name, "attribute", text, type(raw).__doc__ if raw.__doc__ is type(raw).__doc__ else raw.__doc__,
                      owner)  # fmt: skip
    if callable(raw):
        return None
    ann = inspect.get_annotations(owner).get(name)
    text = name + (f": {type_text(ann)}" if ann is not None else "") + f" = {value_repr(raw)}"
    return Member(name, "attribute", text + "  # class attribute", None, owner)


def _descriptor_type(raw: Any) -> str | None:
    """The type a descriptor yields: its generic argument (``SessionField[str]``), else
    its ``__get__``'s return annotation less the descriptor's own class."""
    orig = getattr(raw, "__orig_class__", None)
    if orig is not None:
        args = typing.get_args(orig)
        if args:
            return type_text(args[0])
    try:
        ann = inspect.signature(type(raw).__get__).return_annotation
    except (TypeError, ValueError):
        return None
    if not isinstance(ann, str):
        return None
    own = type(raw).__name__
    parts = [p.strip() for p in ann.split("|") if not p.strip().startswith(own)]
    return " | ".join(parts) or None


def _read_only(raw: Any) -> bool:
    setter = getattr(type(raw), "__set__", None)
    if setter is None:
        return True
    try:
        source = inspect.getsource(setter)
    except (OSError, TypeError):
        return False
    return "raise AttributeError" in source


def instance_attributes(w: Writer, cls: type, known: set[str]) -> list[str]:
    """The public attributes the constructors of ``cls`` and its kvmem bases set
    (``self.name = ...``), as ``name: type`` where annotated; sorted."""
    found: dict[str, str] = {}
    for owner in own_mro(w, cls):
        init = owner.__dict__.get("__init__")
        if not inspect.isfunction(init):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            targets: list[tuple[ast.expr, ast.expr | None]] = []
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    targets.extend((e, None) for e in (t.elts if isinstance(t, ast.Tuple) else [t]))
            elif isinstance(node, ast.AnnAssign):
                targets.append((node.target, node.annotation))
            for target, annotation in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id == "self"
                    and not target.attr.startswith("_")
                    and target.attr not in known
                ):
                    text = target.attr + (f": {ast.unparse(annotation)}" if annotation is not None else "")
                    if target.attr not in found or annotation is not None:
                        found[target.attr] = text
    return [found[k] for k in sorted(found)]


def protocols(cls: type) -> list[str]:
    names = {name for owner in kvmem_mro(cls) for name in owner.__dict__}
    return [text for dunder, text in PROTOCOLS.items() if dunder in names]


def constructor(w: Writer, cls: type) -> str | None:
    for owner in kvmem_mro(cls):
        init = owner.__dict__.get("__init__")
        if inspect.isfunction(init):
            sig = inspect.signature(init).replace(return_annotation=inspect.Signature.empty)
            return signature_text(w, cls.__name__, sig, init.__globals__, drop_first=True)
    return None


def base_text(w: Writer, base: type) -> str:
    if base.__module__ == "builtins":
        return f"`{base.__qualname__}`"
    if base.__module__.startswith(PACKAGE) and base.__name__ in w.anchors:
        return w.link(base.__name__)
    return f"`{base.__module__}.{base.__qualname__}`"


# ------------------------------------------------------------------ proto comments


def proto_comments() -> dict[str, dict[str, str]]:
    """Per enum of kvmem.v1's .proto: value name -> its comment (the lines before it
    and the one after it on its line)."""
    text = (importlib.resources.files("kvmem.v1") / "kvmem.proto").read_text()
    enums: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"enum\s+(\w+)\s*\{(.*?)\}", text, re.S):
        values: dict[str, str] = {}
        before: list[str] = []
        for line in m.group(2).splitlines():
            s = line.strip()
            if s.startswith("//"):
                before.append(s[2:].strip())
                continue
            v = re.match(r"(\w+)\s*=\s*\d+\s*;\s*(?://\s*(.*))?$", s)
            if v:
                values[v.group(1)] = " ".join([*before, v.group(2) or ""]).strip()
            before = []
        enums[m.group(1)] = values
    return enums


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


# ------------------------------------------------------------------ errors


def errors_overview(w: Writer) -> None:
    """The hierarchy, and which class a failed call raises for which gRPC code and reason."""
    import grpc

    from kvmem.client import errors

    by_code: dict[Any, type] = errors._BY_CODE
    by_reason: dict[Any, type] = errors._BY_REASON
    classes = _error_classes(errors)  # and those of other modules the page documents (TLSError, if exported)
    classes += sorted(
        (c for c in w.classes.values() if issubclass(c, errors.KVMemError) and c not in classes),
        key=lambda c: c.__name__,
    )
    w.heading(3, "Which class for which failure")
    w.add(
        "A failed call raises the class of its kvmem reason (the `google.rpc.ErrorInfo` the server sends) when",
        "the reason has one, else the class of its gRPC status code, else `KVMemError` itself. Every class is a",
        "`KVMemError`: `code`, `reason`, `raw_reason`, `message`, `metadata` (see below). The blocking and the",
        "asyncio client raise the same ones.",
        "",
    )
    said: dict[type, list[str]] = {c: [] for c in classes}
    for reason, cls in sorted(by_reason.items(), key=lambda kv: kv[0].value):
        said[cls].append(f"reason `{reason.value}`")
    for code, cls in sorted(by_code.items(), key=lambda kv: kv[0].name):
        said[cls].append(f"gRPC `{code.name}`")
    others = sorted(c.name for c in grpc.StatusCode if c not in by_code and c is not grpc.StatusCode.OK)
    said[errors.KVMemError].append("any other code (" + ", ".join(f"`{c}`" for c in others) + ")")

    def tree(cls: type, depth: int) -> None:
        w.add(f"{'  ' * depth}- {w.link(cls.__name__)}: {'; '.join(said[cls]) or 'raised by the client itself'}")
        for sub in sorted((c for c in classes if cls in c.__bases__), key=lambda c: c.__name__):
            tree(sub, depth + 1)

    tree(errors.KVMemError, 0)
    w.add("")


def _error_classes(errors: types.ModuleType) -> list[type]:
    return [
        v
        for _, v in sorted(vars(errors).items())
        if isinstance(v, type) and issubclass(v, errors.KVMemError) and v.__module__ == errors.__name__
    ]


def error_order(errors: types.ModuleType, names: Iterable[str]) -> list[str]:
    """The error classes depth first (subclasses sorted), then the other names sorted."""
    classes = _error_classes(errors)
    order: list[str] = []

    def walk(cls: type) -> None:
        order.append(cls.__name__)
        for sub in sorted((c for c in classes if cls in c.__bases__), key=lambda c: c.__name__):
            walk(sub)

    walk(errors.KVMemError)
    names = set(names)
    return sorted(names - set(order)) + [n for n in order if n in names]


def reason_rows(w: Writer, comments: dict[str, str]) -> list[str]:
    """The table of Reason: each value, the gRPC code the server sends it with, the
    class the client raises, and the proto's comment."""
    import grpc

    from kvmem.client import errors
    from kvmem.server.errors import Reason as ServerReason

    kinds = {r.name: r.kind.name for r in ServerReason}
    rows = ["| Reason | gRPC code | Raises | Meaning (the proto's comment) |", "|---|---|---|---|"]
    for reason in errors.Reason:
        code_name = kinds.get(reason.value, "")
        code = getattr(grpc.StatusCode, code_name, None) if code_name else None
        cls = errors._BY_REASON.get(reason) or errors._BY_CODE.get(code, errors.KVMemError)
        raised = w.link(cls.__name__) if code_name else "(never sent)"
        meaning = comments.get(f"{_snake(PROTO_ENUMS['Reason'])}_{reason.value}", "").replace("|", "\\|")
        rows.append(f"| `{reason.value}` | {f'`{code_name}`' if code_name else ''} | {raised} | {meaning} |")
    return [*rows, ""]


# ------------------------------------------------------------------ the page


def render() -> str:
    entries = collect()
    package = importlib.import_module(PACKAGE)
    w = Writer(entries)
    comments = proto_comments()
    by_module: dict[str, list[Entry]] = {}
    for e in entries:
        by_module.setdefault(e.module, []).append(e)
    modules = [m for m in MODULES if m in by_module] + sorted(m for m in by_module if m not in MODULES)

    # The members' anchors, known before any text links to them.
    for e in entries:
        if inspect.isclass(e.obj):
            for m in members(w, e.obj):
                w.member_anchors.add(anchor(f"{e.name}.{m.name}"))
    w.aliases.clear()

    order: dict[str, list[Entry]] = {}
    for module_name in modules:
        module_entries = by_module[module_name]
        if module_name == "kvmem.client.errors":
            names = error_order(importlib.import_module(module_name), (e.name for e in module_entries))
            order[module_name] = sorted(module_entries, key=lambda e: names.index(e.name))
        else:  # kvmem.client's names first
            order[module_name] = sorted(module_entries, key=lambda e: (not e.top_level, e.name))

    body = Writer(entries)
    body.member_anchors = w.member_anchors
    for module_name in modules:
        module = importlib.import_module(module_name)
        body.heading(2, section_title(module_name))
        body.doc(module.__doc__, missing="")
        if module_name == "kvmem.client.errors":
            errors_overview(body)
        for entry in order[module_name]:
            document(body, entry, comments)

    aliases = body.aliases
    w.add(
        "# The client API (`kvmem.client`)",
        "",
        f"<!-- Generated by docs/gen_api.py from the client's docstrings: do not edit. Regenerate: {COMMAND} -->",
        "",
        "Generated by [`docs/gen_api.py`](gen_api.py) from the docstrings and signatures of `kvmem.client`",
        "(`inspect`); do not edit it by hand. After changing a public docstring or signature, regenerate it with",
        "",
        "```bash",
        COMMAND,
        "```",
        "",
        f"`tests/client/test_api_docs.py` fails while it is stale (`{COMMAND} --check`). It documents every name of",
        "`kvmem.client.__all__` and the other names their modules export in their own `__all__`. The methods of",
        "`KVMemClient` and `AsyncKVMemClient` are made from `kvmem.client.session.Session`'s (`Operation`s):",
        "shown with that method's signature less the session and its docstring; `async def` marks the asyncio",
        "client's, which return awaitables.",
        "",
    )
    w.heading(2, f"Overview (`{PACKAGE}`)")
    w.doc(package.__doc__)
    w.heading(2, "Contents")
    w.add(f"- [Overview (`{PACKAGE}`)](#{anchor(f'Overview (`{PACKAGE}`)')})")
    for module_name in modules:
        title = section_title(module_name)
        w.add(f"- [{title}](#{anchor(title)})")
        for e in order[module_name]:
            w.add(f"  - {w.link(e.name)}")
    if aliases:
        w.add("- [Type aliases in signatures](#type-aliases-in-signatures)")
    w.add("")
    w.add(*body.lines)
    if aliases:
        w.heading(2, "Type aliases in signatures")
        for name in sorted(aliases):
            home = _home(aliases[name], name)
            w.add(f"- {w.link(name)} (`{home}`): `{type_text(aliases[name])}`")
        w.add("")
    text = "\n".join(w.lines).rstrip("\n") + "\n"
    return re.sub(r"\n{3,}", "\n\n", text)


def section_title(module_name: str) -> str:
    title = MODULES.get(module_name)
    return f"{title} (`{module_name}`)" if title else f"`{module_name}`"


def document(w: Writer, e: Entry, comments: dict[str, dict[str, str]]) -> None:
    obj = e.obj
    w.heading(3, e.heading)
    if inspect.isclass(obj):
        document_class(w, e, comments)
    elif inspect.isfunction(obj):
        w.add(f"`{e.import_line}` · function", "")
        prefix = "async def " if inspect.iscoroutinefunction(obj) else "def "
        w.add(*code(signature_text(w, e.name, inspect.signature(obj), obj.__globals__, prefix=prefix)))
        w.doc(obj.__doc__)
    elif typing.get_origin(obj) is not None:
        w.add(f"`{e.import_line}` · type alias", "")
        w.add(*code(f"{e.name} = {type_text(obj)}"))
    else:
        w.add(f"`{e.import_line}` · `{type(obj).__qualname__}`: `{value_repr(obj)}`", "")


def document_class(w: Writer, e: Entry, comments: dict[str, dict[str, str]]) -> None:
    cls = e.obj
    w.context = e.name
    bases = [b for b in cls.__bases__ if b is not object and b is not typing.Generic]
    if isinstance(cls, enum.EnumMeta):
        bases = [b for b in cls.__mro__[1:] if b.__module__ == "enum"][:1]
    kind = "exception" if issubclass(cls, BaseException) else "enum" if isinstance(cls, enum.EnumMeta) else "class"
    line = f"`{e.import_line}` · {kind}"
    if bases:
        line += ", bases: " + ", ".join(base_text(w, b) for b in bases)
    w.add(line, "")
    if not isinstance(cls, enum.EnumMeta) and (not issubclass(cls, BaseException) or "__init__" in cls.__dict__):
        sig = constructor(w, cls)
        if sig is not None:
            w.add(*code(sig))
    own = cls.__dict__.get("__doc__")
    w.doc(own)
    for base in own_mro(w, cls)[1:]:
        # A base the page does not document, that documented classes share (the clients'
        # ClientBase): its docstring says what they have in common.
        sharing = [n for n in w.classes if n != e.name and base in kvmem_mro(w.classes[n])]
        if sharing and base.__dict__.get("__doc__"):
            w.add(f"From `{base.__module__}.{base.__qualname__}` (shared with {', '.join(map(w.link, sharing))}):", "")
            w.doc(base.__dict__["__doc__"])
    if isinstance(cls, enum.EnumMeta):
        enum_members(w, cls, comments)
        return
    if e.module == "kvmem.client.errors" and e.name == "Reason":
        return
    found = members(w, cls)
    base = documented_base(w, cls)
    if base is not None:
        w.add(f"Has the members of {w.link(base.__name__)}" + (", and:" if found else "."), "")
    supports = protocols(cls)
    if supports:
        w.add("Supports: " + ", ".join(supports) + ".", "")
    attrs = instance_attributes(w, cls, {m.name for m in found})
    if attrs:
        w.add("Attributes set by the constructor: " + ", ".join(f"`{a}`" for a in attrs) + ".", "")
    for m in found:
        w.heading(4, f"{e.name}.{m.name}")
        if m.kind == "awaitable":
            w.add("Awaitable: `await` what it returns.", "")
        w.add(*code(m.signature))
        w.doc(m.doc)


def enum_members(w: Writer, cls: type, comments: dict[str, dict[str, str]]) -> None:
    proto = PROTO_ENUMS.get(cls.__name__)
    values = comments.get(proto, {}) if proto else {}
    if cls.__module__ == "kvmem.client.errors" and cls.__name__ == "Reason":
        w.add(*reason_rows(w, values))
        return
    prefix = f"{_snake(proto)}_" if proto else ""
    w.add("| Member | Value | Meaning (the proto's comment) |", "|---|---|---|")
    for member in cls:  # type: ignore[attr-defined]
        meaning = values.get(prefix + member.name, "").replace("|", "\\|")
        w.add(f"| `{member.name}` | `{member.value!r}` | {meaning} |")
    w.add("")


# ------------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    parser.add_argument(
        "--output", type=Path, default=DEFAULT_OUTPUT, help="the file to write (or, with --check, to compare)"
    )
    args = parser.parse_args(argv)
    text = render()
    out: Path = args.output
    if args.check:
        current = out.read_text() if out.exists() else ""
        if current != text:
            diff = list(
                difflib.unified_diff(current.splitlines(), text.splitlines(), str(out), "generated", lineterm="")
            )
            print(f"{out} is stale, run `{COMMAND}`:")
            print("\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else ""))
            return 1
        print(f"{out} is current ({len(text.splitlines())} lines)")
        return 0
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
