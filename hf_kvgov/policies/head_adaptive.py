"""AdaKV's head-adaptive budgets: the KV heads of a layer share its total, by how much their slots are worth.

Heads differ: some spread their attention thin, others put it on a handful of tokens, so the ``B``-th slot of a
focused head is worth far less than the ``B``-th of a diffuse one. AdaKV (Feng et al., 2024) ranks the slots of all
the layer's heads together by the policy's score and keeps the ``heads x B`` best: the same total bytes, each head
getting what its scores earn, with a floor of ``floor x B`` slots (0.2 by default) so that no head loses its
context outright. Scores compare across heads as they are, because attention facts are probabilities summed over
the same number of query heads per KV head; slots a policy always keeps rank at +inf, so every head keeps them.
`select` returns the ragged result padded to the largest head, with a mask of kept entries; the cache stores only
the kept ones in pool blocks (``hf_kvgov.hf.eviction.pooled_slots``), so a head keeping fewer frees real memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from hf_kvgov.policies.base import check_budget
from hf_kvgov.policies.selection import rank_of, ranked, select_by_priority


@dataclass(frozen=True)
class HeadAdaptive:
    """Per-head budgets within each layer's total: the layer's best ``heads x budget`` slots, ranked together.

    Args:
        floor: the share of the budget every head keeps whatever its scores (AdaKV's alpha), in ``[0, 1]``;
            ``floor=1`` is the uniform budget.

    Use it as a cache's ``head_budgets``: ``PolicyCache(model, SnapKV(), 0.2, head_budgets=HeadAdaptive())``.
    """

    floor: float = 0.2

    def __post_init__(self) -> None:
        if isinstance(self.floor, bool) or not isinstance(self.floor, int | float) or not 0 <= self.floor <= 1:
            raise ValueError(f"HeadAdaptive.floor must be a number in [0, 1] (1: uniform budgets); got {self.floor!r}.")

    def floor_slots(self, budget: int) -> int:
        """Slots every head keeps under ``budget`` before the heads compete (rounded down)."""
        return min(budget, int(self.floor * budget + 1e-9))

    def select(self, priority: Tensor, positions: Tensor, valid: Tensor, budget: int) -> tuple[Tensor, Tensor]:
        """The kept slots of every row, ``heads x min(budget, slots)`` of them shared by the heads.

        Args:
            priority: float ``[batch, kv_heads, slots]`` from a `RankingPolicy` (+inf: always kept; NaN lowest).
            positions: long ``[batch, kv_heads, slots]``; valid: bool, the same shape (invalid slots are never kept).
            budget: the average slots per KV head.

        Returns:
            ``(keep_idx, kept)``: long ``[batch, kv_heads, n]`` slot indices and bool ``[batch, kv_heads, n]``,
            ``n`` the most slots any head keeps. A head's kept slots come last, in ascending position; the
            entries before them are fillers (``kept`` False), as a left-padded row.

        Within a head, slots rank as in `select_by_priority`; across heads, by priority, then the more recent
        position, then the lower head. A row with fewer valid slots than its total keeps all of them.
        """
        check_budget(budget)
        batch, heads, slots = priority.shape
        per_head = min(budget, slots)
        in_head = rank_of(ranked(priority, positions, valid))
        guaranteed = valid & (in_head < self.floor_slots(per_head))
        # The rest of the row's total goes to the best remaining slots of any head.
        open_slots = valid & ~guaranteed
        room = heads * per_head - guaranteed.sum(dim=(1, 2))  # [batch]
        flat = (t.reshape(batch, 1, heads * slots) for t in (priority, positions, open_slots))
        across = rank_of(ranked(*flat)).reshape(batch, heads, slots)
        chosen = guaranteed | (open_slots & (across < room[:, None, None]))
        width = max(int(chosen.sum(dim=-1).max()), 1)
        keep_idx = select_by_priority(chosen.float(), positions, chosen, width)
        return keep_idx, chosen.gather(-1, keep_idx)
