"""Eviction caches whose kept slots are stored quantized (``codec=``), on tiny models.

The reference for quantized slots is independent of the slot store: `FakeQuantReferenceH2O` is the masking
H2O reference of test_eviction_reference run over a DynamicCache that holds every token in float32, with
the K/V of earlier steps' tokens replaced at read time by ``decode(encode(x))``, each (token, head) its own
group. Quantizing a token is deterministic, so re-quantizing the float tokens every step reads exactly
what a cache that stored the codes once reads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from hf_kvgov import HeavyHitterCache, SinkCache, eviction_attention
from hf_kvgov.codecs import Int8Codec, KVCodec, get_codec
from hf_kvgov.engine.quant_config import QuantConfig
from tests.conftest import tiny_llama
from tests.eviction.test_eviction_reference import (
    ReferenceH2O,
    generate,
    one_layer_llama,
    sharp_llama,
    streaming_reference,
)

REFERENCE_NAME = "kvgov_test_h2o_fake_quant_reference"


def round_trip(codec: KVCodec, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, h, t, d]`` through the codec with one group per token (the codec's value grouping)."""
    encoded = codec.encode_values(x.transpose(1, 2).float())  # [b, t, h, d]: groups along d per (token, head)
    return codec.decode(encoded, torch.float32).transpose(1, 2)


class FakeQuantReferenceH2O(ReferenceH2O):
    """The masking H2O reference reading earlier steps' tokens through the codec (see the module docstring)."""

    def __init__(self, budget: int, recent: int, codec: KVCodec) -> None:
        super().__init__(budget, recent)
        self.codec = codec

    def attention(self, module: Any, query, key, value, attention_mask, scaling=None, **kwargs):  # type: ignore[no-untyped-def]
        old = key.shape[2] - query.shape[2]  # tokens of earlier steps
        if old == 0:
            return super().attention(module, query, key, value, attention_mask, scaling, **kwargs)
        keys = torch.cat((round_trip(self.codec, key[:, :, :old]), key[:, :, old:]), dim=2)
        values = torch.cat((round_trip(self.codec, value[:, :, :old]), value[:, :, old:]), dim=2)
        return super().attention(module, query, keys, values, attention_mask, scaling, **kwargs)


@pytest.fixture()
def use_reference():  # type: ignore[no-untyped-def]
    """Yields a function switching a model to a reference's attention; restores the model afterwards."""
    switched: list[tuple[Any, str]] = []

    def use(model: Any, reference: ReferenceH2O) -> ReferenceH2O:
        AttentionInterface.register(REFERENCE_NAME, reference.attention)
        AttentionMaskInterface.register(REFERENCE_NAME, sdpa_mask)
        switched.append((model, model.config._attn_implementation))
        model.set_attn_implementation(REFERENCE_NAME)
        return reference

    yield use
    for model, previous in reversed(switched):
        model.set_attn_implementation(previous)


def padded_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (2, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # row 1 is left-padded
    return {"input_ids": ids, "attention_mask": mask}


# ------------------------------------------------------------------ codec=None is the cache as it was


@pytest.mark.parametrize(("budget", "recent"), [(8, 4), (6, 1)])
def test_codec_none_equals_the_masking_reference_and_the_default(use_reference, budget: int, recent: int) -> None:  # type: ignore[no-untyped-def]
    model, inputs = sharp_llama(), padded_batch()
    explicit, default = HeavyHitterCache(model, budget, recent, codec=None), HeavyHitterCache(model, budget, recent)
    with eviction_attention(model):
        got = generate(model, explicit, inputs, max_new_tokens=12, min_new_tokens=12)
        again = generate(model, default, inputs, max_new_tokens=12, min_new_tokens=12)
    use_reference(model, ReferenceH2O(budget, recent))
    expected = generate(model, DynamicCache(), inputs, max_new_tokens=12, min_new_tokens=12)
    assert torch.equal(got.sequences, expected.sequences) and torch.equal(got.sequences, again.sequences)
    for got_step, again_step, expected_step in zip(got.logits, again.logits, expected.logits, strict=True):
        assert torch.equal(got_step, again_step)
        torch.testing.assert_close(got_step, expected_step, atol=1e-5, rtol=1e-5)
    stats = explicit.stats()
    assert stats.codec is None and stats.kv_bytes == 2 * 2 * 2 * budget * (2 * 16 * 4)


def test_sink_codec_none_matches_streaming_positions() -> None:
    model = one_layer_llama()
    ids = torch.randint(3, 96, (1, 120), generator=torch.Generator().manual_seed(6))
    cache = SinkCache(model, n_sink=4, window=12, codec=None)
    with eviction_attention(model), torch.inference_mode():
        logits = torch.cat([model(ids[:, s : s + 7], cache=cache).logits[0] for s in range(0, 120, 7)])
        for t in (30, 63, 119):
            expected = streaming_reference(model, ids, t, t - t % 7, n_sink=4, window=12)
            torch.testing.assert_close(logits[t], expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ quantized slots against the reference


@pytest.mark.parametrize("codec", ["int8", "fp8_e4m3"])
def test_quantized_h2o_matches_the_fake_quant_reference(use_reference, codec: str) -> None:  # type: ignore[no-untyped-def]
    model, inputs = sharp_llama(), padded_batch()
    cache = HeavyHitterCache(model, budget=8, recent=4, codec=codec)
    with eviction_attention(model):
        got = generate(model, cache, inputs, max_new_tokens=16, min_new_tokens=16)
    reference = use_reference(model, FakeQuantReferenceH2O(8, 4, get_codec(codec)))
    expected = generate(model, DynamicCache(), inputs, max_new_tokens=16, min_new_tokens=16)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        torch.testing.assert_close(got_step, expected_step, atol=1e-4, rtol=1e-4)
    for index, layer in enumerate(cache.layers):
        for row, pad in enumerate((0, 5)):
            for head in range(2):
                alive = reference.alive[index][row, head].nonzero().flatten() - pad
                positions = layer.positions[row, head][layer.valid[row, head]]  # type: ignore[attr-defined]
                assert positions.tolist() == alive.tolist()
    assert cache.stats().codec == codec


@pytest.mark.parametrize(
    ("codec", "codec_name"),
    [("int8", "int8"), ("int4", "int4"), ("int2", "int2"), ("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")],
)
def test_kept_slots_read_as_the_round_trip_of_the_full_precision_tokens(codec: str, codec_name: str) -> None:
    # Layer 0's K/V depend only on the tokens, so DynamicCache holds exactly the float K/V the cache encoded.
    # A sink cache keeps the same positions whatever the precision; gathering the round trip of DynamicCache's
    # K/V at the kept positions must give exactly what the quantized cache reads.
    model = tiny_llama(num_kv_heads=2)
    ids = torch.randint(3, 96, (2, 40), generator=torch.Generator().manual_seed(1))
    cache, dynamic = SinkCache(model, n_sink=2, window=9, codec=codec), DynamicCache()
    with torch.inference_mode():
        with eviction_attention(model):
            for start in range(0, 40, 6):
                model(ids[:, start : start + 6], cache=cache)
        for start in range(0, 40, 6):  # the same chunks: the same matmul shapes, bit for bit the same K/V
            model(ids[:, start : start + 6], cache=dynamic)
    reference = get_codec(codec_name)
    assert cache.stats().codec == codec_name
    full_keys, full_values = dynamic.layers[0].keys, dynamic.layers[0].values
    layer = cache.layers[0]
    keep = layer.positions  # type: ignore[attr-defined]
    index = keep[..., None].expand(-1, -1, -1, 16)
    assert keep[0, 0].tolist() == [0, 1, *range(31, 40)]
    expected_keys = round_trip(reference, full_keys).gather(2, index)
    expected_values = round_trip(reference, full_values).gather(2, index)
    assert torch.equal(layer.keys, expected_keys)
    assert torch.equal(layer.values, expected_values)
    assert not torch.equal(layer.keys, full_keys.gather(2, index))  # the slots really are quantized


def test_eviction_gathers_codes_and_encodes_each_token_once(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded_tokens: list[int] = []
    original = Int8Codec.encode_values

    def counting(self: Int8Codec, v: torch.Tensor) -> Any:
        encoded_tokens.append(int(v.shape[2]))  # [b, h, slots, 1, d]: the slots being encoded
        return original(self, v)

    monkeypatch.setattr(Int8Codec, "encode_values", counting)
    model = sharp_llama()
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = HeavyHitterCache(model, budget=10, recent=3, codec="int8")
    with eviction_attention(model), torch.inference_mode():
        model(ids[:, :12], cache=cache)
        before = [(layer.store, layer.positions.clone()) for layer in cache.layers]  # type: ignore[attr-defined]
        model(ids[:, 12:17], cache=cache)
    # Each step encodes its new tokens only: keys and values, in both layers.
    assert encoded_tokens == [12] * 4 + [5] * 4
    for (store, positions), layer in zip(before, cache.layers, strict=True):
        after, kept = layer.store, layer.positions  # type: ignore[attr-defined]
        for head in range(2):
            for slot, position in enumerate(kept[0, head].tolist()):
                if position >= 12:
                    continue  # a token of the second step, encoded in it
                old = positions[0, head].tolist().index(position)
                for name in ("keys", "values"):
                    new_codes, old_codes = getattr(after, name), getattr(store, name)
                    assert torch.equal(new_codes.codes[0, head, slot], old_codes.codes[0, head, old])
                    assert torch.equal(new_codes.scale[0, head, slot], old_codes.scale[0, head, old])
                    assert torch.equal(new_codes.zero[0, head, slot], old_codes.zero[0, head, old])


def test_reorder_moves_codes_and_scales_with_their_rows() -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=4, recent=2, codec="int4")
    ids = torch.randint(3, 96, (3, 7), generator=torch.Generator().manual_seed(5))
    with eviction_attention(model):
        model(ids, cache=cache)
    before = [(layer.keys.clone(), layer.values.clone(), layer.store.keys.scale.clone()) for layer in cache.layers]  # type: ignore[union-attr, attr-defined]
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    for layer, (keys, values, scale) in zip(cache.layers, before, strict=True):
        assert torch.equal(layer.keys, keys[[2, 0, 0]]) and torch.equal(layer.values, values[[2, 0, 0]])
        assert torch.equal(layer.store.keys.scale, scale[[2, 0, 0]])  # type: ignore[attr-defined]
    cache.batch_repeat_interleave(2)
    assert torch.equal(cache.layers[0].keys, before[0][0][[2, 2, 0, 0, 0, 0]])


# ------------------------------------------------------------------ bytes held


# tiny Llama: 2 layers, 2 KV heads, head_dim 16; a batch of 2 rows keeping BUDGET slots per (row, head).
BUDGET = 6
SLOT_HEADS = 2 * 2 * 2 * BUDGET  # layers x rows x heads x slots


@pytest.mark.parametrize(
    ("codec", "slot_bytes"),
    [
        ("int8", 2 * (16 + 2 + 2)),  # K and V: 16 one-byte codes + float16 scale + float16 zero point
        ("int4", 2 * (8 + 2 + 2)),  # 16 codes two per byte
        ("int2", 2 * (4 + 2 + 2)),  # 16 codes four per byte
        ("fp8", 2 * (16 + 2)),  # no zero point
        ("fp8_e5m2", 2 * (16 + 2)),
        (QuantConfig(bits=8, group_size=8), 2 * (16 + 2 * (2 + 2))),  # two scale groups per slot
    ],
    ids=["int8", "int4", "int2", "fp8", "fp8_e5m2", "int8-groups-of-8"],
)
def test_kv_bytes_are_the_codes_and_scales_held(codec: Any, slot_bytes: int) -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=BUDGET, recent=2, codec=codec)
    with eviction_attention(model):
        model(torch.randint(3, 96, (2, 15), generator=torch.Generator().manual_seed(0)), cache=cache)
    stats = cache.stats()
    assert stats.slots == BUDGET
    assert stats.kv_bytes == SLOT_HEADS * slot_bytes
    assert stats.metadata_bytes == SLOT_HEADS * (8 + 1 + 4)  # positions, validity, mass
    assert stats.bytes_used == stats.kv_bytes + stats.metadata_bytes


def test_full_precision_layers_store_float_slots() -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=BUDGET, recent=2, codec=QuantConfig(bits=8, full_precision_layers=(0,)))
    with eviction_attention(model):
        model(torch.randint(3, 96, (2, 15), generator=torch.Generator().manual_seed(0)), cache=cache)
    dense_layer = 2 * 2 * BUDGET * (2 * 16 * 4)  # float32 K + V
    int8_layer = 2 * 2 * BUDGET * 2 * (16 + 2 + 2)
    assert cache.stats().kv_bytes == dense_layer + int8_layer
    assert cache.stats().codec == "int8"


# ------------------------------------------------------------------ what codec= accepts


@pytest.mark.parametrize(
    ("codec", "error", "message"),
    [
        ("int3", ValueError, "unknown codec 'int3'; the accepted names are int8, int4, int2, fp8, fp8_e4m3, fp8_e5m2"),
        (8, TypeError, "codec must be None, a codec name (int8, int4, int2, fp8, fp8_e4m3, fp8_e5m2) or a QuantConfig"),
        (QuantConfig(residual=16), ValueError, "cannot honour QuantConfig(residual=16): an eviction cache"),
        (QuantConfig(sink_blocks=0), ValueError, "cannot honour QuantConfig(sink_blocks=0): it stores slots"),
        (QuantConfig(full_precision_layers=(2,)), ValueError, "full_precision_layers [2] are not layers of this"),
        (QuantConfig(bits=4, group_size=32), ValueError, "group_size=32 does not divide head_dim=16"),
    ],
)
def test_bad_codecs_are_refused_with_a_sentence(codec: Any, error: type, message: str) -> None:
    with pytest.raises(error) as raised:
        HeavyHitterCache(tiny_llama(), budget=8, codec=codec)
    assert message in str(raised.value)
    with pytest.raises(error):
        SinkCache(tiny_llama(), n_sink=2, window=6, codec=codec)
