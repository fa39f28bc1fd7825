"""Paged attention by gathering one layer's blocks and calling sdpa: the fastest exact path without a
paged kernel (CPU, or a GPU without Triton).

The gather copies the layer's blocks of the batch into one transient tensor, freed when the layer's
attention returns, so extra memory is one layer's K/V, never the whole cache; sealed blocks are decoded into that
copy (`quantized_paged_attention_gathered_sdpa`). On a CPU that copy plus
PyTorch's fused sdpa costs about what `DynamicCache`'s per-step `torch.cat` does, while the block-chunked
reference (the specification, O(chunk) memory) takes over twice as long: its matmuls run over strided
block views with an unfused softmax (`python eval/bench_decode_step.py --runs layer`; figures in
eval/RESULTS.md).
"""

from __future__ import annotations

import torch

from hf_kvgov.kernels.quantized_reference import SealedReader, gather_quantized
from hf_kvgov.kernels.sealed_blocks import SealedBlocks


def paged_attention_gathered_sdpa(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.reference.paged_attention_reference`; no soft-capping (sdpa has none).

    Args:
        query: `[batch, q_heads, q_len, head_dim]`, the last `q_len` of `kv_length` tokens when `mask` is None.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]`.
        block_table: long `[batch, blocks]`.
        mask: `[batch, 1, q_len, kv_length]`, bool (True = attend) or additive float; None means causal.
    Returns:
        `[batch, q_len, q_heads, head_dim]`.
    """
    if softcap is not None:
        raise ValueError(f"{unsupported_reason(softcap)} Use the torch reference backend for soft-capped logits.")
    keys = gather_blocks(key_cache, block_table, kv_length)
    values = gather_blocks(value_cache, block_table, kv_length)
    return _sdpa(query, keys, values, kv_length, scale, mask)


def quantized_paged_attention_gathered_sdpa(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    *,
    read_sealed: SealedReader,
    sealed: SealedBlocks | None = None,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as `kernels.quantized_reference.quantized_paged_attention_reference`: the rows' blocks, sealed
    ones decoded through `read_sealed` (`sealed`, the pieces a kernel reads in place, is not needed), gathered into
    one layer's transient K/V in the query's dtype, then sdpa."""
    if softcap is not None:
        raise ValueError(f"{unsupported_reason(softcap)} Use the torch reference backend for soft-capped logits.")
    keys, values = gather_quantized(key_cache, value_cache, block_table, kv_length, read_sealed, query.dtype)
    return _sdpa(query, keys, values, kv_length, scale, mask)


def _sdpa(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    q_len = query.shape[2]
    if mask is None and q_len not in (1, kv_length):  # causal, with the queries at the end
        mask = torch.ones(q_len, kv_length, dtype=torch.bool, device=query.device).tril(kv_length - q_len)
    is_causal = mask is None and q_len > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=True
    )
    return out.transpose(1, 2)


def unsupported_reason(softcap: float | None) -> str | None:
    """Why this backend cannot serve a call, or None."""
    if softcap is not None:
        return "sdpa has no logit soft-capping."
    return None


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor, kv_length: int) -> torch.Tensor:
    """`[batch, kv_heads, kv_length, head_dim]`: a transposed view of one fresh copy of the rows' blocks."""
    batch, blocks = block_table.shape
    shape = (batch, blocks * cache.shape[1], *cache.shape[2:])
    # index_select on the flattened table copies whole blocks ~3x faster on CPU than advanced indexing.
    return cache.index_select(0, block_table.reshape(-1)).view(shape)[:, :kv_length].transpose(1, 2)
