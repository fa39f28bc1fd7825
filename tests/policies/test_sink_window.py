"""SinkWindow (StreamingLLM) on hand-made layouts whose kept slots were worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_kvgov.policies import FactNeeds, SinkWindow, SlotFacts


def row(values: list, dtype: torch.dtype) -> torch.Tensor:
    """One (batch, head) row: ``[1, 1, slots]``."""
    return torch.tensor(values, dtype=dtype).view(1, 1, -1)


def select(policy: SinkWindow, n: int, budget: int, positions=None, valid=None, scores=None) -> list[int]:
    pos = row(positions if positions is not None else list(range(n)), torch.long)
    ok = row(valid if valid is not None else [True] * n, torch.bool)
    facts = SlotFacts() if scores is None else SlotFacts(mass=row(scores, torch.float32))
    return policy.select(facts, pos, ok, budget).view(-1).tolist()


def test_sinks_plus_recent_window() -> None:
    assert select(SinkWindow(n_sink=2, window=3), 10, budget=5) == [0, 1, 7, 8, 9]


def test_spare_budget_widens_the_window() -> None:
    assert select(SinkWindow(n_sink=2, window=3), 10, budget=7) == [0, 1, 5, 6, 7, 8, 9]


def test_left_padding_is_never_a_sink() -> None:
    valid = [False, False, False] + [True] * 7
    assert select(SinkWindow(n_sink=2, window=2), 10, budget=4, valid=valid) == [3, 4, 8, 9]


def test_slots_in_any_order_are_ranked_by_position() -> None:
    positions = [7, 3, 0, 5, 1, 6, 2, 4]
    # Sink: position 0 (slot 2). Window: positions 6 (slot 5) and 7 (slot 0).
    assert select(SinkWindow(n_sink=1, window=2), 8, budget=3, positions=positions) == [2, 5, 0]


def test_sink_is_the_first_valid_position_when_slots_are_shuffled() -> None:
    positions = [7, 3, 0, 5, 1, 6, 2, 4]
    valid = [False, True, False, True, True, True, True, True]
    # Positions 0 (slot 2) and 7 (slot 0) are invalid: sink is position 1 (slot 4), window 6 and 5.
    kept = select(SinkWindow(n_sink=1, window=2), 8, budget=3, positions=positions, valid=valid)
    assert kept == [4, 3, 5]


def test_scores_are_ignored() -> None:
    scores = [0, 0, 0, 0, 100, 100, 0, 0, 0, 0]
    assert select(SinkWindow(n_sink=2, window=3), 10, budget=5, scores=scores) == [0, 1, 7, 8, 9]


def test_every_row_and_head_selects_independently() -> None:
    positions = torch.tensor([[[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]], [[0, 1, 2, 3, 4], [2, 0, 4, 1, 3]]])
    valid = torch.tensor(
        [[[True] * 5, [True] * 5], [[False, False, True, True, True], [True, False, True, True, True]]]
    )
    kept = SinkWindow(n_sink=1, window=1).select(SlotFacts(), positions, valid, 2)
    # Row 1 head 1: slot 1 (position 0) is padding, so the sink is position 1 (slot 3).
    assert kept.tolist() == [[[0, 4], [4, 0]], [[2, 4], [3, 2]]]


def test_fewer_valid_slots_than_budget_are_padded_with_invalid_slots_first() -> None:
    valid = [False, False, False, True, True]
    assert select(SinkWindow(n_sink=1, window=1), 5, budget=4, valid=valid) == [0, 1, 3, 4]


def test_budget_at_least_the_slot_count_keeps_everything_in_position_order() -> None:
    positions = [7, 3, 0, 5, 1, 6, 2, 4]
    kept = select(SinkWindow(n_sink=1, window=2), 8, budget=8, positions=positions)
    assert kept == [2, 4, 6, 1, 7, 3, 5, 0]


def test_budget_below_sinks_plus_window_is_refused_with_the_numbers() -> None:
    message = r"SinkWindow\(n_sink=4, window=8\) always keeps 4 sink \+ 8 window = 12 slots.*got a budget of 10"
    with pytest.raises(ValueError, match=message):
        select(SinkWindow(n_sink=4, window=8), 20, budget=10)
    # The configuration is refused even while the sequence is still shorter than the budget.
    with pytest.raises(ValueError, match="at least 12"):
        select(SinkWindow(n_sink=4, window=8), 5, budget=10)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"n_sink": -1, "window": 4}, ValueError, "n_sink must be at least 0; got -1"),
        ({"n_sink": 4, "window": -3}, ValueError, "window must be at least 0; got -3"),
        ({"n_sink": 4.0, "window": 4}, TypeError, "n_sink must be an int"),
        ({"n_sink": 4, "window": None}, TypeError, "window must be an int"),
    ],
)
def test_config_is_validated_on_construction(kwargs: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        SinkWindow(**kwargs)


def test_config_is_frozen_and_declares_its_needs() -> None:
    policy = SinkWindow(n_sink=4, window=60)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.window = 5  # type: ignore[misc]
    assert policy.needs == FactNeeds()
    assert policy.min_budget == 64


def test_sink_keys_turn_each_rows_first_valid_slots_to_just_before_its_window() -> None:
    """`SinkKeys` against the definition, slot by slot: in each (row, head) the ``n`` first valid slots (the oldest:
    kept slots are stored in position order) are read as if at ``w0 - n + j``; every other key is returned exactly
    as stored, whatever padding precedes the sinks or follows the window."""
    from hf_kvgov.policies.rope import LayerRope, rerotate
    from hf_kvgov.policies.sink_window import SinkKeys

    n_sink, slots, head_dim = 2, 9, 8
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    keys = torch.randn(2, 2, slots, head_dim, generator=torch.Generator().manual_seed(0))
    valid = torch.tensor(
        [
            [[False, False, True, True, True, True, True, False, False], [True] * 9],
            [[False, True, True, True, True, True, True, True, True], [True] * 3 + [False] * 6],
        ]
    )  # fmt: skip
    starts = torch.tensor([[0, 40], [7, 100]])  # sinks at start, start + 1; the window from start + 30 on
    positions = torch.zeros(2, 2, slots, dtype=torch.long)
    for b in range(2):
        for h in range(2):
            at = [i for i in range(slots) if valid[b, h, i]]
            sequence = [int(starts[b, h]), int(starts[b, h]) + 1] + [
                int(starts[b, h]) + 30 + k for k in range(len(at) - 2)
            ]
            positions[b, h, at] = torch.tensor(sequence)
    read = SinkKeys(n_sink, (LayerRope(inv_freq),))(0, keys, positions, valid)
    for b in range(2):
        for h in range(2):
            at = [i for i in range(slots) if valid[b, h, i]]
            window_start = int(positions[b, h, at[n_sink]]) if len(at) > n_sink else None
            for i in range(slots):
                if window_start is not None and i in at[:n_sink]:
                    delta = window_start - n_sink + at.index(i) - int(positions[b, h, i])
                    expected = rerotate(keys[b, h, i].view(1, 1, 1, -1), torch.tensor([delta]), inv_freq).view(-1)
                    torch.testing.assert_close(read[b, h, i], expected)
                    assert delta != 0
                else:
                    assert torch.equal(read[b, h, i], keys[b, h, i])
