"""The tiny random-initialised Llama of the engine's exactness tests (``test_attention.py``,
``test_generate.py``): 2 layers, hidden 64, 4 query heads, 2 KV heads of 16, vocab 128,
fp32, seeded; the ``kvmem serve`` flags of its geometry; ``generate()``'s greedy tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 128
SERVE_FLAGS = f"--format mha --layers {LAYERS} --kv-heads {KV_HEADS} --head-dim {HEAD_DIM} --dtype float32"


def tiny_config(**overrides: Any) -> LlamaConfig:
    settings = dict(
        num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=KV_HEADS, vocab_size=VOCAB, max_position_embeddings=512, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, dtype="float32",
    )  # fmt: skip
    return LlamaConfig(**{**settings, **overrides})


def tiny_llama(seed: int = 1234) -> LlamaForCausalLM:
    """The seeded model, with transformers' own attention ("sdpa")."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config()).eval()


def greedy(model: LlamaForCausalLM, prompt: np.ndarray, new_tokens: int) -> list[int]:
    """``generate(do_sample=False)``'s ``new_tokens`` tokens after ``prompt`` (transformers' cache)."""
    ids = torch.from_numpy(np.asarray(prompt)).long()[None]
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
            do_sample=False,
        )  # fmt: skip
    return list(out[0, ids.shape[1] :].tolist())
