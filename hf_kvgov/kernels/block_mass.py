"""The attention each block of a packed step receives: the score the serving engine's heavy-hitter eviction ranks by.

H2O keeps the tokens that collected the most attention. The engine evicts whole blocks, which every layer and KV head
share, so a block's score is the softmax probability its tokens received from every query of the step, summed over
query heads and layers (`BlockMasses`, one per step, filled layer by layer by `RaggedStep.attend`). The probabilities
are those of the attention the step computes (same scale, soft-cap and masks), recomputed here in float32 from the
gathered keys because no paged kernel hands its weights back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hf_kvgov.kernels.sinks import softmax_with_sinks

QUERY_CHUNK = 128  # queries scored at a time: memory O(heads x QUERY_CHUNK x keys) for a long prefill chunk


def attention_mass(
    query: Tensor,
    keys: Tensor,
    scale: float,
    mask: Tensor | None,
    softcap: float | None,
    block_size: int,
    sinks: Tensor | None = None,
) -> Tensor:
    """Per block, the attention probability `query` pays its keys, summed over heads and queries: `[batch, blocks]`.

    Args:
        query: `[batch, q_heads, q_len, d]`; keys: `[batch, kv_heads, length, d]` (float32).
        mask: `[batch, 1, q_len, length]` bool (True = attend); None: causal with the queries last.
        sinks: learned sink logits `[q_heads]`, which take their share of each softmax (no block's mass).
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    grouped = query.float().reshape(batch, kv_heads, q_heads // kv_heads, q_len, dim)
    mass = keys.new_zeros(batch, length)
    for first in range(0, q_len, QUERY_CHUNK):
        last = min(first + QUERY_CHUNK, q_len)
        logits = torch.einsum("bhgqd,bhld->bhgql", grouped[:, :, :, first:last], keys) * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        if mask is not None:
            visible = mask[:, :, first:last].unsqueeze(1)  # [batch, 1, 1, queries, length]
        else:
            rows = torch.arange(length - q_len + first, length - q_len + last, device=keys.device)[:, None]
            visible = torch.arange(length, device=keys.device)[None, :] <= rows
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = softmax_with_sinks(logits, sinks)
        mass += probs.nan_to_num(0.0).sum(dim=(1, 2, 3))
    blocks = -(-length // block_size)
    padded = torch.nn.functional.pad(mass, (0, blocks * block_size - length))
    return padded.view(batch, blocks, block_size).sum(dim=-1)


class BlockMasses:
    """One step's block scores: `decode` `[decoding, width]` for the decode rows (in packing order) and one
    `[blocks]` vector per prefill chunk, each summed over the layers seen so far."""

    def __init__(self, decode_rows: int, decode_width: int, chunk_blocks: list[int], device: torch.device) -> None:
        self.decode = torch.zeros(decode_rows, decode_width, device=device)
        self.chunks = [torch.zeros(blocks, device=device) for blocks in chunk_blocks]

    def per_sequence(self, decode_blocks: list[int]) -> list[Tensor]:
        """The step's scores of each sequence in packing order (decode rows cut to their own `decode_blocks`)."""
        rows = [self.decode[i, :blocks] for i, blocks in enumerate(decode_blocks)]
        return rows + self.chunks
