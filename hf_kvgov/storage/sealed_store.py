"""The sealed-block store: encoded K/V blocks indexed by a sealed id, with reference counts.

It holds the compressed half of a `QuantizedBlockPool`, mirroring `BlockPool`'s metadata (a reference count
per id, a FIFO free list) so sealed ids are shared, forked and freed as pool blocks are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import Tensor

from hf_kvgov.storage.free_ids import FifoIds, FreeIds
from hf_kvgov.storage.geometry import zero_extended
from hf_kvgov.storage.layer_groups import GroupLayout, single_group
from hf_kvgov.storage.sealed_formats import SealedFormat, piece_bytes

DEFAULT_SEALED_GROWTH = 64

# One device for every layer, or one per layer.
Placement: TypeAlias = torch.device | Sequence[torch.device]


@dataclass(frozen=True)
class SealedStats:
    capacity_blocks: int
    used_blocks: int
    bytes_per_block: int  # all layers, keys and values, codes + scales + zero points
    bytes_used: int
    bytes_reserved: int


class SealedBlockStore:
    """Sealed blocks of every layer, encoded by each layer's `SealedFormat`.

    Memory layout, per layer, one tensor per piece of that layer's `SealedFormat` (int8 shown)::

        pieces[layer]["key_codes"]   : uint8 [capacity, block_size, H, D]
        pieces[layer]["key_scale"]   : fp16  [capacity, 1, H, D]          one scale per channel per block
        pieces[layer]["key_zero"]    : fp16  [capacity, 1, H, D]
        pieces[layer]["value_codes"] : uint8 [capacity, block_size, H, D]
        pieces[layer]["value_scale"] : fp16  [capacity, block_size, H, D // g]
        pieces[layer]["value_zero"]  : fp16  [capacity, block_size, H, D // g]

    (fp8: float8 codes, a one-byte e4m3 `key_zero` and no `value_zero`.)

        sealed id s  ->  pieces[l][name][s] for every layer l and piece     (one id spans all layers)

    With layer groups (`BlockPool(groups=...)`, hybrid sliding-window models) a sealed id spans the layers of
    one group, as a pool block does: the layers at one position of their groups share one dict of pieces
    (`pieces[l]` aliases), so they must share a format, and `bytes_per_block` counts one group's layers.

    Layers may use different formats (a layer kept in full precision stores raw `keys`/`values`) and live on
    different devices (a model split over accelerators): layer l's pieces sit on its device. Metadata
    mirrors `BlockPool`: a reference count per id and a free list (FIFO, or lowest first: ``free_ids``, which an
    owner with a byte cap asks for, so free ids gather at the end). The store takes no lock: its owner,
    `QuantizedBlockPool`, calls it under the pool's lock. Left alone it grows as `allocate` needs; an owner
    with a byte cap grows it first (`grow`, within the cap) and may take back free ids at its end
    (`release_tail`).

    Args:
        formats: one format per layer.
        block_size, num_kv_heads, head_dim: the block geometry (as the pool's).
        device: where the pieces live: one device, or one per layer (layer l's pieces on `device[l]`).
        growth_blocks: blocks added per growth step (the store at least doubles).
        layout: the pool's layer groups (`BlockPool.layout`): layers at one position share pieces, format and
            device. None: every layer has pieces of its own.
        free_ids: the order free ids are handed out in (`hf_kvgov.storage.free_ids`; None: FIFO).
    """

    def __init__(
        self,
        formats: Sequence[SealedFormat],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: Placement,
        growth_blocks: int = DEFAULT_SEALED_GROWTH,
        layout: GroupLayout | None = None,
        free_ids: FreeIds | None = None,
    ) -> None:
        if not formats:
            raise ValueError("A sealed store needs one SealedFormat per layer; got an empty list.")
        if growth_blocks <= 0:
            raise ValueError(f"growth_blocks must be positive; got {growth_blocks}.")
        self.formats = tuple(formats)
        self.block_size = block_size
        self.devices = _per_layer(device, len(self.formats))
        self.device = self.devices[0]
        self._growth = growth_blocks
        self.group_layout = layout or GroupLayout.of(single_group(len(self.formats)), len(self.formats))
        self.group_layout.check_shared(lambda layer: (self.formats[layer].name, self.devices[layer]), "sealed blocks")
        self._heads = self.group_layout.heads
        self._layouts = [f.layout(block_size, num_kv_heads, head_dim) for f in self.formats]
        per_position = [
            {name: torch.empty((0, *shape), dtype=dtype, device=self.devices[head])
             for name, (shape, dtype) in self._layouts[head].items()}
            for head in self._heads
        ]  # fmt: skip
        self.pieces: list[dict[str, Tensor]] = [per_position[position] for position in self.group_layout.position]
        self._ref: list[int] = []
        self._free: FreeIds = FifoIds() if free_ids is None else free_ids
        self.bytes_per_block = sum(sum(piece_bytes(self._layouts[head])) for head in self._heads)

    # ------------------------------------------------------------------ metadata

    @property
    def capacity(self) -> int:
        return len(self._ref)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def ref_count(self, sealed_id: int) -> int:
        return self._ref[sealed_id]

    @property
    def num_free(self) -> int:
        """Ids on the free list (the store may still grow)."""
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` sealed ids with reference count 1 (the store grows as needed: an owner with a cap grows
        it first, within the cap, and then finds the ids free)."""
        short = n - len(self._free)
        if short > 0:
            self.grow(self.growth_step(short))
        ids = [self._free.take() for _ in range(n)]
        for sealed_id in ids:
            self._ref[sealed_id] = 1
        return ids

    def growth_step(self, short: int) -> int:
        """Blocks to add when `short` more are needed (the store at least doubles), before any cap."""
        return max(short, self._growth, self.capacity)

    def grow(self, extra: int) -> None:
        """Append `extra` zeroed blocks to every piece; their ids go to the back of the free list."""
        if extra <= 0:
            return
        start = self.capacity
        self._resize_pieces(lambda old: zero_extended(old, extra), start)
        self._ref.extend([0] * extra)
        self._free.extend(range(start, start + extra))

    def free_tail(self, dropping: Mapping[int, int] | None = None) -> int:
        """How many ids at the end of the pieces are free, or become free once the references counted in
        `dropping` (sealed id -> references) are dropped: what `release_tail` could give back."""
        dropping = dropping or {}
        count = 0
        for sealed_id in range(self.capacity - 1, -1, -1):
            if self._ref[sealed_id] != dropping.get(sealed_id, 0):
                break
            count += 1
        return count

    def release_tail(self, count: int) -> None:
        """Give back the memory of the last `count` ids, which must be free: every piece shrinks (a copy of the
        blocks kept, as growth copies them) and those ids leave the free list."""
        if count <= 0:
            return
        keep = self.capacity - count
        assert all(self._ref[sealed_id] == 0 for sealed_id in range(keep, self.capacity)), "only free ids go"
        try:
            self._resize_pieces(lambda old: old[:keep].clone(), keep)
        finally:  # a failed copy still leaves every piece `keep` blocks long
            del self._ref[keep:]
            self._free.keep_below(keep)

    def _resize_pieces(self, resized: Callable[[Tensor], Tensor], keep: int) -> None:
        """Replace every piece by ``resized(piece)``, one at a time, as `BlockPool` resizes its tensors: each old
        piece goes before the next new one is allocated. If an allocation fails part way, every piece is cut to its
        first ``keep`` blocks (views) before the error propagates."""
        try:
            # As in BlockPool: tensors created under torch.inference_mode() could not take in-place writes later.
            with torch.inference_mode(False):
                for layer in self._heads:  # one dict per position: the layers sharing it see the new pieces
                    pieces = self.pieces[layer]
                    for name in list(pieces):
                        pieces[name] = resized(pieces[name])
        except BaseException:
            for layer in self._heads:
                pieces = self.pieces[layer]
                pieces.update({name: piece[:keep] for name, piece in pieces.items()})
            raise

    def place_layer(self, layer: int, device: torch.device) -> None:
        """Put layer `layer`'s pieces on `device`; for a layer that has sealed nothing yet (they hold zeros).

        The layers at its position share those pieces and move with it (the pool places them together).
        """
        for other in self.group_layout.sharing(layer):
            self.devices[other] = torch.device(device)
        self.device = self.devices[0]
        pieces = self.pieces[layer]
        pieces.update({name: torch.zeros_like(t, device=device) for name, t in pieces.items()})

    def check_live(self, sealed_ids: Iterable[int], action: str) -> list[int]:
        """Validate every id (counting repeats when freeing) before anything changes."""
        ids = list(sealed_ids)
        remaining: dict[int, int] = {}
        for sealed_id in ids:
            if isinstance(sealed_id, bool) or not 0 <= sealed_id < self.capacity:
                raise ValueError(
                    f"Cannot {action} sealed block {sealed_id!r}: sealed ids are ints in [0, {self.capacity})."
                )
            remaining[sealed_id] = remaining.get(sealed_id, self._ref[sealed_id]) - (action == "free")
            if self._ref[sealed_id] <= 0 or remaining[sealed_id] < 0:
                raise ValueError(
                    f"Cannot {action} sealed block {sealed_id}: it is free (reference count 0); it was freed "
                    "twice or never sealed."
                )
        return ids

    def incref(self, sealed_ids: Iterable[int]) -> None:
        for sealed_id in self.check_live(sealed_ids, "share"):
            self._ref[sealed_id] += 1

    def decref(self, sealed_ids: Iterable[int]) -> None:
        for sealed_id in self.check_live(sealed_ids, "free"):
            self._ref[sealed_id] -= 1
            if self._ref[sealed_id] == 0:
                self._free.put(sealed_id)

    def free_ids(self) -> tuple[int, ...]:
        """Free sealed ids in the order they will be handed out; for tests and debugging."""
        return self._free.in_order()

    # ------------------------------------------------------------------ data

    def layout(self, layer: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Layer `layer`'s pieces of one block: name -> (shape without the leading block dim, dtype)."""
        return dict(self._layouts[layer])

    def write_pieces(self, layer: int, sealed_ids: Tensor, pieces: dict[str, Tensor]) -> None:
        """Store already encoded pieces (each `[n, *shape]`, as `layout(layer)`) under sealed ids long `[n]`.

        For blocks coming back from a tier that holds them as stored: no re-encoding, bit for bit.
        """
        if set(pieces) != set(self.pieces[layer]):
            raise ValueError(f"Layer {layer} stores pieces {sorted(self.pieces[layer])}; got {sorted(pieces)}.")
        for name, piece in pieces.items():
            self.pieces[layer][name][sealed_ids] = piece.to(self.devices[layer])

    def read(self, layer: int, sealed_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Decoded keys, values `[n, block_size, H, D]` of `dtype` for sealed ids long `[n]`, on the layer's device."""
        # index_select rather than t[ids]: 5-15x faster on the CPU for int8 codes, and it takes float8.
        pieces = {name: t.index_select(0, sealed_ids) for name, t in self.pieces[layer].items()}
        return self.formats[layer].decode(pieces, dtype)

    def stats(self) -> SealedStats:
        return SealedStats(
            capacity_blocks=self.capacity,
            used_blocks=self.num_used,
            bytes_per_block=self.bytes_per_block,
            bytes_used=self.num_used * self.bytes_per_block,
            bytes_reserved=self.capacity * self.bytes_per_block,
        )


def _per_layer(device: Placement, num_layers: int) -> list[torch.device]:
    if isinstance(device, (torch.device, str)):
        return [torch.device(device)] * num_layers
    devices = [torch.device(d) for d in device]
    if len(devices) != num_layers:
        raise ValueError(
            f"A sealed store on several devices needs one device per layer ({num_layers}); got {len(devices)}."
        )
    return devices
