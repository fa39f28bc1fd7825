"""Which elements of a K/V block share one scale (KIVI grouping), as explicit shapes.

A block tensor is ``[*lead, T, H, D]``: leading dims (``[n]`` for a batch of blocks), ``T`` tokens, ``H`` KV heads,
``D`` = head_dim. Keys are grouped **per channel** over the block's tokens, because RoPE'd keys have a few outlier
channels (|K| 15x the median in some layers) and a per-token scale would be set by the outlier and flatten every
other channel of that token to a handful of levels. Values are grouped **per token**, along head_dim in groups of
``group_size`` (default: the whole head_dim): they have no channel outliers, and attention mixes them per token,
so a per-token error stays local. Statistic (scale / zero point) shapes, which a kernel indexes directly::

    keys   (CHANNEL): [*lead, 1, H, D]        element (.., t, h, d) uses stat[.., 0, h, d]
    values (TOKEN):   [*lead, T, H, D // g]   element (.., t, h, d) uses stat[.., t, h, d // g]
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from torch import Tensor


class GroupAxis(str, Enum):
    """The axis along which one scale is shared."""

    CHANNEL = "channel"
    """One scale per (head, channel), reduced over the block's tokens (keys)."""
    TOKEN = "token"
    """One scale per (token, head, head_dim group), reduced along head_dim (values)."""


def check_block_shape(shape: tuple[int, ...], what: str) -> None:
    """Raise ValueError unless ``shape`` is ``[*lead, T, H, D]`` with T, H, D >= 1."""
    if len(shape) < 3:
        raise ValueError(
            f"The {what} must have shape [..., block_size, num_kv_heads, head_dim] (at least 3 dims); "
            f"got shape {tuple(shape)}."
        )
    if min(shape[-3:]) < 1:
        raise ValueError(
            f"The {what} must have at least one token, one head and one channel; got shape {tuple(shape)}."
        )


@dataclass(frozen=True)
class ScaleGroups:
    """How a ``[*lead, T, H, D]`` tensor is split into groups that share one scale.

    ``group_size`` is the number of elements that share one scale: the token count ``T`` for
    ``CHANNEL`` grouping, the head_dim slice length for ``TOKEN`` grouping.
    """

    shape: tuple[int, ...]
    axis: GroupAxis
    group_size: int

    def __post_init__(self) -> None:
        check_block_shape(self.shape, "encoded tensor")
        if not isinstance(self.axis, GroupAxis):
            raise TypeError(f"axis must be a GroupAxis (CHANNEL or TOKEN); got {self.axis!r}.")
        tokens, head_dim = self.shape[-3], self.shape[-1]
        if self.axis is GroupAxis.CHANNEL and self.group_size != tokens:
            raise ValueError(
                f"Per-channel (key) groups span all {tokens} tokens of the block, so group_size must be "
                f"{tokens}; got {self.group_size}."
            )
        if self.axis is GroupAxis.TOKEN:
            check_group_size(self.group_size, head_dim)

    @classmethod
    def for_block(cls, shape: tuple[int, ...], axis: GroupAxis, group_size: int | None) -> ScaleGroups:
        """The layout for a block of ``shape``; ``group_size`` applies to TOKEN grouping only."""
        check_block_shape(shape, "encoded tensor")
        if axis is GroupAxis.CHANNEL:
            return cls(shape, axis, shape[-3])
        return cls(shape, axis, shape[-1] if group_size is None else group_size)

    @property
    def reduce_dim(self) -> int:
        """The dim of the grouped view (see ``to_groups``) that a statistic reduces over."""
        return -3 if self.axis is GroupAxis.CHANNEL else -1

    @property
    def stat_shape(self) -> tuple[int, ...]:
        """Shape of a stored scale / zero point tensor (see the module docstring)."""
        *lead, tokens, heads, head_dim = self.shape
        if self.axis is GroupAxis.CHANNEL:
            return (*lead, 1, heads, head_dim)
        return (*lead, tokens, heads, head_dim // self.group_size)

    def to_groups(self, x: Tensor) -> Tensor:
        """View ``x [*lead, T, H, D]`` so that each group lies along ``reduce_dim``.

        CHANNEL: ``x`` itself (groups run along dim -3). TOKEN: ``[*lead, T, H, D // g, g]``.
        """
        if self.axis is GroupAxis.CHANNEL:
            return x
        return x.unflatten(-1, (x.shape[-1] // self.group_size, self.group_size))

    def from_groups(self, grouped: Tensor) -> Tensor:
        """Inverse of ``to_groups``: back to ``[*lead, T, H, D]``."""
        return grouped if self.axis is GroupAxis.CHANNEL else grouped.flatten(-2)

    def store_stat(self, stat: Tensor) -> Tensor:
        """A keepdim statistic of the grouped view -> its stored shape ``stat_shape``."""
        return stat if self.axis is GroupAxis.CHANNEL else stat.squeeze(-1)

    def load_stat(self, stat: Tensor) -> Tensor:
        """A stored statistic -> a tensor that broadcasts against the grouped view."""
        return stat if self.axis is GroupAxis.CHANNEL else stat.unsqueeze(-1)


def check_group_size(group_size: int, head_dim: int) -> None:
    """Raise ValueError unless ``group_size`` is a positive divisor of ``head_dim``."""
    if group_size < 1 or head_dim % group_size != 0:
        divisors = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        raise ValueError(
            f"group_size={group_size} does not divide head_dim={head_dim}; use one of {divisors}, or None "
            "for one group per head."
        )
