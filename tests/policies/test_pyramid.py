"""PyramidKV's per-layer budgets (`Pyramid.split`), checked against budgets worked out by hand."""

from __future__ import annotations

import pytest

from hf_kvgov.policies.pyramid import Pyramid


def test_budgets_fall_linearly_with_depth_and_sum_to_the_uniform_total() -> None:
    # Budget 20 over 5 layers, 4 fixed: 16 to share; the last layer gets 16 / 20 = 0.8 above the fixed 4,
    # the first 2 * 16 - 0.8 = 31.2, in steps of 7.6: 35.2, 27.6, 20.0, 12.4, 4.8. Flooring loses 2 slots,
    # which go to the largest remainders (4.8 and 27.6): 35, 28, 20, 12, 5 = 5 x 20.
    assert Pyramid().split(20, [0, 1, 2, 3, 4], fixed=4) == {0: 35, 1: 28, 2: 20, 3: 12, 4: 5}


def test_the_layers_named_get_the_budgets_in_their_order() -> None:
    # Gemma-3's full-attention layers 5, 11, 17 of budget 10, 1 fixed: 18.55, 10.0, 1.45 -> 19, 10, 1.
    assert Pyramid().split(10, [5, 11, 17]) == {5: 19, 11: 10, 17: 1}


def test_a_gentler_beta_flattens_the_pyramid_and_beta_one_is_uniform() -> None:
    # beta 2 over 2 layers, budget 10, 2 fixed: 8 to share, low 4, high 12 -> 14 and 6.
    assert Pyramid(beta=2).split(10, [0, 1], fixed=2) == {0: 14, 1: 6}
    assert Pyramid(beta=1).split(10, [0, 1, 2], fixed=2) == {0: 10, 1: 10, 2: 10}


def test_one_layer_or_nothing_to_share_leaves_the_budget_as_it_is() -> None:
    assert Pyramid().split(7, [3]) == {3: 7}
    assert Pyramid().split(32, [0, 1, 2], fixed=32) == {0: 32, 1: 32, 2: 32}
    assert Pyramid().split(5, []) == {}


@pytest.mark.parametrize("beta", [0.5, 0, -3, True, "20"])
def test_a_beta_below_one_or_not_a_number_is_refused(beta: object) -> None:
    with pytest.raises(ValueError, match=r"Pyramid.beta must be a number >= 1 \(1: uniform budgets\); got"):
        Pyramid(beta=beta)  # type: ignore[arg-type]


def test_a_bad_budget_or_fixed_part_is_refused() -> None:
    with pytest.raises(ValueError, match=r"budget must be a positive number of slots"):
        Pyramid().split(0, [0, 1])
    with pytest.raises(ValueError, match=r"Pyramid\.split\.fixed must be at least 1; got 0"):
        Pyramid().split(8, [0, 1], fixed=0)
