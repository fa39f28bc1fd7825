"""The hf_kvgov eviction attention, registered with transformers as ``"kvgov_evict"``.

An eviction cache (`HeavyHitterCache`, `SinkCache`) puts an `EvictionView` into the kwargs dict that
transformers splats into the attention call; this function attends over the view's slots with per-head
validity and hands the attention mass back to the cache. Without a view (any other cache) it runs sdpa on
the K/V and mask it was given, so switching a model to it never breaks other caches.

The mask registered with it is transformers' own ``sdpa_mask``: an eviction cache reports
``get_mask_sizes(q) = (q, tokens seen)``, so the mask transformers builds is the causal + padding mask of
the new tokens alone, O(q^2) however long the stream. Registration uses the public ``register`` API and
only adds a name; `eviction_attention(model)` switches one model and restores its implementation on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_kvgov.engine.slots.view import ATTENTION_NAME, VIEW_KEY, EvictionView
from hf_kvgov.hf.attention import sdpa_over_given_kv
from hf_kvgov.hf.compat import AttentionInterface, AttentionMaskInterface, attention_implementation, sdpa_mask

_registered = False


def eviction_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature; returns ``([batch, q_len, q_heads, head_dim], None)``."""
    if kwargs.get("s_aux") is not None:
        raise ValueError(f"Attention sinks given as learned logits (s_aux) are not supported by {ATTENTION_NAME}.")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    view: EvictionView | None = kwargs.get(VIEW_KEY)
    if view is None:
        return _sdpa(query, key, value, attention_mask, scale, softcap), None
    return view.attend(query, attention_mask, scale, softcap), None


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Plain attention for caches that are not eviction caches: ``[batch, q_len, q_heads, head_dim]``."""
    return sdpa_over_given_kv(query, key, value, mask, scale, softcap, ATTENTION_NAME)


def register() -> str:
    """Make ``"kvgov_evict"`` known to transformers (idempotent); returns the name."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, eviction_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        _registered = True
    return ATTENTION_NAME


def use_eviction_attention(model: Any) -> str:
    """Switch ``model`` to the eviction attention; returns the implementation it had before."""
    previous = attention_implementation(model.config)
    model.set_attn_implementation(register())
    return previous


@contextlib.contextmanager
def eviction_attention(model: Any) -> Iterator[Any]:
    """``with eviction_attention(model): model.generate(..., cache=HeavyHitterCache(model))``.

    Restores the model's previous attention implementation on exit, even after an exception.
    """
    previous = use_eviction_attention(model)
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)
