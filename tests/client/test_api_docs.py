"""The API reference: pdoc (pinned in the test extra) makes it from the docstrings and
signatures (``docs/build_api.py``). CI fails on any warning it prints, and on a public
class, method or attribute of the client or the drop-in that it does not show with its
docstring and signature. The docstrings themselves are checked on the objects
(``inspect``): every public name has one, and every call of the clients states its cost
and its errors."""

from __future__ import annotations

import enum
import inspect
import re
import subprocess
import sys
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from types import MemberDescriptorType, ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docs" / "build_api.py"
# The calls of a session: written out on both clients, each over its Session builder.
CALLS = ("open", "step", "alloc", "truncate", "release", "match", "cache", "handoff", "adopt", "stats", "detach")


@dataclass
class Entry:
    """One documented name on a page: its header (``def step(self, ...) -> StepResult:``,
    ``class KVMemClient(...)``, ``timeout: float``) and its docstring, as text."""

    header: str = ""
    doc: str = ""


@dataclass
class Page:
    entries: dict[str, Entry] = field(default_factory=dict)
    inherited: dict[str, str] = field(
        default_factory=dict
    )  # "KVMemClient.memory" -> "client/base.html#ClientBase.memory"
    text: str = ""


class _PageParser(HTMLParser):
    """pdoc 16's default template: a ``<section id=NAME>`` per module member, a ``<div
    class="classattr" id=CLASS.NAME>`` per class member, each with a ``<div class="attr
    ...">`` header and a ``<div class="docstring">``; inherited members are ``<dd
    id=CLASS.NAME>`` links to where they are documented."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.page = Page()
        self._stack: list[tuple[str, str]] = []  # (role, name) of each open <section>/<div>
        self._link_of: str | None = None  # the <dd> whose link is next
        self._text: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = a.get("class", "").split()
        if tag == "dd" and a.get("id"):
            self._link_of = a["id"]
        elif tag == "a" and self._link_of is not None:
            self.page.inherited[self._link_of] = a.get("href", "")
            self._link_of = None
        if tag not in ("section", "div"):
            return
        if a.get("id") and (tag == "section" or "classattr" in classes):
            role, name = "entry", a["id"]
            self.page.entries.setdefault(name, Entry())
        elif "attr" in classes:
            role, name = "header", ""
        elif "docstring" in classes:
            role, name = "doc", ""
        else:
            role, name = "other", ""
        self._stack.append((role, name))

    def handle_endtag(self, tag: str) -> None:
        if tag in ("section", "div") and self._stack:
            self._stack.pop()

    def handle_data(self, data: str) -> None:
        self._text.append(data)
        part = None
        for role, name in reversed(self._stack):
            if role in ("header", "doc") and part is None:
                part = role
            elif role == "entry":
                if part is not None:
                    entry = self.page.entries[name]
                    setattr(entry, part, getattr(entry, part) + data)
                return


def _parse(path: Path) -> Page:
    parser = _PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    page = parser.page
    page.text = "".join(parser._text)
    for entry in page.entries.values():
        entry.header = " ".join(entry.header.split()).removesuffix(" View Source")  # the source button's label
        entry.doc = " ".join(entry.doc.split())
    return page


def _words(text: str) -> str:
    """Text as its words alone, reST roles and markup dropped, for comparing a
    docstring with what pdoc rendered of it."""
    text = re.sub(r":\w+:`~?([^`<]*)[^`]*`", r"\1", text)  # :class:`x` -> x
    return re.sub(r"[\W_]+", "", text).lower()


def _shown(obj: Any, rendered: str) -> bool:
    """Whether ``rendered`` (a docstring as pdoc shows it) holds the first paragraph
    of ``obj``'s docstring; False when it has none."""
    first = _words((inspect.getdoc(obj) or "").split("\n\n")[0])
    return bool(first) and first in _words(rendered)


@dataclass
class Build:
    returncode: int
    output: str
    folder: Path


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """The reference, built by a fresh interpreter the way CI and a developer build it."""
    out = tmp_path_factory.mktemp("api")
    result = subprocess.run([sys.executable, str(SCRIPT), "-o", str(out)], capture_output=True, text=True, cwd=out)
    return Build(result.returncode, result.stdout + result.stderr, out)


@pytest.fixture(scope="module")
def pages(build: Build) -> dict[str, Page]:
    assert build.returncode == 0, build.output
    return {str(p.relative_to(build.folder)): _parse(p) for p in build.folder.rglob("*.html")}


def _modules() -> dict[str, ModuleType]:
    import kvmem.client
    import kvmem.client.base
    import kvmem.client.compat
    import kvmem.client.memory

    return {
        "kvmem/client.html": kvmem.client,
        "kvmem/client/base.html": kvmem.client.base,
        "kvmem/client/memory.html": kvmem.client.memory,
        "kvmem/client/compat.html": kvmem.client.compat,
    }


def _public_members(cls: type) -> dict[str, Any]:
    """What a class documents: its public functions, properties and data descriptors
    defined by kvmem (not by ``object``, ``Exception`` or ``enum``), and its
    constructor where kvmem defines one; as found on the class (static lookup)."""
    found: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("kvmem."):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(value, (classmethod, staticmethod)):
                value = value.__func__
            if inspect.isfunction(value) or inspect.isdatadescriptor(value):
                found[name] = value
    return found


def _is_slot(obj: Any) -> bool:
    """An attribute of ``__slots__``: listed, with no docstring of its own to show."""
    return isinstance(obj, MemberDescriptorType)


def test_the_reference_builds_without_a_warning(build: Build) -> None:
    assert build.returncode == 0 and "Warn" not in build.output, build.output
    for page in (*_modules(), "kvmem/engine.html", "index.html"):
        assert (build.folder / page).is_file(), page


def test_a_warning_fails_the_build(tmp_path: Path) -> None:
    bad = tmp_path / "bad_annotation.py"
    bad.write_text('"""A module."""\n\n\ndef f(x: "NoSuchType") -> None:\n    """Takes what nothing defines."""\n')
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "-o", str(tmp_path / "out"), str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Warn: Error parsing type annotation NoSuchType" in result.stderr, result.stderr


def test_every_public_name_is_shown_with_its_docstring(pages: dict[str, Page]) -> None:
    for page_name, module in _modules().items():
        page = pages[page_name]
        assert _shown(module, page.text), page_name
        for name in getattr(module, "__all__", ()):
            entry = page.entries.get(name)
            assert entry is not None, f"{name} is not on {page_name}"
            obj = getattr(module, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                assert _shown(obj, entry.doc), (page_name, name, entry.doc)
            else:  # a type alias: its docstring is the string after it, which pdoc reads from the source
                assert entry.doc, (page_name, name)


def _check_member(pages: dict[str, Page], page_name: str, cls: type, name: str, obj: Any) -> None:
    """``cls.name`` is on the page with its docstring and, for a function, its
    signature; or it is inherited, linked to the page that shows it so."""
    page = pages[page_name]
    qualname = f"{cls.__name__}.{name}"
    entry = page.entries.get(qualname)
    owner = obj.__qualname__.rpartition(".")[0] if inspect.isfunction(obj) else cls.__name__
    if entry is None and name == "__init__" and owner != cls.__name__:  # a base's constructor: shown with the base
        entry = next((p.entries[f"{owner}.__init__"] for p in pages.values() if f"{owner}.__init__" in p.entries), None)
        assert entry is not None, f"{qualname} is {owner}'s, which no page shows"
    if entry is None:
        href = page.inherited.get(qualname)
        assert href is not None, f"{qualname} is not on {page_name}"
        where, _, anchor = href.partition("#")
        target = str((Path(page_name).parent / where).as_posix()) if where else page_name
        entry = pages[target].entries.get(anchor)
        assert entry is not None, f"{qualname} links to {href}, which does not show it"
    shown = owner if name == "__init__" else name  # pdoc shows a constructor as its class's call
    assert re.search(rf"\b{shown}\b", entry.header), (qualname, entry.header)
    if name != "__init__" and not _is_slot(obj):
        assert _shown(obj, entry.doc), (qualname, entry.doc)
    if inspect.isfunction(obj):
        signature = inspect.signature(obj)
        for param in list(signature.parameters)[1 if name == "__init__" else 0 :]:  # pdoc shows no constructor's self
            assert re.search(rf"\b{param}\b", entry.header), (qualname, param, entry.header)
        returns = signature.return_annotation
        if returns is not inspect.Signature.empty and returns != "None":
            shown = str(returns).rpartition(".")[2].split("[")[0]
            assert re.search(rf"\) -> .*\b{re.escape(shown)}\b", entry.header), (qualname, returns, entry.header)


def test_every_public_member_is_shown_with_its_docstring_and_signature(pages: dict[str, Page]) -> None:
    for page_name, module in _modules().items():
        for name in getattr(module, "__all__", ()):
            cls = getattr(module, name)
            if not inspect.isclass(cls) or issubclass(cls, enum.Enum):
                continue  # an enum's members are values, listed with the class
            members = _public_members(cls)
            for member, obj in members.items():
                _check_member(pages, page_name, cls, member, obj)


def test_both_clients_write_out_each_call_with_its_cost_and_errors(pages: dict[str, Page]) -> None:
    from kvmem.client import AsyncKVMemClient, KVMemClient

    entries = pages["kvmem/client.html"].entries
    for cls, prefix in ((KVMemClient, "def"), (AsyncKVMemClient, "async def")):
        for name in CALLS:
            method = vars(cls)[name]  # defined on the client itself, not made by machinery
            assert inspect.isfunction(method) and method.__qualname__ == f"{cls.__name__}.{name}"
            assert inspect.iscoroutinefunction(method) == (cls is AsyncKVMemClient), name
            doc = " ".join((inspect.getdoc(method) or "").split())
            assert ("Cost: " in doc and ":raises " in doc) or "Cost and errors: :meth:`step`'s" in doc, (cls, name, doc)
            header = entries[f"{cls.__name__}.{name}"].header
            assert re.match(rf"{prefix} {name}\( ?self\b", header), header
        step = entries[f"{cls.__name__}.step"]
        assert step.header.endswith(") -> StepResult:"), step.header
        for words in ("One scheduler step in one round trip", "Cost: one round trip", "Raises", "SessionLost"):
            assert words in step.doc, (cls, words)
    assert entries["KVMemClient.step"].doc == entries["AsyncKVMemClient.step"].doc


def test_the_drop_in_is_shown_whole(pages: dict[str, Page]) -> None:
    from kvmem.client.compat import KVAllocator

    members = _public_members(KVAllocator)
    assert {"__init__", "alloc", "free_req_cache", "match_prefix", "close"} <= set(members), sorted(members)
    for name, obj in members.items():
        _check_member(pages, "kvmem/client/compat.html", KVAllocator, name, obj)


def test_every_public_name_has_a_docstring_of_its_own() -> None:
    """On the objects: a class its own docstring (not its base's), every public function,
    property and data descriptor of it one."""
    for module in _modules().values():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            if inspect.isclass(obj):
                assert vars(obj).get("__doc__"), f"{module.__name__}.{name} has no docstring of its own"
                for member, value in _public_members(obj).items():
                    if member != "__init__" and not _is_slot(value):
                        assert inspect.getdoc(value), f"{module.__name__}.{name}.{member} has no docstring"
            elif inspect.isfunction(obj):
                assert obj.__doc__, f"{module.__name__}.{name} has no docstring"


def test_no_addresses_or_local_paths(pages: dict[str, Page]) -> None:
    for name, page in pages.items():
        assert " at 0x" not in page.text, name
        assert str(ROOT) not in page.text, name
        home = str(Path.home())
        assert len(home) < 2 or home not in page.text, name
