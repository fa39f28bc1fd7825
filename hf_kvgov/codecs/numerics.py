"""Directed rounding of scales into their storage dtype, one-byte statistics, and the finite-input guard.

Scales are computed in float32 and rounded *up* into their dtype (int zero points *down*), because a scale rounded
to the nearest could be slightly too small and clip a group's largest element: half a stored step bounds the error
exactly. ``scale_dtype=LOG_SCALE`` stores each statistic in one byte, since at 2 bits fp16 ones cost half the codes::

    scale  uint8 b     decodes to 2 ** ((b - LOG_SCALE_BIAS) / LOG_SCALE_STEPS)   2**-12 .. 2**9.25 (~608)
    zero   e4m3 byte   (torch.float8_e4m3fn), an integer codec's zero rounded down to it, within +-448

A scale is a step size, so a logarithmic byte keeps one relative precision at every magnitude (rounding up loses
at most 5.9% of a step, against e4m3's 12.5%); a zero is a position, so it stays a float. Both decode exactly.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

LOG_SCALE = torch.uint8  # a scale stored as one logarithmic byte (see the module docstring)
LOG_SCALE_STEPS = 12  # codes per octave
LOG_SCALE_BIAS = 144  # code 0 -> 2**-12, code 255 -> 2**(111/12)
ONE_BYTE_ZERO = torch.float8_e4m3fn  # zero points beside one-byte scales, and fp8 keys' zero points
SCALE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.float32, LOG_SCALE)
# Zero points: in a float scale's dtype, or one byte of e4m3 (one-byte statistics, fp8 keys).
ZERO_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.float32, ONE_BYTE_ZERO)
INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class StatisticsOutOfRange(ValueError):
    """A block's scales or zero points do not fit the codec's statistics dtype (one byte, or an fp16 overflow).

    A store that seals blocks catches it and keeps that block in full precision (`QuantizedBlockPool.seal`)."""


_CPU = torch.device("cpu")


@functools.cache
def log_scale_table(device: torch.device = _CPU) -> Tensor:
    """The float32 scale each of the 256 `LOG_SCALE` codes decodes to, ascending."""
    codes = torch.arange(256, dtype=torch.float32, device=device)
    return torch.exp2((codes - LOG_SCALE_BIAS) / LOG_SCALE_STEPS)


@functools.cache
def _e4m3_grid(device: torch.device) -> Tensor:
    """Every finite e4m3 value in float32, ascending, each once."""
    values = torch.arange(256, dtype=torch.uint8).view(ONE_BYTE_ZERO).float()
    return values[torch.isfinite(values)].unique().to(device)


def stat_to_float(stat: Tensor) -> Tensor:
    """A stored scale or zero point -> float32 (a `LOG_SCALE` byte through its table, exactly)."""
    if stat.dtype == LOG_SCALE:
        return log_scale_table(stat.device).index_select(0, stat.reshape(-1).int()).view(stat.shape)
    return stat.float()


def round_up(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The smallest ``dtype`` value >= each element of float32 ``x`` (same shape, dtype ``dtype``).

    For `LOG_SCALE` the result holds the codes of those values. Raises `StatisticsOutOfRange` where ``x`` lies above
    the largest one-byte value (a float dtype overflows to inf instead, which `require_finite_stats` catches).
    """
    if dtype in (LOG_SCALE, ONE_BYTE_ZERO):
        return _on_grid(x, dtype, up=True)
    rounded = x.to(dtype)
    if dtype == x.dtype:
        return rounded
    too_small = rounded.to(x.dtype) < x
    return torch.where(too_small, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)


def round_down(x: Tensor, dtype: torch.dtype) -> Tensor:
    """The largest ``dtype`` value <= each element of float32 ``x`` (same shape, dtype ``dtype``).

    Raises `StatisticsOutOfRange` where ``x`` lies outside a one-byte grid (e4m3's +-448): above it, the zero
    would clamp to 448 and the scale stretch over the gap.
    """
    if dtype in (LOG_SCALE, ONE_BYTE_ZERO):
        return _on_grid(x, dtype, up=False)
    rounded = x.to(dtype)
    if dtype == x.dtype:
        return rounded
    too_big = rounded.to(x.dtype) > x
    return torch.where(too_big, torch.nextafter(rounded, torch.full_like(rounded, -torch.inf)), rounded)


def _on_grid(x: Tensor, dtype: torch.dtype, up: bool) -> Tensor:
    """`round_up` / `round_down` onto a one-byte format's grid of values, by binary search."""
    grid = log_scale_table(x.device) if dtype == LOG_SCALE else _e4m3_grid(x.device)
    flat = x.reshape(-1).contiguous()
    index = torch.searchsorted(grid, flat, right=not up) - (0 if up else 1)
    outside = (index < 0) | (index >= grid.numel())
    if not up:  # a zero point above the grid would clamp to its top and stretch the scale over the gap: refused
        outside |= flat > grid[-1]
    if bool(outside.any()):
        what = "scale" if dtype == LOG_SCALE else "zero point"
        raise StatisticsOutOfRange(
            f"A {what} of {float(flat[outside][0]):.4g} lies outside the one-byte range "
            f"[{float(grid[0]):.4g}, {float(grid[-1]):.4g}]; build the codec with scale_dtype=torch.float16."
        )
    if dtype == LOG_SCALE:
        return index.to(LOG_SCALE).view(x.shape)
    return grid.index_select(0, index).view(x.shape).to(dtype)


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
        raise StatisticsOutOfRange(
            f"The {what} passed to the {codec} codec span a range that {dtype} scales cannot hold (their "
            "magnitude exceeds its largest finite value); build the codec with scale_dtype=torch.float32."
        )
