"""Rank slots by scores computed before the cache saw the tokens: per layer, row, KV head and position.

A compressor that scores a context in passes of its own (KVzip's context reconstruction,
`hf_kvgov.hf.eviction.kvzip`) hands the scores to the cache through this policy; the cache then keeps the best
of them at its prefill like any other policy, in its own memory and pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.selection import select_within_budget


@dataclass(frozen=True, eq=False)
class GivenScores:
    """Keep the slots with the highest given scores; the first ``sinks`` positions always.

    Args:
        scores: one float tensor ``[batch, kv_heads, positions]`` per decoder layer (None for a layer that never
            evicts): the score of the token at each position, for each row and KV head.
        sinks: leading positions always kept (attention sinks).

    A slot past the scored positions (a token that came after the scoring) ranks +inf: it is newer than anything
    scored. Ties go to the more recent position, then to the lower slot index.
    """

    scores: tuple[Tensor | None, ...]
    sinks: int = 4

    needs: ClassVar[FactNeeds] = FactNeeds()

    def __post_init__(self) -> None:
        check_count("GivenScores", "sinks", self.sinks)
        for layer, table in enumerate(self.scores):
            if table is not None and (not isinstance(table, Tensor) or table.dim() != 3):
                raise ValueError(
                    f"GivenScores.scores[{layer}] must be a float tensor [batch, kv_heads, positions] or None; "
                    f"got {table!r}."
                )

    @property
    def min_budget(self) -> int:
        return max(self.sinks, 1)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices (see `priority`)."""
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: the layer's score at each slot's position, +inf on the sinks."""
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.sinks, f"{self.sinks} sink positions")
        if facts.layer is None or not 0 <= facts.layer < len(self.scores):
            raise ValueError(
                f"GivenScores holds scores for layers 0..{len(self.scores) - 1}, so facts.layer must name one of "
                f"them; got {facts.layer!r}."
            )
        table = self.scores[facts.layer]
        if table is None:
            raise ValueError(f"GivenScores has no scores for layer {facts.layer}, which evicts.")
        if table.shape[:2] != positions.shape[:2]:
            raise ValueError(
                f"GivenScores.scores[{facts.layer}] is for [batch, kv_heads] = {list(table.shape[:2])}, but the cache "
                f"holds {list(positions.shape[:2])}."
            )
        scored = table.shape[-1]
        found = table.to(positions.device, torch.float32).gather(-1, positions.clamp(0, scored - 1))
        always = (positions >= scored) | (positions < self.sinks)
        return torch.where(always, float("inf"), found)
