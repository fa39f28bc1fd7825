"""The contract every eviction policy follows, and the input checks they share.

A policy is a pure function from per-slot facts to the slots worth keeping. It never touches K/V memory:
the cache calls ``select``, then moves its tensors with :func:`hf_kvgov.policies.selection.gather_kept`.

Shapes, for every policy:

- ``scores``    float ``[batch, kv_heads, slots]``: accumulated attention mass of each stored slot, or
  ``None`` for a policy whose ``needs_scores`` is False.
- ``positions`` long  ``[batch, kv_heads, slots]``: absolute token position of each stored slot. Slots may
  be stored in any order; a policy ranks them by position, never by slot index.
- ``valid``     bool  ``[batch, kv_heads, slots]``: False for left padding and for empty slots. Invalid
  slots are never kept as sinks, heavy hitters or window tokens; their positions and scores are ignored.
- ``budget``    int: how many slots each (row, head) may keep.

The result is a long ``[batch, kv_heads, kept]`` tensor of slot indices with ``kept = min(budget, slots)``,
the same for every row and head so that K/V stay one dense tensor. When a row has fewer valid slots than
``kept``, the selection is padded with invalid slots (the lowest slot indices among them) and the caller
masks them through ``gather_kept(valid, keep_idx)``. Within a row the invalid fillers come first, then the
valid slots in ascending position: the kept row is left-padded, like a left-padded batch in transformers.
"""

from __future__ import annotations

from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses, per KV head, which stored slots survive an eviction.

    Implementations are frozen dataclasses validated in ``__post_init__``, one per file.
    """

    #: Whether ``select`` reads ``scores``; a cache only pays for attention mass when this is True.
    needs_scores: ClassVar[bool]

    @property
    def min_budget(self) -> int:
        """The smallest budget this configuration accepts (its fixed parts: sinks, windows)."""
        ...

    def select(self, scores: Tensor | None, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` slot indices to keep (see module doc)."""
        ...


def check_slot_tensors(scores: Tensor | None, positions: Tensor, valid: Tensor) -> None:
    """Raise a ``TypeError``/``ValueError`` unless the three per-slot tensors follow the contract above."""
    if positions.dim() != 3:
        raise ValueError(
            "positions must have shape [batch, kv_heads, slots]; "
            f"got a {positions.dim()}-D tensor of shape {tuple(positions.shape)}."
        )
    if positions.dtype != torch.long:
        raise TypeError(f"positions must be a torch.long tensor; got dtype {positions.dtype}.")
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a torch.bool tensor; got dtype {valid.dtype}.")
    if valid.shape != positions.shape:
        raise ValueError(
            f"valid has shape {tuple(valid.shape)} but positions has shape {tuple(positions.shape)}; they must match."
        )
    if scores is None:
        return
    if not scores.is_floating_point():
        raise TypeError(f"scores must be a floating-point tensor; got dtype {scores.dtype}.")
    if scores.shape != positions.shape:
        raise ValueError(
            f"scores has shape {tuple(scores.shape)} but positions has shape {tuple(positions.shape)}; they must match."
        )


def check_budget(budget: int) -> None:
    """Raise unless ``budget`` is a positive Python int (bool is rejected: ``True`` is not a budget)."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int number of slots; got {budget!r} of type {type(budget).__name__}.")
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of slots to keep per KV head; got {budget}.")


def check_count(owner: str, name: str, value: object, minimum: int = 0) -> None:
    """Raise unless a config field is an int ``>= minimum`` (used by policies' ``__post_init__``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int; got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be at least {minimum}; got {value}.")
