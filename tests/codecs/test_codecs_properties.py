"""Property test: over random shapes, dtypes, magnitudes, offsets, constant groups and outliers,
every codec stays within the error bound derived from its format (see kv_codec_reference)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_codec_reference import error_bound

from hf_kvgov.codecs import available_codecs, get_codec


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    group_size: int | None
    dtype: torch.dtype
    scale_dtype: torch.dtype
    seed: int
    log_magnitude: float
    offset: float
    constant_groups: bool
    outlier: float

    def tensor(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.shape, generator=gen) * 10**self.log_magnitude + self.offset
        x[..., 0, -1] *= self.outlier  # head 0, last channel
        if self.constant_groups:
            x[..., :, 0, 0] = x[..., :1, 0, 0]  # a constant key channel
            x[..., 0, -1, :] = x[..., 0, -1, :1]  # a constant value token (all its groups)
        return x.to(self.dtype)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    head_dim = 4 * draw(st.integers(1, 4))  # int2 packs four codes per byte
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    shape = (*lead, draw(st.integers(1, 9)), draw(st.integers(1, 3)), head_dim)
    return Case(
        name=draw(st.sampled_from(available_codecs())),
        shape=shape,
        group_size=draw(st.sampled_from([None] + [g for g in range(1, head_dim + 1) if head_dim % g == 0])),
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        scale_dtype=draw(st.sampled_from([torch.float16, torch.float32])),
        seed=draw(st.integers(0, 2**31 - 1)),
        log_magnitude=draw(st.floats(-3, 2.5)),
        offset=draw(st.sampled_from([0.0, 0.5, -3.0, 200.0])),
        constant_groups=draw(st.booleans()),
        outlier=draw(st.sampled_from([1.0, 40.0])),
    )


@settings(max_examples=80, deadline=None, derandomize=True)
@given(cases())
def test_round_trip_within_format_bound(case: Case) -> None:
    codec = get_codec(case.name, group_size=case.group_size, scale_dtype=case.scale_dtype)
    x = case.tensor()
    exact = x.float()
    for axis, enc in (("keys", codec.encode_keys(x)), ("values", codec.encode_values(x))):
        out = codec.decode(enc, case.dtype)
        assert out.shape == x.shape and out.dtype == case.dtype
        err = (codec.decode(enc, torch.float32) - exact).abs().double()
        group = case.shape[-1] if case.group_size is None or axis == "keys" else case.group_size
        bound = error_bound(case.name, exact, axis, group)
        assert (err <= bound).all(), f"{axis}: worst excess {(err - bound).max().item():.3g}"
        assert codec.nbytes(enc) > 0
