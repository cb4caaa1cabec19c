"""Deprecated: :mod:`kvmem.engine.generate.models`, re-exported here for one release."""

from ._moved import alias

alias(__name__)
