"""The gathered-sdpa backend (the CPU's automatic choice) against dense attention and the reference."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.kernels.gathered_sdpa import paged_attention_gathered_sdpa
from hf_kvgov.kernels.reference import paged_attention_reference
from hf_kvgov.kernels.synthetic import make_case


@pytest.mark.parametrize(
    ("lengths", "q_heads", "kv_heads", "block_size", "q_len"),
    [([37, 20], 4, 4, 16, 1), ([64], 6, 2, 5, 1), ([33, 33, 9], 8, 1, 16, 3), ([40], 3, 1, 256, 1)],
)
def test_matches_dense_attention_with_a_mask(
    lengths: list[int], q_heads: int, kv_heads: int, block_size: int, q_len: int
) -> None:
    case = make_case(lengths, q_heads=q_heads, kv_heads=kv_heads, head_dim=32, block_size=block_size, q_len=q_len)
    # Pools hold zeros in unwritten slots; the case marks them NaN to catch reads the mask should hide.
    keys, values = case.key_cache.nan_to_num(), case.value_cache.nan_to_num()
    out = paged_attention_gathered_sdpa(
        case.query, keys, values, case.block_table, case.kv_length, 0.125, mask=case.attention_mask()
    )
    torch.testing.assert_close(out.double(), case.dense_attention(0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len", [1, 4, 40])
def test_without_a_mask_the_queries_are_the_last_tokens_and_causal(q_len: int) -> None:
    case = make_case([40, 40], q_heads=6, kv_heads=3, head_dim=16, block_size=8, q_len=q_len)
    args = (case.query, case.key_cache, case.value_cache, case.block_table, 40, 0.25)
    torch.testing.assert_close(paged_attention_gathered_sdpa(*args), paged_attention_reference(*args))


def test_soft_capping_is_refused_with_the_way_out() -> None:
    case = make_case([8], q_heads=2, kv_heads=2, head_dim=16, block_size=4)
    args = (case.query, case.key_cache, case.value_cache, case.block_table, 8, 0.25)
    with pytest.raises(ValueError, match=r"no logit soft-capping.*torch reference"):
        paged_attention_gathered_sdpa(*args, softcap=30.0)
