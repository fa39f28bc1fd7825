"""Layer groups: layers that keep the same tokens share block tables, and a block holds one group's layers.

A hybrid model mixes full-attention layers with layers sliding over the last `w` tokens; one table for every layer
would keep every token in every layer, so layers are grouped by what they keep, each group with its own tables over
the one pool. Groups all have `s` layers, the gcd of each kind's count (as in vLLM's hybrid allocator), so a block
id means the same memory in every group and the pool keeps one free list, one byte cap and one kind of block
(`GroupLayout` gives an example).

A block costs `s` layers' bytes whatever its group; a sliding layer holds at most about `w + block_size` tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroup:
    """Layers (indices in layer order) that keep the same tokens; `window`: None for full attention, else
    the sliding window `w` (a query at position p sees keys at positions p - w + 1 .. p)."""

    layers: tuple[int, ...]
    window: int | None = None

    def first_needed(self, position: int) -> int:
        """The first token position a query at `position` (or later) can still attend to."""
        return 0 if self.window is None else max(0, position - self.window + 1)

    def first_kept(self, position: int, block_size: int) -> int:
        """The first token the group keeps while queries start at `position`: the start of the block holding
        the first token they can see (0 for full attention)."""
        return self.first_needed(position) // block_size * block_size


def full_group(groups: Sequence[LayerGroup]) -> int | None:
    """The index of the first full-attention group (whose tables an eviction policy drops blocks from; every
    full group's tables list the same tokens), None when every group slides."""
    return next((g for g, group in enumerate(groups) if group.window is None), None)


def single_group(num_layers: int) -> tuple[LayerGroup, ...]:
    """Every layer in one full-attention group: one block id spans all layers (a model without windows)."""
    return (LayerGroup(tuple(range(num_layers))),)


def layer_groups(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
    """Groups of equal size from each layer's window (None: full attention), in the order kinds first appear.

    A model whose layers all keep the same tokens gets one group; a window at least as long as any sequence
    is still a window here (the tokens a query cannot see are freed once there are any).
    """
    if not windows:
        raise ValueError("A model needs at least one layer to group.")
    for layer, window in enumerate(windows):
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"Layer {layer}'s sliding window must be a positive int or None; got {window!r}.")
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_kind.setdefault(window, []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_kind.values()))
    return tuple(
        LayerGroup(tuple(layers[start : start + size]), window)
        for window, layers in by_kind.items()
        for start in range(0, len(layers), size)
    )


def check_groups(groups: Sequence[LayerGroup], num_layers: int) -> None:
    """Raise a `ValueError` unless `groups` partition layers 0..num_layers-1 into groups of one size."""
    if not groups:
        raise ValueError("groups must hold at least one LayerGroup.")
    sizes = {len(group.layers) for group in groups}
    covered = sorted(layer for group in groups for layer in group.layers)
    if len(sizes) != 1 or covered != list(range(num_layers)):
        raise ValueError(
            f"Layer groups must cover each of the {num_layers} layers exactly once, in groups of one size; got "
            f"{[group.layers for group in groups]}."
        )


@dataclass(frozen=True)
class GroupLayout:
    """Where each layer's blocks live when a block holds one group's layers: its group and its position in it.
    The layers at one position share memory; group 0's layers (`heads`) stand for the positions::

        Gemma-3-270M: 15 sliding layers, 3 full (5, 11, 17)  ->  s = 3, six groups of three layers
            sliding 512: (0 1 2)  (3 4 6)  (7 8 9)  (10 12 13)  (14 15 16)        full: (5 11 17)
        pool tensors: keys[position j] : [capacity, block_size, kv_heads, head_dim], j = 0, 1, 2
        layer l  ->  (its group, its position j): its K/V live in keys[j][block ids of its group's tables]
    """

    groups: tuple[LayerGroup, ...]
    group_of: tuple[int, ...]  # per layer: its index in `groups`
    position: tuple[int, ...]  # per layer: its index in its group's `layers`

    @classmethod
    def of(cls, groups: Sequence[LayerGroup], num_layers: int) -> GroupLayout:
        check_groups(groups, num_layers)
        group_of, position = [0] * num_layers, [0] * num_layers
        for index, group in enumerate(groups):
            for at, layer in enumerate(group.layers):
                group_of[layer], position[layer] = index, at
        return cls(tuple(groups), tuple(group_of), tuple(position))

    @property
    def heads(self) -> tuple[int, ...]:
        return self.groups[0].layers

    def sharing(self, layer: int) -> list[int]:
        """The layers whose memory is layer `layer`'s (itself included)."""
        return [other for other, at in enumerate(self.position) if at == self.position[layer]]

    def check_shared(self, value_of: Callable[[int], object], what: str) -> None:
        """Raise a `ValueError` unless every layer's `value_of` (a device, a format) equals its position's head's."""
        for layer, at in enumerate(self.position):
            head = self.heads[at]
            if value_of(layer) != value_of(head):
                raise ValueError(
                    f"Layers {head} and {layer} share {what} (position {at} of their layer groups) but have "
                    f"{value_of(head)} and {value_of(layer)}; layers sharing a position need the same (or no "
                    "layer groups)."
                )
