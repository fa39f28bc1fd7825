"""StreamingLLM: keep the first few tokens (attention sinks) and a window of the most recent ones (`SinkWindow`),
and read the sinks' keys as if just before the window (`SinkKeys`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from hf_kvgov.policies.base import FactNeeds, SlotFacts, check_budget_fits, check_count, check_slot_tensors
from hf_kvgov.policies.rope import LayerRope
from hf_kvgov.policies.selection import oldest_valid, select_within_budget


@dataclass(frozen=True)
class SinkWindow:
    """Attention sinks plus a recent window (Xiao et al., 2023), applied per KV head.

    Keeps the ``n_sink`` valid slots with the lowest positions, which are the first real tokens, never
    left padding, and fills the rest of ``kept = min(budget, slots)`` with the most recent valid slots.
    The window is therefore ``kept - n_sink`` slots, at least ``window``; it reads no facts.

    Args:
        n_sink: sink tokens kept at the start (StreamingLLM uses 4).
        window: most recent valid slots always kept; the budget must cover ``n_sink + window``.

    The cache that applies this policy should re-rotate kept keys so that query-key distances stay
    inside the model's trained range (see :func:`hf_kvgov.policies.rope.rerotate`).
    """

    n_sink: int
    window: int

    needs: ClassVar[FactNeeds] = FactNeeds()

    def __post_init__(self) -> None:
        check_count("SinkWindow", "n_sink", self.n_sink)
        check_count("SinkWindow", "window", self.window)

    @property
    def min_budget(self) -> int:
        return max(self.n_sink + self.window, 1)

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` kept slot indices.

        ``facts`` are ignored; ``positions``/``valid`` as in :mod:`hf_kvgov.policies.base`.
        """
        return select_within_budget(self.priority(facts, positions, valid, budget), positions, valid, budget)

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]``: 1 on the sinks, 0 elsewhere (see `RankingPolicy`).

        Every non-sink slot ties at priority 0, and the shared tie-break prefers newer positions, so the
        slots left after the sinks go to the newest tokens: that is the window, grown to the budget.
        """
        check_slot_tensors(facts, positions, valid)
        fixed = self.n_sink + self.window
        check_budget_fits(self, budget, fixed, f"{self.n_sink} sink + {self.window} window = {fixed} slots")
        return oldest_valid(positions, valid, self.n_sink).float()


@dataclass(frozen=True)
class SinkKeys:
    """How a sink cache's attention reads its kept keys: each of the ``n_sink`` sinks turned to just before the
    window (StreamingLLM's in-cache positions), the window's keys as stored. Called with the layer's index as an
    eviction view's ``read_keys``; ``ropes`` holds each layer's RoPE as its keys carry it.
    """

    n_sink: int
    ropes: tuple[LayerRope, ...]

    def __call__(self, layer: int, keys: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
        """``keys`` ``[batch, kv_heads, slots, head_dim]`` with each sink moved to just before the window."""
        delta = sink_shift(positions, valid, self.n_sink)
        # The sinks are each row's first valid slots: turn the leading slots up to the last one that moves (a zero
        # turn leaves a key exactly as stored) and keep the others as they are, with no per-key indexing.
        moved = (delta != 0).flatten(0, 1).any(dim=0).nonzero()
        if moved.numel() == 0:
            return keys
        span = int(moved[-1]) + 1
        turned = self.ropes[layer].turn(keys[:, :, :span], delta[:, :, :span])
        return torch.cat((turned, keys[:, :, span:]), dim=2)


def sink_shift(positions: Tensor, valid: Tensor, n_sink: int) -> Tensor:
    """Long ``[batch, kv_heads, slots]``: how far to move each slot's key; non-zero only for displaced sinks.

    Sinks are the ``n_sink`` oldest valid slots; sink ``j`` goes to ``w0 - n + j``, with ``w0`` the oldest
    other valid position and ``n`` the sinks present. Valid slots must be stored in ascending position
    order, which the cache guarantees (policies return kept slots in position order, new tokens come last).
    """
    rank = valid.long().cumsum(dim=-1) - 1  # each valid slot's rank by position: the first valid slots are the oldest
    is_sink = valid & (rank < n_sink)
    rest = valid & ~is_sink
    oldest_rest = torch.where(rest, positions, torch.iinfo(torch.long).max).amin(dim=-1, keepdim=True)
    target = oldest_rest - is_sink.sum(dim=-1, keepdim=True) + rank
    shifted = is_sink & rest.any(dim=-1, keepdim=True)
    return torch.where(shifted, target - positions, 0)
