"""One layer's sealed blocks as a kernel reads them: the format's name and its stored pieces.

Kernels take every dtype and group size from these tensors (`SealedBlocks` lists them), never from constants, so a
change of the stored layout needs no kernel change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

RAW_FORMAT = "full"


@dataclass(frozen=True)
class SealedBlocks:
    """The sealed blocks of one layer.

    The pieces are `storage.sealed_store`'s tensors for one layer, named as `storage.sealed_formats` names them::

        codec formats ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2"):
            key_codes    [capacity, block_size, H, D * bits // 8]   uint8, or float8 for fp8
            key_scale    [capacity, 1, H, D]                        one per channel per block (fp16 or fp32)
            key_zero     same as key_scale                          int formats and fp8
            value_codes  [capacity, block_size, H, D * bits // 8]
            value_scale  [capacity, block_size, H, D // group]       one per token and head_dim group
            value_zero   same as value_scale                        int formats only
        "full" (a layer kept in full precision):  keys, values [capacity, block_size, H, D]

    A table entry `b < 0` names sealed id `-1 - b`.

    Attributes:
        format: the sealed format's name ("int8", "int4", "int2", "fp8_e4m3", "fp8_e5m2" or "full").
        pieces: piece name -> tensor, as listed above (copied: the store may grow later).
    """

    format: str
    pieces: Mapping[str, torch.Tensor] = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or not self.format:
            raise TypeError(f"format must be a sealed format's name (a non-empty str); got {self.format!r}.")
        if not self.pieces:
            raise ValueError(f"The sealed blocks of format {self.format!r} need their pieces; got none.")
        object.__setattr__(self, "pieces", dict(self.pieces))

    def piece(self, name: str) -> torch.Tensor:
        """The piece `name`; a ValueError naming the pieces present when it is missing."""
        tensor = self.pieces.get(name)
        if tensor is None:
            raise ValueError(
                f"Sealed blocks of format {self.format!r} have no {name!r} piece; they hold {sorted(self.pieces)}."
            )
        return tensor

    @property
    def capacity(self) -> int:
        """Sealed ids the pieces have room for."""
        return int(next(iter(self.pieces.values())).shape[0])
