"""Budgets and their parts given either as token counts or as fractions.

A cache budget is the number of slots each (sequence, KV head) may keep: an int, or a float fraction of
a declared length or of generate's prompt (``hf_kvgov.engine.slots.budget_basis`` says which). The
parts of a budget (H2O's recent window and heavy hitters) are ints or fractions of the resolved budget.
"""

from __future__ import annotations

import math

BudgetSpec = int | float

# What a budget typed as text may be (`h2o@0.2`, `h2o@256`, `kvgov serve --h2o 0.2`).
BUDGET_TEXT_FORMS = "a fraction in (0, 1] with a decimal point (0.2) or a number of tokens (256)"

# 0.29 * 100 is 28.999999999999996 in floating point; the epsilon keeps such products from rounding down.
_EPSILON = 1e-9


def check_budget_spec(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    """Raise unless ``value`` is an int count (``>= 1``, or ``>= 0`` with ``allow_zero``) or a float in (0, 1]."""
    lowest = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{owner}: {name} must be an int number of tokens or a float fraction; "
            f"got {value!r} of type {type(value).__name__}."
        )
    if isinstance(value, int) and value < lowest:
        raise ValueError(f"{owner}: {name} as a number of tokens must be at least {lowest}; got {value}.")
    if isinstance(value, float) and not (0.0 <= value <= 1.0 if allow_zero else 0.0 < value <= 1.0):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{owner}: {name} as a fraction must lie in {interval}; got {value}.")


def read_budget(text: str) -> BudgetSpec | None:
    """`0.2` -> a fraction in (0, 1] (it has a decimal point); `256` -> tokens (an integer of at least 1); None
    when `text` is neither (the caller names the option: `BUDGET_TEXT_FORMS` says what is accepted)."""
    if text.isdecimal():
        return int(text) if int(text) >= 1 else None
    try:
        fraction = float(text)
    except ValueError:
        return None
    return fraction if "." in text and 0.0 < fraction <= 1.0 else None


def fraction_of(value: BudgetSpec, total: int) -> int:
    """``value`` itself if it is an int, else ``floor(value * total)``."""
    if isinstance(value, int):
        return value
    return math.floor(value * total + _EPSILON)


def resolve_budget(spec: BudgetSpec, first_length: int, minimum: int) -> int:
    """The budget in slots: an int as given; a fraction of ``first_length``, raised to ``minimum`` if below."""
    if isinstance(spec, int):
        return spec
    return max(minimum, fraction_of(spec, first_length), 1)
