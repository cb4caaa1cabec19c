"""The one-release aliases of the modules that moved into :mod:`kvmem.engine.generate`:
``kvmem.engine.X`` is ``kvmem.engine.generate.X`` itself (a re-export, not a copy),
imported with a :class:`DeprecationWarning` naming the new path."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str) -> None:
    """Make module ``old`` (``kvmem.engine.X``) the moved ``kvmem.engine.generate.X``."""
    new = old.replace("kvmem.engine.", "kvmem.engine.generate.", 1)
    warnings.warn(f"{old} moved to {new}; this alias goes in the next release", DeprecationWarning, stacklevel=4)
    sys.modules[old] = importlib.import_module(new)
