"""A block pool whose full blocks can be *sealed*: encoded into a `SealedBlockStore`, their
full-precision memory handed back to the free list.

Block tables hold full-precision and sealed ids side by side (`QuantizedBlockPool` gives the convention), so
they fork, truncate and release mixed lists unchanged, and one byte cap bounds both kinds of memory together.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from hf_kvgov.codecs.numerics import StatisticsOutOfRange
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.free_ids import LowestIds
from hf_kvgov.storage.geometry import index_per_layer
from hf_kvgov.storage.layer_groups import LayerGroup
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool, KVGeometry, PoolStats
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


@dataclass(frozen=True)
class QuantizedPoolStats(PoolStats):
    """`PoolStats` (its block fields count the full-precision blocks; ``bytes_held`` every byte the cap bounds),
    plus the sealed store."""

    sealed: SealedStats  # bytes_held adds its bytes_reserved
    overflow_blocks: int  # blocks `seal` kept in full precision: their statistics did not fit the format


@dataclass(frozen=True)
class _Part:
    """One of the pool's two parts (full-precision blocks, the sealed store) as the byte cap sees it."""

    bytes_per_block: int
    used: int
    free: int  # ids on its free list
    step: Callable[[int], int]  # blocks to add for `short` missing ones, before the cap
    free_tail: Callable[[Mapping[int, int]], int]  # free ids at its end, counting references being dropped


@dataclass(frozen=True)
class _Room:
    """How a request fits under the byte cap: free blocks the other part gives back at its end, then blocks
    the part grows by."""

    give_back: int = 0
    grow: int = 0


class QuantizedBlockPool(BlockPool):
    """Full-precision blocks plus a sealed store.

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

    The cap: `max_bytes` bounds every byte of the pool's tensors, full-precision blocks (free ones included) plus
    the sealed store, and the bytes charged beside them (`stats().bytes_held`). Each part grows lazily, its step
    clamped to the budget left. Freeing a block returns no bytes (ids are stable), so a part short of budget first
    takes back the other part's free blocks at the end of its tensors, then asks the reclaimers, then raises
    `PoolExhausted` having done nothing; a growing `charge` takes either part's free blocks at its end. Sealing
    rule: the blocks an operation frees count as freed before it takes new ones, so `seal` may grow the store into
    the full-precision blocks it frees at the end (encoding them before they go), and `unseal` into the sealed block
    it drops; either is refused only when its net effect does not fit. A resize copies one tensor at a time, as
    `BlockPool`'s growth does. `max_tokens` still caps the full-precision blocks alone (the store is then
    uncapped); `max_bytes` refuses `preallocate`, the budget being shared.

    Layer groups (`groups=`, hybrid sliding-window models): as in `BlockPool`, a full-precision id and a sealed
    id both span the layers of one group, the layers at one position of their groups sharing tensors; sealing
    a block encodes one tensor per position, so those layers must share a sealed format.

    Args:
        geometry, block_size, growth_blocks, preallocate: as `BlockPool`, for the full-precision blocks
            (`growth_blocks` defaults to 8: a quantized cache keeps only each row's sink and tail blocks there).
        max_tokens: cap on the full-precision blocks, in tokens (the sealed store is then not capped).
        max_bytes: cap on every byte the pool holds, full-precision blocks and sealed store together (see
            "The cap" above); not with `preallocate`.
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
        if preallocate and max_bytes is not None:
            raise ValueError(
                "A QuantizedBlockPool shares max_bytes between full-precision and sealed blocks, so it cannot "
                "preallocate the cap; give max_tokens to preallocate full-precision blocks, or leave "
                "preallocate=False."
            )
        super().__init__(geometry, block_size, max_tokens, max_bytes, growth_blocks, preallocate, groups)
        devices = [geometry.layer_device(layer) for layer in range(geometry.num_layers)]
        self.sealed = SealedBlockStore(
            formats, block_size, geometry.num_kv_heads, geometry.head_dim, devices, sealed_growth_blocks, self.layout,
            LowestIds() if max_bytes is not None else None,  # as the full-precision blocks': free ids at the end
        )  # fmt: skip
        self.overflow_blocks = 0  # blocks kept in full precision because their statistics overflowed (`seal`)
        if max_bytes is not None and max_bytes < self.sealed.bytes_per_block:
            raise ValueError(
                f"max_bytes={max_bytes} is smaller than one sealed block ({self.sealed.bytes_per_block} bytes at "
                "this geometry and these formats); give at least one block's worth."
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

    # ------------------------------------------------------------------ the byte cap

    def bytes_held(self) -> int:
        """Bytes the cap bounds: full-precision blocks (free ones included), the sealed store's pieces and the
        bytes charged beside them."""
        with self._lock:
            return super().bytes_held() + self.sealed.capacity * self.sealed.bytes_per_block

    @property
    def num_free(self) -> int:
        """Full-precision blocks that can be handed out without exceeding the cap (free list + room to grow,
        under a byte cap counting the sealed store's free blocks at its end)."""
        if self.max_bytes is None:
            return super().num_free
        with self._lock:
            return self._available(False, {})

    def _parts(self, sealed: bool) -> tuple[_Part, _Part]:
        """(the part a request takes blocks of, the other part): the sealed store if `sealed`, else full precision."""
        store = self.sealed
        full = _Part(
            self.bytes_per_block, self.capacity - len(self._free), len(self._free), self._growth_step, self._free_tail
        )
        coded = _Part(store.bytes_per_block, store.num_used, store.num_free, store.growth_step, store.free_tail)
        return (coded, full) if sealed else (full, coded)

    def _available(self, sealed: bool, dropping: Mapping[int, int]) -> int:
        """Blocks of one part a request could take now: its free ones, and what the budget left plus the other
        part's free blocks at its end (counting the references `dropping` to its ids as dropped) would add."""
        assert self.max_bytes is not None
        part, other = self._parts(sealed)
        spare = self.max_bytes - self.bytes_held() + other.free_tail(dropping) * other.bytes_per_block
        return part.free + spare // part.bytes_per_block

    def _fit(self, sealed: bool, n: int, dropping: Mapping[int, int]) -> _Room | None:
        """How `n` blocks of one part fit under the byte cap (see `_available`), or None when they do not."""
        assert self.max_bytes is not None
        part, other = self._parts(sealed)
        short = n - part.free
        if short <= 0:
            return _Room()
        left = self.max_bytes - self.bytes_held()
        over = short * part.bytes_per_block - left
        give_back = 0
        if over > 0:
            give_back = -(-over // other.bytes_per_block)
            if give_back > other.free_tail(dropping):
                return None
        budget = left + give_back * other.bytes_per_block
        return _Room(give_back, min(part.step(short), budget // part.bytes_per_block))

    def _room(self, sealed: bool, n: int, dropping: Sequence[int] = ()) -> _Room:
        """Check that `n` blocks of one part fit under the byte cap once the references `dropping` (ids of the
        other part) are dropped, asking the reclaimers first if they do not; raise `PoolExhausted` if they
        still do not, with nothing changed but what the reclaimers freed. Changes nothing itself: the caller
        drops `dropping`, then `_apply`s the room."""
        drops = Counter(dropping)
        room = self._fit(sealed, n, drops)
        for reclaim in list(self._reclaimers):
            if room is not None:
                break
            reclaim(n - self._available(sealed, drops))
            room = self._fit(sealed, n, drops)  # trust the counts, not the reclaimer's
        if room is None:
            part, _ = self._parts(sealed)
            available = self._available(sealed, drops)
            raise PoolExhausted(n, available, part.used + available, self.block_size)
        return room

    def _apply(self, sealed: bool, room: _Room) -> None:
        """The other part gives back its free blocks at its end, then the part grows, as `room` says."""
        if sealed:
            self._release_tail(room.give_back)
            self.sealed.grow(room.grow)
        else:
            self.sealed.release_tail(room.give_back)
            if room.grow:
                self._grow(room.grow)

    def _tails_covering(self, nbytes: int) -> tuple[int, ...] | None:
        """(full-precision, sealed) free blocks at the ends of the parts whose bytes cover `nbytes` (full precision
        first), or None: a growing `charge` takes either part's."""
        full = min(self._free_tail(), -(-nbytes // self.bytes_per_block))
        sealed = -(-max(0, nbytes - full * self.bytes_per_block) // self.sealed.bytes_per_block)
        return (full, sealed) if sealed <= self.sealed.free_tail() else None

    def _release_tails(self, tails: tuple[int, ...]) -> None:
        self._release_tail(tails[0])
        self.sealed.release_tail(tails[1])

    def _make_room(self, n: int) -> None:
        if self.max_bytes is None:
            super()._make_room(n)
        else:
            self._apply(False, self._room(False, n))

    # ------------------------------------------------------------------ sealing

    def seal(self, block_ids: Sequence[int]) -> list[int]:
        """Encode full-precision blocks into the sealed store; returns the sealed entry for each given id.

        Each occurrence of an id moves one reference from the full-precision block to its sealed copy, so
        a block listed by k rows is encoded once and its sealed copy has k references. A full-precision
        block still referenced elsewhere afterwards keeps its memory; the others return to the free list.
        Under a byte cap the sealed blocks may take the bytes of those freed at the end of the tensors
        (the sealing rule of the class docstring); `PoolExhausted` leaves every block as it was.

        A block whose statistics do not fit its format (one-byte statistics past e4m3's +-448, an fp16 scale
        overflow) stays in full precision, the widest statistics there are: its own id comes back, its
        references unmoved, and `stats().overflow_blocks` counts it. The store holds one layout per layer that
        kernels read in place, so a block cannot carry wider statistics than its neighbours there.
        """
        ids = [int(i) for i in block_ids]
        if not ids:
            return []
        with self._lock:
            if any(is_sealed(i) for i in ids):
                raise ValueError(f"Cannot seal blocks that are already sealed (negative ids) in {ids}.")
            self._checked_live(ids, "free")
            # Encoded before any reference moves: the store may grow into blocks this seal frees at the end.
            distinct = list(dict.fromkeys(ids))
            unique, pieces = self._encoded(distinct)
            fits = set(unique)
            moving = [i for i in ids if i in fits]
            room = None if self.max_bytes is None else self._room(True, len(unique), moving)
            self.overflow_blocks += len(distinct) - len(unique)  # once the seal goes ahead (a refused one is retried)
            BlockPool.decref(self, moving)
            if room is not None:
                self._apply(True, room)
            slots = self.sealed.allocate(len(unique))
            self._write_encoded(slots, pieces)
            sealed_of = dict(zip(unique, slots, strict=True))
            # allocate gave each sealed block one reference; every further occurrence adds one.
            self.sealed.incref(sealed_of[i] for i in _repeats(moving))
            return [sealed_ref(sealed_of[i]) if i in fits else i for i in ids]

    def _encoded(self, full_ids: list[int]) -> tuple[list[int], dict[int, dict[str, Tensor]]]:
        """(the ids whose statistics fit their formats in every layer, their pieces per position's layer), not yet
        stored anywhere."""
        try:
            return full_ids, self._encode_layers(full_ids)
        except StatisticsOutOfRange:
            pass  # rare: find the blocks at fault one by one
        fitting, pieces = [], []
        for block in full_ids:
            try:
                pieces.append(self._encode_layers([block]))
                fitting.append(block)
            except StatisticsOutOfRange:
                pass  # kept in full precision
        if not pieces:
            return [], {}
        joined = {
            layer: {name: torch.cat([p[layer][name] for p in pieces]) for name in pieces[0][layer]}
            for layer in pieces[0]
        }
        return fitting, joined

    def _encode_layers(self, full_ids: list[int]) -> dict[int, dict[str, Tensor]]:
        sources = index_per_layer(full_ids, self.geometry)
        formats = self.sealed.formats
        return {
            layer: formats[layer].encode(self.keys[layer][sources[layer]], self.values[layer][sources[layer]])
            for layer in self._heads
        }

    def _write_encoded(self, slots: list[int], pieces: dict[int, dict[str, Tensor]]) -> None:
        if not slots:
            return
        targets = index_per_layer(slots, self.geometry)
        for layer, encoded in pieces.items():
            self.sealed.write_pieces(layer, targets[layer], encoded)

    def allocate_sealed(self, n: int) -> list[int]:
        """`n` sealed block-table entries with one reference each, whose pieces the caller then writes
        (`write_sealed_pieces`): for sealed blocks coming back from a tier."""
        with self._lock:
            if self.max_bytes is not None:
                self._apply(True, self._room(True, n))
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

        Drops one reference to the sealed block (freed when it was the last one). Under a byte cap the fresh
        block may take the bytes of that sealed block, when it is freed at the end of the store.
        """
        with self._lock:
            sealed_id = sealed_id_of(block_id)
            self.sealed.check_live([sealed_id], "copy")
            if self.max_bytes is None:
                (fresh,) = self.allocate(1)
                self.copy_block(block_id, fresh)
                self.decref([block_id])
                return fresh
            decoded = self._decoded(block_id)  # before the sealed block's bytes may be given back
            room = self._room(False, 1, [sealed_id])
            self.decref([block_id])
            self._apply(False, room)
            (fresh,) = self.allocate(1)
            for layer, (keys, values) in decoded.items():
                self.keys[layer][fresh].copy_(keys[0])
                self.values[layer][fresh].copy_(values[0])
            return fresh

    def copy_on_write(self, block_id: int) -> int:
        if is_sealed(block_id):
            return self.unseal(block_id)
        return super().copy_on_write(block_id)

    def copy_block(self, src: int, dst: int) -> None:
        if not is_sealed(src):
            super().copy_block(src, dst)
            return
        for layer, (keys, values) in self._decoded(src).items():
            self.keys[layer][dst].copy_(keys[0])
            self.values[layer][dst].copy_(values[0])

    def _decoded(self, block_id: int) -> dict[int, tuple[Tensor, Tensor]]:
        """Decoded keys, values `[1, block_size, H, D]` of sealed entry `block_id`, per position's layer."""
        slots = index_per_layer([sealed_id_of(block_id)], self.geometry)
        return {layer: self.sealed.read(layer, slots[layer], self.geometry.dtype) for layer in self._heads}

    def place_layer(self, layer: int, device: torch.device) -> None:
        """As `BlockPool.place_layer`; the layer's sealed pieces follow (nothing of it is sealed yet)."""
        with self._lock:
            super().place_layer(layer, device)
            self.sealed.place_layer(layer, device)

    # ------------------------------------------------------------------ data

    def gather_blocks(self, layer: int, block_ids: Tensor) -> tuple[Tensor, Tensor]:
        """As `BlockPool.gather_blocks`, block-table entries of either kind: sealed ones decoded."""
        sealed = block_ids < 0
        keys, values = super().gather_blocks(layer, block_ids.clamp(min=0))  # sealed rows overwritten below
        if bool(sealed.any()):
            decoded_k, decoded_v = self.read_sealed(layer, block_ids[sealed], self.geometry.dtype)
            keys[sealed], values[sealed] = decoded_k, decoded_v
        return keys, values

    def read_sealed(self, layer: int, block_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Decoded keys, values `[n, block_size, H, D]` of sealed block-table entries long `[n]` (all < 0)."""
        return self.sealed.read(layer, -1 - block_ids, dtype)

    def sealed_stats(self) -> SealedStats:
        with self._lock:
            return self.sealed.stats()

    def stats(self) -> QuantizedPoolStats:
        """The full-precision blocks' `PoolStats`, the sealed store's, and `bytes_held`: what `max_bytes` bounds."""
        with self._lock:
            full, sealed = super().stats(), self.sealed.stats()
            return QuantizedPoolStats(
                **{f.name: getattr(full, f.name) for f in fields(full)},
                sealed=sealed,
                overflow_blocks=self.overflow_blocks,
            )
