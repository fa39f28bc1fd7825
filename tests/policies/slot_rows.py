"""One (batch, head) row of hand-made slot facts, and a policy's choice over it as a list of slot indices."""

from __future__ import annotations

import torch

from hf_kvgov.policies import EvictionPolicy, SlotFacts


def row(values: list, dtype: torch.dtype) -> torch.Tensor:
    """One (batch, head) row: ``[1, 1, slots]``."""
    return torch.tensor(values, dtype=dtype).view(1, 1, -1)


def select_row(policy: EvictionPolicy, fact: str, values: list, budget: int, positions=None, valid=None) -> list[int]:  # type: ignore[no-untyped-def]
    """``policy.select`` with ``values`` as the fact named ``fact`` (positions 0.. and all valid by default)."""
    n = len(values)
    pos = row(positions if positions is not None else list(range(n)), torch.long)
    ok = row(valid if valid is not None else [True] * n, torch.bool)
    out = policy.select(SlotFacts(**{fact: row(values, torch.float32)}), pos, ok, budget)
    assert out.dtype == torch.long
    return out.view(-1).tolist()
