"""What an eviction cache holds: tokens seen, tokens kept per layer and KV head, bytes, codec, budgets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from hf_kvgov.engine.kv_stats import KVStats
from hf_kvgov.stats_repr import rounded_repr

if TYPE_CHECKING:
    from hf_kvgov.engine.slots.recall import RecallStats
    from hf_kvgov.engine.slots.slot_layer import SlotLayer


@dataclass(frozen=True, kw_only=True)
class EvictionStats(KVStats):
    """A snapshot of an eviction cache (`KVStats`, then its slots).

    ``kept[layer][head]`` counts the real tokens (never padding) that KV head ``head`` of layer ``layer`` keeps,
    summed over the sequences of the batch. ``slots`` is what each (sequence, head) stores, padding fillers
    included: at most ``budget`` between steps (``layer_budgets[layer]`` in each layer), except in a cache built
    with ``compress="prefill"``, which keeps the budget after the prompt and adds every later token.
    ``bytes_used`` is everything the cache holds in memory: ``kv_bytes`` (keys and values as stored: codes and
    scales when ``codec`` is set) plus ``metadata_bytes`` (positions, validity, attention mass, and a running
    forecast's query statistics) plus ``recall_bytes`` (with recall: pending pages, page summaries and tables,
    the recall buffer); what recall wrote to and read from disk is in ``recall``.
    """

    __repr__ = rounded_repr

    tokens_seen: int  # tokens processed per sequence (left padding included), as get_seq_length() reports
    budget: int | None  # None until a fraction of the prompt is resolved
    slots: int  # the most slots any layer stores per (sequence, KV head)
    kept: tuple[tuple[int, ...], ...]
    kv_bytes: int
    metadata_bytes: int
    codec: str | None = None  # the codec of the kept slots ("int8", "fp8_e4m3"...); None: the model's precision
    # Per layer, the most slots it keeps between steps: its budget (``budget`` unless ``layer_budgets`` named
    # it), at most window - 1 in a sliding-window layer; None until a fraction is resolved.
    layer_budgets: tuple[int | None, ...] = ()
    recall_bytes: int = 0
    recall: RecallStats | None = None


def layer_stats(
    layers: Sequence[SlotLayer],
    budget: int | None,
    kv_heads: int,
    codec: str | None = None,
    layer_budgets: tuple[int | None, ...] = (),
    recall: RecallStats | None = None,
) -> EvictionStats:
    """Build `EvictionStats` from the layers of one cache."""
    kv_bytes = sum(layer.kv_bytes for layer in layers)
    metadata = sum(
        _nbytes(layer.positions) + _nbytes(layer.valid) + _nbytes(layer.scores) + _statistics_bytes(layer)
        for layer in layers
    )
    recall_bytes = sum(layer.recall_bytes for layer in layers)
    held = kv_bytes + metadata + recall_bytes
    kept = tuple(_kept(layer.valid, kv_heads) for layer in layers)
    sequences = max((int(layer.valid.shape[0]) for layer in layers if layer.valid is not None), default=0)
    seen = layers[0].seen if layers else 0
    slots = max((layer.slots for layer in layers), default=0)
    tokens = sequences * seen
    return EvictionStats(
        sequences=sequences,
        tokens=tokens,
        tokens_seen=seen,
        budget=budget,
        slots=slots,
        kept=kept,
        kv_bytes=kv_bytes,
        metadata_bytes=metadata,
        bytes_used=held,
        bytes_per_token=held / tokens if tokens else 0.0,
        codec=codec,
        layer_budgets=layer_budgets,
        recall_bytes=recall_bytes,
        recall=recall,
    )


def _statistics_bytes(layer: SlotLayer) -> int:
    """Bytes of a layer's running query statistics (`QueryForecast(running=True)`), 0 without them."""
    return 0 if layer.query_stats is None else layer.query_stats.nbytes


def _kept(valid: Tensor | None, kv_heads: int) -> tuple[int, ...]:
    if valid is None:
        return (0,) * kv_heads
    return tuple(int(n) for n in valid.sum(dim=(0, 2)).tolist())


def _nbytes(tensor: Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
