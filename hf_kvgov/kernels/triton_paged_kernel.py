"""Triton kernels for paged decode attention: one query token per row, keys read through a block table.

Two launches. The split kernel, grid `(batch, kv_heads, splits)`: a program owns one KV head of one row
and one range of `split_tokens` key positions, and attends with all `GROUP` query heads that share that
KV head at once (they are the rows of one `[BLOCK_H, head_dim]` tile, so each K/V tile is read once per
group, not once per query head)::

    key positions of row b:  | split 0         | split 1         | ...     (split_tokens each)
                             | tile | tile | ..                            (BLOCK_N tokens each)
    token t  ->  block_table[b, t // PAGE]  ->  key_cache[block, t % PAGE, kv_head, :]

Inside a split the tiles are merged by an online softmax in fp32. The program stores its partial state
(running max `m`, denominator `l`, unnormalized `acc`); the combine kernel, grid `(batch, q_heads)`,
rescales the splits of one query head to a common max and writes `acc / l` in the output dtype. The
split count is the caller's choice (`triton_paged.py` picks it from the GPU's size).

Reductions go through `tl.reduce` with triton's own max/sum combine functions instead of `tl.max` /
`tl.sum`: those are `@triton.jit` objects created when triton is first imported, and when that import
happened before `TRITON_INTERPRET=1` was set (transformers imports triton through torch._dynamo), the
interpreter cannot call them. It recognises the combine functions themselves and reduces with numpy.

K/V tiles are loaded through `_load_kv_tile`, keyed by the constexpr `KV_FORMAT`; a quantized cache adds
a format there (load codes and scales, dequantize to fp32) without touching the attention math.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_combine(a, b):
    return a + b


# Prefer triton's own combine functions: the interpreter reduces them with numpy (see the module
# docstring); with ours it would call back into Python once per element.
_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_SUM = getattr(tl.standard, "_sum_combine", _sum_combine)

KV_FORMAT_NATIVE = 0  # K/V stored in the query's dtype (fp32, fp16 or bf16)
MASK_NONE = 0
MASK_BOOL = 1  # int8 row per batch entry, nonzero = attend; masked keys are never loaded
MASK_ADDITIVE = 2  # fp32 row per batch entry, added to the (soft-capped) logits


@triton.jit
def _tanh(x):
    # tanh(x) = sign(x) (1 - e^{-2|x|}) / (1 + e^{-2|x|}): the exponent is never positive, so no overflow.
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, y, -y)


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """`a @ b` with fp32 accumulation."""
    if WIDEN_BF16:
        # The interpreter (triton 3.9) multiplies bf16 tiles as their raw uint16 bits; widening to fp32
        # first is exact, and gives what a tensor core computes from the same bf16 operands.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_kv_tile(base_ptr, slot_offsets, dims, valid, stride_d, KV_FORMAT: tl.constexpr):
    """`[BLOCK_N, HEAD_DIM]` keys or values of one KV head; invalid tokens read as 0 (never from memory)."""
    tl.static_assert(KV_FORMAT == 0, "only the native K/V format is implemented")
    ptrs = base_ptr + slot_offsets[:, None] + dims[None, :] * stride_d
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def paged_decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    mask_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    kv_length,
    split_tokens,
    scale,
    softcap,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_tb,
    stride_tn,
    stride_mb,
    stride_mt,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_MODE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN_BF16: tl.constexpr,
):
    """Partial attention of one (row, KV head, split); writes m, l `[batch, q_heads, splits]` and acc
    `[batch, q_heads, splits, HEAD_DIM]` (contiguous fp32 buffers)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    q_heads = tl.num_programs(1) * GROUP

    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < GROUP
    q_head = kv_head * GROUP + heads
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + row * stride_qb + q_head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)  # [BLOCK_H, HEAD_DIM]

    length = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), kv_length)
    start = split * split_tokens
    stop = tl.minimum(start + split_tokens, length)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, HEAD_DIM], 0.0, tl.float32)
    for tile in range(start, stop, BLOCK_N):
        tokens = tile + tl.arange(0, BLOCK_N)
        valid = tokens < stop
        if MASK_MODE == 1:
            allowed = tl.load(mask_ptr + row * stride_mb + tokens * stride_mt, mask=valid, other=0)
            valid = valid & (allowed != 0)
        # Physical block of every token (a tile may span several blocks, or be part of one).
        block = tl.load(table_ptr + row * stride_tb + (tokens // PAGE) * stride_tn, mask=valid, other=0)
        block = block.to(tl.int64)
        slot = tokens % PAGE
        k = _load_kv_tile(
            k_ptr + kv_head * stride_kh, block * stride_kb + slot * stride_ks, dims, valid, stride_kd, KV_FORMAT
        )
        s = _dot(q, tl.trans(k), DOT_PRECISION, WIDEN_BF16) * scale  # [BLOCK_H, BLOCK_N] fp32
        if USE_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        if MASK_MODE == 2:
            bias = tl.load(mask_ptr + row * stride_mb + tokens * stride_mt, mask=valid, other=0.0)
            s = s + bias[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        # A row with every key so far masked has m_new = -inf: shift by 0 there to avoid -inf - -inf.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = _load_kv_tile(
            v_ptr + kv_head * stride_vh, block * stride_vb + slot * stride_vs, dims, valid, stride_vd, KV_FORMAT
        )
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, WIDEN_BF16)
        m_i = m_new

    state = (row * q_heads + q_head) * num_splits + split  # [BLOCK_H] index into m, l
    tl.store(m_ptr + state, m_i, mask=head_ok)
    tl.store(l_ptr + state, l_i, mask=head_ok)
    tl.store(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])


@triton.jit
def paged_decode_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Merge the splits of one (row, query head) into `out[row, 0, head, :]`."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    q_heads = tl.num_programs(1)
    splits = tl.arange(0, SPLITS)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_DIM)
    state = (row * q_heads + head) * num_splits + splits

    m = tl.load(m_ptr + state, mask=split_ok, other=float("-inf"))
    l = tl.load(l_ptr + state, mask=split_ok, other=0.0)  # noqa: E741 (the usual name in the literature)
    acc = tl.load(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0)

    m_max = tl.reduce(m, 0, _MAX)
    shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp(m - shift)  # 0 for empty splits (m = -inf)
    denom = tl.reduce(weight * l, 0, _SUM)
    out = tl.reduce(weight[:, None] * acc, 0, _SUM) / tl.maximum(denom, 1.1754943508222875e-38)
    out_ptrs = out_ptr + row * stride_ob + head * stride_oh + dims * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))
