"""What `kvgov check-quant` measures by default: the formats it knows and the sizes of a run. Plain values, so the
command line can describe them without loading torch."""

from __future__ import annotations

from typing import Any

# Format names accepted by the check -> QuantizedCache(bits=..., fmt=...).
FORMAT_OPTIONS: dict[str, dict[str, Any]] = {
    "int8": {"bits": 8, "fmt": "int"},
    "int4": {"bits": 4, "fmt": "int"},
    "int2": {"bits": 2, "fmt": "int"},
    "fp8": {"bits": 8, "fmt": "fp8"},
    "fp8_e5m2": {"bits": 8, "fmt": "fp8_e5m2"},
}
DEFAULT_TOLERANCE_PCT = 0.5
DEFAULT_MAX_TOKENS = 2048
DEFAULT_SCAN_TOKENS = 512
DEFAULT_MAX_ROWS = 32
