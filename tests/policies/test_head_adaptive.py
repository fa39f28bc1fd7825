"""`HeadAdaptive` (AdaKV): a layer's heads share its total by priority, with a floor per head.

Every expected selection below is worked out by hand from the priorities written in the test.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.policies import HeadAdaptive, SlotFacts, SnapKV, select_by_priority

INF = float("inf")


def kept_by_head(keep_idx: torch.Tensor, kept: torch.Tensor) -> list[list[list[int]]]:
    """The kept slot indices of every (row, head), in the order returned."""
    return [
        [
            [int(i) for i, k in zip(head_idx, head_kept, strict=True) if k]
            for head_idx, head_kept in zip(r_i, r_k, strict=True)
        ]
        for r_i, r_k in zip(keep_idx, kept, strict=True)
    ]


def slots(priority: list[list[list[float]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    scores = torch.tensor(priority)
    positions = torch.arange(scores.shape[-1]).expand(scores.shape).clone()
    return scores, positions, torch.ones(scores.shape, dtype=torch.bool)


def test_the_heads_share_the_total_by_priority() -> None:
    # Budget 2 per head, 2 heads: the row keeps the 4 best of the 12 slots, wherever they are.
    scores, positions, valid = slots([[[9, 8, 7, 1, 1, 1], [0.5, 0.4, 6, 0.3, 0.2, 0.1]]])
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, positions, valid, budget=2)
    assert kept_by_head(keep_idx, kept) == [[[0, 1, 2], [2]]]
    assert int(kept.sum()) == 4
    assert keep_idx.shape == (1, 2, 3)  # padded to the head that keeps most


def test_the_floor_keeps_every_head_its_share() -> None:
    # floor 0.5 of budget 2: every head first keeps its best slot, then the 2 best of the rest go anywhere.
    scores, positions, valid = slots([[[9, 8, 7, 1, 1, 1], [0.5, 0.4, 0.6, 0.3, 0.2, 0.1]]])
    keep_idx, kept = HeadAdaptive(floor=0.5).select(scores, positions, valid, budget=2)
    assert kept_by_head(keep_idx, kept) == [[[0, 1, 2], [2]]]
    keep_idx, kept = HeadAdaptive(floor=0.5).select(scores, positions, valid, budget=3)  # floor 1, total 6
    assert kept_by_head(keep_idx, kept) == [[[0, 1, 2, 4, 5], [2]]]  # the 1s tie: the newer go first
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, positions, valid, budget=2)
    assert kept_by_head(keep_idx, kept) == [[[0, 1, 2, 5], []]]  # without a floor head 1 loses everything


def test_a_floor_of_one_is_the_uniform_selection() -> None:
    generator = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 3, 9, generator=generator)
    positions = torch.randperm(9, generator=generator).expand(2, 3, 9).clone()
    valid = torch.ones(2, 3, 9, dtype=torch.bool)
    valid[1, :, :2] = False
    keep_idx, kept = HeadAdaptive(floor=1).select(scores, positions, valid, budget=4)
    uniform = select_by_priority(scores, positions, valid, 4)
    assert torch.equal(keep_idx, uniform) and bool(kept.all())


def test_always_kept_slots_stay_in_every_head() -> None:
    # +inf (a policy's window) outranks any score of another head, even with no floor.
    scores, positions, valid = slots([[[9, 8, 7, 6, 5, 4], [0.1, 0.1, 0.1, 0.1, INF, INF]]])
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, positions, valid, budget=2)
    assert kept_by_head(keep_idx, kept) == [[[0, 1], [4, 5]]]


def test_ties_across_heads_go_to_the_newer_position_then_the_lower_head() -> None:
    # Total 2: head 0's priority-2 slot, then one of the two priority-1 slots.
    scores = torch.tensor([[[2.0, 1.0], [1.0, 0.0]]])
    valid = torch.ones(1, 2, 2, dtype=torch.bool)
    newer_in_head_0 = torch.tensor([[[0, 1], [0, 1]]])  # head 0's priority-1 slot is at position 1, head 1's at 0
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, newer_in_head_0, valid, budget=1)
    assert kept_by_head(keep_idx, kept) == [[[0, 1], []]]
    newer_in_head_1 = torch.tensor([[[1, 0], [1, 0]]])  # now head 1's is at position 1, head 0's at 0
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, newer_in_head_1, valid, budget=1)
    assert kept_by_head(keep_idx, kept) == [[[0], [0]]]
    same_position = torch.tensor([[[0, 1], [1, 0]]])  # both at position 1: the lower head wins
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, same_position, valid, budget=1)
    assert kept_by_head(keep_idx, kept) == [[[0, 1], []]]


def test_invalid_slots_are_never_kept_and_nan_ranks_lowest() -> None:
    scores, positions, valid = slots([[[9, float("nan"), 7, 1], [5, 4, 3, 2]]])
    valid[0, 0, 0] = False  # slot 0 of head 0 is padding, however high its score
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, positions, valid, budget=2)
    assert kept_by_head(keep_idx, kept) == [[[2], [0, 1, 2]]]


def test_a_row_with_few_valid_slots_keeps_them_all() -> None:
    scores, positions, valid = slots([[[3, 2, 1, 0], [3, 2, 1, 0]], [[3, 2, 1, 0], [3, 2, 1, 0]]])
    valid[1] = torch.tensor([[False, False, False, True], [False, False, True, True]])
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, positions, valid, budget=2)
    assert kept_by_head(keep_idx, kept) == [[[0, 1], [0, 1]], [[3], [2, 3]]]


def test_kept_slots_come_last_in_position_order() -> None:
    scores = torch.tensor([[[1.0, 9.0, 5.0, 7.0], [2.0, 1.0, 0.0, 3.0]]])
    positions = torch.tensor([[[3, 0, 2, 1], [0, 1, 2, 3]]])
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    keep_idx, kept = HeadAdaptive(floor=0).select(scores, positions, valid, budget=2)
    # The 4 best: 9, 7, 5 in head 0, 3 in head 1; head 0's in position order 0, 1, 2 = slots 1, 3, 2.
    assert keep_idx[0, 0].tolist() == [1, 3, 2] and kept[0, 0].tolist() == [True] * 3
    assert kept[0, 1].tolist() == [False, False, True] and int(keep_idx[0, 1, 2]) == 3


def test_with_a_policys_priority() -> None:
    # SnapKV(window=1): the newest slot of each head is +inf; head 0's attention is focused, head 1's flat.
    attention = torch.tensor([[[0.0, 0.9, 0.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]]])
    positions = torch.arange(5).expand(1, 2, 5).clone()
    valid = torch.ones(1, 2, 5, dtype=torch.bool)
    policy = SnapKV(window=1, kernel=1)
    priority = policy.priority(SlotFacts(recent_attention=attention), positions, valid, 2)
    keep_idx, kept = HeadAdaptive(floor=0).select(priority, positions, valid, budget=2)
    # Windows first (slot 4 of each head), then 0.9 in head 0, then the newest 0.2 of head 1 (slot 3).
    assert kept_by_head(keep_idx, kept) == [[[1, 4], [3, 4]]]


@pytest.mark.parametrize("floor", [-0.1, 1.5, "0.2", True])
def test_a_floor_outside_zero_to_one_is_refused(floor: object) -> None:
    with pytest.raises(ValueError, match="floor must be a number in"):
        HeadAdaptive(floor=floor)  # type: ignore[arg-type]
