"""Attention over block tables whose older blocks are sealed (quantized), in plain torch: the spec.

An entry ``b >= 0`` names a full-precision block ``key_cache[b]`` (the sink, the tail being written), an entry
``b < 0`` a sealed block that ``read_sealed`` decodes::

    block table row:   [ 3 | -1 | -2 | -5 | ... | -9 | 4 ]
                         sink  sealed (codes + scales)     tail (being written)

Keys are read in chunks of whole blocks, as in `kernels.reference`, and each distinct sealed block of a chunk is
decoded just before use (once, even when beams share it). The whole cache never exists in full precision: peak
extra memory is one chunk of decoded K/V plus the online-softmax state.
"""

from __future__ import annotations

import math
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
        return _take(key_cache, block_ids).to(dtype), _take(value_cache, block_ids).to(dtype)
    run = _single_sealed_run(block_ids)
    if run is not None:  # one row read front to back: [full ids][sealed run][full ids]
        start, stop = run
        flat = block_ids.reshape(-1)
        sealed_k, sealed_v = read_sealed(flat[start:stop], dtype)
        head, tail = flat[:start], flat[stop:]
        keys = torch.cat([_take(key_cache, head).to(dtype), sealed_k, _take(key_cache, tail).to(dtype)])
        values = torch.cat([_take(value_cache, head).to(dtype), sealed_v, _take(value_cache, tail).to(dtype)])
        return keys.view(*block_ids.shape, *keys.shape[1:]), values.view(*block_ids.shape, *values.shape[1:])
    # Sorted distinct ids put the sealed (negative) ones first: decode those once each, stack the
    # full-precision ones after them, and pick every entry from that stack with one gather.
    distinct, position = torch.unique(block_ids, return_inverse=True)
    num_sealed = int((distinct < 0).sum())
    sealed_k, sealed_v = read_sealed(distinct[:num_sealed], dtype)
    full = distinct[num_sealed:]
    keys = torch.cat([sealed_k, key_cache.index_select(0, full).to(dtype)])
    values = torch.cat([sealed_v, value_cache.index_select(0, full).to(dtype)])
    return _take(keys, position), _take(values, position)


def _single_sealed_run(block_ids: Tensor) -> tuple[int, int] | None:
    """(start, stop) when `block_ids` is one row whose sealed entries are one contiguous run, else None.

    That is a single sequence's table (sink, sealed blocks, tail); it can be decoded in table order and
    concatenated, skipping the dedup and the final gather of the general path (two copies of the K/V).
    """
    if block_ids.dim() > 1 and math.prod(block_ids.shape[:-1]) != 1:
        return None
    where = (block_ids.reshape(-1) < 0).nonzero().flatten()
    start, stop = int(where[0]), int(where[-1]) + 1
    return (start, stop) if stop - start == where.numel() else None


def _take(blocks: Tensor, ids: Tensor) -> Tensor:
    """``blocks[ids]`` for ids of any shape: index_select on the flattened ids, 2-5x faster than advanced
    indexing on the CPU for whole blocks."""
    return blocks.index_select(0, ids.reshape(-1)).view(*ids.shape, *blocks.shape[1:])


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
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of `query` over the first `kv_length` tokens of `block_table`, sealed blocks decoded.

    Args:
        query: `[batch, q_heads, q_len, head_dim]`.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]`, the full-precision blocks.
        block_table: long `[batch, blocks]`; entries < 0 are sealed blocks, read through `read_sealed`.
        mask: `[batch, 1, q_len, kv_length]`, bool (True = attend) or additive float; None means causal.
        softcap: optional tanh soft-capping of the logits.
        sinks: optional learned sink logit per query head `[q_heads]`, as `paged_attention_reference`'s.
    Returns:
        `[batch, q_len, q_heads, head_dim]`, in the query's dtype (math in float32).
    """

    def read(first: int, num_blocks: int, length: int) -> tuple[Tensor, Tensor]:
        ids = block_table[:, first : first + num_blocks]
        return gather_quantized(key_cache, value_cache, ids, length, read_sealed, torch.float32)

    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    return chunked_attention(query, kv_heads, block_size, kv_length, read, scale, mask, softcap, chunk_tokens, sinks)
