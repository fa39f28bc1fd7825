"""KIVI grouping really happens: keys per channel survive an outlier channel, values per token an
outlier token, and the opposite grouping on the same data does not."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.codecs import get_codec


def _with_outlier_channel() -> torch.Tensor:
    """Keys [n=2, T=16, H=2, D=16] ~ N(0, 1), except head 0 channel 5 ~ 100 + 30 N(0, 1)."""
    k = torch.randn(2, 16, 2, 16, generator=torch.Generator().manual_seed(7))
    k[..., 0, 5] = 100 + 30 * k[..., 0, 5]
    return k


@pytest.mark.parametrize(("name", "levels"), [("int8", 255), ("int4", 15)])
def test_keys_per_channel_isolate_an_outlier_channel(name: str, levels: int) -> None:
    codec = get_codec(name)
    k = _with_outlier_channel()
    normal = torch.ones(16, dtype=torch.bool)
    normal[5] = False
    per_channel = (codec.decode(codec.encode_keys(k), torch.float32) - k)[..., 0, normal].abs().max()
    # The same tensor grouped per token (what encode_values does): the outlier sets every token's scale.
    per_token = (codec.decode(codec.encode_values(k), torch.float32) - k)[..., 0, normal].abs().max()
    # Per channel: half a step of a N(0, 1) channel's range over 16 tokens (< 8), with slack.
    assert per_channel <= 8 / levels / 2 * 1.01
    # Per token: half a step of a range that includes ~100, so at least 10x worse.
    assert per_token > 10 * per_channel


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_values_per_token_isolate_an_outlier_token(name: str) -> None:
    codec = get_codec(name)
    v = torch.randn(16, 2, 16, generator=torch.Generator().manual_seed(8))
    v[3] *= 200  # one token (e.g. an attention sink) with huge values
    others = torch.arange(16) != 3
    per_token = (codec.decode(codec.encode_values(v), torch.float32) - v)[others].abs().max()
    per_channel = (codec.decode(codec.encode_keys(v), torch.float32) - v)[others].abs().max()
    assert per_token > 0  # lossy, but confined
    assert per_channel > 10 * per_token
