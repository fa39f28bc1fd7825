"""Triton kernels for paged decode attention: one query token per row, keys read through a block table.

The split kernel (`paged_decode_split_kernel`) attends with all `GROUP` query heads sharing a KV head at once, so each
K/V tile is read once per group, not once per query head; a combine kernel merges the splits' online-softmax states.
`triton_quantized_kernel.py` shares the tile math and only loads and dequantizes its tiles differently.

Reductions use `tl.reduce` with triton's combine functions, not `tl.max` / `tl.sum`, because the interpreter cannot
call those when triton was imported before `TRITON_INTERPRET=1` was set (transformers imports it through
torch._dynamo).
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
    tl.static_assert(KV_FORMAT == 0, "K/V in the query's dtype only; sealed blocks: triton_quantized_kernel")
    ptrs = base_ptr + slot_offsets[:, None] + dims[None, :] * stride_d
    return tl.load(ptrs, mask=valid[:, None], other=0.0)


@triton.jit
def _load_query(
    q_ptr, row, kv_head, stride_qb, stride_qh, stride_qd,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The `GROUP` query heads sharing `kv_head`, as the rows of a `[BLOCK_H, HEAD_DIM]` tile (padding = 0).

    Returns (q, q_head `[BLOCK_H]` head indices, head_ok `[BLOCK_H]` rows that are real heads).
    """
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < GROUP
    q_head = kv_head * GROUP + heads
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + row * stride_qb + q_head[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=head_ok[:, None], other=0.0)
    return q, q_head, head_ok


@triton.jit
def _split_range(lens_ptr, row, kv_length, split_tokens):
    """[start, stop) of this program's key positions: its split, cut at the row's length."""
    length = tl.minimum(tl.load(lens_ptr + row).to(tl.int32), kv_length)
    start = tl.program_id(2) * split_tokens
    return start, tl.minimum(start + split_tokens, length)


@triton.jit
def _tile_tokens(tile, stop, mask_ptr, row, stride_mb, stride_mt, BLOCK_N: tl.constexpr, MASK_MODE: tl.constexpr):
    """Positions `[BLOCK_N]` of one key tile and which of them are attended (inside the split, and allowed
    by a bool mask: keys a bool mask hides are never loaded)."""
    tokens = tile + tl.arange(0, BLOCK_N)
    valid = tokens < stop
    if MASK_MODE == 1:
        allowed = tl.load(mask_ptr + row * stride_mb + tokens * stride_mt, mask=valid, other=0)
        valid = valid & (allowed != 0)
    return tokens, valid


@triton.jit
def _logits(
    q, k, scale, softcap, mask_ptr, row, stride_mb, stride_mt, tokens, valid,
    MASK_MODE: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, WIDEN_BF16: tl.constexpr,
):  # fmt: skip
    """Scores `[BLOCK_H, BLOCK_N]` fp32 of the query tile against key tile `k` `[BLOCK_N, HEAD_DIM]` (same
    dtype as q): scaled, soft-capped, additive mask added, -inf where a key is not attended."""
    s = _dot(q, tl.trans(k), DOT_PRECISION, WIDEN_BF16) * scale
    if USE_SOFTCAP:
        s = _tanh(s / softcap) * softcap
    if MASK_MODE == 2:
        bias = tl.load(mask_ptr + row * stride_mb + tokens * stride_mt, mask=valid, other=0.0)
        s = s + bias[None, :]
    return tl.where(valid[None, :], s, float("-inf"))


@triton.jit
def _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr, WIDEN_BF16: tl.constexpr):
    """Fold one tile's scores `s` `[BLOCK_H, BLOCK_N]` and values `v` `[BLOCK_N, HEAD_DIM]` into the running
    max `m_i`, denominator `l_i` `[BLOCK_H]` and unnormalized output `acc` `[BLOCK_H, HEAD_DIM]` (fp32)."""
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
    # A row with every key so far masked has m_new = -inf: shift by 0 there to avoid -inf - -inf.
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - shift[:, None])
    alpha = tl.exp(m_i - shift)
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, WIDEN_BF16)
    return m_new, l_i, acc


@triton.jit
def _store_partial(
    m_ptr, l_ptr, acc_ptr, row, q_head, head_ok, m_i, l_i, acc, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """Write one program's state into m, l `[batch, q_heads, splits]` and acc `[batch, q_heads, splits,
    HEAD_DIM]` (contiguous fp32 buffers)."""
    num_splits = tl.num_programs(2)
    q_heads = tl.num_programs(1) * GROUP
    state = (row * q_heads + q_head) * num_splits + tl.program_id(2)  # [BLOCK_H] index into m, l
    dims = tl.arange(0, HEAD_DIM)
    tl.store(m_ptr + state, m_i, mask=head_ok)
    tl.store(l_ptr + state, l_i, mask=head_ok)
    tl.store(acc_ptr + state[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])


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
    `[batch, q_heads, splits, HEAD_DIM]` (contiguous fp32 buffers).

    Grid `(batch, kv_heads, splits)`: a program owns one KV head of one row and `split_tokens` key positions, and
    attends with all `GROUP` query heads sharing that KV head at once::

        key positions of row b:  | split 0         | split 1         | ...     (split_tokens each)
                                 | tile | tile | ..                            (BLOCK_N tokens each)
        token t  ->  block_table[b, t // PAGE]  ->  key_cache[block, t % PAGE, kv_head, :]
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
        # Physical block of every token (a tile may span several blocks, or be part of one).
        block = tl.load(table_ptr + row * stride_tb + (tokens // PAGE) * stride_tn, mask=valid, other=0)
        block = block.to(tl.int64)
        slot = tokens % PAGE
        k = _load_kv_tile(
            k_ptr + kv_head * stride_kh, block * stride_kb + slot * stride_ks, dims, valid, stride_kd, KV_FORMAT
        )
        s = _logits(
            q, k, scale, softcap, mask_ptr, row, stride_mb, stride_mt, tokens, valid,
            MASK_MODE, USE_SOFTCAP, DOT_PRECISION, WIDEN_BF16,
        )  # fmt: skip
        v = _load_kv_tile(
            v_ptr + kv_head * stride_vh, block * stride_vb + slot * stride_vs, dims, valid, stride_vd, KV_FORMAT
        )
        m_i, l_i, acc = _online_softmax_update(s, v, m_i, l_i, acc, DOT_PRECISION, WIDEN_BF16)
    _store_partial(m_ptr, l_ptr, acc_ptr, row, q_head, head_ok, m_i, l_i, acc, GROUP, HEAD_DIM)


@triton.jit
def paged_decode_combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    sinks_ptr,
    out_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """Merge the splits of one (row, query head) into `out[row, 0, head, :]`; with `USE_SINKS`, the head's learned
    sink logit `sinks[head]` joins the denominator as one more split that read no value (m = sink, l = 1)."""
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
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    shift = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp(m - shift)  # 0 for empty splits (m = -inf)
    denom = tl.reduce(weight * l, 0, _SUM)
    if USE_SINKS:
        denom = denom + tl.exp(sink - shift)
    out = tl.reduce(weight[:, None] * acc, 0, _SUM) / tl.maximum(denom, 1.1754943508222875e-38)
    out_ptrs = out_ptr + row * stride_ob + head * stride_oh + dims * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))
