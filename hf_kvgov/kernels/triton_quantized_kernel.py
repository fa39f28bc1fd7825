"""Triton paged decode over a block table whose entries mix full-precision and sealed (quantized) blocks.

Grid, split-K and attention math are `paged_decode_split_kernel`'s; only tiles load differently
(`paged_decode_sealed_split_kernel` gives the loads). Dequantization is in registers, in fp32, exactly as the codecs
decode (`quantized_reference.py` is the spec), so sealed blocks are read in place, never expanded in memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_kvgov.codecs.numerics import LOG_SCALE_BIAS, LOG_SCALE_STEPS
from hf_kvgov.kernels.triton_paged_kernel import (
    _load_query,
    _logits,
    _online_softmax_update,
    _split_range,
    _store_partial,
    _tile_tokens,
)

# SEALED_FORMAT values (constexpr globals, so the jitted code may compare against them).
SEALED_RAW = tl.constexpr(0)
SEALED_INT8 = tl.constexpr(1)
SEALED_INT4 = tl.constexpr(2)
SEALED_FP8_E4M3 = tl.constexpr(3)
SEALED_FP8_E5M2 = tl.constexpr(4)
SEALED_INT2 = tl.constexpr(5)
_LOG_SCALE_BIAS = tl.constexpr(float(LOG_SCALE_BIAS))
_LOG_SCALE_STEPS = tl.constexpr(float(LOG_SCALE_STEPS))


@triton.jit
def _fp8_e4m3_to_float(bits):
    """int32 tile of e4m3fn bytes (0..255) -> fp32 values.

    fp8 goes through fp16 with integer ops, so no fp8 hardware is needed: an e4m3fn byte `s eeee mmm` as fp16
    `s 0eeee mmm0000000` is the value times 2**-8, so it is widened and multiplied by 256, exactly. e4m3fn's NaN
    (0x7F / 0xFF) would read as 480; the codec never stores it.
    """
    half = ((bits & 0x80) << 8) | ((bits & 0x7F) << 7)
    return half.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def _fp8_e5m2_to_float(bits):
    """int32 tile of e5m2 bytes (0..255) -> fp32 values, with integer ops (no fp8 hardware needed): an e5m2 byte
    is the top byte of the equal fp16 (`bits << 8`)."""
    return (bits << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _code_values(codes_ptr, code_offsets, dims, ok, SEALED_FORMAT: tl.constexpr):
    """`[BLOCK_N, HEAD_DIM]` fp32 code values (raw values for SEALED_RAW); 0 where `ok` is False."""
    if SEALED_FORMAT == SEALED_INT4:
        ptrs = codes_ptr + code_offsets[:, None] + (dims // 2)[None, :]
        byte = tl.load(ptrs, mask=ok[:, None], other=0).to(tl.int32)
        return ((byte >> ((dims % 2) * 4)[None, :]) & 0xF).to(tl.float32)
    if SEALED_FORMAT == SEALED_INT2:
        ptrs = codes_ptr + code_offsets[:, None] + (dims // 4)[None, :]
        byte = tl.load(ptrs, mask=ok[:, None], other=0).to(tl.int32)
        return ((byte >> ((dims % 4) * 2)[None, :]) & 0x3).to(tl.float32)
    raw = tl.load(codes_ptr + code_offsets[:, None] + dims[None, :], mask=ok[:, None], other=0)
    if SEALED_FORMAT == SEALED_FP8_E4M3:
        return _fp8_e4m3_to_float(raw.to(tl.int32))
    if SEALED_FORMAT == SEALED_FP8_E5M2:
        return _fp8_e5m2_to_float(raw.to(tl.int32))
    return raw.to(tl.float32)


@triton.jit
def _sealed_tile(
    codes_ptr, scale_ptr, zero_ptr, code_offsets, stat_offsets, stat_cols, dims, ok,
    SEALED_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr, LOG_SCALES: tl.constexpr, BYTE_ZEROS: tl.constexpr,
):  # fmt: skip
    """Dequantized `[BLOCK_N, HEAD_DIM]` fp32 keys or values of sealed tokens; 0 where `ok` is False.

    `stat_offsets` `[BLOCK_N]` locate each token's row of statistics and `stat_cols` `[HEAD_DIM]` the
    statistic of each channel (the channel itself for keys, its group for values).
    """
    x = _code_values(codes_ptr, code_offsets, dims, ok, SEALED_FORMAT)
    if SEALED_FORMAT != SEALED_RAW:
        stat = stat_offsets[:, None] + stat_cols[None, :]
        if LOG_SCALES:
            scale_code = tl.load(scale_ptr + stat, mask=ok[:, None], other=0).to(tl.float32)
            x = x * tl.exp2((scale_code - _LOG_SCALE_BIAS) / _LOG_SCALE_STEPS)
        else:
            x = x * tl.load(scale_ptr + stat, mask=ok[:, None], other=0.0).to(tl.float32)
        if HAS_ZERO:
            if BYTE_ZEROS:
                zero_bits = tl.load(zero_ptr + stat, mask=ok[:, None], other=0).to(tl.int32)
                x = x + _fp8_e4m3_to_float(zero_bits)
            else:
                x = x + tl.load(zero_ptr + stat, mask=ok[:, None], other=0.0).to(tl.float32)
    return x


@triton.jit
def _mixed_tile(
    full_ptr, full_offsets, stride_d, codes_ptr, scale_ptr, zero_ptr, code_offsets, stat_offsets, stat_cols,
    dims, full_ok, sealed_ok, SEALED_FORMAT: tl.constexpr, HAS_ZERO: tl.constexpr, LOG_SCALES: tl.constexpr,
    BYTE_ZEROS: tl.constexpr,
):  # fmt: skip
    """fp32 `[BLOCK_N, HEAD_DIM]` tile: each token from the full-precision cache or its sealed block."""
    full = tl.load(full_ptr + full_offsets[:, None] + dims[None, :] * stride_d, mask=full_ok[:, None], other=0.0)
    sealed = _sealed_tile(
        codes_ptr, scale_ptr, zero_ptr, code_offsets, stat_offsets, stat_cols, dims, sealed_ok, SEALED_FORMAT,
        HAS_ZERO, LOG_SCALES, BYTE_ZEROS,
    )  # fmt: skip
    return tl.where(sealed_ok[:, None], sealed, full.to(tl.float32))


@triton.jit
def paged_decode_sealed_split_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
    table_ptr, lens_ptr, mask_ptr, m_ptr, l_ptr, acc_ptr,
    kv_length, split_tokens, scale, softcap,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch,
    stride_ksb, stride_ksh,
    stride_vsb, stride_vss, stride_vsh,
    stride_tb, stride_tn, stride_mb, stride_mt,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    SEALED_FORMAT: tl.constexpr, KEY_ZERO: tl.constexpr, VALUE_ZERO: tl.constexpr, VALUE_GROUP: tl.constexpr,
    LOG_SCALES: tl.constexpr, BYTE_ZEROS: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_BF16: tl.constexpr,
):  # fmt: skip
    """Partial attention of one (row, KV head, split) over mixed blocks; writes m, l, acc as
    `paged_decode_split_kernel` does.

    k/v_ptr: full-precision caches `[blocks, PAGE, H, D]`; kc/vc_ptr: sealed codes `[sealed, PAGE, H, D']`
    (both with the `stride_c*` strides, last dim contiguous); ks/kz_ptr: key statistics `[sealed, 1, H, D]`;
    vs/vz_ptr: value statistics `[sealed, PAGE, H, D // VALUE_GROUP]` (last dims contiguous).

    Every token reads its table entry and then one of two places, with masked loads, so no byte is read twice::

        entry >= 0  ->  k_cache[entry, t % PAGE, head, :]                     (query's dtype: sink, tail)
        entry <  0  ->  sealed id s = -1 - entry:
                        key   = codes[s, t % PAGE, head, d] * key_scale[s, 0, head, d] (+ key_zero[s, 0, head, d])
                        value = codes[s, t % PAGE, head, d]
                                * value_scale[s, t % PAGE, head, d // VALUE_GROUP] (+ zero)
        codes: int8 c;  int4 (byte >> 4 * (d % 2)) & 0xF;  int2 (byte >> 2 * (d % 4)) & 0x3;  raw: no scale
        BYTE_ZEROS: a zero is an e4m3 byte, decoded like a code;
        LOG_SCALES: a scale byte b is 2 ** ((b - 144) / 12)
    """
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    q, q_head, head_ok = _load_query(q_ptr, row, kv_head, stride_qb, stride_qh, stride_qd, GROUP, BLOCK_H, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    start, stop = _split_range(lens_ptr, row, kv_length, split_tokens)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, HEAD_DIM], 0.0, tl.float32)
    for tile in range(start, stop, BLOCK_N):
        tokens, valid = _tile_tokens(tile, stop, mask_ptr, row, stride_mb, stride_mt, BLOCK_N, MASK_MODE)
        entry = tl.load(table_ptr + row * stride_tb + (tokens // PAGE) * stride_tn, mask=valid, other=0).to(tl.int64)
        sealed = entry < 0
        full_ok = valid & (entry >= 0)
        sealed_ok = valid & sealed
        block = tl.where(sealed, 0, entry)
        sealed_id = tl.where(sealed, -1 - entry, 0)
        slot = tokens % PAGE
        code_offsets = sealed_id * stride_cb + slot * stride_cs
        k = _mixed_tile(
            k_ptr + kv_head * stride_kh, block * stride_kb + slot * stride_ks, stride_kd,
            kc_ptr + kv_head * stride_ch, ks_ptr + kv_head * stride_ksh, kz_ptr + kv_head * stride_ksh,
            code_offsets, sealed_id * stride_ksb, dims, dims, full_ok, sealed_ok, SEALED_FORMAT, KEY_ZERO,
            LOG_SCALES, BYTE_ZEROS,
        )  # fmt: skip
        s = _logits(
            q, k.to(q.dtype), scale, softcap, mask_ptr, row, stride_mb, stride_mt, tokens, valid,
            MASK_MODE, USE_SOFTCAP, DOT_PRECISION, WIDEN_BF16,
        )  # fmt: skip
        v = _mixed_tile(
            v_ptr + kv_head * stride_vh, block * stride_vb + slot * stride_vs, stride_vd,
            vc_ptr + kv_head * stride_ch, vs_ptr + kv_head * stride_vsh, vz_ptr + kv_head * stride_vsh,
            code_offsets, sealed_id * stride_vsb + slot * stride_vss, dims // VALUE_GROUP, dims, full_ok, sealed_ok,
            SEALED_FORMAT, VALUE_ZERO, LOG_SCALES, BYTE_ZEROS,
        )  # fmt: skip
        m_i, l_i, acc = _online_softmax_update(s, v.to(q.dtype), m_i, l_i, acc, DOT_PRECISION, WIDEN_BF16)
    _store_partial(m_ptr, l_ptr, acc_ptr, row, q_head, head_ok, m_i, l_i, acc, GROUP, HEAD_DIM)
