"""TOVA: keep the slots the current query attends to most."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget, check_slot_tensors
from hf_kvgov.policies.selection import select_within_budget


@dataclass(frozen=True)
class TOVA:
    """Token Omission Via Attention (Oren et al., 2024), applied per KV head.

    Keeps the ``kept = min(budget, slots)`` valid slots with the highest attention from the step's last
    query, averaged over the query heads of the KV group (the cache hands their sum, which ranks the same).
    During decode the cache holds ``budget`` slots and each step adds one, so the slot the newest query
    attends to least is evicted each step; at prefill the prompt's last query chooses. There is no fixed
    window: a new token stays only if its own query, or a later one, attends to it enough.

    Ties go to the more recent position, then to the lower slot index. NaN attention ranks lowest.
    """

    needs: ClassVar[FactNeeds] = FactNeeds(recent_queries=1)

    @property
    def min_budget(self) -> int:
        return 1

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        Reads ``facts.recent_attention``, float ``[batch, kv_heads, slots]``: the last query's attention;
        ``positions``/``valid`` as in :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: the last query's attention (see `RankingPolicy`)."""
        attention = facts.require("recent_attention", "TOVA")
        check_slot_tensors(facts, positions, valid)
        check_budget(budget)
        return attention
