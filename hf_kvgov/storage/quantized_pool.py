"""A block pool whose full blocks can be *sealed*: encoded into a `SealedBlockStore`, their
full-precision memory handed back to the free list.

Block ids, as block tables hold them::

    id >= 0  : a full-precision block of the pool, keys[l][id] / values[l][id]   (sink, tail, residual)
    id <  0  : sealed block s = -1 - id of the sealed store (codes + scales, or raw K/V for a layer
               kept in full precision)

Both kinds carry reference counts, and `incref` / `decref` / `ref_count` accept either, so `BlockTable`s
hold mixed lists and fork, truncate and release them unchanged. A sealed block is immutable: writes only
touch full-precision blocks, and `copy_on_write` (alias `unseal`) decodes a sealed block into a fresh
full-precision one::

    seal([7, 7, 9]) -> [-1, -1, -2]    block 7 (shared by two rows) is encoded once and sealed id 0 takes
                                        both references; blocks 7 and 9 drop them (freed at count 0)

The cap (`max_tokens` / `max_bytes`) bounds the full-precision blocks only; the sealed store grows as
blocks are sealed. The full-precision part grows in small steps (`growth_blocks`, default 8), since a
quantized cache keeps only the sink and tail blocks of each row there.

Layer groups (`groups=`, hybrid sliding-window models): as in `BlockPool`, a full-precision id and a sealed
id both span the layers of one group, the layers at one position of their groups sharing tensors; sealing
a block encodes one tensor per position, so those layers must share a sealed format.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from hf_kvgov.storage.geometry import index_per_layer
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool, KVGeometry
from hf_kvgov.storage.sealed_formats import SealedFormat
from hf_kvgov.storage.sealed_store import DEFAULT_SEALED_GROWTH, SealedBlockStore, SealedStats

DEFAULT_TAIL_GROWTH = 8


def is_sealed(block_id: int) -> bool:
    """True for a block-table entry that names a sealed block."""
    return block_id < 0


def sealed_ref(sealed_id: int) -> int:
    """The block-table entry for sealed id `sealed_id` (inverse of `sealed_id_of`)."""
    return -1 - sealed_id


def sealed_id_of(block_id: int) -> int:
    """The sealed-store id named by a negative block-table entry."""
    return -1 - block_id


def _repeats(ids: Sequence[int]) -> list[int]:
    """Every occurrence of an id after its first, in order."""
    seen: set[int] = set()
    repeats = []
    for block_id in ids:
        if block_id in seen:
            repeats.append(block_id)
        seen.add(block_id)
    return repeats


class QuantizedBlockPool(BlockPool):
    """Full-precision blocks plus a sealed store; see the module docstring for the id convention.

    Args:
        geometry, block_size, max_tokens, max_bytes, growth_blocks, preallocate: as `BlockPool`, for the
            full-precision blocks.
        formats: one `SealedFormat` per layer: how sealed blocks of that layer are stored.
        sealed_growth_blocks: blocks added per growth step of the sealed store.
        groups: layer groups, as `BlockPool`'s (None: one group of every layer); the layers at one position of
            their groups must have the same format.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        formats: Sequence[SealedFormat],
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        growth_blocks: int = DEFAULT_TAIL_GROWTH,
        preallocate: bool = False,
        sealed_growth_blocks: int = DEFAULT_SEALED_GROWTH,
        groups: tuple[LayerGroup, ...] | None = None,
    ) -> None:
        if len(formats) != geometry.num_layers:
            raise ValueError(
                f"A QuantizedBlockPool needs one SealedFormat per layer ({geometry.num_layers}); got {len(formats)}."
            )
        super().__init__(geometry, block_size, max_tokens, max_bytes, growth_blocks, preallocate, groups)
        devices = [geometry.layer_device(layer) for layer in range(geometry.num_layers)]
        self.sealed = SealedBlockStore(
            formats, block_size, geometry.num_kv_heads, geometry.head_dim, devices, sealed_growth_blocks, self.layout
        )

    @property
    def format_names(self) -> tuple[str, ...]:
        """The sealed format of each layer, by name."""
        return tuple(f.name for f in self.sealed.formats)

    # ------------------------------------------------------------------ reference counts, either kind

    @staticmethod
    def _split(block_ids: Iterable[int]) -> tuple[list[int], list[int]]:
        """(full-precision ids, sealed-store ids) of a mixed list."""
        full, sealed = [], []
        for block_id in block_ids:
            if is_sealed(block_id):
                sealed.append(sealed_id_of(block_id))
            else:
                full.append(block_id)
        return full, sealed

    def ref_count(self, block_id: int) -> int:
        if is_sealed(block_id):
            return self.sealed.ref_count(sealed_id_of(block_id))
        return super().ref_count(block_id)

    def incref(self, block_ids: Iterable[int]) -> None:
        with self._lock:
            full, sealed = self._split(block_ids)
            self.sealed.check_live(sealed, "share")  # all ids are checked before any count changes
            super().incref(full)
            self.sealed.incref(sealed)

    def decref(self, block_ids: Iterable[int]) -> None:
        with self._lock:
            full, sealed = self._split(block_ids)
            self.sealed.check_live(sealed, "free")
            super().decref(full)
            self.sealed.decref(sealed)

    # ------------------------------------------------------------------ sealing

    def seal(self, block_ids: Sequence[int]) -> list[int]:
        """Encode full-precision blocks into the sealed store; returns the sealed entry for each given id.

        Each occurrence of an id moves one reference from the full-precision block to its sealed copy, so
        a block listed by k rows is encoded once and its sealed copy has k references. A full-precision
        block still referenced elsewhere afterwards keeps its memory; the others return to the free list.
        """
        ids = [int(i) for i in block_ids]
        if not ids:
            return []
        with self._lock:
            if any(is_sealed(i) for i in ids):
                raise ValueError(f"Cannot seal blocks that are already sealed (negative ids) in {ids}.")
            self._checked_live(ids, "free")
            unique = list(dict.fromkeys(ids))
            slots = self.sealed.allocate(len(unique))
            try:
                self._encode(unique, slots)
            except Exception:
                self.sealed.decref(slots)
                raise
            sealed_of = dict(zip(unique, slots, strict=True))
            # allocate gave each sealed block one reference; every further occurrence adds one.
            self.sealed.incref(sealed_of[i] for i in _repeats(ids))
            super().decref(ids)
            return [sealed_ref(sealed_of[i]) for i in ids]

    def _encode(self, full_ids: list[int], slots: list[int]) -> None:
        sources = index_per_layer(full_ids, self.geometry)
        targets = index_per_layer(slots, self.geometry)
        for layer in self._heads:  # one tensor per position holds whichever group's layer owns the block
            source = sources[layer]
            self.sealed.write(layer, targets[layer], self.keys[layer][source], self.values[layer][source])

    def allocate_sealed(self, n: int) -> list[int]:
        """`n` sealed block-table entries with one reference each, whose pieces the caller then writes
        (`write_sealed_pieces`): for sealed blocks coming back from a tier."""
        with self._lock:
            return [sealed_ref(s) for s in self.sealed.allocate(n)]

    def write_sealed_pieces(self, layer: int, block_ids: Sequence[int], pieces: dict[str, Tensor]) -> None:
        """Store encoded pieces `[n, *shape]` of layer `layer` under sealed entries `block_ids` (all < 0)."""
        ids = [sealed_id_of(b) for b in block_ids]
        with self._lock:
            self.sealed.check_live(ids, "write")
            target = torch.tensor(ids, dtype=torch.long, device=self.geometry.layer_device(layer))
            self.sealed.write_pieces(layer, target, pieces)

    def unseal(self, block_id: int) -> int:
        """A writable full-precision block holding the decoded content of sealed `block_id`.

        Drops one reference to the sealed block (freed when it was the last one).
        """
        with self._lock:
            self.sealed.check_live([sealed_id_of(block_id)], "copy")
            (fresh,) = self.allocate(1)
            self.copy_block(block_id, fresh)
            self.decref([block_id])
            return fresh

    def copy_on_write(self, block_id: int) -> int:
        if is_sealed(block_id):
            return self.unseal(block_id)
        return super().copy_on_write(block_id)

    def copy_block(self, src: int, dst: int) -> None:
        if not is_sealed(src):
            super().copy_block(src, dst)
            return
        slots = index_per_layer([sealed_id_of(src)], self.geometry)
        for layer in self._heads:
            keys, values = self.sealed.read(layer, slots[layer], self.geometry.dtype)
            self.keys[layer][dst].copy_(keys[0])
            self.values[layer][dst].copy_(values[0])

    def place_layer(self, layer: int, device: torch.device) -> None:
        """As `BlockPool.place_layer`; the layer's sealed pieces follow (nothing of it is sealed yet)."""
        with self._lock:
            super().place_layer(layer, device)
            self.sealed.place_layer(layer, device)

    # ------------------------------------------------------------------ data

    def read_sealed(self, layer: int, block_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Decoded keys, values `[n, block_size, H, D]` of sealed block-table entries long `[n]` (all < 0)."""
        return self.sealed.read(layer, -1 - block_ids, dtype)

    def sealed_stats(self) -> SealedStats:
        with self._lock:
            return self.sealed.stats()
