"""QuantizedDiskCache: sealed blocks spill to disk as codes and come back bit for bit.

Every generate mode gives exactly QuantizedCache's tokens and logits (torch.equal) while blocks spill; the
bookkeeping across the pool, the sealed store and the tier is checked with exact entries; the bytes written
are the codec's layout, about half (int8) or a quarter (int4) of a full-precision spill's.

Geometry of the tiny model (2 layers, 2 KV heads, head dim 16, fp32), per (block, layer) at block size 4,
written out by hand from the KIVI layout (keys: codes + a scale and zero per channel, values: codes + a scale
and zero per token, fp16 parameters):
    int8: codes 2 x 4*2*16 = 256, key scale + zero 2 x 2*16*2 = 128, value scale + zero 2 x 4*2*2 = 32 -> 416
    int4: codes 2 x 4*2*16/2 = 128, + 128 + 32 -> 288
    fp8: codes 256 + key scale 64 + e4m3 key zero 32 + value scale 16 -> 368
    int2: codes 2 x 4*2*16/4 = 64, + 128 + 32 -> 224
    full precision (what DiskOffloadCache writes): 2 x 4*2*16*4 = 1,024
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_kvgov import GovernedCache, QuantizedDiskCache, paged_attention
from hf_kvgov.chain import Disk, Paging
from hf_kvgov.errors import SpillCorrupted, SpillSpaceExhausted
from hf_kvgov.hf.disk_cache import DiskCacheStats, DiskOffloadCache
from hf_kvgov.hf.quantized_cache import QuantizedCache, QuantizedCacheStats
from hf_kvgov.registry import get_cache_spec
from hf_kvgov.tiers import DiskTier, LayerPrefetcher, TierLayout
from tests.conftest import tiny_llama
from tests.spill_damage import flip_byte

MODEL = tiny_llama(num_kv_heads=2)
SEGMENT = {
    "int8": 416,
    "int4": 288,
    "fp8": 368,
    "int2": 224,
}  # bytes per (block, layer) at block size 4, from the docstring
CODECS = {
    "int8": {"bits": 8},
    "int4": {"bits": 4},
    "fp8": {"bits": 8, "fmt": "fp8"},
    "int2": {"bits": 2, "residual": 0, "scale_bytes": 2},  # the bare format, not bits=2's KIVI defaults
}
S = -(1 << 62)  # the table entry of spilled handle 0; handle h is S - h
pytestmark = pytest.mark.usefixtures("one_thread")


def prompts(batch: int = 1, length: int = 23, pad_first: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(3, 96, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if pad_first:
        ids[0, :pad_first], mask[0, :pad_first] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(cache: Any, inputs: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    torch.manual_seed(0)
    kwargs.setdefault("max_new_tokens", 12)
    context = paged_attention(MODEL) if cache.attention == "paged" else contextlib.nullcontext()
    with context:
        return MODEL.generate(**inputs, cache=cache, return_dict_in_generate=True, output_scores=True, **kwargs)


def assert_identical(got: Any, expected: Any) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores)
    for a, b in zip(got.scores, expected.scores, strict=True):
        assert torch.equal(a, b)


def quantized_pair(
    codec: str = "int8", hot_tokens: int = 6, **kwargs: Any
) -> tuple[QuantizedCache, QuantizedDiskCache]:
    reference = QuantizedCache(MODEL, block_size=4, **CODECS[codec], **kwargs)
    return reference, QuantizedDiskCache(MODEL, hot_tokens=hot_tokens, block_size=4, **CODECS[codec], **kwargs)


SCENARIOS = {
    "greedy": (prompts(), {}),
    "left_padded_batch": (prompts(batch=3, length=21, pad_first=6), {}),
    "beam_search": (prompts(batch=2, length=19, pad_first=3), {"num_beams": 3}),
    "sampling_two_each": (prompts(batch=2, length=18), {"do_sample": True, "top_k": 20, "num_return_sequences": 2}),
    "prompt_lookup_crop": ({"input_ids": torch.tensor([[5, 6, 7, 8, 9] * 5])}, {"prompt_lookup_num_tokens": 3}),
}


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_generate_mode_equals_quantized_cache_while_spilling(scenario: str, attention: str) -> None:
    inputs, kwargs = SCENARIOS[scenario]
    reference, cache = quantized_pair(attention=attention)
    assert_identical(generate(cache, inputs, **kwargs), generate(reference, inputs, **kwargs))
    stats = cache.stats()
    assert stats.spills > 0 and stats.prefetched > 0 and stats.write_amplification == 1.0
    assert stats.bytes_written == stats.kv_bytes_spilled == stats.spills * 2 * SEGMENT["int8"]
    cache.release()


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_every_codec_equals_quantized_cache_and_writes_its_layout(codec: str, attention: str) -> None:
    inputs = prompts(batch=2, length=26, pad_first=5)
    reference, cache = quantized_pair(codec, attention=attention)
    assert_identical(generate(cache, inputs), generate(reference, inputs))
    stats = cache.stats()
    # Last step: 26 + 11 = 37 tokens at its start, (37 - 6) // 4 = 7: blocks 1..6 of each row are on disk.
    assert (stats.spills, stats.spilled_blocks) == (12, 12)
    assert stats.bytes_written == 12 * 2 * SEGMENT[codec]
    assert stats.full_precision_bytes_spilled == 12 * 2 * 1024
    assert stats.spill_ratio == SEGMENT[codec] / 1024
    cache.release()


def test_residual_blocks_stay_in_full_precision_and_in_memory() -> None:
    inputs = prompts(length=30)
    reference, cache = quantized_pair(hot_tokens=4, residual=8)
    assert_identical(generate(cache, inputs), generate(reference, inputs))
    rows = cache.tables.rows  # type: ignore[union-attr]
    # 41 tokens: blocks 0 (sink) and 8..10 (residual window + tail) are full precision, 1..7 are sealed, and
    # with a 4-token hot window every sealed block older than the step's start (40 - 4) // 4 = 9 is on disk.
    assert [b >= 0 for b in rows[0].block_ids] == [True] + [False] * 7 + [True] * 3
    assert all(b <= S for b in rows[0].block_ids[1:8])
    cache.release()


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
def test_a_layer_kept_in_full_precision_spills_raw_and_the_others_as_codes(tmp_path: Path, attention: str) -> None:
    inputs = prompts(batch=2, length=26, pad_first=5)
    reference, cache = quantized_pair(full_precision_layers=[0], attention=attention)
    assert_identical(generate(cache, inputs), generate(reference, inputs))
    stats = cache.stats()
    # Layer 0's sealed blocks are raw fp32 K/V (1,024 bytes), layer 1's int8 codes (416): 1,440 per block.
    assert stats.spills == 12 and stats.bytes_written == 12 * (1024 + 416)
    assert cache.tier is not None and cache.tier.layout.parts(0) == (512, 512)
    assert cache.tier.layout.parts(1) == (128, 64, 64, 128, 16, 16)
    cache.release()


def test_a_slot_file_with_segments_that_differ_per_layer(tmp_path: Path) -> None:
    layout = TierLayout(layers=2, part_bytes=(4, 4), extent_slots=2, layer_parts=((4, 4), (2, 1, 3)))
    assert (layout.slot_bytes, layout.segment_bytes, layout.parts(1)) == (14, 8, (2, 1, 3))
    tier = DiskTier(layout, tmp_path)
    blocks = [[bytes([10 * b + layer] * n) for n in layout.parts(layer)] for b in range(3) for layer in range(2)]

    def segments(layer: int) -> list[list[memoryview]]:
        return [[memoryview(bytearray(part)) for part in blocks[2 * b + layer]] for b in range(3)]

    handles = tier.put(3, [1, 1, 1], segments)
    # Extent = layer 0 (2 slots x 8 bytes) | layer 1 (2 slots x 6 bytes) = 28 bytes; slot 2 starts extent 1.
    # Layer 1, part 2 of slot 1: 16 (layer 0) + 2 x (2 + 1) (parts 0, 1 of both slots) + 1 x 3 = 25.
    assert tier._file is not None and tier._file.offset(1, 1, 2) == 25 and tier._file.offset(2, 1, 0) == 28 + 16
    reader = LayerPrefetcher(tier, 28, "cpu")  # 14 bytes per segment shape: 1 row of 8 bytes, 2 rows of 6
    reader.request(1, handles[:2])  # allocates layer 1's shape only: 2 rows of 6; layer 0's stay unallocated
    outs = [torch.empty((3, n), dtype=torch.uint8) for n in (2, 1, 3)]
    reader.take(1, handles, outs)
    assert [bytes(out[b].tolist()) for b in range(3) for out in outs] == [
        p for b in range(3) for p in blocks[2 * b + 1]
    ]
    assert (reader.prefetched, reader.on_demand, reader.buffer_bytes) == (2, 1, 12)
    with pytest.raises(ValueError, match=r"rows of \[2, 1, 3\] bytes"):
        reader.take(1, handles, [torch.empty((3, 8), dtype=torch.uint8)])
    reader.close()
    tier.close()


def test_beams_share_spilled_codes_written_once(tmp_path: Path) -> None:
    ids = prompts(length=21)["input_ids"]
    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4)
    reference = QuantizedCache(MODEL, block_size=4)
    for each in (cache, reference):
        MODEL(ids[:, :20], cache=each)
        each.batch_repeat_interleave(3)
    got = MODEL(ids[:, 20:].repeat(3, 1), cache=cache).logits
    assert torch.equal(got, MODEL(ids[:, 20:].repeat(3, 1), cache=reference).logits)
    # The prompt sealed blocks 1..4 (sealed ids 0..3) and freed pool ids 1..4 to the end of the free list
    # (5, 6, 7 come first). Step start: 20 tokens, (20 - 4) // 4 = 4, so sealed ids 0..2 spill once each as
    # handles 0..2, held by three rows; sealed id 3 (tokens 16..19) stays, and token 20 takes pool 5, 6, 7.
    assert [row.block_ids for row in cache.tables.rows] == [[0, S, S - 1, S - 2, -4, b] for b in (5, 6, 7)]  # type: ignore[union-attr]
    assert cache.tier is not None and [cache.tier.refs(h) for h in (0, 1, 2)] == [3, 3, 3]
    assert cache._quantized_pool.sealed.free_ids()[-3:] == (0, 1, 2)  # their slots, freed last (FIFO reuse)
    stats = cache.stats()
    assert (stats.spills, stats.bytes_written) == (3, 3 * 2 * SEGMENT["int8"])
    assert (stats.full_precision_blocks, stats.sealed_blocks, stats.spilled_blocks) == (4, 1, 3)
    cache.release()


def test_memory_counts_full_precision_blocks_sealed_slots_and_buffers(tmp_path: Path) -> None:
    ids = prompts(length=31)["input_ids"]
    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4, read_buffer_bytes=4096)
    MODEL(ids[:, :30], cache=cache)
    MODEL(ids[:, 30:], cache=cache)
    stats = cache.stats()
    # Step start 30 tokens: (30 - 4) // 4 = 6, blocks 1..5 spilled; block 6 (24..27) sealed; 0 and 7 in fp.
    # Read-ahead rows: one segment of 416 bytes per spilled block (5), under the cap of 4,096 // 416 = 9.
    assert (stats.full_precision_blocks, stats.sealed_blocks, stats.spilled_blocks) == (2, 1, 5)
    assert (stats.full_precision_bytes, stats.sealed_bytes, stats.read_buffer_bytes) == (2 * 2048, 832, 5 * 416)
    assert stats.resident_bytes == stats.bytes_used == 2 * 2048 + 832 + 5 * 416
    assert stats.disk_bytes == 5 * 832 and stats.bytes_read == stats.blocks_fetched * 416
    # Both sections, computed as for a cache with one link: the codec's over the 3 blocks in memory (what PagedCache
    # would hold for them over their codes), the tier's over what left.
    assert isinstance(stats, QuantizedCacheStats) and isinstance(stats, DiskCacheStats)
    assert stats.resident_blocks == 3 and stats.unquantized_bytes == 3 * 2048
    assert stats.compression == 3 * 2048 / (2 * 2048 + 832) and stats.overflow_blocks == 0
    assert stats.kv_bytes_spilled == 5 * 832 and stats.spill_ratio == 832 / 2048
    assert stats.fetches > 0 and min(stats.fetch_latency_mean_s, stats.fetch_latency_p99_s) > 0  # the tier's figures
    cache.release()


def test_crop_into_a_spilled_block_brings_it_back_and_decodes_it(tmp_path: Path) -> None:
    ids = prompts(length=40)["input_ids"]
    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4)
    reference = QuantizedCache(MODEL, block_size=4)
    for each in (cache, reference):
        MODEL(ids[:, :30], cache=each)
        MODEL(ids[:, 30:31], cache=each)
        each.crop(-21)  # 10 tokens left: block 2 (tokens 8..11) takes writes again
    assert cache.stats().spilled_blocks == 1  # block 1; blocks 3..5 were dropped, block 2 came back
    assert cache.tier is not None and [cache.tier.is_live(h) for h in range(5)] == [True] + [False] * 4
    row = cache.tables.rows[0].block_ids  # type: ignore[union-attr]
    assert row[:2] == [0, S] and row[2] >= 0  # decoded into a writable full-precision block
    assert torch.equal(MODEL(ids[:, 10:], cache=cache).logits, MODEL(ids[:, 10:], cache=reference).logits)
    cache.release()


def test_long_stream_keeps_every_byte_under_the_cap(tmp_path: Path) -> None:
    """max_resident_bytes bounds the pool's tensors, codes included, plus the read-ahead buffers: a step of 64 tokens
    holds 18 full-precision blocks of 2,048 bytes and up to 24 sealed ones of 832 while it seals them (56 KiB)."""
    bound, chunk, hot = 80 * 1024, 64, 32
    cache = QuantizedDiskCache(MODEL, tmp_path, hot, bound, block_size=4, read_buffer_bytes=8 * 1024)
    reference = QuantizedCache(MODEL, block_size=4)
    ids = torch.randint(3, 96, (1, 512), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for start in range(0, 512, chunk):
            got = MODEL(ids[:, start : start + chunk], cache=cache).logits
            expected = MODEL(ids[:, start : start + chunk], cache=reference).logits
            assert torch.equal(got, expected)
            stats = cache.stats()
            # The pool counts the read-ahead rows against its cap with its blocks and codes.
            assert cache.pool is not None and cache.pool.bytes_charged == stats.read_buffer_bytes
            assert cache.pool.bytes_held() <= bound
            assert stats.sealed_blocks <= hot // 4 + chunk // 4  # the hot window plus the step's own blocks
    # Last step start: 448 tokens, (448 - 32) // 4 = 104, so blocks 1..103 are on disk.
    assert (stats.spills, stats.spilled_blocks) == (103, 103)
    cache.release()


# ---------------------------------------------------------------- failures


def spill_step(cache: QuantizedDiskCache) -> None:
    """Prefill 30 tokens, then one: at that step's start sealed blocks 1..5 are cold."""
    ids = prompts(length=40)["input_ids"]
    MODEL(ids[:, :30], cache=cache)
    MODEL(ids[:, 30:31], cache=cache)


def test_write_budget_raises_before_writing_anything(tmp_path: Path) -> None:
    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4, max_write_bytes=2 * 832)
    with pytest.raises(SpillSpaceExhausted, match="write budget"):
        spill_step(cache)
    stats = cache.stats()
    assert (stats.bytes_written, stats.spills, stats.sealed_blocks, cache.get_seq_length()) == (0, 0, 6, 30)


def test_write_budget_with_keep_resident_stops_spilling(tmp_path: Path) -> None:
    inputs = prompts(length=30)
    reference = QuantizedCache(MODEL, block_size=4)
    cache = QuantizedDiskCache(
        MODEL, tmp_path, hot_tokens=4, block_size=4, max_write_bytes=2 * 832 + 100, on_full="keep_resident"
    )
    assert_identical(generate(cache, inputs), generate(reference, inputs))
    stats = cache.stats()
    assert (stats.spills, stats.bytes_written, stats.spilling) == (2, 2 * 832, False)
    assert "write budget" in (stats.stop_reason or "")


@pytest.mark.parametrize("on_full", ["raise", "keep_resident"])
def test_a_full_disk_raises_or_keeps_blocks_resident(tmp_path: Path, monkeypatch, on_full: str) -> None:  # type: ignore[no-untyped-def]
    def pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4, on_full=on_full)
    monkeypatch.setattr(os, "pwritev", pwritev)
    if on_full == "raise":
        with pytest.raises(SpillSpaceExhausted, match="disk full"):
            spill_step(cache)
        assert cache.stats().spilled_blocks == 0 and cache.get_seq_length() == 30
        return
    spill_step(cache)
    stats = cache.stats()
    assert (stats.spilled_blocks, stats.sealed_blocks, stats.spilling) == (0, 6, False)
    assert "disk full" in (stats.stop_reason or "")


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_corrupted_block_names_block_layer_and_tokens(tmp_path: Path, prefetch: bool) -> None:
    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4, prefetch=prefetch)
    spill_step(cache)
    assert cache.tables is not None and cache.tables.rows[0].block_ids[2] == S - 1  # tokens 8..11: handle 1
    assert cache.tier is not None
    path, offset = cache.tier.location(1, 1)
    flip_byte(path, offset + 100)  # the first part is key codes: 128 bytes per block
    with pytest.raises(SpillCorrupted, match=r"block 1 \(tokens \[8, 12\)\), layer 1") as info:
        MODEL(prompts(length=40)["input_ids"][:, 31:32], cache=cache)
    assert (info.value.block, info.value.layer, info.value.tokens) == (1, 1, (8, 12))


def test_reset_keeps_the_file_and_release_removes_it(tmp_path: Path) -> None:
    cache = QuantizedDiskCache(MODEL, tmp_path, hot_tokens=4, block_size=4)
    spill_step(cache)
    path = cache.stats().spill_path
    cache.reset()
    stats = cache.stats()
    assert stats.spill_path == path and stats.disk_bytes == 0 and stats.tokens == 0
    assert cache._quantized_pool.sealed.num_used == 0 and cache.pool is not None and cache.pool.num_used == 0
    spill_step(cache)  # usable again, in the same file
    assert cache.stats().spill_path == path
    cache.release()
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_full must be one of"):
        QuantizedDiskCache(MODEL, tmp_path, on_full="drop")
    # Sink + 8 / 4 residual blocks + tail + one step = 5 full-precision blocks of 4 x 512 bytes, and the 512-token
    # hot window's 128 sealed blocks of 832 bytes: 116,736; 3 / 4 of 8,000 is less.
    with pytest.raises(ValueError, match="need 5 blocks and 128 sealed blocks = 116736 bytes"):
        QuantizedDiskCache(MODEL, tmp_path, block_size=4, residual=8, max_resident_bytes=8000)


# ---------------------------------------------------------------- the chain and the registry


def test_the_chain_builds_it_and_the_registry_names_it() -> None:
    cache = GovernedCache(MODEL, pool=Paging(4), codec="int4", spill=Disk(hot_tokens=8))
    assert isinstance(cache, QuantizedDiskCache) and cache.quant.bits == 4 and cache.disk.hot_tokens == 8
    assert GovernedCache(MODEL, **cache.parts.kwargs()).parts == cache.parts
    spec = get_cache_spec("int8+disk")
    built = spec.build(MODEL)
    assert isinstance(built, QuantizedDiskCache) and built.quant.bits == 8 and not spec.lossless
    for each in (cache, built):
        each.release()


def half_precision_model() -> LlamaForCausalLM:
    """2 layers, 2 KV heads of dim 64, bf16: the layout of real models, where scales are a small overhead."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize(
    ("codec", "segment"),
    # Per (block, layer) at block size 32, heads 2, head dim 64, bf16 parameters (as the codec stores them):
    # codes 2 x 32*2*64*bits/8, key scale + zero 2 x 2*64*2 = 512, value scale + zero 2 x 32*2*2 = 256.
    [("int8", 8192 + 512 + 256), ("int4", 4096 + 512 + 256)],
)
def test_a_spill_of_codes_writes_and_reads_the_codec_share_of_a_full_precision_spill(
    tmp_path: Path, codec: str, segment: int
) -> None:
    model, full = half_precision_model(), 2 * 32 * 2 * 64 * 2  # a bf16 K + V segment: 16,384 bytes
    ids = torch.randint(3, 96, (1, 160), generator=torch.Generator().manual_seed(5))
    caches = (
        DiskOffloadCache(model, tmp_path, 32, block_size=32),
        QuantizedDiskCache(model, tmp_path, 32, **CODECS[codec], block_size=32),
    )
    for each in caches:
        for start in range(0, 160, 32):
            model(ids[:, start : start + 32], cache=each)
        assert each.prefetcher is not None  # the last layer read layer 0 ahead on the reader thread:
        each.prefetcher.close()  # wait for it, so both counts include that read (stats() alone raced it)
    raw, codes = (each.stats() for each in caches)
    assert raw.spills == codes.spills == 2  # last step start: 128 tokens, (128 - 32) // 32 = 3: blocks 1, 2
    assert codes.bytes_written / raw.bytes_written == segment / full  # int8 0.547, int4 0.297
    assert codes.bytes_read / raw.bytes_read == segment / full and codes.blocks_fetched == raw.blocks_fetched
    for each in caches:
        each.release()


@pytest.mark.real_model
def test_smollm2_generates_exactly_what_quantized_cache_generates(smollm2, austen_text, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, tokenizer = smollm2
    ids = tokenizer(austen_text[50_000:53_000], return_tensors="pt")["input_ids"][:, :300]
    assert ids.shape[1] == 300
    kwargs = {"max_new_tokens": 6, "do_sample": False, "output_logits": True, "return_dict_in_generate": True}
    with torch.inference_mode():
        expected = model.generate(ids, cache=QuantizedCache(model, bits=4), **kwargs)
        cache = QuantizedDiskCache(model, tmp_path, hot_tokens=64, bits=4)
        got = model.generate(ids, cache=cache, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.equal(g, e) for g, e in zip(got.logits, expected.logits, strict=True))
    stats = cache.stats()
    # The last step started at 304 tokens: (304 - 64) // 16 = 15, so blocks 1..14 of 16 tokens are on disk.
    # SmolLM2: 30 layers, 3 KV heads of dim 64, fp32; int4 per (block, layer): codes 2 x 16*3*64/2 = 3,072,
    # key scale + zero 2 x 3*64*2 = 768, value scale + zero 2 x 16*3*2 = 192.
    assert stats.spilled_blocks == 14 and stats.prefetched > 0
    assert stats.bytes_written == 14 * 30 * (3072 + 768 + 192)
    assert stats.full_precision_bytes_spilled == 14 * 30 * 2 * 16 * 3 * 64 * 4
    cache.release()
