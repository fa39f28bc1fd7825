"""Paged decode attention with Triton: the fast path of `paged_attention_reference` for q_len == 1.

`paged_attention_triton` takes the reference's arguments (plus per-row lengths) and returns the same
`[batch, 1, q_heads, head_dim]`; `supports` tells `dispatch` which calls it can serve, everything else
(prefill, odd head dims, per-head masks) stays on the torch reference. The kernels themselves and their
memory walk are in `triton_paged_kernel.py`.

What the kernel accepts:
- q_len == 1; head_dim a power of two from 16 to 256; q_heads a multiple of kv_heads (any group size);
- fp32, fp16 or bf16, the same dtype for query and caches; fp32 accumulation in every case;
- any block size (a key tile of `BLOCK_N` tokens may span several blocks or part of one);
- `mask` None, or `[batch or 1, 1, 1, >= kv_length]` bool (True = attend; masked keys are not loaded) or
  additive float (added to the logits after soft-capping, as in the reference); keys past kv_length in
  the mask are ignored;
- `seq_lens` long `[batch]`: row b attends to its first `min(seq_lens[b], kv_length)` tokens, so a ragged
  batch needs no mask. Values are not checked against the table on the host (that would synchronize
  the GPU every step); they are clamped to `[0, kv_length]` inside the kernel instead.

Split-K: long contexts are cut into `num_splits` ranges of key positions, attended in parallel, and
merged by a second small kernel from each split's (max, denominator, unnormalized output). On CUDA the
split count is chosen so that `batch * kv_heads * splits` covers the GPU twice; on the CPU (the Triton
interpreter, `TRITON_INTERPRET=1`, used by the tests) one split is the default, since more programs only
cost more there.

fp32 inputs use IEEE fp32 dot products (no TF32), so they match the reference to ~1e-6. fp16/bf16
inputs multiply in their own dtype with fp32 accumulation, and the softmax weights are rounded to that
dtype before the product with V, as FlashAttention does.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from hf_kvgov.kernels.reference import DEFAULT_CHUNK_TOKENS
from hf_kvgov.kernels.triton_paged_kernel import (
    KV_FORMAT_NATIVE,
    MASK_ADDITIVE,
    MASK_BOOL,
    MASK_NONE,
    paged_decode_combine_kernel,
    paged_decode_split_kernel,
)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
BLOCK_N = 64  # key tokens per tile
MIN_BLOCK_H = 16  # tl.dot needs at least 16 rows: a GQA group is padded up to this
MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in the combine step than it saves
MAX_SPLITS = 64

# Decided once, when triton decorated the kernel: compiled kernels need CUDA tensors, the interpreter
# runs on CPU tensors.
INTERPRETED = isinstance(paged_decode_split_kernel, InterpretedFunction)


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
        num_splits: split-K factor (None: chosen from the device, see the module docstring).
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
    lens = _row_lengths(seq_lens, batch, kv_length, query.device)
    splits = _split_count(num_splits, batch, kv_heads, kv_length, query.device)
    split_tokens = BLOCK_N * math.ceil(math.ceil(max(kv_length, 1) / splits) / BLOCK_N)
    splits = max(1, math.ceil(kv_length / split_tokens))

    m = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=query.device)
    denom = torch.empty_like(m)
    acc = torch.empty((batch, q_heads, splits, head_dim), dtype=torch.float32, device=query.device)
    mask_mode, mask_rows = _mask_rows(mask, batch, kv_length, query.device)
    group = q_heads // kv_heads
    paged_decode_split_kernel[(batch, kv_heads, splits)](
        query, key_cache, value_cache, block_table, lens, mask_rows, m, denom, acc,
        kv_length, split_tokens, float(scale), float(softcap or 1.0),
        query.stride(0), query.stride(1), query.stride(3),
        *key_cache.stride(), *value_cache.stride(), *block_table.stride(), *mask_rows.stride(),
        GROUP=group,
        BLOCK_H=max(MIN_BLOCK_H, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=key_cache.shape[1],
        BLOCK_N=BLOCK_N,
        MASK_MODE=mask_mode,
        USE_SOFTCAP=softcap is not None,
        KV_FORMAT=KV_FORMAT_NATIVE,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN_BF16=INTERPRETED and query.dtype == torch.bfloat16,
    )  # fmt: skip
    out = torch.empty((batch, 1, q_heads, head_dim), dtype=query.dtype, device=query.device)
    paged_decode_combine_kernel[(batch, q_heads)](
        m, denom, acc, out, splits, out.stride(0), out.stride(2), out.stride(3),
        SPLITS=triton.next_power_of_2(splits), HEAD_DIM=head_dim,
    )  # fmt: skip
    return out


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
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache must match key_cache in shape and dtype; got {tuple(value_cache.shape)} {value_cache.dtype}"
            f" and {tuple(key_cache.shape)} {key_cache.dtype}."
        )
    if value_cache.device != query.device or block_table.device != query.device:
        raise ValueError(f"value_cache and block_table must be on the query's device {query.device}.")
    if block_table.dim() != 2 or block_table.shape[0] != query.shape[0]:
        raise ValueError(f"block_table must be [batch={query.shape[0]}, blocks]; got {tuple(block_table.shape)}.")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must hold int32 or int64 block ids; got {block_table.dtype}.")
    capacity = block_table.shape[1] * key_cache.shape[1]
    if not 0 <= kv_length <= capacity:
        raise ValueError(f"kv_length must be in [0, {capacity}] (blocks in the table x block size); got {kv_length}.")
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive; got {chunk_tokens}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None; got {softcap}.")


def _row_lengths(seq_lens: torch.Tensor | None, batch: int, kv_length: int, device: torch.device) -> torch.Tensor:
    """int64 `[batch]` lengths for the kernel (it clamps them to kv_length)."""
    if seq_lens is None:
        return torch.full((batch,), kv_length, dtype=torch.int64, device=device)
    if seq_lens.shape != (batch,) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"seq_lens must be an int32/int64 tensor of shape [{batch}]; got {seq_lens.dtype} {tuple(seq_lens.shape)}."
        )
    if seq_lens.device != device:
        raise ValueError(f"seq_lens must be on the query's device {device}; got {seq_lens.device}.")
    return seq_lens.clamp_min(0).to(torch.int64).contiguous()


def _mask_rows(mask: torch.Tensor | None, batch: int, kv_length: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """The kernel's mask mode and a `[batch, kv_length]` row per batch entry (int8 or fp32)."""
    if mask is None:
        return MASK_NONE, torch.zeros((1, 1), dtype=torch.int8, device=device)  # never read
    if mask.shape[-1] < kv_length:
        raise ValueError(f"mask must cover kv_length={kv_length} keys; got shape {tuple(mask.shape)}.")
    rows = mask[:, 0, 0, :kv_length].expand(batch, kv_length)
    if mask.dtype == torch.bool:
        return MASK_BOOL, rows.to(torch.int8)
    return MASK_ADDITIVE, rows.to(torch.float32)


def _split_count(requested: int | None, batch: int, kv_heads: int, kv_length: int, device: torch.device) -> int:
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"num_splits must be a positive int or None; got {requested!r}.")
        return requested
    if device.type != "cuda":
        return 1
    tiles = math.ceil(kv_length / BLOCK_N)
    wanted = math.ceil(2 * _multiprocessors(device) / (batch * kv_heads))
    return max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT, MAX_SPLITS))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
