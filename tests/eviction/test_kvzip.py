"""KVzip: reconstruction scores checked against one uncached eager forward, the cache's kept slots against the
scores and budgets, and a budget that keeps everything against `DynamicCache`."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import eviction_attention
from hf_kvgov.hf.eviction.kvzip import CONTINUE_PROMPT, REPEAT_PROMPT, kvzip_cache, reconstruction_scores
from hf_kvgov.policies import GivenScores, SlotFacts
from tests.conftest import tiny_gemma3, tiny_llama

LENGTH = 24


class CharTokenizer:
    """Spells the repeat prompts as one id per character (the tiny models have no tokenizer)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + ord(c) % (self.vocab - 3) for c in text]


class ChatCharTokenizer(CharTokenizer):
    """As CharTokenizer, with a chat template whose assistant turn opens with "</u><a>"."""

    chat_template = "a template"

    def apply_chat_template(self, messages: list[dict[str, str]], **options: Any) -> str:
        assert options["add_generation_prompt"] and not options["tokenize"]
        return "<u>" + messages[0]["content"] + "</u><a>"


def context(model: Any, rows: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, model.config.vocab_size, (rows, LENGTH), generator=torch.Generator().manual_seed(seed))


def peaked(model: Any) -> Any:
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)  # attention as peaked as a trained model's
    return model


@pytest.mark.parametrize(("chat", "turn"), [(False, ""), (True, "</u><a>")])
def test_scores_are_the_most_attention_a_repeat_query_pays_each_token(chat: bool, turn: str) -> None:
    model = peaked(tiny_llama(num_kv_heads=2, num_heads=4))
    tokenizer = (ChatCharTokenizer if chat else CharTokenizer)(model.config.vocab_size)
    ids = context(model)
    scores = reconstruction_scores(model, tokenizer, ids, sinks=4)
    # The same from one eager forward over context + repeat, without a cache (one chunk: the softmax covers
    # every key, the sinks, the chunk and the repeat). A chat model reads the assistant turn's opening first.
    repeat = torch.tensor([[*tokenizer.encode(REPEAT_PROMPT + turn), *ids[0].tolist()]])
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(input_ids=torch.cat([ids, repeat], dim=1), output_attentions=True, use_cache=False)
    for layer, attention in enumerate(out.attentions):
        reads = attention[0, :, LENGTH:, :LENGTH]  # [heads, repeat queries, context keys]
        expected = reads.amax(dim=1).reshape(2, 2, LENGTH).amax(dim=1)
        table = scores[layer]
        assert table is not None and table.shape == (1, 2, LENGTH)
        torch.testing.assert_close(table[0], expected, rtol=1e-5, atol=1e-6)


def test_chunks_are_scored_from_their_own_repeat() -> None:
    model = peaked(tiny_llama(num_kv_heads=2, num_heads=4))
    tokenizer = CharTokenizer(model.config.vocab_size)
    ids = context(model)
    whole = reconstruction_scores(model, tokenizer, ids)
    chunked = reconstruction_scores(model, tokenizer, ids, chunk_size=10)
    for a, b in zip(whole, chunked, strict=True):
        assert a is not None and b is not None and bool((b > 0).all())
        assert not torch.allclose(a, b)  # other queries read the later chunks
    # The second chunk (tokens 10-19) is repeated after the continue prompt and tokens 2-9: its scores are the
    # most attention those queries pay tokens 10-19, their softmax over the sinks, tokens 10-19 and the repeat.
    lead = [*tokenizer.encode(CONTINUE_PROMPT), *ids[0, 2:10].tolist()]
    repeat = torch.tensor([[*lead, *ids[0, 10:20].tolist()]])
    model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = model(input_ids=torch.cat([ids, repeat], dim=1), output_attentions=True, use_cache=False)
    reads = out.attentions[1][0, :, LENGTH:]  # [heads, q, LENGTH + q]
    kept = torch.cat([reads[..., :4], reads[..., 10:20], reads[..., LENGTH:]], dim=-1)
    kept = kept / kept.sum(-1, keepdim=True)
    expected = kept[..., 4:14].amax(dim=1).reshape(2, 2, 10).amax(dim=1)
    torch.testing.assert_close(chunked[1][0, :, 10:20], expected, rtol=1e-5, atol=1e-6)  # type: ignore[index]


def test_a_left_padded_row_scores_as_if_alone() -> None:
    model = tiny_llama()
    tokenizer = CharTokenizer(model.config.vocab_size)
    ids = context(model, rows=2)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    batched = reconstruction_scores(model, tokenizer, ids, mask)
    alone = reconstruction_scores(model, tokenizer, ids[1:, 5:])
    for b, a in zip(batched, alone, strict=True):
        assert b is not None and a is not None
        torch.testing.assert_close(b[1, :, : LENGTH - 5], a[0])
        assert bool((b[1, :, LENGTH - 5 :] == 0).all())  # positions the row does not have


def test_the_cache_keeps_the_best_scored_slots_of_every_layer_under_the_total() -> None:
    model = peaked(tiny_llama(num_kv_heads=2, num_heads=4))
    tokenizer = CharTokenizer(model.config.vocab_size)
    ids = context(model, seed=3)
    scores = reconstruction_scores(model, tokenizer, ids)
    for layerwise in (False, True):
        cache = kvzip_cache(model, tokenizer, ids, budget=8, layerwise=layerwise)
        kept_per_layer = [int(layer.valid.sum()) for layer in cache.layers]
        assert sum(kept_per_layer) == 2 * 2 * 8  # layers x KV heads x budget: the uniform budget's bytes
        if layerwise:
            assert kept_per_layer == [16, 16]
        else:  # the layers' slots ranked together: each layer keeps what it wins (in whole slots per head)
            ranked = torch.stack([t[0] for t in scores if t is not None])  # [layers, heads, LENGTH]
            ranked[..., :4] = float("inf")
            won = torch.bincount(ranked.reshape(-1).topk(32).indices // (2 * LENGTH), minlength=2)
            assert kept_per_layer == [2 * round(int(n) / 2) for n in won]
            assert kept_per_layer != [16, 16]  # on this prompt the layers differ
        for layer, table in zip(cache.layers, scores, strict=True):
            assert table is not None
            ranked = table[0].clone()
            ranked[:, :4] = float("inf")  # sinks
            # Within the layer the heads share its total by score: the kept slots are its top scores.
            kept = {(h, int(p)) for h in range(2) for p in layer.positions[0, h][layer.valid[0, h]]}
            top = ranked.reshape(-1).topk(len(kept)).indices
            assert kept == {(int(i) // LENGTH, int(i) % LENGTH) for i in top}


def test_a_budget_that_keeps_everything_generates_as_dynamic_cache() -> None:
    model = tiny_llama()
    tokenizer = CharTokenizer(model.config.vocab_size)
    ids = context(model)
    question = torch.cat([ids, context(model, seed=9)[:, :6]], dim=1)
    cache = kvzip_cache(model, tokenizer, ids, budget=LENGTH)
    with eviction_attention(model), torch.inference_mode():
        got = model.generate(input_ids=question, cache=cache, max_new_tokens=6, do_sample=False)
    with torch.inference_mode():
        want = model.generate(input_ids=question, cache=DynamicCache(), max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_sliding_window_layers_keep_their_window_and_are_not_scored() -> None:
    model = tiny_gemma3()  # sliding, full, sliding; window 8
    tokenizer = CharTokenizer(model.config.vocab_size)
    ids = context(model)
    scores = reconstruction_scores(model, tokenizer, ids)
    assert scores[0] is None and scores[2] is None and scores[1] is not None
    cache = kvzip_cache(model, tokenizer, ids, budget=6)
    assert int(cache.layers[1].valid.sum()) == model.config.num_key_value_heads * 6
    with eviction_attention(model), torch.inference_mode():
        model.generate(input_ids=torch.cat([ids, ids[:, :3]], dim=1), cache=cache, max_new_tokens=3, do_sample=False)


def test_given_scores_rank_by_position_with_sinks_and_unscored_tokens_first() -> None:
    table = torch.tensor([[[0.0, 0.0, 5.0, 1.0, 9.0, 2.0]]])
    policy = GivenScores((table,), sinks=1)
    positions = torch.tensor([[[4, 0, 2, 3, 5, 7, 1]]])  # slot order is not position order; 7 was never scored
    valid = torch.ones_like(positions, dtype=torch.bool)
    priority = policy.priority(SlotFacts(layer=0), positions, valid, budget=4)
    inf = float("inf")
    assert priority.tolist() == [[[9.0, inf, 5.0, 1.0, 2.0, inf, 0.0]]]
    kept = policy.select(SlotFacts(layer=0), positions, valid, budget=4)
    assert sorted(positions.gather(-1, kept)[0, 0].tolist()) == [0, 2, 4, 7]


@pytest.mark.parametrize(
    ("facts", "table", "message"),
    [
        (SlotFacts(), torch.zeros(1, 1, 4), "facts.layer must name one of them"),
        (SlotFacts(layer=3), torch.zeros(1, 1, 4), "facts.layer must name one of them"),
        (SlotFacts(layer=0), None, "no scores for layer 0"),
        (SlotFacts(layer=0), torch.zeros(2, 1, 4), r"is for \[batch, kv_heads\] = \[2, 1\]"),
    ],
)
def test_given_scores_refuse_what_they_cannot_rank(facts: SlotFacts, table: Any, message: str) -> None:
    positions = torch.arange(4)[None, None]
    with pytest.raises(ValueError, match=message):
        GivenScores((table,), sinks=0).priority(facts, positions, torch.ones_like(positions, dtype=torch.bool), 2)


def test_kvzip_cache_sets_its_own_compression() -> None:
    model = tiny_llama()
    with pytest.raises(ValueError, match="kvzip_cache sets compress itself"):
        kvzip_cache(model, CharTokenizer(96), context(model), compress="always")
    with pytest.raises(ValueError, match=r"GivenScores.scores\[0\] must be a float tensor"):
        GivenScores((torch.zeros(3),))


def test_bad_inputs_are_refused_before_scoring() -> None:
    model, tokenizer = tiny_llama(), CharTokenizer(96)
    ids = context(model)
    with pytest.raises(ValueError, match=r"sinks must be an int >= 0 \(leading tokens always kept\); got -1"):
        kvzip_cache(model, tokenizer, ids, sinks=-1)  # it was an IndexError in the middle of the scoring
    float_ids = r"input_ids must be an integer tensor \[batch, length\] .*; got a torch.float32 tensor of shape"
    with pytest.raises(ValueError, match=float_ids):
        kvzip_cache(model, tokenizer, ids.float())


def test_a_model_without_attention_modules_is_refused_by_name() -> None:
    model = tiny_llama()
    for layer in model.model.layers:
        layer.attention = layer.self_attn  # the same module under another name
        del layer.self_attn
    with pytest.raises(ValueError, match="KVzip reads each decoder layer's attention weights from its self_attn"):
        reconstruction_scores(model, CharTokenizer(96), context(model))
