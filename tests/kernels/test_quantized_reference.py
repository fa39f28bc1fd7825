"""The quantized paged-attention reference against brute force: decode every block with the codec,
concatenate, and run plain softmax attention."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_kvgov.codecs import Int4Codec
from hf_kvgov.kernels.quantized_reference import gather_quantized, quantized_paged_attention_reference
from hf_kvgov.storage.pool import KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.storage.sealed_formats import CodecFormat

BLOCK, KV_HEADS, HEAD_DIM = 2, 2, 8
ROWS = [[0, 2, 3, 6, 8], [1, 2, 4, 7, 9]]  # block 2 is shared by both rows
SEALED = [2, 2, 3, 4]  # block columns 1 and 2 of both rows


def setup() -> tuple[QuantizedBlockPool, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pool, block table with sealed entries, brute-force keys, values `[2, kv_heads, 10, head_dim]`)."""
    geometry = KVGeometry(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    pool = QuantizedBlockPool(geometry, [CodecFormat(Int4Codec())], block_size=BLOCK)
    pool.allocate(10)
    generator = torch.Generator().manual_seed(3)
    pool.keys[0].copy_(torch.randn(pool.keys[0].shape, generator=generator) * 3)
    pool.values[0].copy_(torch.randn(pool.values[0].shape, generator=generator))
    # What attention must see: int4 round trips of sealed blocks, originals elsewhere.
    codec = Int4Codec()
    seen_k, seen_v = pool.keys[0].clone(), pool.values[0].clone()
    for block in set(SEALED):
        seen_k[block] = codec.decode(codec.encode_keys(seen_k[block]), torch.float32)
        seen_v[block] = codec.decode(codec.encode_values(seen_v[block]), torch.float32)
    pool.incref([2])
    sealed_of = dict(zip(SEALED, pool.seal(SEALED), strict=True))
    table = [[sealed_of.get(block, block) for block in row] for row in ROWS]
    assert table[0][1] == table[1][1] < 0  # the shared block stays shared once sealed
    ids = torch.tensor(ROWS)
    keys = seen_k[ids].reshape(2, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
    values = seen_v[ids].reshape(2, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
    return pool, torch.tensor(table), keys, values


def brute_force(query, keys, values, scale, mask, softcap):  # type: ignore[no-untyped-def]
    group = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = query @ k.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_gather_decodes_sealed_blocks() -> None:
    pool, table, keys, values = setup()
    got_k, got_v = gather_quantized(
        pool.keys[0], pool.values[0], table, 9, functools.partial(pool.read_sealed, 0), torch.float32
    )
    assert torch.equal(got_k, keys[:, :, :9]) and torch.equal(got_v, values[:, :, :9])


@pytest.mark.parametrize("chunk_tokens", [2, 4, 2048])
@pytest.mark.parametrize("mask_kind", ["causal", "bool", "additive"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_attention_matches_brute_force(chunk_tokens: int, mask_kind: str, softcap: float | None) -> None:
    pool, table, keys, values = setup()
    kv_length, q_len, q_heads = 9, 3, 4
    query = torch.randn(2, q_heads, q_len, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    causal = torch.arange(kv_length)[None, :] <= torch.arange(kv_length - q_len, kv_length)[:, None]
    allowed = causal[None, None].repeat(2, 1, 1, 1)
    allowed[0, :, :, :3] = False  # row 0 is left-padded by three tokens
    mask: torch.Tensor | None = {
        "causal": None,
        "bool": allowed,
        "additive": torch.where(allowed, 0.0, float("-inf")) + 0.25 * (torch.arange(kv_length) % 2),
    }[mask_kind]
    got = quantized_paged_attention_reference(
        query,
        pool.keys[0],
        pool.values[0],
        table,
        kv_length,
        0.3,
        functools.partial(pool.read_sealed, 0),
        mask=mask,
        softcap=softcap,
        chunk_tokens=chunk_tokens,
    )
    full_mask = causal[None, None].expand(2, 1, -1, -1) if mask is None else mask
    expected = brute_force(query, keys[:, :, :kv_length], values[:, :, :kv_length], 0.3, full_mask, softcap)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_sealed_blocks_are_decoded_once_per_chunk_even_when_shared() -> None:
    pool, table, _, _ = setup()
    calls: list[list[int]] = []

    def reader(ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(ids.tolist())
        return pool.read_sealed(0, ids, dtype)

    query = torch.randn(2, 2, 1, HEAD_DIM)
    quantized_paged_attention_reference(query, pool.keys[0], pool.values[0], table, 10, 1.0, reader, chunk_tokens=4)
    # Chunk 0 = columns 0-1 (shared sealed block once), chunk 1 = columns 2-3, chunk 2 = column 4 (no sealed).
    assert [sorted(c) for c in calls] == [[-1], sorted({int(table[0, 2]), int(table[1, 2])})]
