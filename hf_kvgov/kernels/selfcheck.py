"""Every attention kernel against its torch reference, on random paged cases: `run_checks(device)`.

What `eval/gpu_check.py` runs first, and what a user can run to trust the fast paths on their own GPU::

    failed = [c for c in run_checks(torch.device("cuda")) if not c.passed]

Cases come from `kernels.synthetic`. Checked: the torch reference against dense float64 attention; the Triton
paged and sealed-block kernels (every dtype, masks, soft-capping, every format); the quantized reference against
dense attention over the decoded K/V; flash-attn on CUDA when installed. Tolerances (atol, rtol) are the unit
tests': fp32 1e-5, bf16 (2e-2, 1.6e-2), fp16 (2e-3, 1e-3), an output ulp plus the rounding of K/V tiles and
softmax weights. Kernels are imported when a check runs, so `TRITON_INTERPRET=1` set first runs them on a CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hf_kvgov.kernels import flash_paged
from hf_kvgov.kernels.synthetic import PagedCase, make_case

SEALED_FORMATS = ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2", "full")
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1.6e-2), torch.float16: (2e-3, 1e-3)}


@dataclass
class Check:
    """One kernel's agreement with its expected output (filled by `compare`)."""

    kernel: str
    case: str
    dtype: str
    max_abs_error: float | None = None
    tolerance: tuple[float, float] = (0.0, 0.0)
    passed: bool = False
    error: str | None = None


def compare(
    check: Check, run: Callable[[], torch.Tensor], expected: Callable[[], torch.Tensor], dtype: torch.dtype
) -> Check:
    """Fill `check` from one output against its expected value (an exception is a failure too)."""
    atol, rtol = TOLERANCES[dtype]
    check.tolerance = (atol, rtol)
    try:
        out, want = run().double(), expected().double()
        error = (out - want).abs()
        check.max_abs_error = float(error.max()) if error.numel() else 0.0
        check.passed = bool(torch.isfinite(out).all()) and bool((error <= atol + rtol * want.abs()).all())
    except Exception as exc:  # a kernel that crashes has failed its check; the report says how
        check.error = f"{type(exc).__name__}: {exc}"[:500]
    return check


# Kernels and expectations, as functions of (case, scale). The Triton modules are imported inside them, so
# a TRITON_INTERPRET=1 set by the caller before the first check still takes effect.


def _reference(case: PagedCase, scale: float) -> torch.Tensor:
    return case.reference(scale)


def _dense(case: PagedCase, scale: float) -> torch.Tensor:
    return case.dense_attention(scale)


def _triton(case: PagedCase, scale: float) -> torch.Tensor:
    from hf_kvgov.kernels.triton_paged import paged_attention_triton

    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.kv_length, scale)
    return paged_attention_triton(*args, seq_lens=case.seq_lens)


def _triton_masked_capped(case: PagedCase, scale: float) -> torch.Tensor:
    from hf_kvgov.kernels.triton_paged import paged_attention_triton

    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.kv_length, scale)
    return paged_attention_triton(*args, mask=case.attention_mask(), softcap=30.0)


def _reference_capped(case: PagedCase, scale: float) -> torch.Tensor:
    return case.reference(scale, softcap=30.0)


def _triton_sealed(case: PagedCase, scale: float) -> torch.Tensor:
    from hf_kvgov.kernels.triton_quantized import quantized_paged_attention_triton

    assert case.sealed is not None, "a sealed check builds a sealed case"
    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.kv_length, scale)
    return quantized_paged_attention_triton(*args, case.sealed, seq_lens=case.seq_lens)


def _flash(case: PagedCase, scale: float) -> torch.Tensor:
    from hf_kvgov.kernels.flash_paged import paged_attention_flash

    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.kv_length, scale)
    return paged_attention_flash(*args, seq_lens=case.seq_lens)


CaseFn = Callable[[PagedCase, float], torch.Tensor]


@dataclass(frozen=True)
class CheckSpec:
    """One check: `run(case, scale)` against `expected(case, scale)` at the tolerance for `dtype`."""

    kernel: str
    case: str
    dtype: torch.dtype
    run: CaseFn
    expected: CaseFn
    options: dict[str, Any] = field(default_factory=dict)  # make_case options beyond the plan's


def check_specs(device: torch.device) -> list[CheckSpec]:
    """The checks that apply on `device` (flash-attn only on CUDA with flash-attn installed)."""
    bf16, fp32 = torch.bfloat16, torch.float32
    specs = [CheckSpec("torch reference", "ragged, block 16", fp32, _reference, _dense)]
    specs += [CheckSpec("triton paged", "ragged, block 16", dtype, _triton, _reference) for dtype in TOLERANCES]
    specs.append(CheckSpec("triton paged", "block 64, bool mask, softcap 30", bf16, _triton_masked_capped,
                           _reference_capped, {"block_size": 64}))  # fmt: skip
    specs += [
        CheckSpec("triton sealed", f"{fmt}, block 16", bf16, _triton_sealed, _reference, {"sealed_format": fmt})
        for fmt in SEALED_FORMATS
    ]
    specs.append(CheckSpec("torch quantized reference", "int4, block 16", fp32, _reference, _dense,
                           {"sealed_format": "int4"}))  # fmt: skip
    if device.type == "cuda" and flash_paged.is_installed():
        for q_len in (1, 16):
            options = {"block_size": 256, "q_len": q_len}
            specs.append(CheckSpec("flash-attn paged", f"q_len {q_len}, block 256", bf16, _flash, _reference, options))
    return specs


def run_checks(
    device: torch.device,
    lengths: Sequence[int] = (4099, 2053, 1100, 17),
    heads: tuple[int, int] = (32, 8),
    head_dim: int = 128,
) -> list[Check]:
    """Run every check of `check_specs` on `device`, rows of `lengths` tokens, (query, KV) `heads`."""
    checks = []
    for seed, spec in enumerate(check_specs(device)):
        options = {"block_size": 16, **spec.options}
        case = make_case(
            lengths, q_heads=heads[0], kv_heads=heads[1], head_dim=head_dim, dtype=spec.dtype, device=device,
            seed=seed, **options,
        )  # fmt: skip
        scale = head_dim**-0.5
        run, expected = functools.partial(spec.run, case, scale), functools.partial(spec.expected, case, scale)
        check = Check(spec.kernel, spec.case, str(spec.dtype).removeprefix("torch."))
        checks.append(compare(check, run, expected, spec.dtype))
    return checks
