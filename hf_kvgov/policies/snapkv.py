"""SnapKV: keep the slots the prompt's last queries (the observation window) attend to, pooled."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.selection import kept_of, newest_valid, select_within_budget

_POOLS = ("max", "avg")


@dataclass(frozen=True)
class SnapKV:
    """SnapKV (Li et al., 2024), applied per KV head.

    The last ``window`` queries of the prompt (the observation window) show which earlier tokens the
    question needs. Each slot outside the window is scored by the attention those queries paid it (summed
    over the window and over the query heads of its KV group), smoothed by a 1-D ``pooling`` pool of
    ``kernel`` slots along positions so that a kept token brings its neighbours; the window itself is
    always kept, and the best-scored slots fill the rest of ``kept = min(budget, slots)``.

    During decode a step has a single query, so when the cache evicts again the score is the newest
    query's attention (pooled the same way), and the ``window`` newest slots (the recent steps) stay.

    Args:
        window: queries in the observation window, and the newest slots always kept.
        kernel: odd pooling width in slots.
        pooling: "max" or "avg" (zero-padded at the ends, like ``avg_pool1d``).

    The defaults (window 32, kernel 7, max pooling) are those of the official repository's LongBench run
    (``ablation_c4096_w32_k7_maxpool``); its code falls back to kernel 5 with average pooling.

    Slots are pooled in position order, so neighbours are the nearest kept positions; invalid slots count
    as zero attention. Ties go to the more recent position, then to the lower slot index.
    """

    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def __post_init__(self) -> None:
        check_count("SnapKV", "window", self.window, minimum=1)
        check_count("SnapKV", "kernel", self.kernel, minimum=1)
        if self.kernel % 2 == 0:
            raise ValueError(f"SnapKV.kernel must be odd, so the pool is centred on each slot; got {self.kernel}.")
        if self.pooling not in _POOLS:
            raise ValueError(f"SnapKV.pooling must be one of {_POOLS}; got {self.pooling!r}.")

    @property
    def needs(self) -> FactNeeds:
        return FactNeeds(recent_queries=self.window)

    @property
    def min_budget(self) -> int:
        return self.window

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        Reads ``facts.recent_attention``, float ``[batch, kv_heads, slots]``: the attention of the step's
        last ``window`` queries; ``positions``/``valid`` as in :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: the pooled window attention, +inf on the window (`RankingPolicy`)."""
        attention = facts.require("recent_attention", "SnapKV")
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.window, f"its {self.window}-slot observation window")
        window = min(self.window, kept_of(positions, budget))
        # As in SnapKV, the window's own attention is not pooled into its neighbours: it is kept anyway.
        in_window = newest_valid(positions, valid, window)
        pooled = pool_by_position(
            torch.where(valid & ~in_window, attention, 0.0), positions, valid, self.kernel, self.pooling
        )
        return torch.where(in_window, float("inf"), pooled)


def pool_by_position(values: Tensor, positions: Tensor, valid: Tensor, kernel: int, pooling: str) -> Tensor:
    """Float ``[batch, kv_heads, slots]``: a stride-1 ``pooling`` pool of ``kernel`` slots over ``values``.

    Slots are taken in position order (invalid ones last, as zeros) and the result is returned in slot
    order; ``values``/``positions``/``valid`` are ``[batch, kv_heads, slots]``.
    """
    order = torch.sort(torch.where(valid, positions, torch.iinfo(torch.long).max), dim=-1, stable=True).indices
    ordered = torch.where(valid, values, 0.0).gather(-1, order)
    batch, heads, slots = ordered.shape
    rows = ordered.reshape(batch * heads, 1, slots)
    pool = functional.max_pool1d if pooling == "max" else functional.avg_pool1d
    pooled = pool(rows, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(batch, heads, slots)
    return torch.empty_like(pooled).scatter_(-1, order, pooled)
