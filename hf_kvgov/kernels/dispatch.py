"""One dispatch point for attention over block tables.

Today every call runs the torch reference (`kernels.reference`), which is the specification. Fast
backends (a Triton paged-decode kernel, flash-attn's `flash_attn_with_kvcache(block_table=...)`) plug in
here by name; `set_backend` overrides the choice and `last_backend()` shows what ran.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_kvgov.kernels.reference import paged_attention_reference

PagedAttentionFn = Callable[..., torch.Tensor]

BACKENDS: dict[str, PagedAttentionFn] = {"torch": paged_attention_reference}
_forced: str | None = None
_last: str | None = None


def set_backend(name: str | None) -> None:
    """Force one backend by name (None restores automatic choice)."""
    global _forced
    if name is not None and name not in BACKENDS:
        raise ValueError(f"Unknown paged attention backend {name!r}; available: {sorted(BACKENDS)}.")
    _forced = name


def last_backend() -> str | None:
    """The backend that served the latest call (for stats and debugging)."""
    return _last


def choose_backend(query: torch.Tensor) -> str:
    if _forced is not None:
        return _forced
    return "torch"


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    kv_length: int,
    scale: float,
    mask: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """See `paged_attention_reference` for shapes; returns `[batch, q_len, q_heads, head_dim]`."""
    global _last
    name = choose_backend(query)
    _last = name
    return BACKENDS[name](query, key_cache, value_cache, block_table, kv_length, scale, mask=mask, softcap=softcap)
