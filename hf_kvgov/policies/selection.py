"""The one routine that turns per-slot priorities into kept slots, and the gather that applies it.

A policy only says how much each slot is worth (a ``priority``); ranking, tie-breaking, padding and the
final position order live here, so every policy breaks ties and handles padding the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

_LONG_MIN = torch.iinfo(torch.long).min
_LONG_MAX = torch.iinfo(torch.long).max


def select_by_priority(priority: Tensor, positions: Tensor, valid: Tensor, kept: int) -> Tensor:
    """Keep the ``kept`` best slots of every (row, head), returned in position order.

    Args:
        priority: float ``[batch, kv_heads, slots]``; higher is kept first. NaN ranks lowest.
        positions: long ``[batch, kv_heads, slots]`` absolute token positions.
        valid: bool ``[batch, kv_heads, slots]``; invalid slots rank after every valid slot.
        kept: number of slots to keep, ``1 <= kept <= slots``.

    Returns:
        long ``[batch, kv_heads, kept]`` slot indices: invalid fillers first (lowest slot indices among
        them), then valid slots in ascending position.

    Ranking is lexicographic: valid before invalid, then higher priority, then the more recent position
    (a newer token has had fewer queries to collect mass from, so on a tie it is the better bet), then
    the lower slot index. The result does not depend on how torch breaks ties.
    """
    assert 1 <= kept <= positions.shape[-1], "kept must be within [1, slots]"
    return order_by_position(ranked(priority, positions, valid)[..., :kept], positions, valid)


def ranked(priority: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
    """Long, the shape of ``priority``: the indices along the last axis, best first, in the order
    `select_by_priority` keeps by (valid, then priority with NaN lowest, then newer, then lower index)."""
    priority = torch.where(torch.isnan(priority), float("-inf"), priority)
    # Stable sorts applied from the least to the most significant key give the lexicographic order.
    # Invalid slots get neutral keys, so among themselves they stay in slot order.
    order = _stable_argsort(torch.where(valid, positions, 0), descending=True)
    order = _refine(order, torch.where(valid, priority, 0.0), descending=True)
    return _refine(order, (~valid).to(torch.int8), descending=False)


def rank_of(order: Tensor) -> Tensor:
    """The inverse of an order along the last axis: each index's rank (0 first)."""
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)


def select_with_window(priority: Tensor, positions: Tensor, valid: Tensor, kept: int, window: int) -> Tensor:
    """`select_by_priority` after giving the ``window`` newest valid slots of each row top priority.

    Shapes as in `select_by_priority`. The window outranks every priority, +inf included, because the
    shared tie-break prefers newer slots.
    """
    return select_by_priority(window_first(priority, positions, valid, window), positions, valid, kept)


def window_first(priority: Tensor, positions: Tensor, valid: Tensor, window: int) -> Tensor:
    """``priority`` with the ``window`` newest valid slots of each row raised to +inf (always kept)."""
    return torch.where(newest_valid(positions, valid, window), float("inf"), priority)


def select_within_budget(priority: Tensor, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
    """`select_by_priority` keeping ``min(budget, slots)``: every `RankingPolicy`'s ``select``."""
    return select_by_priority(priority, positions, valid, kept_of(positions, budget))


def kept_of(positions: Tensor, budget: int) -> int:
    """How many slots a selection keeps per (row, head): ``min(budget, slots)``."""
    return min(budget, positions.shape[-1])


def order_by_position(slot_idx: Tensor, positions: Tensor, valid: Tensor) -> Tensor:
    """Reorder ``slot_idx`` ``[batch, kv_heads, n]``: invalid slots by slot index, then valid by position."""
    slot_idx = slot_idx.sort(dim=-1).values
    key = torch.where(valid.gather(-1, slot_idx), positions.gather(-1, slot_idx), _LONG_MIN)
    return slot_idx.gather(-1, _stable_argsort(key, descending=False))


def newest_valid(positions: Tensor, valid: Tensor, count: int) -> Tensor:
    """Bool ``[batch, kv_heads, slots]``: the ``count`` valid slots with the highest positions per row."""
    return valid & (_rank_valid(positions, valid, newest_first=True) < count)


def oldest_valid(positions: Tensor, valid: Tensor, count: int) -> Tensor:
    """Bool ``[batch, kv_heads, slots]``: the ``count`` valid slots with the lowest positions per row."""
    return valid & (_rank_valid(positions, valid, newest_first=False) < count)


def gather_kept(tensor: Tensor, keep_idx: Tensor) -> Tensor:
    """Gather kept slots along dim 2.

    Args:
        tensor: ``[batch, kv_heads, slots, ...]``: keys/values ``[b, h, s, d]``, or per-slot facts such
            as scores, positions and validity ``[b, h, s]``.
        keep_idx: long ``[batch, kv_heads, kept]`` from a policy's ``select``.

    Returns:
        ``[batch, kv_heads, kept, ...]`` with the dtype of ``tensor``.
    """
    if keep_idx.dim() != 3 or tensor.dim() < 3 or tensor.shape[:2] != keep_idx.shape[:2]:
        raise ValueError(
            "gather_kept needs tensor [batch, kv_heads, slots, ...] and keep_idx [batch, kv_heads, kept] "
            f"with the same batch and kv_heads; got {tuple(tensor.shape)} and {tuple(keep_idx.shape)}."
        )
    trailing = tensor.shape[3:]
    index = keep_idx.reshape(*keep_idx.shape, *([1] * len(trailing))).expand(*keep_idx.shape, *trailing)
    return tensor.gather(2, index)


def _rank_valid(positions: Tensor, valid: Tensor, *, newest_first: bool) -> Tensor:
    """Long ``[batch, kv_heads, slots]``: each valid slot's rank by position; invalid slots rank last."""
    key = -positions if newest_first else positions
    return rank_of(_stable_argsort(torch.where(valid, key, _LONG_MAX), descending=False))


def _stable_argsort(key: Tensor, *, descending: bool) -> Tensor:
    return torch.sort(key, dim=-1, descending=descending, stable=True).indices


def _refine(order: Tensor, key: Tensor, *, descending: bool) -> Tensor:
    """Stable-sort ``order`` by ``key`` (indexed by slot), keeping ``order`` among equal keys."""
    return order.gather(-1, _stable_argsort(key.gather(-1, order), descending=descending))
