"""Load the reference allocator (``shared/reference/seed_kv_allocator.py``) for benchmarks.

The reference is measured against, never copied: this module imports the file as it
is, under a private module name, and patches exactly one thing at construction time.
``KVAllocator.clear()`` builds its CPU block-table mirror with
``torch.zeros(..., pin_memory=True)``, which fails on a machine without a GPU; while the
allocator is being constructed, the module's global ``torch`` is replaced by a thin
proxy whose ``zeros`` drops ``pin_memory`` (only when CUDA is not available). Every
other attribute is the real ``torch``, and the original global is restored afterwards
(``clear()`` allocates only on first use, so later calls never reach ``zeros`` with
``pin_memory`` again).

Shared by the benchmarks in this folder. The import and the patch are
:mod:`kvmem.engine.simulate.reference`'s (``kvmem simulate --baseline`` loads the same
file); this module only makes a missing file a note instead of an error, and builds the
allocator with the geometry of a kvmem pool.
"""

from __future__ import annotations

import dataclasses
import pathlib
import types
from typing import Any

from kvmem.engine.simulate.reference import REFERENCE_RELPATH, ReferenceMissing, construct
from kvmem.engine.simulate.reference import load_reference as _load


def default_reference_path() -> pathlib.Path:
    """``<repo>/../shared/reference/seed_kv_allocator.py``, ``<repo>`` being this
    file's repository root (the parent of ``bench/``)."""
    repo = pathlib.Path(__file__).resolve().parent.parent
    return repo.parent / REFERENCE_RELPATH


@dataclasses.dataclass(frozen=True)
class Reference:
    """A loaded reference module, or the reason there is none (``module is None``)."""

    path: pathlib.Path
    module: types.ModuleType | None
    note: str | None = None

    @property
    def available(self) -> bool:
        return self.module is not None

    def allocator(
        self,
        *,
        num_pages: int,
        page_size: int,
        max_batch_size: int,
        max_context_len: int,
        device: str = "cpu",
    ) -> Any:
        """A ``KVAllocator`` with the same geometry as a kvmem pool of ``num_pages``
        pages (page 0 padding in both, so ``num_pages - 1`` usable pages). Request
        indices ``0 .. max_batch_size - 1``."""
        if self.module is None:
            raise RuntimeError(f"reference allocator not available: {self.note}")
        return construct(
            self.module,
            size=num_pages * page_size,
            device=device,
            max_batch_size=max_batch_size,
            max_context_len=max_context_len,
            page_size=page_size,
        )


def load_reference(path: str | pathlib.Path | None = None) -> Reference:
    """Import the reference from ``path`` (default :func:`default_reference_path`).
    Never raises for a missing or broken file: the result says why it is unavailable."""
    p = pathlib.Path(path).expanduser() if path is not None else default_reference_path()
    p = p.resolve() if p.exists() else p
    if not p.is_file():
        return Reference(p, None, f"reference allocator not found at {p}")
    try:
        return Reference(p, _load(p))
    except ReferenceMissing as exc:
        return Reference(p, None, str(exc))
