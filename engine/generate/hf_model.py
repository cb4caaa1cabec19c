"""A transformers causal LM behind the engine's model seam (:class:`kvmem.engine.forward.Model`):
:class:`TransformersModel` runs each iteration's packed batch as one forward pass whose
attention reads and writes kvmem's pages (:mod:`.attention`), and samples the next
tokens; :func:`check_geometry` and :func:`serve_flags` match a pool to the model
(defined in :mod:`.geometry`, which loads no torch, and re-exported here).

One forward per iteration: ``model(input_ids=[1, T], position_ids=[1, T],
use_cache=False, logits_to_keep=<the sampled positions>, kvmem=<PagedBatch>)``; the LM
head runs on the sampled positions only. Greedy by default; :class:`Sampling` gives
temperature, top-k and top-p from a seeded ``torch.Generator``.

Needs the ``model`` extra (``pip install 'kvmem[model]'``: transformers, gguf,
accelerate); ``kvmem simulate`` never imports this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..forward import ForwardBatch, ForwardOutput
from .attention import ATTENTION, PagedBatch
from .geometry import Geometry, GeometryMismatch, check_geometry, serve_flags

__all__ = [
    "TRANSFORMERS_TESTED",
    "Geometry",
    "GeometryMismatch",
    "Sampling",
    "TransformersModel",
    "check_geometry",
    "sample",
    "sampled_positions",
    "serve_flags",
]

TRANSFORMERS_TESTED = "==5.23.0"
"""The transformers versions the hook is proven on (the ``model`` extra's pin; a test
fails on any other)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 is greedy (argmax); otherwise
    softmax of ``logits / temperature`` restricted to the ``top_k`` most likely
    (0: all) and to the smallest set of probability ``>= top_p``, drawn from a
    ``torch.Generator`` seeded with ``seed`` (None: a random seed)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"sampling needs temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got temperature "
                f"{self.temperature}, top_k {self.top_k}, top_p {self.top_p}"
            )


def sample(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``[S, vocab]``: int64 ``[S]``."""
    if sampling.temperature == 0 or not logits.shape[0]:
        return logits.argmax(dim=-1)
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(scores, dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        outside = probs.cumsum(dim=-1) - probs > sampling.top_p  # the most likely always stays
        scores = scores.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(scores.softmax(dim=-1), 1, generator=generator).squeeze(-1)


class TransformersModel:
    """A transformers causal LM as the scheduler's :class:`~kvmem.engine.forward.Model`.

    ``kv_cache``: per layer ``(K, V)`` ``[num_tokens, kv_heads, head_dim]`` (kvmem's
    :meth:`kvmem.client.KVMemClient.kv_cache`, or plain tensors); ``block_table``: the
    int32 rows (:attr:`kvmem.client.KVMemClient.block_table`, or the drop-in's
    ``req_to_page``); ``page_size``: the
    pool's. The model is switched to :data:`~.attention.ATTENTION` if it was loaded with
    another attention. Refuses K/V tensors of another geometry (:func:`check_geometry`).
    :attr:`last_logits` holds the last forward's logits at its sampled positions
    ``[S, vocab]``.
    """

    def __init__(
        self,
        model: Any,
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_table: Any,
        page_size: int,
        sampling: Sampling | None = None,
    ) -> None:
        if not kv_cache or any(not isinstance(layer, tuple) for layer in kv_cache):
            raise GeometryMismatch("kvmem attention needs MHA KV memory: a (K, V) pair per layer")
        weights = next(model.parameters())
        check_geometry(model.config, Geometry.of_tensors(kv_cache), weights.dtype)
        if model.config._attn_implementation != ATTENTION:
            model.set_attn_implementation(ATTENTION)
        self.model = model
        self.kv_cache = list(kv_cache)
        self.block_table = block_table
        self.page_size = int(page_size)
        self.sampling = sampling or Sampling()
        self.device = weights.device
        self.generator: torch.Generator | None = None
        if self.sampling.temperature > 0:
            self.generator = torch.Generator(device=self.device)
            if self.sampling.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.sampling.seed)
        self.last_logits: torch.Tensor | None = None
        self.num_forwards = 0

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """One forward pass over the batch's tokens; the next token after each sampled
        position (see :mod:`kvmem.engine.forward`)."""
        if batch.num_tokens == 0:
            return ForwardOutput(np.zeros(0, dtype=np.int32))
        if batch.kv_loc is None:
            raise ValueError(f"a transformers model needs KV memory: the batch ({batch.describe()}) has no kv_loc")
        rows, offsets, positions, kv_loc, seq_lens = (
            torch.from_numpy(a) for a in (batch.rows, batch.offsets, batch.positions, batch.kv_loc, batch.seq_lens)
        )
        paged = PagedBatch.build(
            self.kv_cache, self.block_table, self.page_size, rows, offsets, positions, kv_loc, seq_lens, batch.wait
        )
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.from_numpy(batch.token_ids).to(self.device, torch.int64)[None],
                position_ids=torch.from_numpy(batch.positions).to(self.device)[None],
                use_cache=False,
                logits_to_keep=torch.from_numpy(sampled_positions(batch)).to(self.device),
                kvmem=paged,
            )
            logits = out.logits[0]
            tokens = sample(logits, self.sampling, self.generator)
        self.last_logits = logits
        self.num_forwards += 1
        return ForwardOutput(tokens.to(device="cpu", dtype=torch.int32).numpy(), logits)


def sampled_positions(batch: ForwardBatch) -> np.ndarray:
    """Indices into the batch's tokens of its sampled positions: the last
    ``sample_offsets[i + 1] - sample_offsets[i]`` tokens of each request i, in order."""
    per = np.diff(batch.sample_offsets)
    request = np.repeat(np.arange(per.size), per)
    within = np.arange(int(batch.sample_offsets[-1])) - batch.sample_offsets[:-1][request]
    return (batch.offsets[1:][request] - per[request] + within).astype(np.int64)
