"""H2O: keep a recent window plus the tokens that have collected the most attention (heavy hitters)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.selection import kept_of, select_within_budget, window_first


@dataclass(frozen=True)
class H2O:
    """Heavy-hitter oracle (Zhang et al., 2023), applied per KV head.

    Of ``kept = min(budget, slots)`` slots, ``h = min(heavy slots, kept - recent)`` go to the valid slots
    with the highest accumulated attention mass outside the window, and the window holds the other
    ``kept - h`` most recent valid slots (never fewer than ``recent``). With ``budget = heavy + recent``
    this is H2O exactly; a larger budget widens the window, a smaller one takes slots from the heavy part.

    Args:
        heavy: heavy-hitter slots, as an int count or as a float fraction of the budget in ``[0, 1]``
            (rounded down: ``heavy=0.2`` with budget 64 gives 12).
        recent: most recent valid slots always kept; the budget must be at least this.

    Ties in mass go to the more recent position, then to the lower slot index. NaN mass ranks lowest.
    """

    heavy: int | float
    recent: int

    needs: ClassVar[FactNeeds] = FactNeeds(mass=True)

    def __post_init__(self) -> None:
        check_count("H2O", "recent", self.recent)
        if isinstance(self.heavy, bool) or not isinstance(self.heavy, int | float):
            raise TypeError(
                "H2O.heavy must be an int count of slots or a float fraction of the budget; "
                f"got {self.heavy!r} of type {type(self.heavy).__name__}."
            )
        if isinstance(self.heavy, int) and self.heavy < 0:
            raise ValueError(f"H2O.heavy as a count of slots must be at least 0; got {self.heavy}.")
        if isinstance(self.heavy, float) and not 0.0 <= self.heavy <= 1.0:
            raise ValueError(f"H2O.heavy as a fraction of the budget must lie in [0, 1]; got {self.heavy}.")

    @property
    def min_budget(self) -> int:
        return max(self.recent, 1)

    def heavy_slots(self, budget: int) -> int:
        """How many heavy-hitter slots the configuration asks for under ``budget`` (before capping)."""
        if isinstance(self.heavy, int):
            return self.heavy
        # The epsilon keeps 0.29 * 100 = 28.999999999999996 from rounding down to 28.
        return math.floor(self.heavy * budget + 1e-9)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        Reads ``facts.mass``, float ``[batch, kv_heads, slots]`` accumulated attention mass (required);
        ``positions``/``valid`` as in :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: the mass, +inf on the window (see `RankingPolicy`)."""
        mass = facts.require("mass", "H2O")
        check_slot_tensors(facts, positions, valid)
        check_budget_fits(self, budget, self.recent, f"{self.recent} recent slots")
        kept = kept_of(positions, budget)
        heavy = max(0, min(self.heavy_slots(budget), kept - self.recent))
        return window_first(mass, positions, valid, kept - heavy)
