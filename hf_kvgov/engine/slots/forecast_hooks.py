"""The eviction view's hooks for Expected Attention: the forecast of the queries to come, and the running
query statistics a ``QueryForecast(running=True)`` forecasts from (`hf_kvgov.policies.query_forecast`).

Both are built per layer and step by `EvictionStore`, bound to the layer's RoPE (`LayerRope`); the statistics
live on the layer (`SlotLayer.query_stats`), so they follow its rows through beams and resets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import Tensor

from hf_kvgov.engine.slots.view import Forecast, QueryObserver
from hf_kvgov.policies import EvictionPolicy
from hf_kvgov.policies.query_forecast import QueryForecast, expected_attention, observe_queries
from hf_kvgov.policies.rope import LayerRope

if TYPE_CHECKING:
    from hf_kvgov.engine.slots.slot_layer import SlotLayer


def forecast_hook(layer: SlotLayer, forecast: QueryForecast, rope: LayerRope) -> Forecast:
    """The expected attention of the queries to come, with the layer's RoPE (and, for a running forecast, the
    layer's query statistics as they stand when attention calls it). Queries and keys are read in the
    ``rotate_half`` pairing the forecast turns them in (`LayerRope.split_half`)."""

    def attend(
        query: Tensor, positions: Tensor, query_valid: Tensor, keys: Tensor, values: Tensor, valid: Tensor,
        scale: float,
    ) -> Tensor:  # fmt: skip
        statistics = layer.query_stats if forecast.running else None
        query, keys = rope.split_half(query), rope.split_half(keys)
        return expected_attention(
            forecast, rope.inv_freq, query, positions, query_valid, keys, values, valid, scale, statistics
        )

    return attend


def forecasts_running(policies: Iterable[EvictionPolicy | None]) -> bool:
    """Whether one of ``policies`` (those that may evict a layer) forecasts from running statistics."""
    return any(p is not None and p.needs.forecast is not None and p.needs.forecast.running for p in policies)


def observer_hook(layer: SlotLayer, rope: LayerRope) -> QueryObserver:
    """Adds a step's queries to the layer's running statistics (every step, those that do not evict too)."""

    def observe(query: Tensor, positions: Tensor, valid: Tensor) -> None:
        layer.query_stats = observe_queries(layer.query_stats, rope.inv_freq, rope.split_half(query), positions, valid)

    return observe
