"""Key-norm on hand-made key norms whose kept slots were worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvgov.policies import FactNeeds, KeyNorm, SlotFacts
from tests.policies.slot_rows import select_row

NAN = float("nan")


def select(policy: KeyNorm, norms: list, budget: int, positions=None, valid=None) -> list[int]:
    return select_row(policy, "key_norm", norms, budget, positions, valid)


NORMS = [1.0, 5.0, 0.5, 3.0, 9.0, 2.0, 8.0, 7.0]


def test_recent_window_plus_the_lowest_norms() -> None:
    # Window: slots 6, 7 (norms 8, 7, high but kept). Lowest of slots 0..5: slot 2 (0.5), slot 0 (1.0).
    assert select(KeyNorm(recent=2), NORMS, budget=4) == [0, 2, 6, 7]
    # Without a window the lowest four overall: 2 (0.5), 0 (1), 5 (2), 3 (3).
    assert select(KeyNorm(recent=0), NORMS, budget=4) == [0, 2, 3, 5]


def test_ties_go_to_the_newest_positions() -> None:
    assert select(KeyNorm(recent=1), [1.0, 1.0, 1.0, 1.0, 5.0], budget=3) == [2, 3, 4]


def test_padded_slots_are_never_kept_even_with_the_lowest_norm() -> None:
    valid = [False, False, True, True, True, True]
    assert select(KeyNorm(recent=1), [0.0, 0.0, 4.0, 1.0, 3.0, 9.0], budget=3, valid=valid) == [3, 4, 5]
    assert select(KeyNorm(recent=1), [0.0, 0.0, 4.0, 1.0, 3.0, 9.0], budget=5, valid=valid) == [0, 2, 3, 4, 5]


def test_nan_norms_rank_lowest() -> None:
    assert select(KeyNorm(recent=0), [NAN, 3.0, NAN, 2.0], budget=2) == [1, 3]


def test_a_budget_at_least_the_slot_count_keeps_everything_in_position_order() -> None:
    assert select(KeyNorm(recent=2), NORMS[:4], budget=4, positions=[3, 1, 0, 2]) == [2, 1, 3, 0]


def test_every_kv_head_selects_independently() -> None:
    norms = torch.tensor([[[0.1, 5.0, 5.0], [5.0, 0.1, 5.0]]])
    keep = KeyNorm(recent=1).select(
        SlotFacts(key_norm=norms), torch.arange(3).expand(1, 2, 3), torch.ones(1, 2, 3, dtype=torch.bool), 2
    )
    assert keep.tolist() == [[[0, 2], [1, 2]]]


def test_it_reads_key_norms_only() -> None:
    # Attention facts may be absent altogether: the policy works where no attention weights exist.
    positions = torch.arange(3).view(1, 1, 3)
    with pytest.raises(ValueError, match=r"KeyNorm ranks slots by key_norm.*got None"):
        KeyNorm(recent=1).select(
            SlotFacts(mass=torch.zeros(1, 1, 3)), positions, torch.ones(1, 1, 3, dtype=torch.bool), 2
        )
    assert KeyNorm.needs == FactNeeds(key_norm=True)


def test_budget_below_the_window_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"KeyNorm\(recent=4\) always keeps 4 recent slots.*got a budget of 3"):
        select(KeyNorm(recent=4), NORMS, budget=3)


def test_config_is_validated_and_frozen() -> None:
    with pytest.raises(ValueError, match="recent must be at least 0; got -1"):
        KeyNorm(recent=-1)
    with pytest.raises(TypeError, match="recent must be an int"):
        KeyNorm(recent=0.5)  # type: ignore[arg-type]
    policy = KeyNorm()
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.recent = 1  # type: ignore[misc]
    assert (policy.recent, policy.min_budget, KeyNorm(recent=0).min_budget) == (32, 32, 1)
