"""flash-attn 2's paged path: `flash_attn_with_kvcache(q, k_cache, v_cache, block_table=...)`.

The pool's layout is flash-attn's paged layout, so the pool's tensors are handed over as they are
(`paged_attention_flash` maps the shapes); `unsupported_reason` refuses what flash-attn 2 cannot serve.
It is imported on the first call, never at import time: an optional extra that cannot be built without CUDA.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch

from hf_kvgov.kernels.reference import DEFAULT_CHUNK_TOKENS

PAGE_MULTIPLE = 256
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
MIN_CAPABILITY = (8, 0)  # flash-attn 2 runs on Ampere and newer
DEVICE_TYPES = frozenset({"cuda"})


def is_installed() -> bool:
    """True when the flash_attn package can be imported (without importing it)."""
    return importlib.util.find_spec("flash_attn") is not None


@functools.cache
def load_kernel() -> Callable[..., torch.Tensor]:
    """flash-attn's `flash_attn_with_kvcache`, imported on first use."""
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError as error:
        raise ImportError(
            "The flash_attn backend needs flash-attn 2 (`pip install flash-attn`, which builds only where CUDA "
            "is available); the 'triton' and 'torch' backends need nothing more."
        ) from error
    return flash_attn_with_kvcache


def unsupported_reason(query: torch.Tensor, key_cache: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """A sentence saying why flash-attn cannot serve these inputs, or None when it can (cheap, no sync).

    Refused: not CUDA on Ampere or newer, not fp16/bf16 (query as cache), blocks not a multiple of 256 tokens,
    head_dim not a multiple of 8 up to 256, q_heads not a multiple of kv_heads, and any explicit mask.
    flash-attn's own masking is causal, bottom-right aligned (the reference's convention), plus `cache_seqlens`
    and `window_size`, so a ragged call (`dispatch.paged_attention` with `seq_lens` / `window`: the serving
    engine's decode rows and chunks) is served from those instead of its mask; left padding would need
    `cache_leftpad`, which flash-attn 2 does not combine with a paged cache.
    """
    return _shape_problem(query, key_cache) or _placement_problem(query, key_cache) or _mask_problem(mask)


def _shape_problem(query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    if query.dim() != 4 or key_cache.dim() != 4:
        return (
            f"query must be [batch, q_heads, q_len, head_dim] and key_cache [num_blocks, block_size, kv_heads, "
            f"head_dim]; got shapes {tuple(query.shape)} and {tuple(key_cache.shape)}."
        )
    q_heads, head_dim = query.shape[1], query.shape[3]
    block_size, kv_heads, cache_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    if block_size % PAGE_MULTIPLE:
        return f"flash-attn 2 needs blocks of a multiple of {PAGE_MULTIPLE} tokens; got block_size={block_size}."
    if head_dim % HEAD_DIM_MULTIPLE or not 0 < head_dim <= MAX_HEAD_DIM:
        return f"flash-attn 2 needs head_dim a multiple of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}; got {head_dim}."
    if cache_dim != head_dim:
        return f"key_cache head_dim {cache_dim} differs from the query's {head_dim}."
    if kv_heads == 0 or q_heads % kv_heads:
        return f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for grouped attention."
    if key_cache.stride(-1) != 1:
        return f"flash-attn needs the cache contiguous along head_dim; got strides {key_cache.stride()}."
    return None


def _placement_problem(query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    if query.dtype not in SUPPORTED_DTYPES or key_cache.dtype != query.dtype:
        return f"flash-attn needs fp16 or bf16 for query and cache alike; got {query.dtype} and {key_cache.dtype}."
    if query.device != key_cache.device:
        return f"query is on {query.device} but key_cache on {key_cache.device}."
    if query.device.type not in DEVICE_TYPES:
        return f"flash-attn runs on CUDA tensors; got {query.device}."
    if query.device.type == "cuda" and _capability(query.device) < MIN_CAPABILITY:
        return f"flash-attn 2 needs a GPU of compute capability >= 8.0; got {_capability(query.device)}."
    return None


def _mask_problem(mask: torch.Tensor | None) -> str | None:
    if mask is None:
        return None
    return (
        "flash-attn's paged path takes no mask (only causal attention over per-row lengths, and no left "
        "padding with a paged cache); a masked call, e.g. a padded batch, stays on another backend."
    )


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def paged_attention_flash(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    *,
    seq_lens: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of `query` (the last q_len positions of each row) over the tokens of `block_table`.

    The pool's tensors are passed as they are; only the query is transposed::

        pool (one layer)        key_cache [num_blocks, block_size, kv_heads, head_dim]
        flash_attn_with_kvcache k_cache   (num_blocks, page_block_size, nheads_k, headdim)
                                block_table (batch, max_blocks_per_seq) int32; cache_seqlens (batch,) int32
        query (transformers)    [batch, q_heads, q_len, head_dim]  ->  q (batch, seqlen_q, nheads, headdim)

    Args:
        query: `[batch, q_heads, q_len, head_dim]`, fp16/bf16 on CUDA.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]`, block_size % 256 == 0.
        block_table: int `[batch, blocks]` with `blocks * block_size >= kv_length` (cast to int32).
        kv_length: tokens per row (the longest row when `seq_lens` is given).
        mask: must be None (see `unsupported_reason`); accepted for the dispatch signature.
        softcap: optional tanh soft-capping of the logits.
        chunk_tokens: accepted for signature compatibility with the reference; unused.
        seq_lens: optional int `[batch]`: row b holds its first `seq_lens[b]` tokens (default: kv_length).
        window: optional sliding window: a query attends to itself and the `window - 1` keys before it.
    Returns:
        `[batch, q_len, q_heads, head_dim]` in the query's dtype.
    Raises:
        ValueError: for inputs flash-attn does not serve (see `unsupported_reason`) or that disagree.
    """
    reason = unsupported_reason(query, key_cache, mask)
    if reason is not None:
        raise ValueError(reason)
    _check_operands(query, key_cache, value_cache, block_table, kv_length, softcap)
    batch = query.shape[0]
    lengths = torch.full((batch,), kv_length, dtype=torch.int32, device=query.device)
    if seq_lens is not None:
        if seq_lens.shape != (batch,) or seq_lens.device != query.device:
            raise ValueError(f"seq_lens must be a [{batch}] tensor on {query.device}; got {tuple(seq_lens.shape)}.")
        lengths = seq_lens.clamp(0, kv_length).to(torch.int32)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (the keys a query sees, itself included); got {window!r}.")
    return load_kernel()(
        query.transpose(1, 2),
        key_cache,
        value_cache,
        cache_seqlens=lengths,
        block_table=block_table.to(torch.int32),
        softmax_scale=float(scale),
        causal=True,
        softcap=float(softcap or 0.0),  # flash-attn's "off"
        window_size=(-1, -1) if window is None else (window - 1, 0),
    )


def _check_operands(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    softcap: float | None,
) -> None:
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype or value_cache.stride(-1) != 1:
        raise ValueError(
            f"value_cache must match key_cache in shape and dtype and be contiguous along head_dim; got "
            f"{tuple(value_cache.shape)} {value_cache.dtype} and {tuple(key_cache.shape)} {key_cache.dtype}."
        )
    if block_table.dim() != 2 or block_table.shape[0] != query.shape[0] or block_table.device != query.device:
        raise ValueError(
            f"block_table must be [batch={query.shape[0]}, blocks] on {query.device}; got {tuple(block_table.shape)} "
            f"on {block_table.device}."
        )
    capacity = block_table.shape[1] * key_cache.shape[1]
    if not 0 < kv_length <= capacity:
        raise ValueError(f"kv_length must be in [1, {capacity}] (blocks in the table x block size); got {kv_length}.")
    if query.shape[2] > kv_length:
        raise ValueError(f"q_len ({query.shape[2]}) cannot exceed kv_length ({kv_length}): queries are cached keys.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None; got {softcap}.")
