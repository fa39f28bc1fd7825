"""Paged decode attention over sealed (int8 / int4 / int2 / fp8 / raw) and full-precision blocks, with Triton.

The fast path of `quantized_paged_attention_reference` for q_len == 1: the kernel (`triton_quantized_kernel.py`)
reads sealed codes and scales straight from the sealed store's tensors and dequantizes in registers; no block is
decoded into memory. `supports` accepts what `triton_paged` accepts plus `SealedBlocks` of a format in
`KERNEL_FORMATS`, with statistics of any float dtype or of one byte (`hf_kvgov.codecs.numerics`) and any value
group size. fp32 queries agree with the reference (fp32 decode and attention) to ~1e-6; fp16/bf16 round each
dequantized tile and the softmax weights to the query's dtype for the tensor-core product, as the full-precision
kernel and FlashAttention do, about one ulp of the dtype in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvgov.codecs.numerics import LOG_SCALE, ONE_BYTE_ZERO
from hf_kvgov.kernels.reference import DEFAULT_CHUNK_TOKENS
from hf_kvgov.kernels.sealed_blocks import RAW_FORMAT, SealedBlocks
from hf_kvgov.kernels.triton_launch import (
    BLOCK_N,
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
from hf_kvgov.kernels.triton_paged import unsupported_reason as dense_unsupported_reason
from hf_kvgov.kernels.triton_quantized_kernel import (
    SEALED_FP8_E4M3,
    SEALED_FP8_E5M2,
    SEALED_INT2,
    SEALED_INT4,
    SEALED_INT8,
    SEALED_RAW,
    paged_decode_sealed_split_kernel,
)


@dataclass(frozen=True)
class KernelFormat:
    """How the kernel reads one sealed format.

    Attributes:
        code: the kernel's SEALED_FORMAT constexpr.
        codes_per_byte: codes packed into one byte along head_dim (2 for int4, 4 for int2).
        key_zero / value_zero: the format stores zero points for keys / values (fp8: keys only).
        codes_dtype: dtype of the stored codes (None: raw values, any float dtype).
    """

    code: int
    codes_per_byte: int
    key_zero: bool
    value_zero: bool
    codes_dtype: torch.dtype | None


KERNEL_FORMATS: dict[str, KernelFormat] = {
    RAW_FORMAT: KernelFormat(SEALED_RAW.value, 1, False, False, None),
    "int8": KernelFormat(SEALED_INT8.value, 1, True, True, torch.uint8),
    "int4": KernelFormat(SEALED_INT4.value, 2, True, True, torch.uint8),
    "int2": KernelFormat(SEALED_INT2.value, 4, True, True, torch.uint8),
    "fp8_e4m3": KernelFormat(SEALED_FP8_E4M3.value, 1, True, False, torch.float8_e4m3fn),
    "fp8_e5m2": KernelFormat(SEALED_FP8_E5M2.value, 1, True, False, torch.float8_e5m2),
}


def supports(
    query: torch.Tensor, key_cache: torch.Tensor, mask: torch.Tensor | None, sealed: SealedBlocks | None
) -> bool:
    """True when `quantized_paged_attention_triton` can serve this call."""
    return unsupported_reason(query, key_cache, mask, sealed) is None


def unsupported_reason(
    query: torch.Tensor, key_cache: torch.Tensor, mask: torch.Tensor | None, sealed: SealedBlocks | None
) -> str | None:
    """A sentence saying why the kernel cannot serve these inputs, or None when it can (cheap, no sync)."""
    reason = dense_unsupported_reason(query, key_cache, mask)
    if reason is not None:
        return reason
    if sealed is None:
        return "the sealed-block kernel needs the layer's SealedBlocks (the store's tensors); none were given."
    if sealed.format not in KERNEL_FORMATS:
        return f"sealed format {sealed.format!r} has no Triton decoder; it reads {sorted(KERNEL_FORMATS)}."
    return None


@dataclass(frozen=True)
class _SealedOperands:
    """The sealed pieces as the kernel takes them: fp8 codes and e4m3 zero points as bytes; where there are no
    zero points (fp8 values), the scales stand in for them (never read).

    ``log_scales``: the scales are `LOG_SCALE` bytes; ``byte_zeros``: the zero points are e4m3 bytes.
    """

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_zero: torch.Tensor
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_zero: torch.Tensor
    value_group: int
    log_scales: bool = False
    byte_zeros: bool = False


def quantized_paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    sealed: SealedBlocks,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    *,
    seq_lens: torch.Tensor | None = None,
    num_splits: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a table of full-precision (id >= 0) and sealed (id < 0) blocks.

    Args:
        query: `[batch, q_heads, 1, head_dim]`.
        key_cache, value_cache: `[num_blocks, block_size, kv_heads, head_dim]`, the full-precision blocks.
        block_table: int32/int64 `[batch, blocks]`; entry b < 0 is sealed id -1 - b of `sealed`.
        sealed: the layer's sealed blocks (see `sealed_blocks` for the pieces' shapes).
        kv_length, scale, mask, softcap, chunk_tokens, seq_lens, num_splits, sinks: as `paged_attention_triton`.
    Returns:
        `[batch, 1, q_heads, head_dim]` in the query's dtype.
    Raises:
        ValueError: for inputs the kernel does not serve, or pieces that disagree with the caches.
    """
    reason = unsupported_reason(query, key_cache, mask, sealed)
    if reason is not None:
        raise ValueError(reason)
    check_value_cache(query, key_cache, value_cache)
    check_table(block_table, query.shape[0], key_cache.shape[1], kv_length, query.device)
    check_scalars(chunk_tokens, softcap)
    pieces = _sealed_operands(sealed, key_cache)
    fmt = KERNEL_FORMATS[sealed.format]
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    lens = row_lengths(seq_lens, batch, kv_length, query.device)
    plan = plan_splits(num_splits, batch, kv_heads, kv_length, query.device)
    m, denom, acc = partial_state(batch, q_heads, plan.splits, head_dim, query.device)
    mask_mode, rows = mask_rows(mask, batch, kv_length, query.device)
    group = q_heads // kv_heads
    codes, ks, vs = pieces.key_codes, pieces.key_scale, pieces.value_scale
    paged_decode_sealed_split_kernel[(batch, kv_heads, plan.splits)](
        query, key_cache, value_cache, codes, ks, pieces.key_zero, pieces.value_codes, vs, pieces.value_zero,
        block_table, lens, rows, m, denom, acc,
        kv_length, plan.split_tokens, float(scale), float(softcap or 1.0),
        query.stride(0), query.stride(1), query.stride(3),
        *key_cache.stride(), *value_cache.stride(),
        codes.stride(0), codes.stride(1), codes.stride(2),
        ks.stride(0), ks.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        *block_table.stride(), *rows.stride(),
        GROUP=group, BLOCK_H=block_h(group), HEAD_DIM=head_dim, PAGE=key_cache.shape[1], BLOCK_N=BLOCK_N,
        MASK_MODE=mask_mode, USE_SOFTCAP=softcap is not None,
        SEALED_FORMAT=fmt.code, KEY_ZERO=fmt.key_zero, VALUE_ZERO=fmt.value_zero, VALUE_GROUP=pieces.value_group,
        LOG_SCALES=pieces.log_scales, BYTE_ZEROS=pieces.byte_zeros, **dot_options(query.dtype),
    )  # fmt: skip
    return combine_splits(m, denom, acc, query.dtype, sinks)


def _sealed_operands(sealed: SealedBlocks, key_cache: torch.Tensor) -> _SealedOperands:
    """Check the pieces against the full-precision cache `[blocks, block_size, H, D]` and arrange them."""
    fmt = KERNEL_FORMATS[sealed.format]
    _, block_size, heads, head_dim = key_cache.shape
    capacity = sealed.capacity
    if fmt.codes_dtype is None:
        keys, values = sealed.piece("keys"), sealed.piece("values")
        for name, raw in (("keys", keys), ("values", values)):
            _expect(sealed, name, raw, (capacity, block_size, heads, head_dim), key_cache.device)
            if not raw.dtype.is_floating_point:
                raise ValueError(f"Raw sealed {name} must be floating point; got {raw.dtype}.")
        keys, values = _nonempty(keys), _nonempty(values)
        return _SealedOperands(keys, keys, keys, values, keys, keys, 1)  # statistics are never read
    code_shape = (capacity, block_size, heads, head_dim // fmt.codes_per_byte)
    key_codes = _codes(sealed, "key_codes", fmt, code_shape, key_cache.device)
    value_codes = _codes(sealed, "value_codes", fmt, code_shape, key_cache.device)
    groups = sealed.piece("value_scale").shape[-1]
    if groups < 1 or head_dim % groups:
        raise ValueError(f"value_scale's last dim ({groups}) must divide head_dim ({head_dim}).")
    key_stats, value_stats = (capacity, 1, heads, head_dim), (capacity, block_size, heads, groups)
    device = key_cache.device
    key_scale = _statistic(sealed, "key_scale", key_stats, device)
    value_scale = _statistic(sealed, "value_scale", value_stats, device)
    if key_scale.dtype != value_scale.dtype:
        raise ValueError(
            f"key_scale and value_scale must share one dtype; got {key_scale.dtype} and {value_scale.dtype}."
        )
    key_zero, value_zero = key_scale, value_scale  # stand-ins: KEY_ZERO / VALUE_ZERO False never read them
    if fmt.key_zero:
        key_zero = _statistic(sealed, "key_zero", key_stats, device, sealed.piece("key_scale").stride())
    if fmt.value_zero:
        value_zero = _statistic(sealed, "value_zero", value_stats, device, sealed.piece("value_scale").stride())
    zeros = [z.dtype for z, kept in ((key_zero, fmt.key_zero), (value_zero, fmt.value_zero)) if kept]
    if len(set(zeros)) > 1:
        raise ValueError(f"key_zero and value_zero must share one dtype; got {zeros[0]} and {zeros[1]}.")
    # fp8 keys' zero points are e4m3 whatever the scales (the codec's format); the kernel decodes the bytes.
    if fmt.codes_dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and zeros != [ONE_BYTE_ZERO]:
        raise ValueError(f"{sealed.format} key_zero must be torch.float8_e4m3fn; got {zeros[0]}.")
    byte_zeros = bool(zeros) and zeros[0] == ONE_BYTE_ZERO
    if byte_zeros:
        key_zero, value_zero = key_zero.view(torch.uint8), value_zero.view(torch.uint8)
    if value_codes.stride() != key_codes.stride():
        raise ValueError("key_codes and value_codes must share one memory layout (strides).")
    return _SealedOperands(
        key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, head_dim // groups,
        log_scales=key_scale.dtype == LOG_SCALE, byte_zeros=byte_zeros,
    )  # fmt: skip


def _codes(
    sealed: SealedBlocks, name: str, fmt: KernelFormat, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    codes = _expect(sealed, name, sealed.piece(name), shape, device)
    if codes.dtype != fmt.codes_dtype:
        raise ValueError(f"{sealed.format} {name} must be {fmt.codes_dtype}; got {codes.dtype}.")
    # Bytes, whatever the codes' dtype: the kernel decodes fp8 bit patterns itself.
    return _nonempty(codes.view(torch.uint8))


def _statistic(
    sealed: SealedBlocks,
    name: str,
    shape: tuple[int, ...],
    device: torch.device,
    strides: tuple[int, ...] | None = None,
) -> torch.Tensor:
    stat = _expect(sealed, name, sealed.piece(name), shape, device)
    if not (stat.dtype.is_floating_point or (stat.dtype == LOG_SCALE and name.endswith("_scale"))):
        raise ValueError(
            f"{sealed.format} {name} must be floating point{' or LOG_SCALE bytes' if name.endswith('_scale') else ''}; "
            f"got {stat.dtype}."
        )
    if strides is not None and stat.stride() != strides:
        raise ValueError(f"{sealed.format} {name} must have the strides {strides} of its scale; got {stat.stride()}.")
    return _nonempty(stat)


def _expect(
    sealed: SealedBlocks, name: str, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{sealed.format} sealed piece {name!r} must have shape {shape}; got {tuple(tensor.shape)}.")
    if tensor.device != device:
        raise ValueError(f"Sealed piece {name!r} must be on the caches' device {device}; got {tensor.device}.")
    if tensor.stride(-1) != 1:
        raise ValueError(f"Sealed piece {name!r} must be contiguous along its last dim; got strides {tensor.stride()}.")
    return tensor


def _nonempty(tensor: torch.Tensor) -> torch.Tensor:
    """A store with no sealed block yet has 0-row pieces: hand the kernel one unread row instead of a
    null pointer (which the CUDA launcher rejects)."""
    return tensor if tensor.shape[0] else tensor.new_zeros((1, *tensor.shape[1:]))
