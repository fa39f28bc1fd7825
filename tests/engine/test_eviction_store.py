"""The eviction engine without a model: `EvictionStore` and its `SlotLayer`s run a step from tensors alone.

The keys are built so the choice is known by hand: every query attends almost only to the key at position
``HEAVY``, so H2O (one heavy hitter, two recent slots) keeps that position and the two newest, in every KV head.
"""

from __future__ import annotations

import pytest
import torch

from hf_kvgov.engine.slots.eviction_store import EvictionStore
from hf_kvgov.engine.slots.slot_layer import SlotLayer
from hf_kvgov.policies import H2O

KV_HEADS, QUERY_HEADS, HEAD_DIM = 2, 4, 8
HEAVY = 3


class NoRope:
    """Frequencies for a store whose policies never forecast queries: asking is a failure."""

    def of(self, layer: int) -> torch.Tensor:
        raise AssertionError(f"layer {layer}'s RoPE was asked for, but no policy forecasts queries")


def _store(windows: list[int | None], budget: int | float = 3, **options: object) -> EvictionStore:
    arguments: dict[str, object] = dict(
        codec=None, layer_budgets=None, head_budgets=None, decode_policy=None, budget_of=None, compress="always",
        recall=None, prefix=None, namespace="",
    )  # fmt: skip
    arguments.update(options)
    store = EvictionStore(
        windows, KV_HEADS, HEAD_DIM, QUERY_HEADS, NoRope(), budget,
        lambda kept: H2O(heavy=1, recent=kept - 1), 2, None, 64, **arguments,  # type: ignore[arg-type]
    )  # fmt: skip
    store.attach([SlotLayer(store, i, window) for i, window in enumerate(windows)], None, [])
    return store


def _step(store: EvictionStore, layer: SlotLayer, tokens: int, batch: int = 1) -> None:
    """One chunk of ``tokens`` new tokens whose queries all point at the key at position ``HEAVY``."""
    start = layer.seen
    keys = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM) * 0.01
    values = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM)
    direction = torch.ones(HEAD_DIM)
    if start <= HEAVY < start + tokens:
        keys[:, :, HEAVY - start] = direction * 4.0
    query = (direction * 4.0).expand(batch, QUERY_HEADS, tokens, HEAD_DIM).clone()
    positions = torch.arange(start, start + tokens).expand(batch, tokens)
    store.view(layer, keys, values, positions).attend(query, None, HEAD_DIM**-0.5, None)


def test_a_step_keeps_the_heavy_hitter_and_the_newest_slots_without_a_model() -> None:
    store = _store([None])
    (layer,) = store.slot_layers
    _step(store, layer, 10)
    assert layer.positions is not None and layer.valid is not None
    kept = sorted(layer.positions[0, 0].tolist())
    assert kept == [HEAVY, 8, 9]
    assert sorted(layer.positions[0, 1].tolist()) == [HEAVY, 8, 9]
    assert layer.seen == 10 and layer.slots == 3 and bool(layer.valid.all())

    _step(store, layer, 1)  # decode: the heavy hitter stays, the window moves on
    assert sorted(layer.positions[0, 0].tolist()) == [HEAVY, 9, 10]


def test_a_window_layer_keeps_what_its_next_query_can_read() -> None:
    store = _store([4], budget=8)
    (layer,) = store.slot_layers
    _step(store, layer, 10)
    assert layer.positions is not None
    assert sorted(layer.positions[0, 0].tolist()) == [7, 8, 9]  # window - 1: the newest, heavy hitter or not


def test_stats_count_every_byte_the_layers_hold() -> None:
    store = _store([None, None])
    for layer in store.slot_layers:
        _step(store, layer, 10, batch=2)
    stats = store.stats()
    kv = 2 * 2 * (2 * KV_HEADS * 3 * HEAD_DIM * 4)  # layers x (K and V) x float32 [2, heads, 3, dim]
    per_slot = 8 + 1 + 4  # position (long), validity (bool), mass (float32)
    metadata = 2 * 2 * KV_HEADS * 3 * per_slot
    assert (stats.kv_bytes, stats.metadata_bytes, stats.bytes_used) == (kv, metadata, kv + metadata)
    assert (stats.sequences, stats.tokens, stats.kept) == (2, 20, ((6, 6), (6, 6)))


def test_a_fraction_resolves_on_the_first_chunk_and_again_after_forget() -> None:
    store = _store([None], budget=0.5, budget_of=None)
    (layer,) = store.slot_layers
    with pytest.raises(ValueError, match="fraction"):  # of what? no basis was declared
        _step(store, layer, 10)
    store = _store([None], budget=0.5, budget_of=10)
    (layer,) = store.slot_layers
    _step(store, layer, 10)
    assert store.budget == 5 and layer.slots == 5
    layer.clear()
    store.forget()
    assert store.budget == 5 and layer.seen == 0 and layer.store is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compress": "sometimes"}, r"compress must be one of \('always', 'prefill'\); got 'sometimes'"),
        ({"query_chunk": 0}, "query_chunk must be a positive int number of queries; got 0"),
    ],
)
def test_the_store_refuses_bad_options_itself(options: dict[str, object], message: str) -> None:
    query_chunk = options.pop("query_chunk", 64)
    with pytest.raises(ValueError, match=message):
        EvictionStore(
            [None], KV_HEADS, HEAD_DIM, QUERY_HEADS, NoRope(), 3, lambda kept: H2O(heavy=1, recent=kept - 1), 2,
            None, query_chunk,  # type: ignore[arg-type]
            codec=None, layer_budgets=None, head_budgets=None, decode_policy=None, budget_of=None,
            compress=options.get("compress", "always"),  # type: ignore[arg-type]
            recall=None, prefix=None, namespace="",
        )  # fmt: skip
