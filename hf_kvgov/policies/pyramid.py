"""PyramidKV's per-layer budgets: more slots in the lower layers, fewer in the upper, the same total.

PyramidKV (Cai et al., 2024) observes that attention is spread wide in the lower layers and concentrated in the
upper ones, so budgets fall with depth in an arithmetic progression. With ``n`` layers, a mean budget ``B`` and
``fixed`` slots every layer keeps (observation window, recent tokens), the part above ``fixed`` runs from
``2 (B - fixed) - low`` down to ``low = (B - fixed) / beta``; the mean is exactly ``B``, so the cache holds a
uniform budget's bytes. The official code and kvpress's `PyramidKVPress` compute the same progression; here the
budgets are whole slots summing to exactly ``n * B``. As ``layer_budgets=Pyramid()`` it splits the cache's resolved
budget over the layers that evict (a sliding-window layer keeps its window, so it takes no part), lowest first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvgov.policies.base import check_budget, check_count


@dataclass(frozen=True)
class Pyramid:
    """Per-layer budgets falling linearly with depth, summing to the uniform budget's total.

    Args:
        beta: how steep the pyramid is: the last layer keeps ``1 / beta`` of the average budget above the
            fixed slots, the first ``2 - 1 / beta`` of it (PyramidKV's default, 20). ``beta = 1`` is uniform.
    """

    beta: float = 20.0

    def __post_init__(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not self.beta >= 1:
            raise ValueError(f"Pyramid.beta must be a number >= 1 (1: uniform budgets); got {self.beta!r}.")

    def split(self, budget: int, layers: Sequence[int], fixed: int = 1) -> dict[int, int]:
        """Each of ``layers`` (lowest first) -> its budget in slots; the budgets sum to ``len(layers) * budget``.

        Every layer keeps at least ``fixed`` slots (at least 1: a layer with no slot cannot attend); a
        budget at or below ``fixed`` leaves nothing to share out, so every layer keeps ``budget``.
        """
        check_budget(budget)
        check_count("Pyramid.split", "fixed", fixed, minimum=1)
        count = len(layers)
        free = budget - fixed
        if count < 2 or free <= 0:
            return dict.fromkeys(layers, budget)
        low = free / self.beta
        high = 2 * free - low
        step = (high - low) / (count - 1)
        ideal = [fixed + high - i * step for i in range(count)]
        budgets = [math.floor(value) for value in ideal]
        # Whole slots: the largest remainders (lower layers first on ties) get the slots flooring lost.
        short = count * budget - sum(budgets)
        by_remainder = sorted(range(count), key=lambda i: (budgets[i] - ideal[i], i))
        for i in by_remainder[:short]:
            budgets[i] += 1
        return dict(zip(layers, budgets, strict=True))
