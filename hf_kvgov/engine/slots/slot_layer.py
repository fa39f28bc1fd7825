"""`SlotLayer`: one layer's kept slots and their metadata, as the engine keeps them (no transformers).

A slot is one kept token of one (sequence, KV head)::

    store          K/V of the slots (`slot_store`): dense [batch, kv_heads, slots, head_dim], or codes + scales
    positions      long  [batch, kv_heads, slots]   the RoPE position each key was rotated at
    valid          bool  [batch, kv_heads, slots]   False: left padding or an empty filler slot
    scores         float [batch, kv_heads, slots]   accumulated attention mass (policies that rank by it)

The layer is bookkeeping only: its `EvictionStore` runs each step, and `hf_kvgov.hf.eviction.layer.EvictionLayer`
puts transformers' layer interface on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from hf_kvgov.engine.slots.slot_store import DenseFormat, OwnSlots, SlotFormat, SlotHome, SlotStore

if TYPE_CHECKING:
    from hf_kvgov.engine.slots.eviction_store import EvictionStore
    from hf_kvgov.engine.slots.recall import LayerRecall
    from hf_kvgov.policies.query_forecast import QueryStatistics


class SlotLayer:
    """One decoder layer's kept slots (see the module docstring).

    Args:
        owner: the store whose steps fill the layer.
        index: the decoder layer's index.
        window: a sliding-window layer's window (a query at position q reads keys at positions > q - window);
            None: the layer sees the whole context.
        slot_format: how the slots are stored (None: the model's precision).
    """

    def __init__(
        self, owner: EvictionStore, index: int, window: int | None = None, slot_format: SlotFormat | None = None
    ) -> None:
        self.home: SlotHome = OwnSlots()  # with a pool: the blocks the slots live in between steps
        self.owner = owner
        self.index = index
        self.window = window
        self.slot_format: SlotFormat = DenseFormat() if slot_format is None else slot_format
        self.positions: Tensor | None = None
        self.valid: Tensor | None = None
        self.scores: Tensor | None = None
        self.seen = 0
        self.recall: LayerRecall | None = None  # the pages of evicted tokens, when the store recalls them
        self.query_stats: QueryStatistics | None = None  # every query seen, for a running forecast

    @property
    def store(self) -> SlotStore | None:
        """The kept slots as the step's working store (read from the pool's blocks when the layer has a pool)."""
        return self.home.get()

    def hold(self, store: SlotStore, positions: Tensor, valid: Tensor, scores: Tensor | None) -> None:
        """Keep ``store``'s slots with their positions, validity and mass, ``[batch, kv_heads, slots]`` each.

        With a pool, only the valid slots are written to the layer's blocks (see ``pooled_slots``): the
        padding of a batch and the entries a head-adaptive budget leaves unused take no memory. What the layer
        keeps beside them (these tensors, running statistics, recall's pages and tables) is charged to the pool,
        so its cap bounds every byte the cache holds.
        """
        beside = sum(t.numel() * t.element_size() for t in (positions, valid, scores) if t is not None)
        beside += 0 if self.query_stats is None else self.query_stats.nbytes
        beside += 0 if self.recall is None else self.recall.own_bytes
        self.home.put(store, valid, beside)  # raises PoolExhausted, changing nothing, when a pool is full
        self.positions, self.valid, self.scores = positions, valid, scores

    def drop_slots(self) -> None:
        """Give the slots' memory back (the metadata stays until `clear`)."""
        self.home.release()

    @property
    def batch(self) -> int:
        """Sequences the layer holds slots for (0 before the first step)."""
        return self.home.batch

    @property
    def slots(self) -> int:
        return self.home.count

    @property
    def kv_bytes(self) -> int:
        """Bytes of K/V the layer holds (codes and scales when it stores them quantized; whole pool blocks)."""
        return self.home.nbytes

    @property
    def recall_bytes(self) -> int:
        """Bytes its recall holds in memory: pending pages, page summaries, page table, recall buffer."""
        return 0 if self.recall is None else self.recall.nbytes

    def clear(self) -> None:
        """Forget every slot, its metadata, recall's pages and the running statistics."""
        if self.recall is not None:
            self.recall.reset()
        self.drop_slots()
        self.positions = self.valid = self.scores = None
        self.query_stats = None
        self.seen = 0

    def select_rows(self, rows: Tensor) -> None:
        """Row i becomes old row ``rows[i]`` (long ``[new_batch]``), every per-slot tensor (mass included) with it."""
        if self.store is None or self.positions is None:
            return
        assert self.valid is not None
        rows = rows.to(self.positions.device)
        if self.recall is not None:
            self.recall.select_rows(rows)
        if self.query_stats is not None:
            self.query_stats.select_rows(rows)
        self.hold(  # after recall and statistics: the pool is charged what they hold now
            self.store.select_rows(rows),
            self.positions.index_select(0, rows),
            self.valid.index_select(0, rows),
            None if self.scores is None else self.scores.index_select(0, rows),
        )
        shared = self.owner.shared
        if self.index == 0 and shared is not None:  # the matched prefix is the store's, reindexed once
            shared.select_rows(rows)
