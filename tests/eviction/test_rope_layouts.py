"""The RoPE a cache turns keys and queries with, as each layer's cached keys show it.

`SinkCache` moves its sinks and Expected Attention turns queries back to their unrotated form. Both assumed RoPE in
the ``rotate_half`` pairing on every layer, so on Cohere and GLM (interleaved pairs) and on layers without RoPE
(SmolLM3's NoPE layers, Cohere2's full-attention layers) the sinks were read turned by a rotation the model never
applies: other tokens than the keys as stored give, silently. The layouts now come from the model's own keys.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_kvgov import PolicyCache, SinkCache
from hf_kvgov.engine.slots.forecast_hooks import forecast_hook
from hf_kvgov.hf.eviction import eviction_attention
from hf_kvgov.policies import ExpectedAttention, LayerRope, SinkWindow, rerotate
from hf_kvgov.policies.query_forecast import QueryForecast

BASE: dict[str, Any] = {
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.5,
    "pad_token_id": 0,
}
SLIDING, FULL = "sliding_attention", "full_attention"


def _model(config: Any) -> Any:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


# family -> (config, each layer's layout: "split", "interleaved" or "none")
FAMILIES = {
    "cohere": (lambda: transformers.CohereConfig(num_hidden_layers=2, **BASE), ["interleaved"] * 2),
    "glm4, partial rotary": (
        lambda: transformers.Glm4Config(num_hidden_layers=2, head_dim=16, **BASE),
        ["interleaved"] * 2,
    ),
    "smollm3, a NoPE layer": (
        lambda: transformers.SmolLM3Config(num_hidden_layers=3, no_rope_layers=[1, 0, 1], **BASE),
        ["split", "none", "split"],
    ),
    "cohere2, full layers without RoPE": (
        lambda: transformers.Cohere2Config(
            num_hidden_layers=3, sliding_window=8, layer_types=[SLIDING, SLIDING, FULL], **BASE
        ),
        ["interleaved", "interleaved", "none"],
    ),
    "llama": (lambda: transformers.LlamaConfig(num_hidden_layers=2, **BASE), ["split"] * 2),
}


def _keys(model: Any, position: int) -> list[torch.Tensor]:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[position]]), cache=cache, use_cache=True)
    stored = [getattr(layer, "keys", None) for layer in cache.layers]
    return [keys for keys in stored if isinstance(keys, torch.Tensor)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sinks_move_as_the_model_rotates_each_layer(family: str) -> None:
    """Each layer's turn, applied to a key cached at position 3, gives the key the model caches at 23 (one token
    alone: its key before RoPE does not depend on the position)."""
    config, layouts = FAMILIES[family]
    model = _model(config())
    ropes = SinkCache(model, n_sink=4, window=8).sink_keys.ropes
    kinds = ["none" if not rope.inv_freq.any() else "interleaved" if rope.interleaved else "split" for rope in ropes]
    assert kinds == layouts
    at_3, at_23 = _keys(model, 3), _keys(model, 23)
    for rope, before, after in zip(ropes, at_3, at_23, strict=True):
        torch.testing.assert_close(rope.turn(before, torch.tensor([20])), after, rtol=1e-4, atol=1e-5)
        if rope.inv_freq.any():  # the rotate_half turn, all the caches had, is off on interleaved layers
            wrong = rerotate(before, torch.tensor([20]), rope.inv_freq)
            assert rope.interleaved != torch.allclose(wrong, after, rtol=1e-4, atol=1e-5)


def test_a_model_without_rope_on_any_layer_reads_its_sinks_as_stored() -> None:
    """On SmolLM3 with every layer NoPE a score does not depend on positions, so StreamingLLM's in-cache positions
    change nothing: `SinkCache` must equal the same sinks and window read as stored (`PolicyCache(SinkWindow)`).
    Before, its sinks were turned by RoPE and the tokens differed."""
    model = _model(transformers.SmolLM3Config(num_hidden_layers=2, no_rope_layers=[0, 0], **BASE))
    ids = torch.randint(3, 160, (1, 40), generator=torch.Generator().manual_seed(1))
    settings: dict[str, Any] = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    outputs = []
    with eviction_attention(model), torch.no_grad():
        for cache in (SinkCache(model, n_sink=4, window=8), PolicyCache(model, SinkWindow(4, 8), budget=12)):
            out = model.generate(ids, cache=cache, return_dict_in_generate=True, output_logits=True, **settings)
            assert cache.stats().tokens_seen > max(map(max, cache.stats().kept))  # the sinks did move
            outputs.append(out)
    sink, as_stored = outputs
    assert torch.equal(sink.sequences, as_stored.sequences)
    torch.testing.assert_close(torch.stack(sink.logits), torch.stack(as_stored.logits))


def test_expected_attention_reads_interleaved_pairs_as_their_split_half_reordering() -> None:
    """The forecast of an interleaved layer, given queries and keys rotated in interleaved pairs, equals the forecast
    of a rotate_half layer given the same vectors in the rotate_half pairing (scores do not depend on the channel
    order when queries and keys share it); with the rotate_half turn on interleaved keys it does not."""
    gen = torch.Generator().manual_seed(0)
    head_dim, q_heads, kv_heads, slots, q_len = 16, 4, 2, 12, 5
    inv_freq = 1.0 / (10_000 ** (torch.arange(0, 12, 2, dtype=torch.float32) / 12))  # partial rotary: 12 of 16
    split, interleaved = LayerRope(inv_freq), LayerRope(inv_freq, interleaved=True)
    positions = torch.arange(slots)
    query_positions = (torch.arange(q_len) + slots - q_len)[None]
    query = rerotate(torch.randn(1, q_heads, q_len, head_dim, generator=gen), query_positions[:, None], inv_freq)
    keys = rerotate(torch.randn(1, kv_heads, slots, head_dim, generator=gen), positions, inv_freq)
    values = torch.randn(1, kv_heads, slots, head_dim, generator=gen)
    valid, query_valid = torch.ones(1, kv_heads, slots, dtype=torch.bool), torch.ones(1, q_len, dtype=torch.bool)
    forecast = ExpectedAttention().needs.forecast
    assert isinstance(forecast, QueryForecast)

    def scores(rope: LayerRope, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return forecast_hook(None, forecast, rope)(q, query_positions, query_valid, k, values, valid, 0.25)  # type: ignore[arg-type]

    expected = scores(split, query, keys)
    paired_query, paired_keys = interleaved.interleave(query), interleaved.interleave(keys)
    torch.testing.assert_close(scores(interleaved, paired_query, paired_keys), expected)
    assert not torch.allclose(scores(split, paired_query, paired_keys), expected)


def test_keys_the_model_moves_some_other_way_are_refused_at_construction() -> None:
    """A model whose keys no layout fits (here a Llama whose rotary embedding turns every position twice as far as
    its frequencies say) is refused by the caches that turn keys or queries, and served by the others."""
    model = _model(transformers.LlamaConfig(num_hidden_layers=2, **BASE))
    rotary = model.model.rotary_emb
    forward = rotary.forward
    rotary.forward = lambda x, position_ids, **kw: forward(x, position_ids * 2, **kw)
    with pytest.raises(ValueError, match=r"SinkCache re-rotates sink keys, but layer 0's cached keys move"):
        SinkCache(model, n_sink=4, window=8)
    with pytest.raises(ValueError, match=r"PolicyCache turns queries .*, but layer 0's cached keys move"):
        PolicyCache(model, "expected_attention", budget=64)
    PolicyCache(model, "snapkv", budget=64)  # turns nothing
