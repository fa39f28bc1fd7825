"""Random layouts against a plain-Python reference written from the policies' definitions."""

from __future__ import annotations

import math
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_kvgov.policies import H2O, TOVA, EvictionPolicy, KeyNorm, SinkWindow, SlotFacts

FRACTIONS = [0.0, 0.1, 0.2, 0.25, 0.29, 0.3, 0.5, 0.7, 1.0]


def finish(chosen: list[int], pos: list[int], valid: list[bool], kept: int) -> list[int]:
    """Pad with the lowest invalid slots, then order: fillers by slot, valid slots by position."""
    fillers = [i for i in range(len(pos)) if not valid[i]][: kept - len(chosen)]
    return fillers + sorted(chosen, key=lambda i: pos[i])


def reference_h2o(policy: H2O, scores, pos, valid, budget) -> list[int]:
    kept = min(budget, len(pos))
    live = [i for i in range(len(pos)) if valid[i]]
    if len(live) <= kept:
        return finish(live, pos, valid, kept)
    wanted = math.floor(Fraction(str(policy.heavy)) * budget) if isinstance(policy.heavy, float) else policy.heavy
    heavy = max(0, min(wanted, kept - policy.recent))
    window = sorted(live, key=lambda i: -pos[i])[: kept - heavy]
    rest = [i for i in live if i not in window]
    hitters = sorted(rest, key=lambda i: (-scores[i], -pos[i]))[:heavy]
    return finish(window + hitters, pos, valid, kept)


def reference_sink(policy: SinkWindow, pos, valid, budget) -> list[int]:
    kept = min(budget, len(pos))
    live = [i for i in range(len(pos)) if valid[i]]
    if len(live) <= kept:
        return finish(live, pos, valid, kept)
    sinks = sorted(live, key=lambda i: pos[i])[: policy.n_sink]
    newest = sorted((i for i in live if i not in sinks), key=lambda i: -pos[i])
    return finish(sinks + newest[: kept - len(sinks)], pos, valid, kept)


def reference_ranked(policy: TOVA | KeyNorm, scores, pos, valid, budget) -> list[int]:
    """TOVA: the highest attention; key-norm: its recent window, then the lowest norm (ties: newer first)."""
    kept = min(budget, len(pos))
    live = [i for i in range(len(pos)) if valid[i]]
    if len(live) <= kept:
        return finish(live, pos, valid, kept)
    sign = 1 if isinstance(policy, TOVA) else -1
    window = [] if isinstance(policy, TOVA) else sorted(live, key=lambda i: -pos[i])[: policy.recent]
    rest = sorted((i for i in live if i not in window), key=lambda i: (-sign * scores[i], -pos[i]))
    return finish(window + rest[: kept - len(window)], pos, valid, kept)


def draw_policy(draw: st.DrawFn, slots: int) -> EvictionPolicy:
    kind = draw(st.sampled_from(("h2o", "sink", "tova", "key_norm")))
    if kind == "h2o":
        heavy = draw(st.integers(0, slots + 2) | st.sampled_from(FRACTIONS))
        return H2O(heavy=heavy, recent=draw(st.integers(0, 4)))
    if kind == "sink":
        return SinkWindow(n_sink=draw(st.integers(0, 3)), window=draw(st.integers(0, 4)))
    return TOVA() if kind == "tova" else KeyNorm(recent=draw(st.integers(0, 4)))


@st.composite
def layouts(draw):
    batch, heads, slots = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.integers(1, 12))
    rows = batch * heads
    positions = [draw(st.lists(st.integers(0, 40), min_size=slots, max_size=slots, unique=True)) for _ in range(rows)]
    valid = [draw(st.lists(st.booleans(), min_size=slots, max_size=slots)) for _ in range(rows)]
    # Few distinct values, so ties in mass are common.
    scores = [draw(st.lists(st.integers(0, 3), min_size=slots, max_size=slots)) for _ in range(rows)]
    policy = draw_policy(draw, slots)
    budget = draw(st.integers(policy.min_budget, max(policy.min_budget, slots) + 3))
    shape = (batch, heads, slots)
    tensors = (
        torch.tensor(scores, dtype=torch.float32).view(shape),
        torch.tensor(positions, dtype=torch.long).view(shape),
        torch.tensor(valid, dtype=torch.bool).view(shape),
    )
    return policy, tensors, (scores, positions, valid), budget


def fixed_window(policy: EvictionPolicy) -> int:
    if isinstance(policy, TOVA):
        return 0
    return policy.window if isinstance(policy, SinkWindow) else policy.recent  # type: ignore[attr-defined]


@settings(max_examples=300, deadline=None)
@given(layouts())
def test_selection_matches_the_reference_and_keeps_its_promises(case) -> None:
    policy, (scores_t, positions_t, valid_t), (scores, positions, valid), budget = case
    # One tensor serves as every fact: each policy reads only the one it needs.
    facts = SlotFacts(mass=scores_t, recent_attention=scores_t, key_norm=scores_t)
    keep = policy.select(facts, positions_t, valid_t, budget)
    slots = positions_t.shape[-1]
    kept = min(budget, slots)
    assert keep.dtype == torch.long
    assert keep.shape == (*positions_t.shape[:2], kept)
    for r, got in enumerate(keep.view(-1, kept).tolist()):
        pos, ok = positions[r], valid[r]
        assert len(set(got)) == kept
        kept_valid = [i for i in got if ok[i]]
        # Fillers first, then valid slots sorted by position.
        assert got[len(got) - len(kept_valid) :] == kept_valid
        assert [pos[i] for i in kept_valid] == sorted(pos[i] for i in kept_valid)
        live = [i for i in range(slots) if ok[i]]
        assert len(kept_valid) == min(kept, len(live))
        newest = sorted(live, key=lambda i: -pos[i])[: fixed_window(policy)]
        assert set(newest) <= set(got)
        if isinstance(policy, SinkWindow):
            assert set(sorted(live, key=lambda i: pos[i])[: policy.n_sink]) <= set(got)
            assert got == reference_sink(policy, pos, ok, budget)
        elif isinstance(policy, H2O):
            assert got == reference_h2o(policy, scores[r], pos, ok, budget)
        else:
            assert got == reference_ranked(policy, scores[r], pos, ok, budget)
