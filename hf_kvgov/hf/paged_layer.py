"""`PagedLayer`, one decoder layer's view of a `PagedCache`, and the checks of the pool a cache draws from."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hf_kvgov.hf.compat import CacheLayerMixin
from hf_kvgov.storage.pool import DEFAULT_BLOCK_SIZE, BlockPool

if TYPE_CHECKING:
    from hf_kvgov.hf.paged_cache import PagedCache


class PagedLayer(CacheLayerMixin):
    """One decoder layer's view of a `PagedCache`; the blocks themselves belong to the pool."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: PagedCache, index: int) -> None:
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.owner._ensure_pool(key_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.owner._update_layer(self, key_states, value_states, kwargs.get("kwargs"))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        first = self.owner._first_kept_token(self.index, self.length)
        return self.length + query_length - first, first

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


def resolve_block_size(block_size: int | None, given: BlockPool | None) -> int:
    """The block size of a cache: the one asked for, else the given pool's, else `DEFAULT_BLOCK_SIZE`.

    A size that differs from the pool the cache draws from (its own `pool=`, or its prefix tree's) is refused
    rather than silently replaced: the caller would plan memory and kernels for blocks it does not get.
    """
    if block_size is None:
        return given.block_size if given is not None else DEFAULT_BLOCK_SIZE
    if given is not None and block_size != given.block_size:
        raise ValueError(
            f"block_size={block_size}, but the cache draws its blocks from a pool (pool= or the prefix tree's) of "
            f"{given.block_size}-token blocks; pass block_size={given.block_size} or leave it unset."
        )
    return block_size


def check_spill_pool(pool: BlockPool | None, max_tokens: int | None, max_bytes: int | None) -> None:
    """A disk tier creates its own pool, capped by what stays in memory (or draws from a prefix tree's)."""
    if pool is not None:
        raise ValueError(
            "A cache with a disk tier creates its own pool, capped by max_resident_bytes (or draws from the prefix "
            "tree's pool with prefix=); pass no pool=."
        )
    if max_tokens is not None or max_bytes is not None:
        raise ValueError(
            "With a disk tier the pool's cap is what stays in memory: give it as max_resident_bytes of the disk "
            f"settings, not as max_tokens={max_tokens} / max_bytes={max_bytes}."
        )
