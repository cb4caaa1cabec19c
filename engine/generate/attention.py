"""kvmem's attention for transformers models: an ``AttentionInterface`` function that
computes a layer's attention over kvmem's paged KV memory.

Importing this module registers :func:`kvmem_attention` under the name ``"kvmem"``
(:data:`ATTENTION`) through transformers' public ``AttentionInterface``; a model loaded
or configured with ``attn_implementation="kvmem"`` then calls it in each attention
layer, unchanged (the Llama family, and any model whose attention module calls the
interface with ``layer_idx`` and ``num_key_value_groups``). Per forward, the caller
passes one :class:`PagedBatch` as the extra keyword argument ``kvmem=`` to
``model(...)`` (with ``use_cache=False``): transformers hands unknown keyword arguments
down to the attention function. The model's own mask is ignored (transformers builds
none for an implementation it has no mask function for).

The batch is packed ragged: ``input_ids`` ``[1, T]`` holds every request's tokens of
this forward one after the other (prefill chunks and decodes alike), ``position_ids``
each token's position in its own request. For each layer the function

0. waits, when some of the K/V it reads is still being copied in from the server's host
   tier, for that layer's copy only (``PagedBatch.wait``: the load counters, in memory
   the process maps; the layers before it computed meanwhile);
1. writes the forward's new K and V at their token slots ``kv_loc`` into that layer's
   mapped K/V tensors (index assignment into kvmem's memory: no copy of the cache);
2. gathers each request's K/V through its block-table row, positions
   ``0 .. seq_len - 1`` (this forward's included), padded to the batch's longest,
   ``[n, L, kv_heads, head_dim]``;
3. calls ``scaled_dot_product_attention`` once for the whole batch: the queries
   gathered per request, ``[n, heads, Q, head_dim]`` (``Q`` the most tokens any request
   computes), a boolean mask ``[n, 1, Q, L]`` that is causal by position (query at
   position ``p`` sees its request's positions ``<= p``), GQA by ``enable_gqa`` (the
   module's ``num_key_value_groups``).

The index arrays (:meth:`PagedBatch.build`) are built once per forward, vectorised
(no loop over requests or tokens), and shared by every layer; a layer costs one scatter
per K and V, one gather per K and V, and one attention call.

Not covered: sliding-window layers, logit soft-capping and attention sinks (refused, not
computed wrong); MLA. MLA (DeepSeek's latent attention) would take the pool's
``KV_FORMAT_MLA`` layout (one ``[num_tokens, kv_lora_rank + rope_dim]`` latent per
layer, :meth:`kvmem.client.MappedMemory.kv_cache`) and a hook at the attention module
rather than at the interface: transformers' DeepSeek attention up-projects the latent
into per-head K and V before it calls the interface, so the function here sees
expanded K/V, not the latent that would be cached. The module would write the
compressed latent and rope key at ``kv_loc`` and attend with the up-projection absorbed
into the query and output (the same gather and mask as here, one head-shared K).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import AttentionInterface

__all__ = ["ATTENTION", "PagedBatch", "kvmem_attention"]

ATTENTION = "kvmem"
"""The ``attn_implementation`` name the function is registered under."""


@dataclasses.dataclass(frozen=True, slots=True)
class PagedBatch:
    """One forward's metadata, shared by every layer (:meth:`build`). ``n`` requests,
    ``T`` tokens, ``Q`` the most tokens of one request, ``L`` the longest request."""

    kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V) [num_tokens, kv_heads, head_dim]
    kv_loc: torch.Tensor  # int64 [T] token slots this forward writes
    q_index: torch.Tensor  # int64 [n, Q] into the T tokens (padding: 0)
    q_valid: torch.Tensor  # bool [n, Q] a real query
    kv_index: torch.Tensor  # int64 [n, L] token slot of each request's positions (padding: its first)
    mask: torch.Tensor  # bool [n, 1, Q, L] key j visible to query q
    # K/V still loading from the server's host tier: wait(i) returns once layer i is in.
    wait: Callable[[int | None], float] | None = None

    @classmethod
    def build(
        cls,
        kv_cache: Sequence[tuple[torch.Tensor, torch.Tensor]],
        block_table: Any,
        page_size: int,
        rows: torch.Tensor,
        offsets: torch.Tensor,
        positions: torch.Tensor,
        kv_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        wait: Callable[[int | None], float] | None = None,
    ) -> PagedBatch:
        """The metadata of a packed batch: request ``i`` computes tokens
        ``offsets[i] : offsets[i + 1]`` at ``positions`` (its own, contiguous, ending at
        ``seq_lens[i] - 1``) and reads ``seq_lens[i]`` tokens through block-table row
        ``rows[i]``. Every tensor is int64 on the KV memory's device but
        ``block_table`` (int32, any device; or the drop-in's ``req_to_page``, by request
        index). ``wait``: the forward's loads still in copy (see
        :class:`kvmem.engine.forward.ForwardBatch`). O(n * (Q + L)), vectorised."""
        device = kv_cache[0][0].device
        rows, offsets, positions, kv_loc, seq_lens = (
            t.to(device=device, dtype=torch.int64) for t in (rows, offsets, positions, kv_loc, seq_lens)
        )
        n = int(rows.numel())
        total = int(positions.numel())
        counts = offsets[1:] - offsets[:-1]
        if n == 0 or total == 0 or kv_loc.numel() != total or int(counts.min()) < 1:
            raise ValueError(
                f"a paged batch needs at least one token per request and a kv_loc per token: "
                f"{n} requests, {total} tokens, {kv_loc.numel()} slots, counts {counts.tolist()[:8]}"
            )
        if bool((positions[offsets[1:] - 1] != seq_lens - 1).any()):
            raise ValueError(
                f"each request's last position must be its seq_len - 1: last positions "
                f"{positions[offsets[1:] - 1].tolist()[:8]}, seq_lens {seq_lens.tolist()[:8]}"
            )
        q_max, l_max = int(counts.max()), int(seq_lens.max())
        q_pos = torch.arange(q_max, device=device)
        q_valid = q_pos[None, :] < counts[:, None]
        q_index = torch.where(q_valid, offsets[:-1, None] + q_pos[None, :], 0)
        query_positions = torch.where(q_valid, positions[q_index], 0)  # a padding query sees position 0
        k_pos = torch.arange(l_max, device=device)
        table_device = getattr(block_table, "device", rows.device)  # the drop-in's req_to_page moves rows itself
        pages = block_table[rows.to(table_device), : -(-l_max // page_size)].to(device=device, dtype=torch.int64)
        kv_index = pages[:, k_pos // page_size] * page_size + k_pos % page_size
        kv_index = torch.where(k_pos[None, :] < seq_lens[:, None], kv_index, kv_index[:, :1])
        mask = (k_pos[None, None, :] <= query_positions[:, :, None]).unsqueeze(1)
        return cls(kv_cache, kv_loc, q_index, q_valid, kv_index, mask, wait)


def kvmem_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    kvmem: PagedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of layer ``module.layer_idx`` over kvmem's pages (see the module's
    docstring). ``query`` ``[1, heads, T, head_dim]``, ``key``/``value`` ``[1, kv_heads,
    T, head_dim]`` (this forward's tokens, rotary applied); returns ``[1, T, heads,
    head_dim]`` and no weights. ``attention_mask`` is ignored: the mask is ``kvmem``'s."""
    if kvmem is None:
        raise ValueError(
            f"attn_implementation={ATTENTION!r} needs the forward's kvmem.engine.generate.attention.PagedBatch as "
            f"model(..., kvmem=batch, use_cache=False)"
        )
    for name in ("softcap", "s_aux", "sliding_window"):
        if kwargs.get(name) is not None or (name == "sliding_window" and getattr(module, name, None)):
            raise NotImplementedError(f"kvmem attention does not implement {name} (layer {module.layer_idx})")
    if query.shape[0] != 1:
        raise ValueError(f"kvmem attention takes one packed sequence (batch 1), got batch {query.shape[0]}")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    groups = int(module.num_key_value_groups)  # type: ignore[arg-type]
    if query.shape[1] != key.shape[1] * groups:
        raise ValueError(f"layer {layer}: {query.shape[1]} query heads != {key.shape[1]} KV heads x {groups} groups")
    if kvmem.wait is not None:  # pages a match is loading from the host tier: this layer's copy first
        kvmem.wait(layer)
    k_cache, v_cache = kvmem.kv_cache[layer]
    k_cache[kvmem.kv_loc] = key[0].transpose(0, 1).to(k_cache.dtype)  # [T, kv_heads, head_dim]
    v_cache[kvmem.kv_loc] = value[0].transpose(0, 1).to(v_cache.dtype)
    k = k_cache[kvmem.kv_index].to(query.dtype).transpose(1, 2)  # [n, kv_heads, L, head_dim]
    v = v_cache[kvmem.kv_index].to(query.dtype).transpose(1, 2)
    q = query[0].transpose(0, 1)[kvmem.q_index].transpose(1, 2)  # [n, heads, Q, head_dim]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=kvmem.mask, scale=scaling, enable_gqa=groups > 1
    )
    return out.transpose(1, 2)[kvmem.q_valid].unsqueeze(0), None  # [1, T, heads, head_dim]


AttentionInterface.register(ATTENTION, kvmem_attention)
