"""Attention over block tables whose older blocks are sealed (quantized), in plain torch: the spec.

A block-table entry ``b >= 0`` names a full-precision block ``key_cache[b]`` / ``value_cache[b]`` (the
sink, the tail being written); an entry ``b < 0`` names a sealed block that ``read_sealed`` decodes::

    block table row:   [ 3 | -1 | -2 | -5 | ... | -9 | 4 ]
                         sink  sealed (codes + scales)     tail (being written)

The keys are read in chunks of whole blocks, as in `kernels.reference`, and the sealed blocks of a chunk
are decoded just before that chunk is used, each distinct block once (beams that share a block decode it
once). The whole cache never exists in full precision: peak extra memory is one chunk of decoded K/V plus
the online-softmax state, O(batch x heads x queries x chunk_tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from hf_kvgov.kernels.reference import DEFAULT_CHUNK_TOKENS, chunked_attention

# Sealed block-table entries long [n] (all < 0), dtype -> keys, values [n, block_size, kv_heads, head_dim].
SealedReader = Callable[[Tensor, torch.dtype], tuple[Tensor, Tensor]]


def read_blocks(
    block_ids: Tensor, key_cache: Tensor, value_cache: Tensor, read_sealed: SealedReader, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """K/V of the blocks named by `block_ids` long `[*lead]`, either kind, as `[*lead, block_size, H, D]`.

    `key_cache`, `value_cache`: one layer's full-precision blocks `[num_blocks, block_size, H, D]`.
    """
    if not bool((block_ids < 0).any()):
        return key_cache[block_ids].to(dtype), value_cache[block_ids].to(dtype)
    # Sorted distinct ids put the sealed (negative) ones first: decode those once each, stack the
    # full-precision ones after them, and pick every entry from that stack with one gather.
    distinct, position = torch.unique(block_ids, return_inverse=True)
    num_sealed = int((distinct < 0).sum())
    sealed_k, sealed_v = read_sealed(distinct[:num_sealed], dtype)
    full = distinct[num_sealed:]
    keys = torch.cat([sealed_k, key_cache[full].to(dtype)])
    values = torch.cat([sealed_v, value_cache[full].to(dtype)])
    return keys[position], values[position]


def gather_quantized(
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    length: int,
    read_sealed: SealedReader,
    dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """Contiguous K/V `[batch, H, length, D]` of `dtype` for attention implementations that need it.

    `block_table`: long `[batch, blocks]` with `blocks * block_size >= length`.
    """
    keys, values = read_blocks(block_table, key_cache, value_cache, read_sealed, dtype)
    batch, blocks, block_size, heads, head_dim = keys.shape
    flat = (batch, blocks * block_size, heads, head_dim)
    return keys.view(flat)[:, :length].transpose(1, 2), values.view(flat)[:, :length].transpose(1, 2)


def quantized_paged_attention_reference(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    kv_length: int,
    scale: float,
    read_sealed: SealedReader,
    mask: Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> Tensor:
    """Attention of `query` over the first `kv_length` tokens of `block_table`, sealed blocks decoded.

    Args:
        query: `[batch, q_heads, q_len, head_dim]`.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]`, the full-precision blocks.
        block_table: long `[batch, blocks]`; entries < 0 are sealed blocks, read through `read_sealed`.
        mask: `[batch, 1, q_len, kv_length]`, bool (True = attend) or additive float; None means causal.
        softcap: optional tanh soft-capping of the logits.
    Returns:
        `[batch, q_len, q_heads, head_dim]`, in the query's dtype (math in float32).
    """

    def read(first: int, num_blocks: int, length: int) -> tuple[Tensor, Tensor]:
        ids = block_table[:, first : first + num_blocks]
        return gather_quantized(key_cache, value_cache, ids, length, read_sealed, torch.float32)

    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    return chunked_attention(query, kv_heads, block_size, kv_length, read, scale, mask, softcap, chunk_tokens)
