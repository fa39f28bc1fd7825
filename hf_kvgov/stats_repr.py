"""A stats record's repr with its floats rounded (``bytes_per_token=53426.1``, not ``53426.086956521736``): what
`print(cache.stats())` shows a person. The fields keep their exact values."""

from __future__ import annotations

import dataclasses
from typing import Any


def rounded_repr(record: Any) -> str:
    """``Name(field=value, ...)`` of a dataclass, floats to 6 significant digits, nested records likewise."""
    parts = []
    for field in dataclasses.fields(record):
        if not field.repr:
            continue
        value = getattr(record, field.name)
        text = f"{value:.6g}" if isinstance(value, float) else repr(value)
        parts.append(f"{field.name}={text}")
    return f"{type(record).__name__}({', '.join(parts)})"
