"""Deprecated: :mod:`kvmem.engine.generate.hf_model`, re-exported here for one release."""

from ._moved import alias

alias(__name__)
