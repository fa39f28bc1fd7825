"""DiskOffloadCache is lossless on SmolLM2: a 2,048-token context with a 128-token hot window in memory
generates the same tokens as DynamicCache, logits within 1e-4 (fp32). On the demo's prompt the disk caches
hold no more memory than the caches without a tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov.cli.demo import default_prompt
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache
from hf_kvgov.registry import get_cache_spec, kv_bytes

pytestmark = pytest.mark.real_model


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """Torch on one thread: on a shared 2-core machine, two intra-op threads stall on each other whenever
    another process takes a core, which can triple this test's time; results do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.usefixtures("one_thread")
def test_greedy_2048_context_128_hot_tokens(smollm2, austen_text, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    ids = tokenizer(austen_text[40_000:60_000], return_tensors="pt")["input_ids"][:, :2048]
    assert ids.shape[1] == 2048 and model.dtype == torch.float32
    # One prefill of 2,047 tokens serves both caches (it is the slow part on CPU): DynamicCache computes
    # it, and the disk cache receives the same K/V through `update`, 512 tokens at a time as a chunked
    # prefill would store them, spilling and reading back blocks as it goes. generate feeds the rest.
    reference = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids[:, :-1], cache=reference)
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=128)
    for start in range(0, 2047, 512):
        for index, layer in enumerate(reference.layers):
            cache.update(layer.keys[:, :, start : start + 512], layer.values[:, :, start : start + 512], index)
    # The last chunk started at 1,536 tokens: (1536 - 128) // 16 = 88, so blocks 1..87 had spilled.
    assert cache.get_seq_length() == 2047 and cache.stats().spilled_blocks == 87
    kwargs = {"max_new_tokens": 8, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    expected = model.generate(ids, cache=reference, **kwargs)
    got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    worst = max((g - e).abs().max().item() for g, e in zip(got.logits, expected.logits, strict=True))
    assert worst <= 1e-4, f"logits differ by {worst}"
    stats = cache.stats()
    # The last step started at 2,054 tokens: (2054 - 128) // 16 = 120, so blocks 1..119 are on disk, and
    # block 0 + blocks 120..128 (up to token 2,054) are in memory.
    assert (stats.spilled_blocks, stats.resident_blocks) == (119, 10)
    assert stats.write_amplification == 1.0 and stats.blocks_fetched >= 30 * 119 * 8
    cache.release()


@pytest.mark.usefixtures("one_thread")
def test_disk_caches_hold_no_more_than_without_a_tier_on_the_demo_prompt(smollm2) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    inputs = tokenizer(default_prompt(), return_tensors="pt")
    assert inputs["input_ids"].shape[1] == 689
    # Two new tokens, as `kvgov demo` builds and measures its rows: the second step spills the blocks older
    # than the 512-token hot window ((689 - 512) // 16 = 11: blocks 1..10) and reads them back.
    held, outputs = {}, {}
    for name in ("dynamic", "disk", "int8", "int8+disk"):
        spec, cache = get_cache_spec(name), get_cache_spec(name).build(model)
        with spec.attention(model), torch.inference_mode():
            outputs[name] = model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False)
        held[name] = kv_bytes(cache)
        if isinstance(cache, DiskOffloadCache | QuantizedDiskCache):
            assert cache.stats().spilled_blocks == 10
            cache.release()
    assert torch.equal(outputs["disk"], outputs["dynamic"]) and torch.equal(outputs["int8+disk"], outputs["int8"])
    # 690 tokens of 46,080 bytes; the disk cache keeps 44 - 10 = 34 blocks of 737,280 bytes and, as
    # read-ahead, one 24,576-byte layer of each spilled block (the 16 MiB default is only its cap).
    assert held["dynamic"] == 690 * 46_080
    assert held["disk"] == 34 * 737_280 + 10 * 24_576 <= held["dynamic"]
    assert held["int8+disk"] <= held["int8"] <= held["dynamic"]
