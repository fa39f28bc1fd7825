"""TOVA on hand-made attention of the last query whose kept slots were worked out by hand."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.policies import TOVA, FactNeeds, SlotFacts
from tests.policies.slot_rows import select_row

NAN = float("nan")


def select(attention: list, budget: int, positions=None, valid=None) -> list[int]:
    return select_row(TOVA(), "recent_attention", attention, budget, positions, valid)


def test_keeps_the_slots_the_last_query_attends_to_most() -> None:
    # Highest three: slot 1 (0.5), slot 3 (0.3), slot 0 (0.1); returned in position order.
    assert select([0.1, 0.5, 0.05, 0.3, 0.05], budget=3) == [0, 1, 3]


def test_there_is_no_recent_window() -> None:
    # The newest slot draws nothing from the query, so it is the one evicted.
    assert select([0.5, 0.4, 0.0], budget=2) == [0, 1]


def test_ties_go_to_the_newest_positions() -> None:
    assert select([0.25] * 4, budget=2) == [2, 3]
    # Positions 3 and 2 are the newest: slots 0 and 2, returned in position order.
    assert select([0.25] * 4, budget=2, positions=[3, 0, 2, 1]) == [2, 0]


def test_padded_slots_are_never_kept_whatever_their_attention() -> None:
    valid = [False, False, True, True, True]
    assert select([9.0, 9.0, 0.1, 0.3, 0.2], budget=2, valid=valid) == [3, 4]
    # Fewer valid slots than the budget: invalid fillers first, lowest slot index first.
    assert select([9.0, 9.0, 0.1, 0.3, 0.2], budget=4, valid=valid) == [0, 2, 3, 4]


def test_nan_attention_ranks_lowest() -> None:
    assert select([NAN, 0.0, NAN, 0.1], budget=2) == [1, 3]


def test_a_budget_at_least_the_slot_count_keeps_everything_in_position_order() -> None:
    assert select([0.1, 0.2, 0.3, 0.4], budget=9, positions=[2, 0, 3, 1]) == [1, 3, 0, 2]


def test_every_kv_head_selects_independently() -> None:
    attention = torch.tensor([[[0.9, 0.0, 0.1], [0.0, 0.9, 0.1]]])
    keep = TOVA().select(
        SlotFacts(recent_attention=attention), torch.arange(3).expand(1, 2, 3), torch.ones(1, 2, 3, dtype=torch.bool), 1
    )
    assert keep.tolist() == [[[0], [1]]]


def test_the_last_querys_attention_is_required() -> None:
    positions = torch.arange(3).view(1, 1, 3)
    with pytest.raises(ValueError, match=r"TOVA ranks slots by recent_attention.*got None"):
        TOVA().select(SlotFacts(), positions, torch.ones(1, 1, 3, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="positive"):
        select([0.1, 0.2], budget=0)


def test_it_declares_one_query_and_accepts_any_budget() -> None:
    assert TOVA.needs == FactNeeds(recent_queries=1)
    assert TOVA().min_budget == 1
