"""StreamingLLM: keep the first few tokens (attention sinks) and a window of the most recent ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.selection import oldest_valid, select_within_budget


@dataclass(frozen=True)
class SinkWindow:
    """Attention sinks plus a recent window (Xiao et al., 2023), applied per KV head.

    Keeps the ``n_sink`` valid slots with the lowest positions, which are the first real tokens, never
    left padding, and fills the rest of ``kept = min(budget, slots)`` with the most recent valid slots.
    The window is therefore ``kept - n_sink`` slots, at least ``window``; it reads no facts.

    Args:
        n_sink: sink tokens kept at the start (StreamingLLM uses 4).
        window: most recent valid slots always kept; the budget must cover ``n_sink + window``.

    The cache that applies this policy should re-rotate kept keys so that query-key distances stay
    inside the model's trained range (see :func:`hf_kvgov.policies.rope.rerotate`).
    """

    n_sink: int
    window: int

    needs: ClassVar[FactNeeds] = FactNeeds()

    def __post_init__(self) -> None:
        check_count("SinkWindow", "n_sink", self.n_sink)
        check_count("SinkWindow", "window", self.window)

    @property
    def min_budget(self) -> int:
        return max(self.n_sink + self.window, 1)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        ``facts`` are ignored; ``positions``/``valid`` as in :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: 1 on the sinks, 0 elsewhere (see `RankingPolicy`).

        Every non-sink slot ties at priority 0, and the shared tie-break prefers newer positions, so the
        slots left after the sinks go to the newest tokens: that is the window, grown to the budget.
        """
        check_slot_tensors(facts, positions, valid)
        fixed = self.n_sink + self.window
        check_budget_fits(self, budget, fixed, f"{self.n_sink} sink + {self.window} window = {fixed} slots")
        return oldest_valid(positions, valid, self.n_sink).float()
