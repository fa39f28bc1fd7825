"""H2O (H2O) on hand-made scores whose kept slots were worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvgov.policies import H2O, FactNeeds, SlotFacts
from tests.policies.slot_rows import select_row

NAN = float("nan")
INF = float("inf")


def select(policy: H2O, scores: list, budget: int, positions=None, valid=None) -> list[int]:
    return select_row(policy, "mass", scores, budget, positions, valid)


def test_recent_window_plus_highest_mass() -> None:
    # Window: positions 6, 7. Heavy among slots 0..5: mass 9 (slot 2), then 5 (slot 0).
    assert select(H2O(heavy=2, recent=2), [5, 1, 9, 3, 3, 0, 1, 2], budget=4) == [0, 2, 6, 7]


def test_ties_go_to_the_more_recent_position() -> None:
    # Slots 1, 2, 3 tie at mass 4; the two newest of them (3, then 2) win.
    assert select(H2O(heavy=2, recent=2), [1, 4, 4, 4, 0, 0, 0, 0], budget=4) == [2, 3, 6, 7]


def test_slots_in_any_order_are_ranked_by_position_and_returned_in_position_order() -> None:
    positions = [7, 3, 0, 5, 1, 6, 2, 4]
    scores = [0, 8, 0, 0, 7, 0, 9, 0]
    # Window: positions 7 (slot 0) and 6 (slot 5). Heavy: slot 6 (mass 9, pos 2), slot 1 (mass 8, pos 3).
    kept = select(H2O(heavy=2, recent=2), scores, budget=4, positions=positions)
    assert kept == [6, 1, 5, 0]


def test_padding_is_never_a_heavy_hitter() -> None:
    valid = [False, False, True, True, True, True, True, True]
    scores = [100, 100, 1, 5, 2, 3, 0, 0]
    kept = select(H2O(heavy=2, recent=2), scores, budget=4, valid=valid)
    assert kept == [3, 5, 6, 7]


def test_fewer_valid_slots_than_budget_are_padded_with_invalid_slots_first() -> None:
    valid = [False, True, False, False, True, False]
    scores = [50, 0, 50, 50, 0, 50]
    # Two valid slots (1, 4) and a budget of 4: the two lowest invalid slot indices (0, 2) fill the row.
    kept = select(H2O(heavy=1, recent=1), scores, budget=4, valid=valid)
    assert kept == [0, 2, 1, 4]


def test_every_head_selects_independently() -> None:
    scores = torch.tensor(
        [
            [[9, 0, 0, 0, 0, 0], [0, 0, 9, 0, 0, 0]],
            [[0, 0, 0, 0, 9, 0], [0, 1, 1, 0, 0, 0]],
        ],
        dtype=torch.float32,
    )
    positions = torch.arange(6).expand(2, 2, 6)
    valid = torch.ones(2, 2, 6, dtype=torch.bool)
    kept = H2O(heavy=1, recent=1).select(SlotFacts(mass=scores), positions, valid, 2)
    assert kept.tolist() == [[[0, 5], [2, 5]], [[4, 5], [2, 5]]]


def test_heavy_as_a_fraction_of_the_budget() -> None:
    descending = [9, 8, 7, 6, 5, 4, 3, 2]
    assert select(H2O(heavy=0.5, recent=1), descending, budget=4) == [0, 1, 6, 7]
    assert select(H2O(heavy=0.25, recent=1), descending, budget=4) == [0, 5, 6, 7]
    assert H2O(heavy=0.29, recent=0).heavy_slots(100) == 29
    assert H2O(heavy=0.2, recent=0).heavy_slots(64) == 12


def test_heavy_larger_than_the_budget_allows_is_capped_by_the_window() -> None:
    assert select(H2O(heavy=10, recent=2), [9, 8, 7, 6, 5, 4, 3, 2], budget=4) == [0, 1, 6, 7]


def test_budget_beyond_heavy_plus_recent_widens_the_window() -> None:
    assert select(H2O(heavy=1, recent=1), [9, 8, 7, 6, 5, 4, 3, 2], budget=4) == [0, 5, 6, 7]


def test_infinite_mass_does_not_displace_the_window() -> None:
    kept = select(H2O(heavy=1, recent=1), [INF, INF, INF, 0, 0, 0, 0, 0], budget=3)
    assert kept == [2, 6, 7]


def test_nan_mass_ranks_below_any_number() -> None:
    kept = select(H2O(heavy=1, recent=1), [-5, NAN, NAN, NAN, NAN, NAN, NAN, NAN], budget=2)
    assert kept == [0, 7]


@pytest.mark.parametrize("budget", [8, 9, 100])
def test_budget_at_least_the_slot_count_keeps_everything_in_position_order(budget: int) -> None:
    positions = [7, 3, 0, 5, 1, 6, 2, 4]
    kept = select(H2O(heavy=1, recent=1), [0] * 8, budget=budget, positions=positions)
    assert kept == [2, 4, 6, 1, 7, 3, 5, 0]


def test_budget_smaller_than_the_recent_window_is_refused() -> None:
    with pytest.raises(ValueError, match=r"keeps 4 recent slots.*at least 4; got a budget of 3"):
        select(H2O(heavy=2, recent=4), [0] * 8, budget=3)


@pytest.mark.parametrize("budget", [0, -1])
def test_non_positive_budget_is_refused(budget: int) -> None:
    with pytest.raises(ValueError, match=f"positive.*got {budget}"):
        select(H2O(heavy=1, recent=0), [0] * 4, budget=budget)


@pytest.mark.parametrize("budget", [True, 2.0, "2"])
def test_non_int_budget_is_a_type_error(budget: object) -> None:
    with pytest.raises(TypeError, match="budget must be an int"):
        select(H2O(heavy=1, recent=0), [0] * 4, budget=budget)  # type: ignore[arg-type]


def test_mass_is_required() -> None:
    positions = torch.arange(4).view(1, 1, 4)
    with pytest.raises(ValueError, match=r"H2O ranks slots by mass.*facts.mass must be a tensor"):
        H2O(heavy=1, recent=1).select(SlotFacts(), positions, torch.ones_like(positions, dtype=torch.bool), 2)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"heavy": -1, "recent": 1}, ValueError, "at least 0; got -1"),
        ({"heavy": 1.5, "recent": 1}, ValueError, r"\[0, 1\]; got 1.5"),
        ({"heavy": True, "recent": 1}, TypeError, "heavy must be an int"),
        ({"heavy": "2", "recent": 1}, TypeError, "heavy must be an int"),
        ({"heavy": 1, "recent": -2}, ValueError, "recent must be at least 0; got -2"),
        ({"heavy": 1, "recent": 2.0}, TypeError, "recent must be an int"),
    ],
)
def test_config_is_validated_on_construction(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        H2O(**kwargs)


def test_config_is_frozen_and_declares_its_needs() -> None:
    policy = H2O(heavy=4, recent=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.recent = 5  # type: ignore[misc]
    assert policy.needs == FactNeeds(mass=True)
    assert policy.min_budget == 3
    assert H2O(heavy=4, recent=0).min_budget == 1
