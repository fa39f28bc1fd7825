"""Key-norm: keep the slots whose keys have the lowest L2 norm, plus a recent window."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.selection import kept_of, select_within_budget, window_first


@dataclass(frozen=True)
class KeyNorm:
    """L2-norm eviction (Devoto et al., 2024), applied per KV head.

    Keys with a low L2 norm tend to draw high attention (the attention sinks among them), so the valid
    slots with the lowest key norm are kept, after the ``recent`` newest valid slots, up to
    ``kept = min(budget, slots)``. It reads no attention at all, so it needs no attention weights.

    Args:
        recent: most recent valid slots always kept (default 32); the budget must be at least this.

    Ties in norm go to the more recent position, then to the lower slot index. NaN norms rank lowest.
    """

    recent: int = 32

    needs: ClassVar[FactNeeds] = FactNeeds(key_norm=True)

    def __post_init__(self) -> None:
        check_count("KeyNorm", "recent", self.recent)

    @property
    def min_budget(self) -> int:
        return max(self.recent, 1)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        Reads ``facts.key_norm``, float ``[batch, kv_heads, slots]``; ``positions``/``valid`` as in
        :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: minus the key norm, +inf on the window (see `RankingPolicy`)."""
        norm = facts.require("key_norm", "KeyNorm")
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.recent, f"{self.recent} recent slots")
        return window_first(-norm, positions, valid, min(self.recent, kept_of(positions, budget)))
