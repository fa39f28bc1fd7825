"""The paged-attention torch reference against naive dense attention.

Each case builds contiguous K/V, scatters their tokens into a pool of blocks in a random order (block ids
are a random permutation, so a kernel that reads blocks in id order, or ignores the table, fails), fills
every slot outside the sequences with NaN (a kernel that reads a slot past `kv_length` returns NaN), and
compares the kernel to `softmax(Q Kᵀ · scale + mask) V` computed in float64 with K/V repeated per query
head (`repeat_interleave`, the GQA definition).

Tolerances: fp32 inputs must match to 1e-5. For bf16/fp16 inputs both sides read the same rounded K/V/Q,
so the difference is the kernel's output rounding: one bf16 ulp of values below 4 is at most 2^-6
(atol 2e-2, rtol 1.6e-2) and one fp16 ulp at most 2^-9 (atol 2e-3, rtol 1e-3).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.reference import paged_attention_reference

KV_HEADS = 2
BATCH = 2
KV_LENGTH = 150  # not a multiple of any block size below except 1
CHUNK_TOKENS = 32  # several chunks at every block size: 5 at block size 1 or 16, 3 at block size 64

# (atol, rtol) per input dtype; see the module docstring.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 1e-3),
}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def scatter_into_blocks(
    keys: torch.Tensor, values: torch.Tensor, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place contiguous `[batch, kv_heads, length, dim]` K/V into blocks with randomly permuted ids.

    Returns key_cache, value_cache `[num_blocks, block_size, kv_heads, dim]` and block_table
    `[batch, blocks_per_row]`. Three spare blocks and the tail of each last block hold NaN.
    """
    batch, kv_heads, length, dim = keys.shape
    blocks_per_row = -(-length // block_size)
    num_blocks = batch * blocks_per_row + 3
    block_table = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_row]
    block_table = block_table.reshape(batch, blocks_per_row)
    key_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=keys.dtype)
    value_cache = key_cache.clone()
    for row in range(batch):
        for token in range(length):
            block = int(block_table[row, token // block_size])
            key_cache[block, token % block_size] = keys[row, :, token]
            value_cache[block, token % block_size] = values[row, :, token]
    return key_cache, value_cache, block_table


def naive_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    allowed: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense attention in float64.

    Args:
        query: `[batch, q_heads, q_len, dim]`; keys, values: `[batch, kv_heads, length, dim]`.
        allowed: bool `[batch, q_len, length]`, True where a query may attend a key.
    Returns:
        `[batch, q_len, q_heads, dim]`; rows with no allowed key are NaN.
    """
    group = query.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def causal(batch: int, q_len: int, length: int) -> torch.Tensor:
    """Queries are the last `q_len` positions: query i sits at position length - q_len + i."""
    query_pos = torch.arange(length - q_len, length)[:, None]
    return (torch.arange(length)[None, :] <= query_pos).expand(batch, q_len, length)


def left_padding(batch: int, q_len: int, length: int, pads: list[int]) -> torch.Tensor:
    """Causal, and row b's first `pads[b]` keys are padding nobody attends."""
    keep = torch.arange(length)[None, :] >= torch.tensor(pads)[:, None]  # [batch, length]
    return causal(batch, q_len, length) & keep[:, None, :]


def make_inputs(
    gqa: int, head_dim: int, q_len: int, dtype: torch.dtype = torch.float32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(BATCH, KV_HEADS * gqa, q_len, head_dim, generator=generator).to(dtype)
    keys = torch.randn(BATCH, KV_HEADS, KV_LENGTH, head_dim, generator=generator).to(dtype)
    values = torch.randn(BATCH, KV_HEADS, KV_LENGTH, head_dim, generator=generator).to(dtype)
    return query, keys, values, generator


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: waking a second thread per matmul costs more than it saves, and under a
    busy CPU it made this file several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def automatic_backend() -> Iterator[None]:
    dispatch.set_backend(None)
    yield
    dispatch.set_backend(None)


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("mode", ["decode", "causal_prefill", "padding_mask"])
def test_matches_naive_attention(mode: str, gqa: int, head_dim: int, block_size: int) -> None:
    q_len = 1 if mode == "decode" else 9
    query, keys, values, generator = make_inputs(gqa, head_dim, q_len)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, block_size, generator)
    scale = 1 / math.sqrt(head_dim)
    if mode == "padding_mask":
        allowed = left_padding(BATCH, q_len, KV_LENGTH, pads=[0, 37])
        mask: torch.Tensor | None = allowed[:, None]
    else:
        allowed = causal(BATCH, q_len, KV_LENGTH)
        mask = None

    out = paged_attention_reference(
        query, key_cache, value_cache, table, KV_LENGTH, scale, mask=mask, chunk_tokens=CHUNK_TOKENS
    )

    assert out.shape == (BATCH, q_len, KV_HEADS * gqa, head_dim)
    assert out.dtype == torch.float32
    expected = naive_attention(query, keys, values, scale, allowed).float()
    assert_matches(out, expected)


def test_full_prefill_without_cached_prefix() -> None:
    """q_len == kv_length: the first query sees only itself."""
    generator = torch.Generator().manual_seed(1)
    length, head_dim = 40, 64
    query = torch.randn(1, 6, length, head_dim, generator=generator)
    keys = torch.randn(1, KV_HEADS, length, head_dim, generator=generator)
    values = torch.randn(1, KV_HEADS, length, head_dim, generator=generator)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)

    out = paged_attention_reference(query, key_cache, value_cache, table, length, 0.125, chunk_tokens=16)

    expected = naive_attention(query, keys, values, 0.125, causal(1, length, length)).float()
    assert_matches(out, expected)
    # The first query attends one key: its output is that key's value, repeated per group of heads.
    torch.testing.assert_close(out[0, 0], values[0, :, 0].repeat_interleave(3, dim=0), rtol=0, atol=1e-6)


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 10_000])
def test_chunking_does_not_change_the_result(chunk_tokens: int) -> None:
    query, keys, values, generator = make_inputs(gqa=3, head_dim=64, q_len=5)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    out = paged_attention_reference(query, key_cache, value_cache, table, KV_LENGTH, 0.125, chunk_tokens=chunk_tokens)
    expected = naive_attention(query, keys, values, 0.125, causal(BATCH, 5, KV_LENGTH)).float()
    assert_matches(out, expected)


def test_additive_float_mask_equals_bool_mask() -> None:
    query, keys, values, generator = make_inputs(gqa=3, head_dim=64, q_len=4)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    allowed = left_padding(BATCH, 4, KV_LENGTH, pads=[5, 20])
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    # Also a bias on allowed keys, which a bool mask cannot express.
    bias = torch.linspace(-1.0, 1.0, KV_LENGTH).expand_as(additive)
    additive = additive + bias.masked_fill(~allowed, 0.0)

    out = paged_attention_reference(
        query, key_cache, value_cache, table, KV_LENGTH, 0.125, mask=additive[:, None], chunk_tokens=32
    )

    group = 3
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * 0.125 + bias.double()[:, None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    expected = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).float()
    assert_matches(out, expected)


@pytest.mark.parametrize("softcap", [2.0, 30.0])
def test_softcap(softcap: float) -> None:
    query, keys, values, generator = make_inputs(gqa=3, head_dim=64, q_len=3)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    scale = 1.0  # logits of size ~8: capping at 2 changes them a lot, at 30 a little
    allowed = causal(BATCH, 3, KV_LENGTH)

    out = paged_attention_reference(
        query, key_cache, value_cache, table, KV_LENGTH, scale, softcap=softcap, chunk_tokens=32
    )

    expected = naive_attention(query, keys, values, scale, allowed, softcap=softcap).float()
    assert_matches(out, expected)
    uncapped = naive_attention(query, keys, values, scale, allowed).float()
    assert not torch.allclose(out, uncapped, atol=1e-3)


def test_rows_entirely_masked_stay_finite() -> None:
    query, keys, values, generator = make_inputs(gqa=3, head_dim=64, q_len=4)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    allowed = causal(BATCH, 4, KV_LENGTH).clone()
    allowed[0, 1] = False  # one query of row 0 sees nothing
    allowed[1] = False  # every query of row 1 sees nothing

    out = paged_attention_reference(
        query, key_cache, value_cache, table, KV_LENGTH, 0.125, mask=allowed[:, None], chunk_tokens=32
    )

    assert torch.isfinite(out).all()
    expected = naive_attention(query, keys, values, 0.125, allowed).float()
    live = [0, 2, 3]
    assert_matches(out[0, live], expected[0, live])


def test_keys_masked_only_in_later_chunks() -> None:
    """A row whose allowed keys all sit in the first chunk: later, fully masked chunks add nothing."""
    query, keys, values, generator = make_inputs(gqa=1, head_dim=64, q_len=1)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    allowed = torch.zeros(BATCH, 1, KV_LENGTH, dtype=torch.bool)
    allowed[0, 0, :10] = True
    allowed[1, 0, 140:] = True  # and a row whose allowed keys are all in the last chunk

    out = paged_attention_reference(
        query, key_cache, value_cache, table, KV_LENGTH, 0.125, mask=allowed[:, None], chunk_tokens=32
    )

    expected = naive_attention(query, keys, values, 0.125, allowed).float()
    assert_matches(out, expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["decode", "causal_prefill"])
def test_half_precision_inputs(dtype: torch.dtype, mode: str) -> None:
    q_len = 1 if mode == "decode" else 6
    query, keys, values, generator = make_inputs(gqa=3, head_dim=128, q_len=q_len, dtype=dtype)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    scale = 1 / math.sqrt(128)

    out = paged_attention_reference(query, key_cache, value_cache, table, KV_LENGTH, scale, chunk_tokens=32)

    assert out.dtype == dtype
    expected = naive_attention(query, keys, values, scale, causal(BATCH, q_len, KV_LENGTH))
    assert_matches(out.double(), expected, dtype)


def test_table_wider_than_needed_is_ignored_past_kv_length() -> None:
    query, keys, values, generator = make_inputs(gqa=1, head_dim=64, q_len=1)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    unused = sorted(set(range(key_cache.shape[0])) - set(table.flatten().tolist()))  # the NaN blocks
    spare = torch.tensor([unused[:2]] * BATCH)
    wide = torch.cat([table, spare], dim=1)
    out = paged_attention_reference(query, key_cache, value_cache, wide, KV_LENGTH, 0.125)
    expected = naive_attention(query, keys, values, 0.125, causal(BATCH, 1, KV_LENGTH)).float()
    assert_matches(out, expected)


def test_query_heads_must_be_a_multiple_of_kv_heads() -> None:
    _, keys, values, generator = make_inputs(gqa=1, head_dim=64, q_len=1)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    odd_query = torch.randn(BATCH, 3, 1, 64)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        paged_attention_reference(odd_query, key_cache, value_cache, table, KV_LENGTH, 0.125)


# ---------------------------------------------------------------- dispatch


def test_dispatch_runs_gathered_sdpa_on_the_cpu_and_reports_it() -> None:
    query, keys, values, generator = make_inputs(gqa=3, head_dim=64, q_len=2)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    mask = causal(BATCH, 2, KV_LENGTH)[:, None]

    out = dispatch.paged_attention(query, key_cache, value_cache, table, KV_LENGTH, 0.125, mask=mask)

    assert dispatch.last_backend() == "sdpa"
    expected = naive_attention(query, keys, values, 0.125, causal(BATCH, 2, KV_LENGTH)).float()
    assert_matches(out, expected)


def test_dispatch_forced_backend() -> None:
    query, keys, values, generator = make_inputs(gqa=1, head_dim=64, q_len=1)
    key_cache, value_cache, table = scatter_into_blocks(keys, values, 16, generator)
    dispatch.set_backend("torch")
    assert dispatch.choose_backend(query) == "torch"
    dispatch.paged_attention(query, key_cache, value_cache, table, KV_LENGTH, 0.125)
    assert dispatch.last_backend() == "torch"


def test_dispatch_rejects_unknown_backend() -> None:
    with pytest.raises(ValueError, match=r"Unknown paged attention backend 'nope'.*'torch'"):
        dispatch.set_backend("nope")
    assert dispatch.choose_backend(torch.zeros(1, 1, 1, 1)) == "torch"  # the failed call changed nothing
