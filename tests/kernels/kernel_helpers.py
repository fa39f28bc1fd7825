"""Shared by the kernel tests written after test_triton_paged.py: the device, the interpreter switch and
the tolerances against the torch references.

Import this module before anything that imports `hf_kvgov.kernels.triton_*`: without CUDA it sets
`TRITON_INTERPRET=1`, which triton reads when it decorates the kernels.

Tolerances (atol, rtol) per query dtype, against the torch references (fp32 math):
- fp32: 1e-5. IEEE fp32 dot products; dequantization is the codecs' fp32 `code * scale + zero` (a fused
  multiply-add at most changes the last bit). Measured ~6e-7.
- bf16 / fp16: the kernels round K/V tiles (dequantized ones too) and the softmax weights to the query's
  dtype before the tensor-core products, and round the output once; outputs stay below 4 here, where one
  bf16 ulp is at most 2^-6 and one fp16 ulp 2^-9: bf16 (2e-2, 1.6e-2), fp16 (2e-3, 1e-3), the bounds the
  full-precision kernel is held to. Measured: bf16 ~1.2e-2, fp16 ~5e-4.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 1e-3),
}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`actual` (of `dtype`) equals `expected` within the tolerance for `dtype`; NaN never passes."""
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all(), "the kernel read a slot it must not read (NaN there)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)
