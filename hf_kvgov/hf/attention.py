"""The hf_kvgov attention, registered with transformers as ``"kvgov"``: one implementation for every hf_kvgov cache.

A cache that attends its own way (`PagedCache(attention="paged")`'s block tables, an eviction cache's per-head
slots) puts its `AttentionView` into the kwargs transformers splats into the attention call; this function attends
through it. Without a view (any other cache) it runs sdpa on the K/V it was given, so switching a model to it never
breaks other caches. `kvgov_ragged` is the serving engine's (`ragged_attention_forward`).

Registration adds names through transformers' public `register` API and never replaces an existing entry;
`paged_attention(model)` (also named `eviction_attention`) switches one model and restores it on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hf_kvgov.engine.attention_view import ATTENTION_NAME, VIEW_KEY, AttentionView
from hf_kvgov.hf.compat import AttentionInterface, AttentionMaskInterface, attention_implementation, sdpa_mask
from hf_kvgov.kernels.ragged import RaggedStep
from hf_kvgov.kernels.reference import chunked_attention

RAGGED_ATTENTION_NAME = "kvgov_ragged"
RAGGED_STEP_KEY = "kvgov_ragged_step"
_registered = False


def kvgov_attention_forward(
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
    """transformers attention signature; returns `([batch, q_len, q_heads, head_dim], None)`."""
    view: AttentionView | None = kwargs.get(VIEW_KEY)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    if view is None:
        return sdpa_over_given_kv(query, key, value, attention_mask, scale, softcap, sinks), None
    if sinks is None:  # a view written before views took sinks still serves every model without them
        return view.attend(query, attention_mask, scale, softcap), None
    return view.attend(query, attention_mask, scale, softcap, sinks), None


def ragged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature over a packed step; returns `([1, tokens, q_heads, head_dim], None)`.

    `kvgov_ragged` is the serving engine's: one packed row of many sequences, whose `RaggedStep` (in the kwargs, as
    the paged view is) stores each layer's K/V and tells the sequences apart, so no mask is built for it.
    """
    step: RaggedStep | None = kwargs.get(RAGGED_STEP_KEY)
    if step is None:
        raise RuntimeError(
            f"The {RAGGED_ATTENTION_NAME!r} attention serves packed steps of hf_kvgov's ServingEngine only; this "
            "forward pass came without one. Close the engine (it restores the model's attention) to use the model "
            "alone."
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer_idx; the serving engine cannot tell its layer.")
    return step.attend(int(layer), query, key, value, scale, softcap, sliding_window, kwargs.get("s_aux")), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """A packed step's sequences are told apart by its `RaggedStep`, so transformers builds no mask for it."""
    return None


def sdpa_over_given_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain sdpa on the K/V transformers passed, for caches that are not ours: `[batch, q_len, q_heads, dim]`,
    so switching a model to the hf_kvgov attention never breaks other caches. Soft-capped logits and learned sinks,
    which sdpa has not, go through the torch reference's online softmax over the same K/V."""
    if softcap is not None or sinks is not None:
        length = key.shape[2]

        def read(first: int, num_blocks: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
            return key.float(), value.float()  # one chunk of one "block": the whole given K/V

        return chunked_attention(query, key.shape[1], length, length, read, scale, mask, softcap, length, sinks)
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    is_causal = mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, is_causal=is_causal
    )
    return out.transpose(1, 2).contiguous()


def register() -> str:
    """Make `ATTENTION_NAME` and `RAGGED_ATTENTION_NAME` known to transformers (idempotent); returns the first."""
    global _registered
    if not _registered:
        AttentionInterface.register(ATTENTION_NAME, kvgov_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
        AttentionInterface.register(RAGGED_ATTENTION_NAME, ragged_attention_forward)
        AttentionMaskInterface.register(RAGGED_ATTENTION_NAME, _no_mask)
        _registered = True
    return ATTENTION_NAME


def use_paged_attention(model: Any) -> str:
    """Switch `model` to the hf_kvgov attention; returns the implementation it had before."""
    previous = attention_implementation(model.config)
    model.set_attn_implementation(register())
    return previous


def restore_attention(model: Any, previous: str) -> None:
    model.set_attn_implementation(previous)


@contextlib.contextmanager
def paged_attention(model: Any) -> Iterator[Any]:
    """``with paged_attention(model): model.generate(..., cache=PagedCache(model, attention="paged"))``, or
    ``cache=HeavyHitterCache(model)``: the hf_kvgov attention, restoring the model's own on exit (even after an
    exception)."""
    previous = use_paged_attention(model)
    try:
        yield model
    finally:
        restore_attention(model, previous)


# The same attention under the name the eviction caches' examples use: it serves every hf_kvgov cache.
eviction_attention = paged_attention
use_eviction_attention = use_paged_attention
