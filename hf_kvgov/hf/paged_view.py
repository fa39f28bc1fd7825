"""What `PagedCache(attention="paged")` hands the attention for one layer: the pool's tensors and
the batch's block table, which `kernels.dispatch` hands to the fastest backend that serves the call
(flash-attn or Triton read the blocks in place on CUDA; elsewhere one layer's blocks are gathered for
sdpa; the torch reference is the specification)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_kvgov.kernels import dispatch

PAGED_VIEW_KEY = "kvgov_paged_view"


@dataclass
class PagedView:
    """What the paged attention reads for one layer: the pool's tensors and the batch's block table.

    Caches that store blocks differently (e.g. quantized) subclass it and override `attend`.
    """

    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache: torch.Tensor
    block_table: torch.Tensor  # long [batch, blocks]
    kv_length: int
    consumed: bool = False

    def attend(
        self, query: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
    ) -> torch.Tensor:
        """Attention of `query` `[batch, q_heads, q_len, head_dim]` over this layer's blocks.

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
        )
