"""SnapKV on hand-made attention whose kept slots were worked out by hand (the pooled values are in comments)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvgov.policies import FactNeeds, SlotFacts, SnapKV
from tests.policies.slot_rows import select_row


def select(policy: SnapKV, attention: list, budget: int, positions=None, valid=None) -> list[int]:
    return select_row(policy, "recent_attention", attention, budget, positions, valid)


SPIKE = [1, 0, 0, 10, 0, 0, 0, 2, 0, 0, 5, 5]


def test_the_window_is_kept_and_pooling_brings_the_neighbours_of_a_spike() -> None:
    # Window = slots 10, 11. Max pool of width 3 over slots 0..9 (the window counted as 0):
    # [1, 1, 10, 10, 10, 0, 2, 2, 2, 0] -> the three best are slots 2, 3, 4 (the spike and its neighbours).
    assert select(SnapKV(window=2, kernel=3), SPIKE, budget=5) == [2, 3, 4, 10, 11]
    # Without pooling (width 1) the three best are the raw highest: 3 (10), 7 (2), 0 (1).
    assert select(SnapKV(window=2, kernel=1), SPIKE, budget=5) == [0, 3, 7, 10, 11]


def test_max_and_average_pooling_choose_differently() -> None:
    # Window = slot 7. Width 3 over [0, 4, 4, 0, 9, 0, 0, (0)]:
    #   avg (zero-padded): [4/3, 8/3, 8/3, 13/3, 3, 3, 0, .] -> slot 3 is best.
    #   max:               [4, 4, 4, 9, 9, 9, 0, .]          -> 3, 4, 5 tie at 9; the newest, 5, wins.
    attention = [0, 4, 4, 0, 9, 0, 0, 0]
    assert select(SnapKV(window=1, kernel=3, pooling="avg"), attention, budget=2) == [3, 7]
    assert select(SnapKV(window=1, kernel=3, pooling="max"), attention, budget=2) == [5, 7]


def test_the_windows_own_attention_is_not_pooled_into_its_neighbours() -> None:
    # Slot 10 (in the window) has 100; if it were pooled, slot 9 would win. Slots 4, 5, 6 tie at 1 around
    # slot 5, and the newest of them is kept.
    attention = [0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 100, 0]
    assert select(SnapKV(window=2, kernel=3), attention, budget=3) == [6, 10, 11]


def test_pooling_follows_positions_not_slot_order() -> None:
    # SPIKE's layout with the slots stored in another order: slot i holds position order[i].
    order = [5, 11, 0, 8, 3, 10, 1, 7, 2, 9, 4, 6]
    attention = [SPIKE[p] for p in order]
    kept = select(SnapKV(window=2, kernel=3), attention, budget=5, positions=order)
    assert [order[i] for i in kept] == [2, 3, 4, 10, 11]


def test_padded_slots_are_never_kept_and_do_not_join_their_neighbours() -> None:
    # Slots 0..2 are left padding with huge attention. The valid ones, 3..7, pool (width 3) to
    # [0, 1, 1, 1, .]: slots 4, 5, 6 tie, the newest two are kept beside the window slot 7.
    attention = [100, 100, 100, 0, 0, 1, 0, 0]
    valid = [False, False, False, True, True, True, True, True]
    assert select(SnapKV(window=1, kernel=3), attention, budget=3, valid=valid) == [5, 6, 7]


def test_fewer_valid_slots_than_the_budget_are_padded_with_invalid_slots_first() -> None:
    valid = [False, False, True, False, True, True]
    assert select(SnapKV(window=1, kernel=3), [9, 9, 0, 9, 0, 0], budget=5, valid=valid) == [0, 1, 2, 4, 5]


def test_equal_attention_keeps_the_newest_slots() -> None:
    assert select(SnapKV(window=2, kernel=3), [0.5] * 8, budget=4) == [4, 5, 6, 7]


def test_a_budget_at_least_the_slot_count_keeps_everything_in_position_order() -> None:
    positions = [7, 3, 0, 5, 1, 6, 2, 4]
    assert select(SnapKV(window=2, kernel=3), [1, 2, 3, 4, 5, 6, 7, 8], budget=8, positions=positions) == [
        2, 4, 6, 1, 7, 3, 5, 0,
    ]  # fmt: skip
    assert select(SnapKV(window=2), [1, 2, 3], budget=32) == [0, 1, 2]


def test_every_kv_head_selects_independently() -> None:
    attention = torch.tensor([[[9, 0, 0, 0, 0, 0], [0, 0, 0, 9, 0, 0]]], dtype=torch.float32)
    positions = torch.arange(6).expand(1, 2, 6)
    keep = SnapKV(window=1, kernel=1).select(
        SlotFacts(recent_attention=attention), positions, torch.ones(1, 2, 6, dtype=torch.bool), 2
    )
    assert keep.tolist() == [[[0, 5], [3, 5]]]


def test_the_observation_window_is_required_and_fits_the_budget() -> None:
    positions = torch.arange(4).view(1, 1, 4)
    valid = torch.ones(1, 1, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"SnapKV ranks slots by recent_attention.*got None"):
        SnapKV(window=2).select(SlotFacts(mass=torch.zeros(1, 1, 4)), positions, valid, 3)
    with pytest.raises(ValueError, match=r"always keeps its 4-slot observation window.*got a budget of 3"):
        select(SnapKV(window=4), [0.0] * 8, budget=3)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"window": 0}, ValueError, "window must be at least 1; got 0"),
        ({"kernel": 4}, ValueError, "kernel must be odd"),
        ({"kernel": 0}, ValueError, "kernel must be at least 1"),
        ({"pooling": "mean"}, ValueError, r"pooling must be one of \('max', 'avg'\); got 'mean'"),
        ({"window": 2.0}, TypeError, "window must be an int"),
    ],
)
def test_config_is_validated_on_construction(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SnapKV(**kwargs)


def test_defaults_are_snapkvs_and_it_declares_its_needs() -> None:
    policy = SnapKV()
    assert (policy.window, policy.kernel, policy.pooling) == (32, 7, "max")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.window = 5  # type: ignore[misc]
    assert policy.needs == FactNeeds(recent_queries=32)
    assert SnapKV(window=8).needs == FactNeeds(recent_queries=8)
    assert policy.min_budget == 32
