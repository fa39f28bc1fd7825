"""transformers' sdpa, but reading grouped-query K/V heads in place: the check's attention on a CPU.

With a mask, which every chunk after the first has, transformers' sdpa repeats each K/V head for the query
heads that share it (`repeat_kv`) before calling torch: a copy of the whole cache, per layer and step. On a
CPU that copy costs more than the attention over a long text (about 30% of a SmolLM2 check, 3 query heads per
K/V head). torch's sdpa reads the groups in place with `enable_gqa=True`; on CUDA that flag with a mask falls
back to the math kernel, which is why transformers does not use it and why the check switches to this function
on a CPU only. Anything else (no mask, one query head per K/V head, soft-capping, position biases, learned
sinks) goes to transformers' own sdpa unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_kvgov.hf.compat import AttentionInterface, AttentionMaskInterface, attention_implementation, sdpa_mask

ATTENTION_NAME = "kvgov_grouped_sdpa"
_STOCK = "sdpa"
_NOT_HANDLED = ("softcap", "position_bias", "s_aux", "sinks")  # kwargs left to transformers' sdpa


def grouped_sdpa_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: query `[batch, q_heads, q_len, dim]`, key / value
    `[batch, kv_heads, kv_len, dim]`, mask `[batch, 1, q_len, kv_len]`; returns `[batch, q_len, q_heads, dim]`."""
    grouped = query.shape[1] != key.shape[1]
    if attention_mask is None or not grouped or any(kwargs.get(name) is not None for name in _NOT_HANDLED):
        stock = AttentionInterface()[_STOCK]
        return stock(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Make `ATTENTION_NAME` known to transformers (idempotent: `register` replaces its own entry)."""
    AttentionInterface.register(ATTENTION_NAME, grouped_sdpa_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


@contextlib.contextmanager
def grouped_sdpa_on_cpu(model: Any) -> Iterator[None]:
    """Within the block, `model` attends with `grouped_sdpa_forward` if it is on a CPU and uses sdpa."""
    previous = attention_implementation(model.config)
    device = getattr(model, "device", None)
    if previous != _STOCK or device is None or device.type != "cpu":
        yield
        return
    model.set_attn_implementation(register())
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
