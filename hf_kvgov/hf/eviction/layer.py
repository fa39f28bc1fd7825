"""`EvictionLayer`: one decoder layer of an eviction cache, its kept slots and their metadata.

A slot is one kept token of one (sequence, KV head)::

    store          K/V of the slots (`slot_store`): dense [batch, kv_heads, slots, head_dim], or codes + scales
    positions      long  [batch, kv_heads, slots]   the RoPE position each key was rotated at
    valid          bool  [batch, kv_heads, slots]   False: left padding or an empty filler slot
    scores         float [batch, kv_heads, slots]   accumulated attention mass (policies that rank by it)

The layer is bookkeeping only; the owning `EvictionCache` runs each step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_kvgov.engine.slots.slot_store import DenseFormat, OwnSlots, SlotFormat, SlotHome, SlotStore
from hf_kvgov.hf.compat import CacheLayerMixin

if TYPE_CHECKING:
    from hf_kvgov.engine.slots.recall import LayerRecall
    from hf_kvgov.hf.eviction.cache import EvictionCache
    from hf_kvgov.policies.query_forecast import QueryStatistics


class EvictionLayer(CacheLayerMixin):
    """One decoder layer's kept slots (see the module docstring).

    ``keys`` and ``values`` read the store: ``[batch, kv_heads, slots, head_dim]`` as attention reads them
    (decoded when the layer stores codes), or None before the first step.
    """

    is_compileable = False
    is_croppable = False  # evicted tokens cannot come back, so a rollback would not restore the state
    is_sliding = False
    supports_early_init = False

    def __init__(
        self, owner: EvictionCache, index: int, window: int | None = None, slot_format: SlotFormat | None = None
    ) -> None:
        self.home: SlotHome = OwnSlots()  # with a pool: the blocks the slots live in between steps
        super().__init__()
        self.owner = owner
        self.index = index
        # A sliding-window layer: a query at position q reads keys at positions > q - window only.
        self.window = window
        self.is_sliding = window is not None
        self.slot_format: SlotFormat = DenseFormat() if slot_format is None else slot_format
        self.positions: Tensor | None = None
        self.valid: Tensor | None = None
        self.scores: Tensor | None = None
        self.seen = 0
        self.recall: LayerRecall | None = None  # the pages of evicted tokens, when the cache recalls them
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

    def _drop_slots(self) -> None:
        self.home.release()

    @property
    def batch(self) -> int:
        """Sequences the layer holds slots for (0 before the first step)."""
        return self.home.batch

    # transformers' CacheLayerMixin declares keys/values as attributes and sets them to None on init; here
    # they are views of the store, and only None (no slots) may be assigned.
    @property
    def keys(self) -> Tensor | None:
        return None if self.store is None else self.store.read()[0]

    @keys.setter
    def keys(self, value: Tensor | None) -> None:
        self._clear_only(value, "keys")

    @property
    def values(self) -> Tensor | None:
        return None if self.store is None else self.store.read()[1]

    @values.setter
    def values(self, value: Tensor | None) -> None:
        self._clear_only(value, "values")

    def _clear_only(self, value: Tensor | None, name: str) -> None:
        if value is not None:
            raise AttributeError(
                f"EvictionLayer.{name} reads the layer's slot store and cannot be assigned a tensor; the cache "
                "stores slots when a step commits."
            )
        self._drop_slots()

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True  # the slots are created by the first commit

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner.stage(self, key_states, value_states, kwargs.get("kwargs"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

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

    def reset(self) -> None:
        recall = getattr(self, "recall", None)  # transformers' layer init may reset before it is set
        if recall is not None:
            recall.reset()
        self._drop_slots()
        self.positions = self.valid = self.scores = None
        self.query_stats = None
        self.seen = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]``, every per-slot tensor (mass included) with it."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.batch and self.positions is not None:
            rows = torch.arange(self.batch, device=self.positions.device)
            self._select_rows(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select_rows(torch.as_tensor(indices))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                f"{type(self.owner).__name__} cannot crop {abs(tokens_to_remove)} token(s): tokens it evicted cannot "
                "be restored, so the cache would not return to its earlier state. Assisted and prompt-lookup "
                "decoding need a croppable cache such as DynamicCache or PagedCache."
            )

    def _select_rows(self, rows: Tensor) -> None:
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
        if self.index == 0 and shared is not None:  # the matched prefix is the cache's, reindexed once
            shared.select_rows(rows)
