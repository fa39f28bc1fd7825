"""What `PagedCache(attention="paged")` hands the attention for one layer: the pool's tensors and
the batch's block table, which `kernels.dispatch` hands to the fastest backend that serves the call
(flash-attn or Triton read the blocks in place on CUDA; elsewhere one layer's blocks are gathered for
sdpa; the torch reference is the specification)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.quantized_reference import SealedReader
from hf_kvgov.kernels.sealed_blocks import SealedBlocks


@dataclass
class PagedView:
    """What the paged attention reads for one layer: the pool's tensors and the batch's block table.

    A cache that stores blocks differently (sealed codes: `QuantizedView`) subclasses it and overrides `attend`.
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # long [batch, blocks]
    kv_length: int
    consumed: bool = False

    def attend(
        self,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of `query` `[batch, q_heads, q_len, head_dim]` over this layer's blocks (learned `sinks` as
        `AttentionView.attend`'s).

        Returns `[batch, q_len, q_heads, head_dim]`.
        """
        self.consumed = True
        return dispatch.paged_attention(
            query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.kv_length,
            scale,
            mask=mask,
            softcap=softcap,
            sinks=sinks,
        )


@dataclass
class QuantizedView(PagedView):
    """The paged attention's view of one layer whose table holds sealed (negative) entries."""

    read_sealed: SealedReader | None = None
    sealed: SealedBlocks | None = None  # the same blocks as stored, for kernels that read codes in place
    after_attend: Callable[[], None] | None = None  # the last layer seals the blocks this step filled

    def attend(
        self,
        query: torch.Tensor,
        mask: torch.Tensor | None,
        scale: float,
        softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of `query` `[batch, q_heads, q_len, head_dim]`; returns `[batch, q_len, q_heads, head_dim]`."""
        assert self.read_sealed is not None, "a QuantizedView is built with its sealed-block reader"
        self.consumed = True
        out = dispatch.quantized_paged_attention(
            query,
            self.key_cache,
            self.value_cache,
            self.block_table,
            self.kv_length,
            scale,
            self.read_sealed,
            self.sealed,
            mask=mask,
            softcap=softcap,
            sinks=sinks,
        )
        if self.after_attend is not None:
            self.after_attend()
        return out
