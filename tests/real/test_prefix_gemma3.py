"""Prefix sharing on Gemma-3-270M (15 of 18 layers slide over 512 tokens), over a pool with layer groups:
later requests on one document compute only their question and answer exactly as without sharing."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import PagedCache, QuantizedCache, prefix_tree

pytestmark = pytest.mark.real_model


def test_document_qa_reuses_the_document_and_answers_exactly(gemma3, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = gemma3
    document = austen_text[60000:63600]  # about 850 tokens: past the sliding layers' 512-token window
    asks = ["Who is speaking?", "Where does this happen, and what time of day is it?"]
    prompts = [tokenizer(f"{document}\n\n{q}\nAnswer:", return_tensors="pt") for q in asks]
    tree = prefix_tree(model)
    assert len(tree.pool.groups) == 6  # five groups of three sliding layers, one of the three full layers
    computed = []
    for inputs in prompts:
        options = {"max_new_tokens": 8, "do_sample": False, "return_dict_in_generate": True, "output_logits": True}
        expected = model.generate(**inputs, cache=DynamicCache(config=model.config), **options)
        cache = PagedCache(model, prefix=tree)
        warm = cache.match(inputs["input_ids"], inputs["attention_mask"])
        computed.append(1 - cache.get_seq_length() / inputs["input_ids"].shape[1])
        got = model.generate(**warm, cache=cache, **options)
        assert torch.equal(got.sequences, expected.sequences)
        worst = max((g - e).abs().max().item() for g, e in zip(got.logits, expected.logits, strict=True))
        assert worst <= 1e-4, f"logits differ by {worst}"
        # The request's own blocks: the sliding layers hold their window, as without a tree.
        dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in expected.past_key_values.layers)
        assert cache.stats().bytes_used <= 1.05 * dynamic_bytes
        cache.publish(got.sequences)
        cache.release()
    assert computed[0] == 1.0
    assert max(computed[1:]) <= 0.15, f"later requests computed {computed[1:]} of their prompts"


def test_int8_document_qa_shares_codes_and_answers_as_without_sharing(gemma3, austen_text) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = gemma3
    document = austen_text[60000:63600]
    prompts = [tokenizer(f"{document}\n\n{q}\nAnswer:", return_tensors="pt") for q in ("Who?", "Where is it?")]
    tree = prefix_tree(model, codec="int8")
    assert len(tree.pool.groups) == 6
    for index, inputs in enumerate(prompts):
        alone = model.generate(**inputs, cache=QuantizedCache(model), max_new_tokens=8, do_sample=False)
        cache = QuantizedCache(model, prefix=tree)
        warm = cache.match(inputs["input_ids"], inputs["attention_mask"])
        computed = 1 - cache.get_seq_length() / inputs["input_ids"].shape[1]
        assert computed == 1.0 if index == 0 else computed <= 0.15
        got = model.generate(**warm, cache=cache, max_new_tokens=8, do_sample=False)
        assert torch.equal(got, alone)
        cache.publish(got)
        cache.release()
