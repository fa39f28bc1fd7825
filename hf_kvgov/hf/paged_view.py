"""What `PagedCache(attention="paged")` hands the attention for one layer: the pool's tensors and
the batch's block table, read in place by decode steps and gathered once by a prefill."""

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
        if query.shape[2] > 1:
            return self._prefill(query, mask, scale, softcap)
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

    def _prefill(
        self, query: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
    ) -> torch.Tensor:
        """Prefill (many queries): a fast backend that serves it (flash-attn) reads the blocks in place;
        otherwise gather the blocks once and run sdpa, which is exact and far faster on every device than
        the block-chunked reference at O(queries x chunk) scores; decode steps, where the gather would
        dominate, read the blocks in place."""
        if softcap is not None or dispatch.choose_backend(query, self.key_cache, mask) != "torch":
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
        batch, blocks = self.block_table.shape
        shape = (batch, blocks * self.key_cache.shape[1], *self.key_cache.shape[2:])
        keys = (
            self.key_cache.index_select(0, self.block_table.reshape(-1))
            .view(shape)[:, : self.kv_length]
            .transpose(1, 2)
        )
        values = (
            self.value_cache.index_select(0, self.block_table.reshape(-1))
            .view(shape)[:, : self.kv_length]
            .transpose(1, 2)
        )
        q_len = query.shape[2]
        if mask is None and q_len != self.kv_length:  # causal, with the queries at the end
            mask = torch.ones(q_len, self.kv_length, dtype=torch.bool, device=query.device).tril(self.kv_length - q_len)
        group = query.shape[1] // keys.shape[1]
        if group > 1:
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, is_causal=mask is None
        )
        return out.transpose(1, 2)
