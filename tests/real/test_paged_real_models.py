"""PagedCache is lossless on real trained models: same tokens as DynamicCache, logits within 1e-4."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import PagedCache, paged_attention

pytestmark = pytest.mark.real_model
PATHS = ("contiguous", "paged")


def context(model, path: str):  # type: ignore[no-untyped-def]
    return paged_attention(model) if path == "paged" else contextlib.nullcontext()


def generate(model, cache, inputs, seed: int = 0, **kwargs):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    return model.generate(**inputs, cache=cache, return_dict_in_generate=True, output_logits=True, **kwargs)


def assert_lossless(model, inputs, path: str, block_size: int = 16, **kwargs) -> None:  # type: ignore[no-untyped-def]
    expected = generate(model, DynamicCache(config=model.config), inputs, **kwargs)
    with context(model, path):
        got = generate(model, PagedCache(model, block_size=block_size, attention=path), inputs, **kwargs)  # type: ignore[arg-type]
    assert torch.equal(got.sequences, expected.sequences)
    worst = max((g - e).abs().max().item() for g, e in zip(got.logits, expected.logits, strict=True))
    assert worst <= 1e-4, f"logits differ by {worst}"


@pytest.fixture(scope="module")
def smol_prompt(smollm2, austen_text):  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    return tokenizer(austen_text[20000:21500], return_tensors="pt")


@pytest.fixture(scope="module")
def smol_batch(smollm2, austen_text):  # type: ignore[no-untyped-def]
    _, tokenizer = smollm2
    tokenizer.padding_side = "left"
    texts = [austen_text[30000:30400], austen_text[31000:32200], austen_text[33000:33100]]
    return tokenizer(texts, return_tensors="pt", padding=True)


@pytest.mark.parametrize("path", PATHS)
def test_greedy_64_tokens(smollm2, smol_prompt, path: str) -> None:
    assert_lossless(smollm2[0], smol_prompt, path, max_new_tokens=64, do_sample=False)


@pytest.mark.parametrize("path", PATHS)
def test_left_padded_batch_of_three(smollm2, smol_batch, path: str) -> None:
    assert smol_batch["attention_mask"].sum(-1).unique().numel() == 3  # three different lengths
    assert_lossless(smollm2[0], smol_batch, path, block_size=32, max_new_tokens=24, do_sample=False)


@pytest.mark.parametrize("path", PATHS)
def test_beam_search_three_beams(smollm2, smol_prompt, path: str) -> None:
    assert_lossless(smollm2[0], smol_prompt, path, max_new_tokens=16, num_beams=3, do_sample=False)


@pytest.mark.parametrize("path", PATHS)
def test_sampling_two_return_sequences(smollm2, smol_prompt, path: str) -> None:
    kwargs = {"do_sample": True, "temperature": 0.8, "num_return_sequences": 2, "max_new_tokens": 24}
    assert_lossless(smollm2[0], smol_prompt, path, seed=1234, **kwargs)


@pytest.mark.parametrize("path", PATHS)
def test_gemma3_sliding_and_full_layers(gemma3, austen_text, path: str) -> None:
    model, tokenizer = gemma3
    # Longer than the 512-token sliding window, so sliding layers must mask what full layers see.
    inputs = tokenizer(austen_text[50000:53500], return_tensors="pt")
    assert inputs["input_ids"].shape[1] > 700
    assert_lossless(model, inputs, path, max_new_tokens=12, do_sample=False)


def test_prefix_sharing_is_exact_on_smollm2(smollm2, austen_text) -> None:  # type: ignore[no-untyped-def]
    """Document QA: warm-tree answers equal cold ones; the document's KV is computed once."""
    from hf_kvgov import BlockPool
    from hf_kvgov.prefix.sharing import PrefixCache

    model, tokenizer = smollm2
    document = austen_text[60000:63000]
    asks = ["Who is speaking?", "Where does this happen, and what time of day is it?", "Summarize it."]
    prompts = [tokenizer(f"{document}\n\n{q}\nAnswer:", return_tensors="pt") for q in asks]
    pool = BlockPool(PagedCache(model).pool.geometry, block_size=16)  # type: ignore[union-attr]
    prefix = PrefixCache(pool)
    reused = []
    for inputs in prompts:
        expected = generate(model, DynamicCache(config=model.config), inputs, max_new_tokens=16, do_sample=False)
        cache = PagedCache(model, prefix=prefix)
        warm = cache.match(inputs["input_ids"], inputs["attention_mask"])
        reused.append(cache.get_seq_length())
        got = generate(model, cache, warm, max_new_tokens=16, do_sample=False)
        assert torch.equal(got.sequences, expected.sequences)
        worst = max((g - e).abs().max().item() for g, e in zip(got.logits, expected.logits, strict=True))
        assert worst <= 1e-4, f"logits differ by {worst}"
        cache.publish(got.sequences)
        cache.release()
    document_tokens = len(tokenizer(document)["input_ids"])
    assert reused[0] == 0
    assert min(reused[1:]) >= (document_tokens - 16) // 16 * 16
