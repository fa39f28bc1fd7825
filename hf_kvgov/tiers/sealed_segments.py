"""Sealed (quantized) blocks in the disk tier: written as stored, codes and scales, never decoded.

Segment of (sealed block s, layer l): one part per piece of the layer's `SealedFormat`, in the store's order::

    int8:  part 0 = key_codes[l][s]   (block_size x H x D, uint8)
           part 1 = key_scale[l][s]   (1 x H x D, fp16)        part 2 = key_zero[l][s]   (the same)
           part 3 = value_codes[l][s] (block_size x H x D, uint8)
           part 4 = value_scale[l][s] (block_size x H x D/g)   part 5 = value_zero[l][s] (the same)

so a block read back holds the very bytes that were sealed and decodes as the store would. A layer kept in full
precision stores raw `keys`, `values`; the tier's layout records each layer's parts (`TierLayout.layer_parts`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_kvgov.storage.geometry import index_per_layer
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool, is_sealed, sealed_id_of
from hf_kvgov.storage.sealed_formats import piece_bytes
from hf_kvgov.tiers.disk_tier import DiskTier, SegmentSource, TierLayout
from hf_kvgov.tiers.kv_segments import SpilledLayout, byte_view
from hf_kvgov.tiers.moves import TierBlocks


def sealed_tier_layout(pool: QuantizedBlockPool, extent_slots: int) -> TierLayout:
    """The tier layout of the pool's sealed blocks: one segment per position of a block (its layers: every
    layer without layer groups), one part per piece, per position when their formats differ."""
    parts = tuple(_part_bytes(pool, layer) for layer in pool.layout.heads)
    per_layer = parts if any(p != parts[0] for p in parts) else None
    return TierLayout(len(parts), parts[0], extent_slots, per_layer)


def _part_bytes(pool: QuantizedBlockPool, layer: int) -> tuple[int, ...]:
    return piece_bytes(pool.sealed.layout(layer))


def empty_pieces(pool: QuantizedBlockPool, layer: int, count: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Uninitialised pieces of `count` blocks of layer `layer`, `[count, *shape]` each, on `device`."""
    return {
        name: torch.empty((count, *shape), dtype=dtype, device=device)
        for name, (shape, dtype) in pool.sealed.layout(layer).items()
    }


def after_the_store(pool: QuantizedBlockPool, layout: SpilledLayout) -> torch.Tensor:
    """The block table (long `[batch, blocks]`) with spilled block i, row i of a stack read back, as sealed
    entry ``-1 - (capacity + i)``: numbered after the store's own slots, so one reader serves both."""
    flat = layout.block_table.clone().reshape(-1)
    flat[layout.spilled_positions] = -1 - pool.sealed.capacity - layout.spilled_rows
    return flat.view_as(layout.block_table)


def read_store_or_stack(
    stored: dict[str, torch.Tensor], stack: dict[str, torch.Tensor], slots: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Pieces `[n, *shape]` of sealed slots `slots` (long `[n]`, numbered as `after_the_store` numbers them):
    below the store's capacity from `stored`, the others from row ``slot - capacity`` of `stack`.

    Only the blocks asked for are copied, never the whole store: under a prefix tree's shared pool the store
    holds every request's blocks.
    """
    capacity = next(iter(stored.values())).shape[0]
    rows = (slots >= capacity).nonzero().squeeze(1)
    if rows.numel() == 0:
        return {name: piece.index_select(0, slots) for name, piece in stored.items()}
    store_slots = slots.clamp(max=max(capacity - 1, 0))  # stack rows read any store slot first, then are overwritten
    pieces = {}
    for name, piece in stored.items():
        picked = (
            piece.index_select(0, store_slots) if capacity else stack[name].new_empty((len(slots), *piece.shape[1:]))
        )
        picked[rows] = stack[name].index_select(0, slots[rows] - capacity)
        pieces[name] = picked
    return pieces


def sealed_segments(pool: QuantizedBlockPool, entries: Sequence[int]) -> SegmentSource:
    """The segments of sealed entries (all < 0), one position at a time (views on CPU, one copy on GPU)."""
    ids = [sealed_id_of(entry) for entry in entries]
    index = index_per_layer(ids, pool.geometry)

    def segments(position: int) -> list[list[memoryview]]:
        layer = pool.layout.heads[position]
        pieces = pool.sealed.pieces[layer].values()
        if pool.geometry.layer_device(layer).type == "cpu":
            return [[byte_view(piece[s]) for piece in pieces] for s in ids]
        host = [piece[index[layer]].cpu() for piece in pieces]
        return [[byte_view(piece[i]) for piece in host] for i in range(len(ids))]

    return segments


def restore_sealed(pool: QuantizedBlockPool, tier: DiskTier, handles: list[int]) -> list[int]:
    """Read spilled sealed blocks into fresh sealed slots (one reference each); returns their entries."""
    fresh = pool.allocate_sealed(len(handles))
    try:
        for position, layer in enumerate(pool.layout.heads):
            pieces = empty_pieces(pool, layer, len(handles), torch.device("cpu"))
            tier.read(position, handles, [byte_view(piece) for piece in pieces.values()])
            pool.write_sealed_pieces(layer, fresh, pieces)
    except BaseException:
        pool.decref(fresh)
        raise
    return fresh


def sealed_blocks(pool: QuantizedBlockPool) -> TierBlocks:
    """Sealed blocks of a quantized pool, moved as stored; its full-precision blocks (sink, tail) stay."""
    return TierBlocks(
        is_sealed, lambda entries: sealed_segments(pool, entries), lambda tier, h: restore_sealed(pool, tier, h)
    )
