"""The block pool: the one object that owns physical KV memory.

Everything else in hf_kvgov holds block ids, so sharing, forking and freeing KV is reference counting on
one pool (`BlockPool` gives the memory layout, devices and thread safety).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.storage.free_ids import FifoIds, FreeIds, LowestIds
from hf_kvgov.storage.geometry import KVGeometry, check_on_device, zero_extended
from hf_kvgov.storage.layer_groups import GroupLayout, LayerGroup, single_group

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_GROWTH_BLOCKS", "BlockPool", "KVGeometry", "PoolStats", "Reclaimer"]

DEFAULT_BLOCK_SIZE = 16
DEFAULT_GROWTH_BLOCKS = 64


@dataclass(frozen=True)
class PoolStats:
    block_size: int
    capacity_blocks: int
    max_blocks: int | None
    used_blocks: int
    free_blocks: int
    bytes_reserved: int
    bytes_used: int
    bytes_per_block: int
    # Bytes holders keep beside the blocks and count against the cap (`BlockPool.charge`): an eviction cache's
    # per-slot metadata, running statistics and recall state.
    bytes_charged: int
    bytes_held: int  # every byte the cap bounds: the pool's tensors (free blocks included) + bytes_charged
    max_bytes: int | None  # the byte cap; None without one (max_tokens caps blocks only)


# A reclaimer frees up to n blocks held by someone other than a sequence (e.g. the prefix cache's
# unreferenced blocks) and returns how many it freed.
Reclaimer = Callable[[int], int]


class BlockPool:
    """Fixed-size KV blocks with reference counts, copy-on-write and growth up to an optional cap.

    Memory layout, per layer (the layout flash-attn's paged kernel reads, so no conversion is needed)::

        keys[layer]   : [capacity_blocks, block_size, num_kv_heads, head_dim]
        values[layer] : [capacity_blocks, block_size, num_kv_heads, head_dim]

        block id b  ->  keys[l][b] for every layer l      (one id spans all layers)
        slot s      ->  block s // block_size, offset s % block_size

    With layer groups (`hf_kvgov.storage.layer_groups`, for hybrid sliding-window models) a block id spans the
    `s` layers of one group instead: layers at the same position j of their groups share one tensor, so
    `keys[l]` of those layers is the same tensor object and the ids of different groups' tables never collide
    (they come from the one free list). Without groups there is one group of every layer, as above.

    A block's metadata is a reference count. Free ids are handed out oldest freed first (FIFO), or under a byte cap
    lowest first, so that free blocks gather at the end of the tensors, whose bytes a charge can take back
    (`hf_kvgov.storage.free_ids`; a prefix tree keeps the blocks it caches by holding a reference, so it does not
    depend on that order).

    Several devices: each layer's tensors live on that layer's device (`KVGeometry.layer_devices`, a model
    split with `device_map`). The pool never moves a layer's K/V to another device: a write of K/V that
    arrive elsewhere raises, and only index tensors (slots, block tables) are copied between devices.

    Bytes beside the blocks: a holder that keeps tensors of its own for what it stores in the pool (an eviction
    cache's slot positions, attention mass, running statistics, recall pages) `charge`s them, and under
    ``max_bytes`` they count against the cap with the blocks, so the cap bounds every byte the pool's users hold.

    Thread safety: metadata operations (allocate, incref, decref, copy-on-write) and writes (`write`,
    `write_blocks`) hold one re-entrant lock, so a write never lands in a tensor that another thread's resize has
    copied and is about to drop. Reads are not locked: a sequence only writes blocks it owns alone (copy-on-write
    guarantees that), shared blocks are immutable, and a resize keeps every block's data.

    Args:
        geometry: layers, KV heads, head dim, dtype and device(s) of the blocks (one device per layer when
            `geometry.layer_devices` is set).
        block_size: tokens per block (any positive int; flash-attn 2 needs a multiple of 256).
        max_tokens / max_bytes: optional cap on the pool's size (at most one). Asking for more blocks than
            the cap allows raises `PoolExhausted`; nothing is ever overwritten. ``max_bytes`` also bounds the
            bytes charged beside the blocks (`charge`); ``max_tokens`` counts blocks only.
        growth_blocks: blocks added per growth step (the pool at least doubles, so growth is amortised).
        preallocate: allocate the whole cap up front (requires a cap), as a serving engine would.
        groups: layer groups of one size (see `layer_groups`); None: one group of every layer. A block then
            holds one group's layers, and the layers at one position of their groups must share a device.
    """

    def __init__(
        self,
        geometry: KVGeometry,
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        growth_blocks: int = DEFAULT_GROWTH_BLOCKS,
        preallocate: bool = False,
        groups: tuple[LayerGroup, ...] | None = None,
    ) -> None:
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(
                f"block_size must be a positive int (e.g. 16, or 256 for flash-attn 2); got {block_size!r}."
            )
        if max_tokens is not None and max_bytes is not None:
            raise ValueError("Give the pool cap as max_tokens or as max_bytes, not both.")
        if growth_blocks <= 0:
            raise ValueError(f"growth_blocks must be positive; got {growth_blocks}.")
        self.geometry = geometry
        self.block_size = block_size
        # Layer l's tensors are those of its position in its group; group 0's layers stand for the positions.
        self.layout = GroupLayout.of(groups or single_group(geometry.num_layers), geometry.num_layers)
        self.layout.check_shared(geometry.layer_device, "block memory, hence a device,")
        self.groups = self.layout.groups
        self.layers_per_block = len(self.layout.heads)
        self.bytes_per_block = geometry.bytes_per_token // geometry.num_layers * self.layers_per_block * block_size
        self.max_blocks = self._cap_in_blocks(max_tokens, max_bytes)
        self.max_bytes = max_bytes
        if preallocate and self.max_blocks is None:
            raise ValueError("preallocate=True needs a cap: pass max_tokens or max_bytes.")
        self._growth = growth_blocks
        self._lock = threading.RLock()
        self._ref: list[int] = []
        self._free: FreeIds = LowestIds() if max_bytes is not None else FifoIds()
        self._reclaimers: list[Reclaimer] = []
        self._charges: dict[object, int] = {}  # holder -> bytes it keeps beside the blocks (`charge`)
        self._charged = 0
        self._version = 0
        self._written = [False] * geometry.num_layers  # a layer that never stored K/V may still be placed
        shape = (0, block_size, geometry.num_kv_heads, geometry.head_dim)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._set_tensors(
            [torch.empty(shape, dtype=geometry.dtype, device=geometry.layer_device(layer)) for layer in self._heads],
            [torch.empty(shape, dtype=geometry.dtype, device=geometry.layer_device(layer)) for layer in self._heads],
        )
        if preallocate:
            assert self.max_blocks is not None
            self._grow(self.max_blocks)

    @property
    def _heads(self) -> tuple[int, ...]:
        """One layer per group position: the layers whose tensors are all the distinct ones."""
        return self.layout.heads

    def _set_tensors(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Per-position tensors in; `keys[l]` / `values[l]` for every layer l out (aliases within a position)."""
        self.keys = [keys[position] for position in self.layout.position]
        self.values = [values[position] for position in self.layout.position]

    def group_of(self, layer: int) -> int:
        """The index in `groups` of layer `layer`'s group."""
        return self.layout.group_of[layer]

    def _cap_in_blocks(self, max_tokens: int | None, max_bytes: int | None) -> int | None:
        if max_tokens is not None:
            if max_tokens < self.block_size:
                raise ValueError(
                    f"max_tokens={max_tokens} is smaller than one block ({self.block_size} tokens); "
                    "give at least one block's worth."
                )
            return max_tokens // self.block_size
        if max_bytes is not None:
            if max_bytes < self.bytes_per_block:
                raise ValueError(
                    f"max_bytes={max_bytes} is smaller than one block ({self.bytes_per_block} bytes at this "
                    "geometry); give at least one block's worth."
                )
            return max_bytes // self.bytes_per_block
        return None

    # ------------------------------------------------------------------ metadata

    @property
    def capacity(self) -> int:
        """Blocks physically allocated so far."""
        return len(self._ref)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out without exceeding the cap (free list + room to grow)."""
        with self._lock:
            cap = self._block_cap()
            room = math.inf if cap is None else max(0, cap - self.capacity)
            return int(min(len(self._free) + room, 2**62))

    def _block_cap(self) -> int | None:
        """The most blocks the tensors may reach: the cap in blocks, less what is charged under a byte cap."""
        if self.max_bytes is None:
            return self.max_blocks
        return (self.max_bytes - self._charged) // self.bytes_per_block

    @property
    def num_used(self) -> int:
        with self._lock:
            return self.capacity - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    @property
    def lock(self) -> threading.RLock:
        """The pool's lock: held by writers whose tensors another thread's allocation may grow meanwhile."""
        return self._lock

    def add_reclaimer(self, reclaimer: Reclaimer) -> None:
        """Register a callback asked to free blocks before the pool reports exhaustion."""
        with self._lock:
            self._reclaimers.append(reclaimer)

    def remove_reclaimer(self, reclaimer: Reclaimer) -> None:
        with self._lock:
            self._reclaimers.remove(reclaimer)

    # ------------------------------------------------------------------ bytes beside the blocks

    @property
    def bytes_charged(self) -> int:
        """Bytes every holder has charged (`charge`)."""
        return self._charged

    def charged(self, holder: object) -> int:
        """The bytes ``holder`` has charged (0 if none)."""
        with self._lock:
            return self._charges.get(holder, 0)

    @property
    def cap_bytes(self) -> int | None:
        """The cap in bytes: ``max_bytes``, or a token cap's blocks' worth; None without a cap."""
        if self.max_bytes is not None:
            return self.max_bytes
        return None if self.max_blocks is None else self.max_blocks * self.bytes_per_block

    def bytes_held(self) -> int:
        """Every byte the byte cap bounds: the block tensors (free blocks included) and the bytes charged."""
        with self._lock:
            return self.capacity * self.bytes_per_block + self._charged

    def charge(self, holder: object, nbytes: int) -> None:
        """Count ``nbytes`` that ``holder`` keeps beside the blocks, replacing what it charged before (0 ends it).

        Under ``max_bytes`` a charge that grows must fit: free blocks at the end of the tensors give their bytes
        back (ids are stable, so a free block before a live one keeps its bytes), the reclaimers are asked
        next, and otherwise `PoolExhausted` is raised with the charge unchanged. Without a byte cap the bytes
        are counted only.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"A charge is a non-negative int number of bytes; got {nbytes!r}.")
        with self._lock:
            grows = nbytes - self._charges.get(holder, 0)
            if grows > 0 and self.max_bytes is not None:
                self._give_bytes(grows)
            if nbytes:
                self._charges[holder] = nbytes
            else:
                self._charges.pop(holder, None)
            self._charged += grows

    def _give_bytes(self, extra: int) -> None:
        """Make ``extra`` more bytes fit under the byte cap by shrinking free tails (`_tails_covering`), asking the
        reclaimers when they do not cover it, or raise."""
        assert self.max_bytes is not None
        over = self.bytes_held() + extra - self.max_bytes
        if over <= 0:
            return
        blocks = -(-over // self.bytes_per_block)
        tails = self._tails_covering(over)
        for reclaim in list(self._reclaimers):
            if tails is not None:
                break
            reclaim(blocks - self._free_tail())  # what the full-precision tail lacks
            tails = self._tails_covering(over)
        if tails is None:
            raise PoolExhausted(
                blocks, self._free_tail(), self._block_cap() or self.capacity, self.block_size, beside=extra
            )
        self._release_tails(tails)

    def _tails_covering(self, nbytes: int) -> tuple[int, ...] | None:
        """The free blocks at the end of the tensors whose bytes cover `nbytes`, or None when there are too few."""
        blocks = -(-nbytes // self.bytes_per_block)
        return (blocks,) if self._free_tail() >= blocks else None

    def _release_tails(self, tails: tuple[int, ...]) -> None:
        self._release_tail(tails[0])

    def allocate(self, n: int) -> list[int]:
        """Hand out `n` blocks with reference count 1, or raise `PoolExhausted` and change nothing."""
        if n < 0:
            raise ValueError(f"Cannot allocate a negative number of blocks ({n}).")
        with self._lock:
            self._make_room(n)
            ids = [self._free.take() for _ in range(n)]
            for block_id in ids:
                assert self._ref[block_id] == 0, f"block {block_id} on the free list is referenced"
                self._ref[block_id] = 1
            self._version += 1
            return ids

    def _make_room(self, n: int) -> None:
        short = n - len(self._free)
        if short <= 0:
            return
        cap = self._block_cap()
        room = short if cap is None else min(short, cap - self.capacity)
        if room > 0:
            target = self._growth_step(room)
            if cap is not None:
                target = min(target, cap - self.capacity)
            self._grow(target)
            short = n - len(self._free)
        for reclaim in list(self._reclaimers):
            if short <= 0:
                break
            reclaim(short)
            short = n - len(self._free)  # trust the free list, not the reclaimer's count
        if short > 0:
            raise PoolExhausted(n, len(self._free), cap or self.capacity, self.block_size)

    def _growth_step(self, short: int) -> int:
        """Blocks to add when `short` more are needed, before any cap is applied.

        At least double: amortised O(1) growth. The first growth also leaves 1/8 of headroom, so the decode
        steps right after a prefill do not copy the whole pool to add one block per row.
        """
        headroom = short // 8 if self.capacity == 0 else 0
        return max(short + headroom, self._growth, self.capacity)

    def _grow(self, extra: int) -> None:
        # Pool memory outlives any one forward pass: allocate it as normal tensors even when the first
        # allocation happens under torch.inference_mode(), or later in-place writes outside it would fail.
        with torch.inference_mode(False):
            self._grow_tensors(extra)

    def _grow_tensors(self, extra: int) -> None:
        start = self.capacity
        self._resize_tensors(lambda old: zero_extended(old, extra), start)
        self._ref.extend([0] * extra)
        self._free.extend(range(start, start + extra))

    def _resize_tensors(self, resized: Callable[[torch.Tensor], torch.Tensor], keep: int) -> None:
        """Replace each position's keys, then values, by ``resized(tensor)``, one tensor at a time.

        Each old tensor is let go before the next new one is allocated, so a resize holds the new tensors and at
        most one old one (one position's keys or values), not two copies of the pool. If an allocation fails part
        way, every tensor is cut to its first ``keep`` blocks (views: the data kept, all positions the same
        length again) before the error propagates.
        """
        keys = [self.keys[h] for h in self._heads]
        values = [self.values[h] for h in self._heads]
        try:
            for tensors in (keys, values):
                for position in range(len(tensors)):
                    tensors[position] = resized(tensors[position])
                    self._set_tensors(keys, values)  # the pool's hold on the old tensor goes here
        except BaseException:
            self._set_tensors([t[:keep] for t in keys], [t[:keep] for t in values])
            raise

    def _free_tail(self, dropping: Mapping[int, int] | None = None) -> int:
        """How many blocks at the end of the tensors are free, or become free once the references counted in
        `dropping` (block id -> references) are dropped: what `_release_tail` could give back."""
        dropping = dropping or {}
        count = 0
        for block_id in range(self.capacity - 1, -1, -1):
            if self._ref[block_id] != dropping.get(block_id, 0):
                break
            count += 1
        return count

    def _release_tail(self, count: int) -> None:
        """Give back the memory of the last `count` blocks, which must be free: the tensors shrink (a copy
        of the blocks kept, as growth copies them) and those ids leave the free list.

        Freeing a block never shrinks the pool by itself: ids are stable, so a free block before a live one
        keeps its bytes. A `QuantizedBlockPool` under a byte cap calls this when its sealed store needs them.
        """
        if count <= 0:
            return
        keep = self.capacity - count
        assert all(self._ref[block_id] == 0 for block_id in range(keep, self.capacity)), "only free blocks go"
        try:
            with torch.inference_mode(False):
                self._resize_tensors(lambda old: old[:keep].clone(), keep)
        finally:  # a failed copy still leaves every tensor `keep` blocks long
            del self._ref[keep:]
            self._free.keep_below(keep)

    def incref(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a fork shares blocks instead of copying them)."""
        with self._lock:
            ids = self._checked_live(block_ids, "share")
            for block_id in ids:
                self._ref[block_id] += 1
            self._version += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; a block whose count reaches 0 returns to the free list."""
        with self._lock:
            ids = self._checked_live(block_ids, "free")
            for block_id in ids:
                self._ref[block_id] -= 1
                if self._ref[block_id] == 0:
                    self._free.put(block_id)
            self._version += 1

    def _checked_live(self, block_ids: Iterable[int], action: str) -> list[int]:
        """Validate every id before changing anything, so a bad id leaves all counts as they were."""
        ids = list(block_ids)
        remaining: dict[int, int] = {}
        for block_id in ids:
            if isinstance(block_id, bool) or not 0 <= block_id < self.capacity:
                raise ValueError(f"Cannot {action} block {block_id!r}: block ids are ints in [0, {self.capacity}).")
            remaining[block_id] = remaining.get(block_id, self._ref[block_id]) - (action == "free")
            if self._ref[block_id] <= 0 or remaining[block_id] < 0:
                raise ValueError(
                    f"Cannot {action} block {block_id}: it is free (reference count 0); it was freed twice "
                    "or never allocated."
                )
        return ids

    @property
    def version(self) -> int:
        """Changes whenever a reference count changes (callers cache derived slot tensors on it)."""
        return self._version

    def copy_on_write(self, block_id: int) -> int:
        """Return a block the caller may write: `block_id` itself if unshared, else a private copy."""
        with self._lock:
            self._checked_live([block_id], "copy")
            if self._ref[block_id] == 1:
                return block_id
            (new_id,) = self.allocate(1)
            self.copy_block(block_id, new_id)
            self.decref([block_id])
            return new_id

    def zero_blocks(self, block_ids: Sequence[int]) -> None:
        """Clear blocks of every layer (used for padding blocks, which are masked but must stay finite)."""
        with self._lock:  # as `write`
            for layer in self._heads:
                index = torch.tensor(list(block_ids), dtype=torch.long, device=self.keys[layer].device)
                self.keys[layer].index_fill_(0, index, 0)
                self.values[layer].index_fill_(0, index, 0)

    def copy_block(self, src: int, dst: int) -> None:
        for layer in self._heads:  # one copy per distinct tensor: a group's layers share ids
            self.keys[layer][dst].copy_(self.keys[layer][src])
            self.values[layer][dst].copy_(self.values[layer][src])

    # ------------------------------------------------------------------ data

    def gather_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of blocks long `[n]` of one layer: keys, values `[n, block_size, H, D]` in the pool's dtype."""
        return self.keys[layer][block_ids], self.values[layer][block_ids]

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store tokens into slots of one layer.

        Args:
            slots: long `[n]`, slot = block_id * block_size + offset (copied to the layer's device if elsewhere;
                callers on a hot path pass them there, see `BlockTables.slots_on`).
            keys, values: `[n, num_kv_heads, head_dim]` on the layer's device.
        Raises:
            ValueError: `keys` or `values` are on another device than the layer's blocks.
        """
        g = self.geometry
        with self._lock:  # a resize by another thread copies the tensors: a write must land in the ones kept
            target = self.keys[layer]
            check_on_device(layer, target.device, "keys", keys)
            check_on_device(layer, target.device, "values", values)
            flat_shape = (-1, g.num_kv_heads, g.head_dim)
            slots = slots if slots.device == target.device else slots.to(target.device)
            target.view(flat_shape).index_copy_(0, slots, keys.to(g.dtype))
            self.values[layer].view(flat_shape).index_copy_(0, slots, values.to(g.dtype))
            self._written[layer] = True

    def write_blocks(self, layer: int, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store whole blocks of one layer (and the layers sharing its tensors): `keys`/`values` ``[n, block_size,
        kv_heads, head_dim]`` into the blocks `block_ids` (long ``[n]``), as a tier restores them. Copied to the
        layer's device; under the lock, as `write`."""
        with self._lock:
            target = self.keys[layer]
            index = block_ids.to(target.device)
            target.index_copy_(0, index, keys.to(target.device, self.geometry.dtype))
            self.values[layer].index_copy_(0, index, values.to(target.device, self.geometry.dtype))
            self._written[layer] = True

    def gather(self, layer: int, block_table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K/V of the first `length` tokens of each row.

        Args:
            block_table: long `[batch, num_blocks]`, with num_blocks * block_size >= length; best on the layer's
                device (`BlockTables.tensor(device)`), else it is copied there.
        Returns:
            keys, values: `[batch, num_kv_heads, length, head_dim]` on the layer's device (a transposed view of a
            fresh copy).
        """
        batch, num_blocks = block_table.shape
        g = self.geometry
        if block_table.device != self.keys[layer].device:
            block_table = block_table.to(self.keys[layer].device)
        # index_select on the flattened table copies whole blocks ~3x faster on CPU than advanced indexing.
        shape = (batch, num_blocks * self.block_size, g.num_kv_heads, g.head_dim)
        keys = self.keys[layer].index_select(0, block_table.reshape(-1)).view(shape)[:, :length].transpose(1, 2)
        values = self.values[layer].index_select(0, block_table.reshape(-1)).view(shape)[:, :length].transpose(1, 2)
        return keys, values

    # ------------------------------------------------------------------ placement

    def layer_device(self, layer: int) -> torch.device:
        """The device holding layer `layer`'s blocks (the device its tensors report)."""
        return self.keys[layer].device

    def is_written(self, layer: int) -> bool:
        """True once K/V were written to layer `layer` (from then on it can no longer be placed)."""
        return self._written[layer]

    def place_layer(self, layer: int, device: torch.device) -> None:
        """Put layer `layer`'s blocks on `device` before the layer has stored anything.

        For a cache that learns each layer's device from the first K/V the layer stores: until then the
        layer's blocks hold only the zeros they were allocated with, so placing them moves no data.

        Raises:
            ValueError: the layer already holds K/V (moving those would copy blocks across devices).
        """
        device = torch.device(device)
        with self._lock:
            sharing = self.layout.sharing(layer)
            written = [other for other in sharing if self._written[other]]
            if written:
                holder = f"Layer {layer}" if written == [layer] else (
                    f"Layer {written[0]}, whose blocks layer {layer} shares (one position of their layer groups),"
                )  # fmt: skip
                raise ValueError(
                    f"{holder} already stores K/V on {self.keys[layer].device}; the pool does not move blocks "
                    f"between devices, so it cannot place the layer on {device} now."
                )
            self._place_tensors(layer, device)
            for other in sharing:
                self.geometry = self.geometry.with_layer_device(other, device)

    def _place_tensors(self, layer: int, device: torch.device) -> None:
        position = self.layout.position[layer]
        with torch.inference_mode(False):
            keys = [torch.zeros_like(self.keys[h], device=device) if p == position else self.keys[h]
                    for p, h in enumerate(self._heads)]  # fmt: skip
            values = [torch.zeros_like(self.values[h], device=device) if p == position else self.values[h]
                      for p, h in enumerate(self._heads)]  # fmt: skip
            self._set_tensors(keys, values)

    def stats(self) -> PoolStats:
        with self._lock:
            used = self.num_used
            return PoolStats(
                block_size=self.block_size,
                capacity_blocks=self.capacity,
                max_blocks=self.max_blocks,
                used_blocks=used,
                free_blocks=self.num_free,
                bytes_reserved=self.capacity * self.bytes_per_block,
                bytes_used=used * self.bytes_per_block,
                bytes_per_block=self.bytes_per_block,
                bytes_charged=self._charged,
                bytes_held=self.bytes_held(),
                max_bytes=self.max_bytes,
            )

    def free_ids(self) -> Sequence[int]:
        """Free block ids in the order they will be handed out; for tests and debugging."""
        with self._lock:
            return self._free.in_order()
