"""Outlier channels of cached keys: why per-token key scales fail and int8 is not free on every model.

For one layer's keys as cached, ``a[h, d] = max over tokens of |K[.., h, t, d]|``, and the outlier ratio is::

    ratio = max over (h, d) of a  /  median over (h, d) of a

Near 1-3 the channels share a scale; at 15x a per-token scale is set by the outlier and flattens the others, which
is why keys are quantized per channel. That gives the outlier a relative error like any channel's but not an
absolute one, and it dominates the logits q.k: at 4 bits a channel spanning [-30m, 30m] (m the median magnitude)
has a step of 4m, coarser than a median channel's whole value. So formats of at most `LOW_BIT_LIMIT` bits are
flagged on layers at or above `DEFAULT_OUTLIER_RATIO`, even when the scored text does not expose the damage.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from hf_kvgov.hf.paged_cache import PagedCache

DEFAULT_OUTLIER_RATIO = 10.0  # a layer at or above this is flagged in reports
LOW_BIT_LIMIT = 4  # formats with at most this many bits per code are flagged on outlier layers


def outlier_ratio(keys: Tensor) -> float:
    """Max / median per-channel magnitude of keys `[batch, kv_heads, tokens, head_dim]`."""
    if keys.dim() != 4 or keys.shape[2] == 0:
        raise ValueError(f"keys must be [batch, kv_heads, tokens, head_dim] with tokens > 0; got {tuple(keys.shape)}.")
    magnitude = keys.detach().abs().float().amax(dim=(0, 2)).flatten()  # [kv_heads * head_dim]
    median = magnitude.median()
    return float(magnitude.max() / median.clamp_min(torch.finfo(torch.float32).tiny))


def key_outlier_ratios(cache: PagedCache) -> list[float]:
    """`outlier_ratio` of every layer's keys held by a (lossless) `PagedCache` (a sliding-window layer's: the
    tokens it still holds)."""
    if cache.pool is None or cache.tables is None or cache.get_seq_length() == 0:
        raise ValueError("The cache holds no tokens yet; run the model on some text first.")
    return [outlier_ratio(cache.layer_kv(layer)[0]) for layer in range(cache.num_layers)]


def outlier_layers(ratios: Sequence[float], threshold: float = DEFAULT_OUTLIER_RATIO) -> tuple[int, ...]:
    """Layers whose key outlier ratio is at least `threshold`, the most extreme first (NaN never counts)."""
    flagged = [layer for layer, ratio in enumerate(ratios) if ratio >= threshold]
    return tuple(sorted(flagged, key=lambda layer: ratios[layer], reverse=True))


def flagged_by_outliers(bits: int, ratios: Sequence[float]) -> tuple[int, ...]:
    """The outlier layers (most extreme first) that a format of `bits` bits per code should not quantize."""
    return outlier_layers(ratios) if bits <= LOW_BIT_LIMIT else ()
