"""`PagedLayer`, one decoder layer's view of a `PagedCache`: transformers' layer interface over the store."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hf_kvgov.hf.compat import CacheLayerMixin

if TYPE_CHECKING:
    from hf_kvgov.engine.block_store import BlockStore


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a block store; the blocks themselves belong to the pool.

    ``keys`` and ``values`` read the store, as transformers' layers expose them: ``[batch, kv_heads, tokens,
    head_dim]`` (a copy: sealed blocks decoded, spilled ones read back; a sliding layer from its first kept
    block), or None while it holds no token.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: BlockStore, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0

    # transformers' CacheLayerMixin declares keys/values as attributes and sets them to None on init; here
    # they are read from the blocks, and only that None may be assigned.
    @property
    def keys(self) -> torch.Tensor | None:
        return self.owner.layer_kv(self.index)[0] if self.length > 0 else None

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._refuse_tensor(value, "keys")

    @property
    def values(self) -> torch.Tensor | None:
        return self.owner.layer_kv(self.index)[1] if self.length > 0 else None

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._refuse_tensor(value, "values")

    @staticmethod
    def _refuse_tensor(value: torch.Tensor | None, name: str) -> None:
        if value is not None:
            raise AttributeError(
                f"PagedLayer.{name} reads the layer's blocks and cannot be assigned a tensor; the cache writes "
                "blocks in `update`."
            )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner.ensure_pool(key_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner.update_layer(self, key_states, value_states, kwargs.get("kwargs"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        first = self.owner.first_kept_token(self.index, self.length)
        return self.length + query_length - first, first

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0
