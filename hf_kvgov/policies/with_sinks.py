"""Attention sinks added to any policy: ``WithSinks(4, SnapKV())`` keeps the first 4 tokens, then SnapKV's choice.

StreamingLLM found that the first tokens collect attention whatever the query (attention sinks), so a policy
that drops them can hurt even when its own ranking is good. Sinks are configuration here, not a new policy per
combination: the wrapper keeps the ``n_sink`` oldest valid slots of each (row, KV head) and lets ``inner``
choose the rest of the budget among the other slots, with the facts ``inner`` asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from hf_kvgov.policies.base import (
    EvictionPolicy,
    FactNeeds,
    SlotFacts,
    check_budget_fits,
    check_count,
    check_slot_tensors,
)
from hf_kvgov.policies.selection import oldest_valid, select_by_priority


@dataclass(frozen=True)
class WithSinks:
    """``inner``'s choice plus the ``n_sink`` first valid tokens of each (row, KV head).

    Args:
        n_sink: sink tokens always kept (StreamingLLM uses 4).
        inner: the policy that fills the rest of the budget, among the slots that are not sinks.

    The sinks keep their positions (no re-rotation: that is `SinkCache`'s, for a StreamingLLM window).
    """

    n_sink: int
    inner: EvictionPolicy

    def __post_init__(self) -> None:
        check_count("WithSinks", "n_sink", self.n_sink)
        if not isinstance(self.inner, EvictionPolicy):
            raise TypeError(
                f"WithSinks.inner must be an eviction policy (needs, min_budget, select); got {self.inner!r}."
            )

    @property
    def needs(self) -> FactNeeds:
        return self.inner.needs

    @property
    def min_budget(self) -> int:
        return self.n_sink + self.inner.min_budget

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices (facts as ``inner`` needs)."""
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.min_budget, f"{self.n_sink} sinks and what {self.inner!r} keeps")
        kept = min(budget, positions.shape[-1])
        sinks = oldest_valid(positions, valid, self.n_sink)
        rest = valid & ~sinks
        chosen = self.inner.select(facts, positions, rest, budget - self.n_sink)
        keep = sinks | (torch.zeros_like(valid).scatter_(-1, chosen, True) & rest)  # a filler is never kept
        # Ranked by kept-or-not: the chosen slots first; any room left (a row with few valid slots) goes to
        # the other valid slots, newest first, then to invalid fillers, as every policy pads.
        return select_by_priority(keep.float(), positions, valid, kept)
