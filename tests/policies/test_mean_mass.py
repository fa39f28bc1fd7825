"""Mean attention mass on hand-made masses whose kept slots were worked out by hand."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.policies import FactNeeds, MeanMass, SlotFacts, make_policy
from tests.policies.slot_rows import select_row


def select(policy: MeanMass, mass: list, budget: int, positions=None, valid=None) -> list[int]:
    return select_row(policy, "mass", mass, budget, positions, valid)


# Positions 0..5, newest 5: readers 6, 5, 4, 3, 2, 1, so the means are 1.0, 1.0, 1.25, 0.5, 1.5, 0.5.
MASS = [6.0, 5.0, 5.0, 1.5, 3.0, 0.5]


def test_the_highest_means_win_where_the_sum_would_keep_the_oldest() -> None:
    assert select(MeanMass(), MASS, budget=2) == [2, 4]  # H2O's sum would keep slots 0 and 1
    # Slots 0 and 1 tie at 1.0: the more recent position wins.
    assert select(MeanMass(), MASS, budget=3) == [1, 2, 4]


def test_the_recent_window_is_kept_first() -> None:
    assert select(MeanMass(recent=1), MASS, budget=3) == [2, 4, 5]


def test_readers_count_from_the_newest_valid_position_and_padding_is_never_kept() -> None:
    valid = [False, True, True, True]
    # Positions 7, 8, 9, 10 (left padding at 7): readers 3, 2, 1 -> means 2.0, 1.0, 3.0 for slots 1..3.
    assert select(MeanMass(), [100.0, 6.0, 2.0, 3.0], budget=2, positions=[7, 8, 9, 10], valid=valid) == [1, 3]


def test_registered_needs_the_mass_and_refuses_a_budget_below_its_window() -> None:
    assert make_policy("mean_mass") == MeanMass() and MeanMass.needs == FactNeeds(mass=True)
    facts = SlotFacts(mass=torch.ones(1, 1, 4))
    with pytest.raises(ValueError):
        MeanMass(recent=3).select(facts, torch.arange(4)[None, None], torch.ones(1, 1, 4, dtype=torch.bool), 2)
