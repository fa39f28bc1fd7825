"""Host-side pieces shared by the Triton paged decode kernels (full precision and sealed blocks).

Both kernels attend in split-K fashion: the key positions of a row are cut into `splits` ranges of
`split_tokens` tokens, each attended by its own program, and `paged_decode_combine_kernel` merges the
per-split (max, denominator, unnormalized output) into the final output. This module sizes the splits,
normalizes row lengths and masks into what the kernels read, and runs the combine step.

Split count: on CUDA, enough splits that `batch * kv_heads * splits` covers the GPU's multiprocessors
twice (a decode batch alone rarely does); on the CPU (the Triton interpreter, `TRITON_INTERPRET=1`) one
split, since more programs only cost more there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from hf_kvgov.kernels.sinks import checked_sinks
from hf_kvgov.kernels.triton_paged_kernel import (
    MASK_ADDITIVE,
    MASK_BOOL,
    MASK_NONE,
    paged_decode_combine_kernel,
    paged_decode_split_kernel,
)

BLOCK_N = 64  # key tokens per tile
MIN_BLOCK_H = 16  # tl.dot needs at least 16 rows: a GQA group is padded up to this
MIN_TILES_PER_SPLIT = 4  # a split shorter than this costs more in the combine step than it saves
MAX_SPLITS = 64

# Decided once, when triton decorated the kernels: compiled kernels need CUDA tensors, the interpreter
# runs on CPU tensors.
INTERPRETED = isinstance(paged_decode_split_kernel, InterpretedFunction)


@dataclass(frozen=True)
class SplitPlan:
    """How the key positions of every row are cut: `splits` ranges of `split_tokens` (a multiple of BLOCK_N)."""

    splits: int
    split_tokens: int


def plan_splits(requested: int | None, batch: int, kv_heads: int, kv_length: int, device: torch.device) -> SplitPlan:
    """The split plan for one call; `requested` (None: from the device) is an upper bound on the count."""
    wanted = _split_count(requested, batch, kv_heads, kv_length, device)
    split_tokens = BLOCK_N * math.ceil(math.ceil(max(kv_length, 1) / wanted) / BLOCK_N)
    return SplitPlan(max(1, math.ceil(kv_length / split_tokens)), split_tokens)


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


def block_h(group: int) -> int:
    """Rows of the query tile for `group` query heads per KV head (padded to what tl.dot accepts)."""
    return max(MIN_BLOCK_H, triton.next_power_of_2(group))


def row_lengths(seq_lens: torch.Tensor | None, batch: int, kv_length: int, device: torch.device) -> torch.Tensor:
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


def mask_rows(mask: torch.Tensor | None, batch: int, kv_length: int, device: torch.device) -> tuple[int, torch.Tensor]:
    """The kernel's mask mode and a `[batch, kv_length]` row per batch entry (int8 or fp32)."""
    if mask is None:
        return MASK_NONE, torch.zeros((1, 1), dtype=torch.int8, device=device)  # never read
    if mask.shape[-1] < kv_length:
        raise ValueError(f"mask must cover kv_length={kv_length} keys; got shape {tuple(mask.shape)}.")
    rows = mask[:, 0, 0, :kv_length].expand(batch, kv_length)
    if mask.dtype == torch.bool:
        return MASK_BOOL, rows.to(torch.int8)
    return MASK_ADDITIVE, rows.to(torch.float32)


def partial_state(
    batch: int, q_heads: int, splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty fp32 buffers the split kernels fill: max and denominator `[batch, q_heads, splits]`, and the
    unnormalized output `[batch, q_heads, splits, head_dim]` (all contiguous, as the kernels index them)."""
    m = torch.empty((batch, q_heads, splits), dtype=torch.float32, device=device)
    acc = torch.empty((batch, q_heads, splits, head_dim), dtype=torch.float32, device=device)
    return m, torch.empty_like(m), acc


def combine_splits(
    m: torch.Tensor, denom: torch.Tensor, acc: torch.Tensor, dtype: torch.dtype, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """Merge the splits of `partial_state` into the output `[batch, 1, q_heads, head_dim]` of `dtype`, with each
    query head's learned sink logit (`sinks` `[q_heads]`) in its denominator when given."""
    batch, q_heads, splits, head_dim = acc.shape
    sink_logits = m if sinks is None else checked_sinks(sinks, q_heads, acc.device).contiguous()
    out = torch.empty((batch, 1, q_heads, head_dim), dtype=dtype, device=acc.device)
    paged_decode_combine_kernel[(batch, q_heads)](
        m, denom, acc, sink_logits, out, splits, out.stride(0), out.stride(2), out.stride(3),
        SPLITS=triton.next_power_of_2(splits), HEAD_DIM=head_dim, USE_SINKS=sinks is not None,
    )  # fmt: skip
    return out


def check_value_cache(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Raise ValueError unless `value_cache` matches `key_cache` and sits on the query's device."""
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError(
            f"value_cache must match key_cache in shape and dtype; got {tuple(value_cache.shape)} {value_cache.dtype}"
            f" and {tuple(key_cache.shape)} {key_cache.dtype}."
        )
    if value_cache.device != query.device:
        raise ValueError(f"value_cache must be on the query's device {query.device}; got {value_cache.device}.")


def check_table(block_table: torch.Tensor, batch: int, block_size: int, kv_length: int, device: torch.device) -> None:
    """Raise ValueError unless `block_table` is an int `[batch, blocks]` tensor covering `kv_length` tokens."""
    if block_table.device != device:
        raise ValueError(f"block_table must be on the query's device {device}; got {block_table.device}.")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(f"block_table must be [batch={batch}, blocks]; got {tuple(block_table.shape)}.")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must hold int32 or int64 block ids; got {block_table.dtype}.")
    capacity = block_table.shape[1] * block_size
    if not 0 <= kv_length <= capacity:
        raise ValueError(f"kv_length must be in [0, {capacity}] (blocks in the table x block size); got {kv_length}.")


def check_scalars(chunk_tokens: int, softcap: float | None) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive; got {chunk_tokens}.")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None; got {softcap}.")


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """The kernels' DOT_PRECISION / WIDEN_BF16 constexprs for queries of `dtype` (see `_dot`)."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "WIDEN_BF16": INTERPRETED and dtype == torch.bfloat16,
    }
