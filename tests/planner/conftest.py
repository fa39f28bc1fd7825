"""Small geometries whose byte counts are easy to work out by hand."""

from __future__ import annotations

import pytest

from hf_kvgov.planner import ModelGeometry


@pytest.fixture
def tiny() -> ModelGeometry:
    """2 layers x 3 KV heads x head_dim 8: one fp16 token is 2 x 2 x 3 x 8 x 2 = 192 B."""
    return ModelGeometry("tiny", num_layers=2, num_kv_heads=3, head_dim=8, max_position_embeddings=64)


@pytest.fixture
def unit() -> ModelGeometry:
    """1 layer x 1 KV head x head_dim 8: one fp16 token is 2 x 8 x 2 = 32 B, a 4-token block 128 B."""
    return ModelGeometry("unit", num_layers=1, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
