"""Mean attention mass: keep the slots that drew the most attention per query that could read them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.selection import kept_of, select_within_budget, window_first


@dataclass(frozen=True)
class MeanMass:
    """H2O's accumulated mass divided by how many queries have read each slot, applied per KV head.

    A slot at position ``p`` has been read by the ``newest - p + 1`` queries at or after it, so H2O's sum
    favours old tokens merely for having been read longer; the mean removes that bias (kvpress's
    ObservedAttentionPress scores the same way at prefill). The ``recent`` newest valid slots are kept
    first, then the highest means up to ``kept = min(budget, slots)``.

    Args:
        recent: most recent valid slots always kept (default 0); the budget must be at least this.

    Ties go to the more recent position, then to the lower slot index. NaN mass ranks lowest.
    """

    recent: int = 0

    needs: ClassVar[FactNeeds] = FactNeeds(mass=True)

    def __post_init__(self) -> None:
        check_count("MeanMass", "recent", self.recent)

    @property
    def min_budget(self) -> int:
        return max(self.recent, 1)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        Reads ``facts.mass``, float ``[batch, kv_heads, slots]``; ``positions``/``valid`` as in
        :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: mass per reader, +inf on the window (see `RankingPolicy`)."""
        mass = facts.require("mass", "MeanMass")
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.recent, f"{self.recent} recent slots")
        newest = torch.where(valid, positions, -1).amax(dim=-1, keepdim=True)
        readers = (newest + 1 - positions).clamp(min=1).to(mass.dtype)
        return window_first(mass / readers, positions, valid, min(self.recent, kept_of(positions, budget)))
