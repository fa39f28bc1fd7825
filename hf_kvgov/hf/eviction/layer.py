"""`EvictionLayer`: transformers' cache-layer interface over one layer's kept slots (`SlotLayer`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from hf_kvgov.engine.slots.slot_layer import SlotLayer
from hf_kvgov.engine.slots.slot_store import SlotFormat
from hf_kvgov.hf.compat import CacheLayerMixin

if TYPE_CHECKING:
    from hf_kvgov.hf.eviction.cache import EvictionCache


class EvictionLayer(SlotLayer, CacheLayerMixin):
    """One decoder layer of an eviction cache: the engine's `SlotLayer`, as transformers calls a layer.

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
        SlotLayer.__init__(self, owner, index, window, slot_format)
        CacheLayerMixin.__init__(self)
        self.is_sliding = window is not None

    @property
    def cache(self) -> EvictionCache:
        """The cache whose store holds this layer (the transformers side of `owner`)."""
        return cast("EvictionCache", self.owner)

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
        self.drop_slots()

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.is_initialized = True  # the slots are created by the first commit

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.cache.stage(self, key_states, value_states, kwargs.get("kwargs"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return query_length, self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.clear()
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]``, every per-slot tensor (mass included) with it."""
        self.select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.batch and self.positions is not None:
            rows = torch.arange(self.batch, device=self.positions.device)
            self.select_rows(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        self.select_rows(torch.as_tensor(indices))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove != 0:
            raise ValueError(
                f"{type(self.cache).__name__} cannot crop {abs(tokens_to_remove)} token(s): tokens it evicted cannot "
                "be restored, so the cache would not return to its earlier state. Assisted and prompt-lookup "
                "decoding need a croppable cache such as DynamicCache or PagedCache."
            )
