"""Paged decode attention with Triton: the fast path of `paged_attention_reference` for q_len == 1.

`paged_attention_triton` takes the reference's arguments (plus per-row lengths) and returns the same; `supports`
tells `dispatch` which calls it serves: q_len == 1, head_dim a power of two from 16 to 256, any GQA group, fp32 /
fp16 / bf16 (one dtype, fp32 accumulation), any block size, a bool or additive decode mask, and `seq_lens` for
ragged rows. `seq_lens` is clamped inside the kernel rather than checked on the host, which would synchronize the
GPU every step. Long contexts are split into `num_splits` key ranges attended in parallel and merged by a second
kernel (`triton_launch.py` chooses the count; the kernels are in `triton_paged_kernel.py`). fp32 uses IEEE dot
products (no TF32), matching the reference to ~1e-6; fp16/bf16 multiply in their dtype, and the softmax weights
are rounded to it before the product with V, as FlashAttention does.
"""

from __future__ import annotations

import torch

from hf_kvgov.kernels.reference import DEFAULT_CHUNK_TOKENS
from hf_kvgov.kernels.triton_launch import (
    BLOCK_N,
    INTERPRETED,
    block_h,
    check_scalars,
    check_table,
    check_value_cache,
    combine_splits,
    dot_options,
    mask_rows,
    partial_state,
    plan_splits,
    row_lengths,
)
from hf_kvgov.kernels.triton_paged_kernel import KV_FORMAT_NATIVE, paged_decode_split_kernel

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def supports(query: torch.Tensor, key_cache: torch.Tensor, mask: torch.Tensor | None = None) -> bool:
    """True when `paged_attention_triton` can serve this call (what `dispatch` asks before using it)."""
    return unsupported_reason(query, key_cache, mask) is None


def unsupported_reason(query: torch.Tensor, key_cache: torch.Tensor, mask: torch.Tensor | None) -> str | None:
    """A sentence saying why the kernel cannot serve these inputs, or None when it can.

    Called on every dispatched decode step, so the checks are cheap and build a message only on failure.
    """
    return _shape_problem(query, key_cache) or _placement_problem(query, key_cache) or _mask_problem(mask, query)


def _shape_problem(query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    if query.dim() != 4 or key_cache.dim() != 4:
        return (
            f"query must be [batch, q_heads, q_len, head_dim] and key_cache [num_blocks, block_size, kv_heads, "
            f"head_dim]; got shapes {tuple(query.shape)} and {tuple(key_cache.shape)}."
        )
    _, q_heads, q_len, head_dim = query.shape
    kv_heads, cache_dim = key_cache.shape[2], key_cache.shape[3]
    if q_len != 1:
        return f"the Triton kernel serves decode (q_len == 1) only; got q_len={q_len} (use the reference)."
    if not (_is_power_of_two(head_dim) and MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
        return f"head_dim must be a power of two from {MIN_HEAD_DIM} to {MAX_HEAD_DIM}; got {head_dim}."
    if cache_dim != head_dim:
        return f"key_cache head_dim {cache_dim} differs from the query's {head_dim}."
    if kv_heads == 0 or q_heads % kv_heads:
        return f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for grouped attention."
    return None


def _placement_problem(query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    if query.dtype not in SUPPORTED_DTYPES or key_cache.dtype != query.dtype:
        return (
            f"query and key_cache must share one dtype of {SUPPORTED_DTYPES}; got {query.dtype} and {key_cache.dtype}."
        )
    if query.device != key_cache.device:
        return f"query is on {query.device} but key_cache on {key_cache.device}."
    if not (query.is_cuda or (INTERPRETED and query.device.type == "cpu")):
        return (
            f"the compiled Triton kernel needs CUDA tensors; got {query.device} (to run the interpreter on the "
            "CPU, set TRITON_INTERPRET=1 before hf_kvgov.kernels.triton_paged is first imported)."
        )
    return None


def _mask_problem(mask: torch.Tensor | None, query: torch.Tensor) -> str | None:
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[0] not in (1, query.shape[0]) or mask.shape[1] != 1 or mask.shape[2] != 1:
        return f"mask must be [batch or 1, 1, 1, kv_length] for decode; got shape {tuple(mask.shape)}."
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        return f"mask must be bool (True = attend) or an additive float mask; got dtype {mask.dtype}."
    return None


def paged_attention_triton(
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
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of `query` over the tokens held by `block_table`, as `paged_attention_reference`.

    Args:
        query: `[batch, q_heads, 1, head_dim]`.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]` (one layer of the pool).
        block_table: int32/int64 `[batch, blocks]` with `blocks * block_size >= kv_length`.
        kv_length: tokens per row (the longest row when `seq_lens` is given).
        mask: None, or `[batch or 1, 1, 1, >= kv_length]` bool (True = attend) or additive float.
        softcap: optional tanh soft-capping of the logits (Gemma-2 style), > 0.
        chunk_tokens: accepted for signature compatibility with the reference; the kernel's working set
            is one tile of `BLOCK_N` tokens whatever its value.
        seq_lens: optional int `[batch]`; row b attends to its first `seq_lens[b]` tokens (default: all
            `kv_length`).
        num_splits: split-K factor (None: chosen from the device, see `triton_launch`).
        sinks: optional learned sink logit per query head `[q_heads]`, merged with the splits.
    Returns:
        `[batch, 1, q_heads, head_dim]` in the query's dtype.
    Raises:
        ValueError: for inputs the kernel does not serve (see `unsupported_reason`) or that disagree.
    """
    reason = unsupported_reason(query, key_cache, mask)
    if reason is not None:
        raise ValueError(reason)
    _check_operands(query, key_cache, value_cache, block_table, kv_length, chunk_tokens, softcap)
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    lens = row_lengths(seq_lens, batch, kv_length, query.device)
    plan = plan_splits(num_splits, batch, kv_heads, kv_length, query.device)
    m, denom, acc = partial_state(batch, q_heads, plan.splits, head_dim, query.device)
    mask_mode, rows = mask_rows(mask, batch, kv_length, query.device)
    group = q_heads // kv_heads
    paged_decode_split_kernel[(batch, kv_heads, plan.splits)](
        query, key_cache, value_cache, block_table, lens, rows, m, denom, acc,
        kv_length, plan.split_tokens, float(scale), float(softcap or 1.0),
        query.stride(0), query.stride(1), query.stride(3),
        *key_cache.stride(), *value_cache.stride(), *block_table.stride(), *rows.stride(),
        GROUP=group,
        BLOCK_H=block_h(group),
        HEAD_DIM=head_dim,
        PAGE=key_cache.shape[1],
        BLOCK_N=BLOCK_N,
        MASK_MODE=mask_mode,
        USE_SOFTCAP=softcap is not None,
        KV_FORMAT=KV_FORMAT_NATIVE,
        **dot_options(query.dtype),
    )  # fmt: skip
    return combine_splits(m, denom, acc, query.dtype, sinks)


def _check_operands(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    chunk_tokens: int,
    softcap: float | None,
) -> None:
    """The checks `supports` leaves to the call: they concern arguments dispatch does not look at."""
    check_value_cache(query, key_cache, value_cache)
    check_table(block_table, query.shape[0], key_cache.shape[1], kv_length, query.device)
    check_scalars(chunk_tokens, softcap)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
