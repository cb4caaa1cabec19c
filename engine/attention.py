"""Deprecated: :mod:`kvmem.engine.generate.attention`, re-exported here for one release."""

from ._moved import alias

alias(__name__)
