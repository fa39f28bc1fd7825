"""Re-rotating cached keys: rot(rot(k, p), q - p) must equal rot(k, q), built here from scratch."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.policies import apply_rope, rerotate


def inv_freq_for(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def rot(k: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0) -> torch.Tensor:
    """From scratch, in float64: pair channel i with i + d/2 and turn each pair by pos * inv_freq[i]."""
    k = k.double()
    half = inv_freq.numel()
    angle = pos.double()[..., None] * inv_freq.double()
    cos, sin = angle.cos() * scaling, angle.sin() * scaling
    x1, x2, rest = k[..., :half], k[..., half : 2 * half], k[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


def random_keys(shape=(2, 3, 7, 16), seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def random_positions(shape, high: int, seed: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def test_rerotate_moves_keys_per_slot() -> None:
    k, inv_freq = random_keys(), inv_freq_for(16)
    p, q = random_positions((2, 3, 7), 4096, 1), random_positions((2, 3, 7), 4096, 2)
    cached = rot(k, p, inv_freq).float()
    moved = rerotate(cached, q - p, inv_freq)
    assert moved.dtype == torch.float32
    torch.testing.assert_close(moved.double(), rot(k, q, inv_freq), rtol=0, atol=2e-5)


def test_rerotate_with_one_delta_per_slot_shared_by_rows_and_heads() -> None:
    k, inv_freq = random_keys(), inv_freq_for(16)
    p = torch.arange(100, 107)
    delta = torch.tensor([-100, -99, -50, 0, 3, 7, 1000])
    moved = rerotate(rot(k, p, inv_freq).float(), delta, inv_freq)
    torch.testing.assert_close(moved.double(), rot(k, p + delta, inv_freq), rtol=0, atol=2e-5)


def test_rerotate_is_exact_in_float64_and_for_float_deltas() -> None:
    k, inv_freq = random_keys().double(), inv_freq_for(16)
    p = torch.arange(7).double() * 3.5
    moved = rerotate(rot(k, p, inv_freq), -p, inv_freq)
    torch.testing.assert_close(moved, k, rtol=0, atol=1e-12)


def test_rerotate_far_beyond_float32_integer_range() -> None:
    # 2**25 + 3 is not a float32 number: angles computed in float32 would be off by whole radians.
    k, inv_freq = random_keys(), inv_freq_for(16)
    p = torch.arange(7)
    delta = torch.full((7,), 2**25 + 3)
    moved = rerotate(rot(k, p, inv_freq).float(), delta, inv_freq)
    torch.testing.assert_close(moved.double(), rot(k, p + delta, inv_freq), rtol=0, atol=1e-4)


def test_attention_scaling_is_carried_by_the_cached_keys_and_not_applied_again() -> None:
    k, inv_freq = random_keys(), inv_freq_for(16)
    p, q = torch.arange(7), torch.arange(7) + 40
    cached = rot(k, p, inv_freq, scaling=1.25).float()
    moved = rerotate(cached, q - p, inv_freq)
    torch.testing.assert_close(moved.double(), rot(k, q, inv_freq, scaling=1.25), rtol=0, atol=2e-5)
    assert not torch.allclose(moved.double(), rot(k, q, inv_freq, scaling=1.25**2), atol=1e-2)


def test_partial_rotary_leaves_the_pass_through_channels_alone() -> None:
    k, inv_freq = random_keys(shape=(1, 2, 5, 12)), inv_freq_for(8)
    p, q = torch.arange(5), torch.arange(5) * 9 + 2
    moved = rerotate(rot(k, p, inv_freq).float(), q - p, inv_freq)
    torch.testing.assert_close(moved.double(), rot(k, q, inv_freq), rtol=0, atol=2e-5)
    torch.testing.assert_close(moved[..., 8:], k[..., 8:])


def test_apply_rope_matches_the_from_scratch_rotation() -> None:
    k, inv_freq = random_keys(), inv_freq_for(16)
    p = random_positions((2, 3, 7), 500, 3)
    out = apply_rope(k, p, inv_freq, attention_scaling=1.1)
    torch.testing.assert_close(out.double(), rot(k, p, inv_freq, scaling=1.1), rtol=0, atol=2e-5)


def test_apply_rope_matches_transformers_yarn_rotary_embedding() -> None:
    modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 2048,
        },
    )
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling != 1.0
    k = random_keys(shape=(1, 2, 6, 16))
    positions = torch.tensor([[0, 1, 2, 300, 301, 1000]])
    cos, sin = rotary(k, positions)
    _, expected = modeling_llama.apply_rotary_pos_emb(k, k, cos, sin)
    out = apply_rope(k, positions[0], rotary.inv_freq, rotary.attention_scaling)
    # transformers forms angles in float32 (1000 * inv_freq is off by ~6e-5 rad); these helpers use float64.
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-4)
    # The transformers-cached key moves like any other.
    moved = rerotate(expected, torch.full((6,), 17), rotary.inv_freq)
    cos, sin = rotary(k, positions + 17)
    torch.testing.assert_close(moved, modeling_llama.apply_rotary_pos_emb(k, k, cos, sin)[1], rtol=1e-5, atol=1e-5)


def test_rerotate_keeps_half_precision_dtype_and_zero_is_identity() -> None:
    k = random_keys().bfloat16()
    moved = rerotate(k, torch.zeros(7, dtype=torch.long), inv_freq_for(16))
    assert moved.dtype == torch.bfloat16
    assert torch.equal(moved, k)


@pytest.mark.parametrize(
    ("keys", "delta", "inv_freq", "message"),
    [
        (torch.zeros(3, 7, 16), torch.zeros(7), inv_freq_for(16), r"\[batch, heads, seq, head_dim\]"),
        (torch.zeros(1, 1, 7, 16), torch.zeros(6), inv_freq_for(16), r"do not broadcast.*\(1, 1, 7\)"),
        (torch.zeros(1, 1, 7, 16), torch.zeros(7), inv_freq_for(20), "between 1 and head_dim/2 = 8"),
    ],
)
def test_rerotate_refuses_mismatched_shapes(keys, delta, inv_freq, message) -> None:
    with pytest.raises(ValueError, match=message):
        rerotate(keys, delta, inv_freq)
