"""Sizes, counts and element types as users type them, and how the planner prints them back.

Memory sizes: ``"80GB"`` is 80 x 10^9 bytes, ``"80GiB"`` is 80 x 2^30 bytes, and a bare number
(``"80"`` or ``80``) is GiB, the unit ``nvidia-smi`` and ``torch.cuda.mem_get_info`` report (an
"80 GB" A100 has 81,920 MiB = 80 GiB = 85.9 GB).
"""

from __future__ import annotations

import re

_SIZE_UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

_COUNT_SUFFIXES: dict[str, int] = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
_COUNT_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)

# Bytes per element of the full-precision KV cache (what keys and values are computed in).
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2}

# Bytes per weight. int8/int4 weights also carry one fp16 scale per group of 128 weights (the usual
# group size of GPTQ/AWQ-style checkpoints), i.e. 2/128 byte per weight on top of the codes.
WEIGHT_GROUP_SIZE = 128
WEIGHT_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "fp16": 2.0,
    "bf16": 2.0,
    "int8": 1.0 + 2.0 / WEIGHT_GROUP_SIZE,
    "int4": 0.5 + 2.0 / WEIGHT_GROUP_SIZE,
}

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "float": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "torch.float32": "fp32",
    "torch.float16": "fp16",
    "torch.bfloat16": "bf16",
}


def parse_memory(value: str | float | int, what: str = "accelerator memory") -> int:
    """Bytes in ``value`` ("80GB", "80 GiB", "512MiB", 80, "80"); a bare number means GiB.

    Raises ValueError with the accepted forms for anything else, and for zero or negative sizes.
    """
    if isinstance(value, bool):
        raise TypeError(f"The {what} must be a size such as '80GB' or '80GiB' or a number of GiB; got {value!r}.")
    if isinstance(value, int | float):
        number, unit = float(value), "gib"
    else:
        match = _SIZE_PATTERN.match(str(value))
        if match is None:
            stripped = str(value).strip()
            if stripped.startswith("-"):
                raise ValueError(f"The {what} must be positive; got {value!r}.")
            raise ValueError(
                f"Cannot read {value!r} as the {what}: give a number and a unit, such as '80GB', '80GiB' or "
                f"'24 GiB' (units: {', '.join(_SIZE_UNITS)}, case-insensitive), or a bare number of GiB."
            )
        number, unit = float(match.group(1)), (match.group(2).lower() or "gib")
        if unit not in _SIZE_UNITS:
            raise ValueError(
                f"Unknown unit {match.group(2)!r} in the {what} {value!r}; accepted units are "
                f"{', '.join(_SIZE_UNITS)} (case-insensitive), or none for GiB."
            )
    if number <= 0:
        raise ValueError(f"The {what} must be positive; got {value!r}.")
    return round(number * _SIZE_UNITS[unit])


def parse_count(value: str | int, what: str = "parameter count") -> int:
    """An integer count from ``13015864320``, ``"13B"``, ``"135M"`` or ``"6.7e9"``."""
    if isinstance(value, bool):
        raise TypeError(f"The {what} must be a number such as 13000000000 or '13B'; got {value!r}.")
    if isinstance(value, int):
        number, factor = float(value), 1
    else:
        match = _COUNT_PATTERN.match(str(value))
        if match is None:
            raise ValueError(
                f"Cannot read {value!r} as the {what}: give an integer or a number with a suffix K, M, B "
                "or T (e.g. '13B', '135M')."
            )
        number, factor = float(match.group(1)), _COUNT_SUFFIXES[match.group(2).lower()]
    if number <= 0:
        raise ValueError(f"The {what} must be positive; got {value!r}.")
    return round(number * factor)


def normalize_dtype(name: str, accepted: dict[str, int] | dict[str, float], what: str) -> str:
    """The canonical key of ``accepted`` for a user's dtype name ("float16" -> "fp16")."""
    if not isinstance(name, str):
        raise TypeError(f"The {what} must be a string such as 'fp16'; got {name!r}.")
    key = name.strip().lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in accepted:
        raise ValueError(f"Unknown {what} {name!r}; accepted: {', '.join(accepted)}.")
    return key


def kv_dtype_bytes(name: str) -> int:
    """Bytes per element of a full-precision KV dtype ('fp32', 'fp16', 'bf16')."""
    return KV_DTYPE_BYTES[normalize_dtype(name, KV_DTYPE_BYTES, "KV cache dtype")]


def weight_dtype_bytes(name: str) -> float:
    """Bytes per parameter for a weight dtype ('fp32', 'fp16', 'bf16', 'int8', 'int4'), scales included."""
    return WEIGHT_DTYPE_BYTES[normalize_dtype(name, WEIGHT_DTYPE_BYTES, "weight dtype")]


def format_bytes(n: float) -> str:
    """Decimal units, as the article and datasheets write them: 819200 -> '0.819 MB', 1.68e9 -> '1.68 GB'."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        # Switch unit at half of it, so 819,200 B reads "0.819 MB" as the article's "0.82 MB" does.
        if abs(n) >= size / 2:
            value = n / size
            return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.3g} {unit}"
    return f"{n:,.0f} B"


def format_ratio(x: float | None) -> str:
    """'4.00x', or '-' where a ratio is undefined (a division by zero concurrency)."""
    return "-" if x is None else f"{x:.2f}x"
