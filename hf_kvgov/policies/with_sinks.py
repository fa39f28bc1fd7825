"""Attention sinks added to any policy: ``WithSinks(4, SnapKV())`` keeps the first 4 tokens, then SnapKV's choice.

StreamingLLM found that the first tokens collect attention whatever the query (attention sinks), so a policy
that drops them can hurt even when its own ranking is good. Sinks are configuration here, not a new policy per
combination: the wrapper keeps the ``n_sink`` oldest valid slots of each (row, KV head) and lets ``inner``
choose the rest of the budget among the other slots, with the facts ``inner`` asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from hf_kvgov.policies.base import (
    FactNeeds,
    RankingPolicy,
    SlotFacts,
    check_budget_fits,
    check_count,
    check_slot_tensors,
)
from hf_kvgov.policies.selection import oldest_valid, select_within_budget


@dataclass(frozen=True)
class WithSinks:
    """``inner``'s choice plus the ``n_sink`` first valid tokens of each (row, KV head).

    Args:
        n_sink: sink tokens always kept (StreamingLLM uses 4).
        inner: the policy that fills the rest of the budget, among the slots that are not sinks.

    The sinks keep their positions (no re-rotation: that is `SinkCache`'s, for a StreamingLLM window).
    """

    n_sink: int
    inner: RankingPolicy

    def __post_init__(self) -> None:
        check_count("WithSinks", "n_sink", self.n_sink)
        if not isinstance(self.inner, RankingPolicy):
            raise TypeError(
                "WithSinks.inner must be an eviction policy that ranks slots (needs, min_budget, select, "
                f"priority); got {self.inner!r}."
            )

    @property
    def needs(self) -> FactNeeds:
        return self.inner.needs

    @property
    def min_budget(self) -> int:
        return self.n_sink + self.inner.min_budget

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices (facts as ``inner`` needs)."""
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: +inf on the sinks, ``inner``'s priority among the other slots.

        ``inner`` ranks the slots that are not sinks for the rest of the budget, so its own always-kept
        slots (a window) are counted among those, not among the sinks (see `RankingPolicy`).
        """
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.min_budget, f"{self.n_sink} sinks and what {self.inner!r} keeps")
        sinks = oldest_valid(positions, valid, self.n_sink)
        rest = self.inner.priority(facts, positions, valid & ~sinks, budget - self.n_sink)
        return rest.masked_fill(sinks, float("inf"))
