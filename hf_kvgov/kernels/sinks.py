"""Learned attention sinks (GPT-OSS; transformers' ``s_aux``): one logit per query head that joins every softmax's
denominator and reads no value. The online-softmax paths start their running state from it (the torch reference,
the Triton combine step); the paths that take a whole softmax at once add it as a column (`softmax_with_sinks`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def checked_sinks(sinks: Tensor, q_heads: int, device: torch.device) -> Tensor:
    """`sinks` as float32 `[q_heads]` on `device`; a `ValueError` for any other shape."""
    if tuple(sinks.shape) != (q_heads,):
        raise ValueError(f"sinks must hold one logit per query head, shape ({q_heads},); got {tuple(sinks.shape)}.")
    return sinks.to(device=device, dtype=torch.float32)


def softmax_with_sinks(logits: Tensor, sinks: Tensor | None) -> Tensor:
    """The softmax over the last dim of grouped logits `[batch, kv_heads, group, queries, keys]` (query head
    ``kv_head * group + g``), each row's denominator holding its head's sink; without sinks, the plain softmax."""
    if sinks is None:
        return logits.softmax(dim=-1)
    _, kv_heads, group, _, keys = logits.shape
    column = checked_sinks(sinks, kv_heads * group, logits.device).to(logits.dtype).view(1, kv_heads, group, 1, 1)
    return torch.cat((logits, column.expand(*logits.shape[:-1], 1)), dim=-1).softmax(dim=-1)[..., :keys]
