"""The real-model engine: a transformers causal LM generating on kvmem's KV memory, and
``kvmem generate``, which runs several of them.

* :class:`Engine` (:mod:`.engine`) -- the engine API: attach to a server, complete and
  stream prompts with continuous batching (the engine's scheduler,
  :mod:`kvmem.engine.scheduler`, with this engine's policy);
* :mod:`.attention` -- the attention hook that reads and writes kvmem's pages;
  :mod:`.hf_model` -- the transformers model behind the model seam; :mod:`.models` --
  loading a model (the bundled SmolLM2 GGUF, or a directory); :mod:`.geometry` -- the
  pool geometry a model needs, from its config.json or GGUF metadata, without torch;
* :mod:`.command` -- ``kvmem generate``'s options and run; :mod:`.worker` -- one engine
  process; :mod:`.moves` -- how requests move between them; :mod:`.report`.

Importing this package loads no torch: the engine API's names load :mod:`.engine` when
first used, so ``kvmem generate``'s parent and its router stay light. It imports nothing
of :mod:`kvmem.engine.simulate`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import APIS as APIS
    from .engine import Completion as Completion
    from .engine import Delta as Delta
    from .engine import Engine as Engine
    from .engine import RunFigures as RunFigures
    from .engine import propose_drafts as propose_drafts

_ENGINE_API = ("APIS", "Completion", "Delta", "Engine", "RunFigures", "propose_drafts")  # documented in .engine


def __getattr__(name: str) -> Any:
    if name in _ENGINE_API:
        return getattr(importlib.import_module(".engine", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
