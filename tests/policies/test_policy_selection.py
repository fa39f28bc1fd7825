"""The shared ranking routine, the gather that applies it, and the per-slot input checks."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.policies import (
    H2O,
    TOVA,
    EvictionPolicy,
    KeyNorm,
    SinkWindow,
    SlotFacts,
    SnapKV,
    gather_kept,
    newest_valid,
    oldest_valid,
    select_by_priority,
)


def row(values: list, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).view(1, 1, -1)


def test_gather_kept_on_keys_and_on_per_slot_facts() -> None:
    keys = torch.arange(2 * 2 * 4 * 3, dtype=torch.float32).view(2, 2, 4, 3)
    keep = torch.tensor([[[3, 0], [1, 2]], [[0, 0], [2, 3]]])
    out = gather_kept(keys, keep)
    assert out.shape == (2, 2, 2, 3)
    for b in range(2):
        for h in range(2):
            for j in range(2):
                assert torch.equal(out[b, h, j], keys[b, h, keep[b, h, j]])
    positions = torch.tensor([[[10, 11, 12, 13], [20, 21, 22, 23]], [[30, 31, 32, 33], [40, 41, 42, 43]]])
    assert gather_kept(positions, keep).tolist() == [[[13, 10], [21, 22]], [[30, 30], [42, 43]]]


def test_gather_kept_refuses_mismatched_heads() -> None:
    with pytest.raises(ValueError, match="same batch and kv_heads"):
        gather_kept(torch.zeros(1, 2, 4, 8), torch.zeros(1, 3, 2, dtype=torch.long))


def test_newest_and_oldest_valid_follow_positions_not_slots() -> None:
    positions = row([7, 3, 0, 5, 1, 6, 2, 4], torch.long)
    valid = row([True, True, False, True, True, True, True, False], torch.bool)
    # Valid positions: 7 (slot 0), 3 (1), 5 (3), 1 (4), 6 (5), 2 (6).
    assert newest_valid(positions, valid, 2).view(-1).nonzero().view(-1).tolist() == [0, 5]
    assert oldest_valid(positions, valid, 2).view(-1).nonzero().view(-1).tolist() == [4, 6]
    # Asking for more than there are valid slots never marks an invalid one.
    assert oldest_valid(positions, valid, 99).view(-1).tolist() == valid.view(-1).tolist()


def test_select_by_priority_breaks_ties_by_position_then_slot_index() -> None:
    priority = row([1.0, 2.0, 2.0, 2.0, 0.0], torch.float32)
    # Slots 2 and 3 share position 5, newer than slot 1: the lower slot index (2) goes first.
    positions = row([0, 1, 5, 5, 9], torch.long)
    valid = row([True] * 5, torch.bool)
    assert select_by_priority(priority, positions, valid, 1).view(-1).tolist() == [2]
    assert select_by_priority(priority, positions, valid, 2).view(-1).tolist() == [2, 3]
    assert select_by_priority(priority, positions, valid, 3).view(-1).tolist() == [1, 2, 3]


def test_select_by_priority_ranks_invalid_slots_last_whatever_their_priority() -> None:
    priority = row([9.0, 0.0, 9.0, 0.0], torch.float32)
    positions = row([0, 1, 2, 3], torch.long)
    valid = row([False, True, False, True], torch.bool)
    assert select_by_priority(priority, positions, valid, 2).view(-1).tolist() == [1, 3]
    assert select_by_priority(priority, positions, valid, 3).view(-1).tolist() == [0, 1, 3]


@pytest.mark.parametrize(
    "policy",
    [H2O(heavy=1, recent=1), SinkWindow(n_sink=1, window=1), SnapKV(), TOVA(), KeyNorm(recent=2)],
    ids=repr,
)
def test_policies_satisfy_the_protocol(policy: EvictionPolicy) -> None:
    assert isinstance(policy, EvictionPolicy)


def make_inputs(positions=None, valid=None, scores=None):
    positions = torch.arange(4).view(1, 1, 4) if positions is None else positions
    valid = torch.ones(1, 1, 4, dtype=torch.bool) if valid is None else valid
    scores = torch.zeros(1, 1, 4) if scores is None else scores
    return scores, positions, valid


@pytest.mark.parametrize(
    ("inputs", "error", "message"),
    [
        (make_inputs(positions=torch.arange(4).view(1, 4)), ValueError, "got a 2-D tensor"),
        (make_inputs(positions=torch.zeros(1, 1, 4)), TypeError, "positions must be a torch.long"),
        (make_inputs(valid=torch.ones(1, 1, 4, dtype=torch.long)), TypeError, "valid must be a torch.bool"),
        (
            make_inputs(valid=torch.ones(1, 1, 5, dtype=torch.bool)),
            ValueError,
            r"valid has shape \(1, 1, 5\)",
        ),
        (make_inputs(scores=torch.zeros(1, 1, 4, dtype=torch.long)), TypeError, "floating-point"),
        (make_inputs(scores=torch.zeros(1, 2, 4)), ValueError, r"facts.mass has shape \(1, 2, 4\)"),
    ],
)
def test_malformed_slot_tensors_are_refused(inputs: tuple, error: type, message: str) -> None:
    scores, positions, valid = inputs
    with pytest.raises(error, match=message):
        H2O(heavy=1, recent=1).select(SlotFacts(mass=scores), positions, valid, 2)


def test_kept_slots_gather_into_a_dense_cache_with_a_validity_mask() -> None:
    # The way a cache applies a policy: select, then gather K/V, positions and validity alike.
    positions = torch.tensor([[[0, 1, 2, 3, 4, 5]]])
    valid = torch.tensor([[[False, False, False, False, True, True]]])
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1).expand(1, 1, 6, 2)
    keep = SinkWindow(n_sink=1, window=1).select(SlotFacts(), positions, valid, 3)
    assert keep.view(-1).tolist() == [0, 4, 5]
    assert gather_kept(valid, keep).view(-1).tolist() == [False, True, True]
    assert gather_kept(keys, keep)[0, 0, :, 0].tolist() == [0.0, 4.0, 5.0]
