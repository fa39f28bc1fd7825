"""Directed rounding of scales into their storage dtype, and the finite-input guard.

Scales are computed in float32 and stored in float16 by default. Rounding a scale to the *nearest*
float16 could make it slightly too small, so the largest element of a group would land just past the
last code and be clipped. Rounding scales *up* (and int zero points *down*) keeps every element of the
group inside the representable range, so the error bound "half a step of the stored scale" holds
exactly instead of "half a step plus a clipping term".
"""

from __future__ import annotations

import torch
from torch import Tensor

SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.float32)
# Zero points: in the scale's dtype, or one byte of e4m3 (fp8 keys, `hf_kvgov.codecs.fp8`).
ZERO_DTYPES: tuple[torch.dtype, ...] = (*SCALE_DTYPES, torch.float8_e4m3fn)
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The smallest ``dtype`` value >= each element of float32 ``x`` (same shape, dtype ``dtype``)."""
    rounded = x.to(dtype)
    if dtype == x.dtype:
        return rounded
    too_small = rounded.to(x.dtype) < x
    return torch.where(too_small, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)


def round_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The largest ``dtype`` value <= each element of float32 ``x`` (same shape, dtype ``dtype``)."""
    rounded = x.to(dtype)
    if dtype == x.dtype:
        return rounded
    too_big = rounded.to(x.dtype) > x
    return torch.where(too_big, torch.nextafter(rounded, torch.full_like(rounded, -torch.inf)), rounded)


def check_input_dtype(x: Tensor, what: str) -> None:
    """Raise TypeError unless ``x`` is a float32 / float16 / bfloat16 tensor."""
    if not isinstance(x, Tensor):
        raise TypeError(f"The {what} must be a torch.Tensor; got {type(x).__name__}.")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"The {what} must have dtype float32, float16 or bfloat16; got {x.dtype}.")


def check_output_dtype(dtype: torch.dtype) -> None:
    """Raise TypeError unless ``dtype`` is one a decoded K/V tensor may have."""
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"decode can return float32, float16 or bfloat16; got dtype={dtype!r}.")


def require_finite(x: Tensor, what: str, codec: str) -> None:
    """Raise ValueError if ``x`` holds NaN or inf: a KV cache must never store garbage silently.

    One fused ``isfinite().all()`` reduction and a single host sync; callers on a hot path can turn it
    off with ``check_finite=False`` on the codec.
    """
    if not bool(torch.isfinite(x).all()):
        raise ValueError(
            f"The {what} passed to the {codec} codec contain NaN or inf (shape {tuple(x.shape)}); a KV cache "
            "must not store them. Find where they come from (often a float16 overflow upstream), or build "
            "the codec with check_finite=False to skip this check."
        )


def require_finite_stats(stats: tuple[Tensor, ...], what: str, codec: str, dtype: torch.dtype) -> None:
    """Raise ValueError if a scale or zero point overflowed its storage dtype."""
    # float8 has no isfinite kernel; its NaNs survive the widening (an e4m3 zero is clamped, so has none).
    if not all(bool(torch.isfinite(s if s.dtype.itemsize > 1 else s.float()).all()) for s in stats):
        raise ValueError(
            f"The {what} passed to the {codec} codec span a range that {dtype} scales cannot hold (their "
            "magnitude exceeds its largest finite value); build the codec with scale_dtype=torch.float32."
        )
