"""DiskOffloadCache on a tiny random Llama: equal to DynamicCache in every generate mode, exact block
bookkeeping across tiers, bounded resident memory over 8,192 tokens, and every failure it must report.

Geometry of the tiny model (2 layers, 2 KV heads, head dim 16, fp32): one token is 2 x 2 x 2 x 16 x 4 =
512 bytes; at block size 4 a block is 2,048 bytes (one 1,024-byte segment per layer), at 16 it is 8,192.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import paged_attention
from hf_kvgov.errors import SpillCorrupted, SpillFileLost, SpillSpaceExhausted
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.registry import get_cache_spec
from tests.conftest import tiny_llama
from tests.spill_damage import flip_byte

MODEL = tiny_llama(num_kv_heads=2)
BLOCK_BYTES_4 = 4 * 512
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """Torch on one thread: on a shared 2-core machine, two intra-op threads stall on each other whenever
    another process takes a core (a tiny matmul then takes milliseconds); results do not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def prompts(batch: int = 1, length: int = 23, pad_first: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(3, 96, (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if pad_first:
        ids[0, :pad_first] = 0
        mask[0, :pad_first] = 0
    return {"input_ids": ids, "attention_mask": mask}


def generate(cache, inputs, seed: int = 0, **kwargs):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    kwargs.setdefault("max_new_tokens", 12)
    return MODEL.generate(**inputs, cache=cache, return_dict_in_generate=True, output_scores=True, **kwargs)


def assert_same_as_dynamic(cache: DiskOffloadCache, inputs, **kwargs) -> None:  # type: ignore[no-untyped-def]
    expected = generate(DynamicCache(), inputs, **kwargs)
    context = paged_attention(MODEL) if cache.attention == "paged" else contextlib.nullcontext()
    with context:
        got = generate(cache, inputs, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.scores, expected.scores, strict=True):
        finite = torch.isfinite(expected_step)
        assert torch.equal(finite, torch.isfinite(got_step))
        torch.testing.assert_close(got_step[finite], expected_step[finite], atol=1e-5, rtol=1e-5)


SCENARIOS = {
    "greedy": (prompts(), {}),
    "left_padded_batch": (prompts(batch=3, length=21, pad_first=6), {}),
    "beam_search": (prompts(batch=2, length=19, pad_first=3), {"num_beams": 3}),
    "sampling_two_each": (prompts(batch=2, length=18), {"do_sample": True, "top_k": 20, "num_return_sequences": 2}),
    "prompt_lookup_crop": ({"input_ids": torch.tensor([[5, 6, 7, 8, 9] * 5])}, {"prompt_lookup_num_tokens": 3}),
}


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_generation_equals_dynamic_cache_while_spilling(scenario: str, attention: str, tmp_path: Path) -> None:
    inputs, kwargs = SCENARIOS[scenario]
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=6, block_size=4, attention=attention)  # type: ignore[arg-type]
    assert_same_as_dynamic(cache, inputs, **kwargs)
    stats = cache.stats()
    assert stats.spills > 0 and stats.prefetched > 0 and stats.write_amplification == 1.0
    assert stats.bytes_written == stats.spills * BLOCK_BYTES_4
    cache.release()
    assert list(tmp_path.iterdir()) == []


def test_without_read_ahead_every_block_is_read_on_demand(tmp_path: Path) -> None:
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=6, block_size=4, prefetch=False)
    assert_same_as_dynamic(cache, prompts())
    stats = cache.stats()
    assert stats.prefetched == 0 and stats.fetched_on_demand == stats.blocks_fetched > 0
    assert stats.read_buffer_bytes == 0


def test_blocks_shared_by_beams_are_written_once(tmp_path: Path) -> None:
    ids = prompts(length=21)["input_ids"]
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4)
    reference = DynamicCache()
    MODEL(ids[:, :20], cache=cache)
    MODEL(ids[:, :20], cache=reference)
    cache.batch_repeat_interleave(3)
    reference.batch_repeat_interleave(3)
    # Step start: 20 tokens, hot window 16..19, so blocks 1, 2, 3 are cold; each is held by three rows.
    got = MODEL(ids[:, 20:].repeat(3, 1), cache=cache).logits
    expected = MODEL(ids[:, 20:].repeat(3, 1), cache=reference).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert (stats.spills, stats.bytes_written, stats.spilled_blocks) == (3, 3 * BLOCK_BYTES_4, 3)
    assert cache.tier is not None and [cache.tier.refs(h) for h in (0, 1, 2)] == [3, 3, 3]
    # Pool ids 0..4 held the prompt; 1..3 went back to the end of the free list, so token 20's private
    # blocks (one per row) are 5, 6, 7.
    assert [row.block_ids for row in cache.tables.rows] == [[0, -1, -2, -3, 4, b] for b in (5, 6, 7)]  # type: ignore[union-attr]
    assert cache.pool is not None and cache.pool.num_used == 5 and stats.resident_blocks == 5


def test_crop_frees_disk_slots_and_brings_the_new_tail_back(tmp_path: Path) -> None:
    ids = prompts(length=40)["input_ids"]
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4)
    MODEL(ids[:, :30], cache=cache)
    MODEL(ids[:, 30:31], cache=cache)  # 30 tokens at step start: blocks 1..5 spill (handles 0..4)
    assert cache.stats().spilled_blocks == 5
    cache.crop(-21)  # 10 tokens left: blocks 3..5 leave the disk, block 2 (tokens 8..11) is the tail again
    stats = cache.stats()
    assert (stats.spilled_blocks, stats.disk_bytes, stats.resident_blocks) == (1, BLOCK_BYTES_4, 2)
    assert cache.tables is not None and cache.tables.rows[0].block_ids == [0, -1, 8]  # pool id 8: next free
    assert cache.tier is not None and [cache.tier.is_live(h) for h in range(5)] == [True] + [False] * 4
    after_crop = MODEL(ids[:, 10:], cache=cache).logits
    fresh = MODEL(ids, cache=DynamicCache()).logits[:, 10:]
    torch.testing.assert_close(after_crop, fresh, atol=1e-5, rtol=1e-5)


def test_resident_memory_stays_bounded_over_8192_streamed_tokens(tmp_path: Path) -> None:
    bound, chunk = 320 * 1024, 256
    cache = DiskOffloadCache(
        MODEL, tmp_path, hot_tokens=128, max_resident_bytes=bound, read_buffer_bytes=64 * 1024, block_size=16
    )
    reference = DynamicCache()
    ids = torch.randint(3, 96, (1, 8192), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for start in range(0, 8192, chunk):
            got = MODEL(ids[:, start : start + chunk], cache=cache).logits
            stats = cache.stats()
            assert stats.resident_bytes <= bound
            # What is physically allocated, too: the pool's blocks (free ones included) and the read-ahead rows,
            # which the pool counts against its cap (max_resident_bytes) with its blocks.
            assert cache.pool is not None and cache.pool.bytes_charged == stats.read_buffer_bytes
            assert cache.pool.bytes_held() == stats.pool_bytes_reserved + stats.read_buffer_bytes <= bound
        expected = MODEL(ids, cache=reference, logits_to_keep=chunk).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # The last step started at 7,936 tokens: blocks 1..487 had spilled, and 0 + 488..511 are resident.
    stats = cache.stats()
    assert (stats.spills, stats.spilled_blocks, stats.resident_blocks) == (487, 487, 25)
    assert stats.bytes_written == stats.kv_bytes_spilled == 487 * 8192 and stats.write_amplification == 1.0
    assert stats.disk_file_bytes == 8 * 64 * 8192  # 8 extents of 64 slots
    # Steps 1..31 each read every spilled block once per layer: 2 x sum(16k - 9) = 15,314 segments.
    assert stats.prefetched + stats.fetched_on_demand == 15_314
    assert stats.bytes_read == stats.blocks_fetched * 4096 and stats.fetch_latency_p99_s >= stats.fetch_latency_mean_s


def test_read_ahead_follows_the_spill_and_reset_frees_it(tmp_path: Path) -> None:
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4)  # the default cap, 16 MiB
    ids = prompts(length=40)["input_ids"]
    MODEL(ids[:, :30], cache=cache)
    assert cache.stats().read_buffer_bytes == 0  # nothing spilled yet
    MODEL(ids[:, 30:31], cache=cache)  # 30 tokens at step start: blocks 1..5 spill and come back
    stats = cache.stats()
    # One 1,024-byte row (one layer of a block) per spilled block, beside resident blocks 0, 6 and 7: less
    # than the 31 tokens x 512 bytes DynamicCache holds.
    assert (stats.spilled_blocks, stats.read_buffer_bytes) == (5, 5 * 1024)
    assert stats.resident_bytes == 3 * BLOCK_BYTES_4 + 5 * 1024 == 11_264 < 31 * 512
    cache.reset()
    assert cache.stats().read_buffer_bytes == 0
    cache.release()


# ---------------------------------------------------------------- failures


def spill_step(cache: DiskOffloadCache) -> torch.Tensor:
    """Prefill 30 tokens, then one token: at that step's start blocks 1..5 (5 blocks) are cold."""
    ids = prompts(length=40)["input_ids"]
    MODEL(ids[:, :30], cache=cache)
    return MODEL(ids[:, 30:31], cache=cache).logits


def test_write_budget_raises_before_writing_anything(tmp_path: Path) -> None:
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4, max_write_bytes=2 * BLOCK_BYTES_4)
    with pytest.raises(SpillSpaceExhausted, match="write budget"):
        spill_step(cache)
    stats = cache.stats()
    assert (stats.bytes_written, stats.spills, stats.resident_blocks, cache.get_seq_length()) == (0, 0, 8, 30)


def test_write_budget_with_keep_resident_stops_spilling(tmp_path: Path) -> None:
    cache = DiskOffloadCache(
        MODEL, tmp_path, hot_tokens=4, block_size=4, max_write_bytes=2 * BLOCK_BYTES_4 + 100, on_full="keep_resident"
    )
    assert_same_as_dynamic(cache, prompts(length=30))
    stats = cache.stats()
    assert (stats.spills, stats.bytes_written, stats.spilling) == (2, 2 * BLOCK_BYTES_4, False)
    assert "write budget" in (stats.stop_reason or "")


def filling_disk(monkeypatch) -> list[int]:  # type: ignore[no-untyped-def]
    """Make the next writes behave like a full disk: a short write of half a part, then ENOSPC."""
    real, calls = os.pwritev, []

    def pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, [buffers[0][: len(buffers[0]) // 2]], offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    return calls


def test_disk_full_raises_and_the_half_written_block_is_never_read(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4)
    ids = prompts(length=40)["input_ids"]
    MODEL(ids[:, :30], cache=cache)
    filling_disk(monkeypatch)
    with pytest.raises(SpillSpaceExhausted, match="disk full"):
        MODEL(ids[:, 30:31], cache=cache)
    monkeypatch.undo()
    assert cache.stats().spilled_blocks == 0 and cache.get_seq_length() == 30
    got = MODEL(ids[:, 30:], cache=cache).logits  # retried: the slots are rewritten whole
    expected = MODEL(ids, cache=DynamicCache()).logits[:, 30:]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    # + the 256 bytes written before the disk filled: half of the first part, layer 0's 512 bytes of K.
    assert stats.spills == 5 and stats.bytes_written == 5 * BLOCK_BYTES_4 + 256
    assert stats.write_amplification == pytest.approx(1 + 256 / (5 * BLOCK_BYTES_4))


def test_disk_full_with_keep_resident_keeps_blocks_in_memory(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4, on_full="keep_resident")
    filling_disk(monkeypatch)
    assert_same_as_dynamic(cache, prompts(length=30))
    stats = cache.stats()
    assert (stats.spills, stats.spilled_blocks, stats.spilling) == (0, 0, False)
    assert "disk full" in (stats.stop_reason or "")


@pytest.mark.parametrize("prefetch", [True, False])
def test_a_corrupted_block_names_block_layer_and_tokens(tmp_path: Path, prefetch: bool) -> None:
    cache = DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4, prefetch=prefetch)
    spill_step(cache)
    assert cache.tables is not None and cache.tables.rows[0].block_ids[2] == -2  # tokens 8..11: handle 1
    assert cache.tier is not None
    path, offset = cache.tier.location(1, 1)
    flip_byte(path, offset + 100)
    with pytest.raises(SpillCorrupted, match=r"block 1 \(tokens \[8, 12\)\), layer 1") as info:
        MODEL(prompts(length=40)["input_ids"][:, 31:32], cache=cache)
    assert (info.value.block, info.value.layer, info.value.tokens) == (1, 1, (8, 12))


def test_removed_directory_is_a_clear_error(tmp_path: Path) -> None:
    directory = tmp_path / "spill"
    cache = DiskOffloadCache(MODEL, directory, hot_tokens=4, block_size=4)
    spill_step(cache)
    shutil.rmtree(directory)
    with pytest.raises(SpillFileLost, match="deleted"):
        MODEL(prompts(length=40)["input_ids"][:, 31:32], cache=cache)


def test_two_caches_never_share_a_file_and_files_are_removed(tmp_path: Path) -> None:
    one, two = (DiskOffloadCache(MODEL, tmp_path, hot_tokens=4, block_size=4) for _ in range(2))
    spill_step(one)
    spill_step(two)
    paths = {one.stats().spill_path, two.stats().spill_path}
    assert len(paths) == 2 and {Path(p or "").parent for p in paths} == {tmp_path}
    one.reset()  # slots freed, file kept for reuse
    assert one.stats().spill_path in paths and one.stats().disk_bytes == 0
    one.release()
    two.release()
    assert list(tmp_path.iterdir()) == []
    private = DiskOffloadCache(MODEL, hot_tokens=4, block_size=4)
    spill_step(private)
    directory = Path(private.stats().spill_path or "").parent
    private.release()
    assert not directory.exists()
    private = DiskOffloadCache(MODEL, hot_tokens=4, block_size=4)
    spill_step(private)  # usable after release too, with a new private directory
    directory = Path(private.stats().spill_path or "").parent
    del private
    gc.collect()
    assert not directory.exists()


def test_bad_arguments_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="on_full must be one of"):
        DiskOffloadCache(MODEL, tmp_path, on_full="drop")
    with pytest.raises(ValueError, match="hot_tokens"):
        DiskOffloadCache(MODEL, tmp_path, hot_tokens=-1)
    with pytest.raises(ValueError, match="leaves nothing"):
        DiskOffloadCache(MODEL, tmp_path, max_resident_bytes=1000, read_buffer_bytes=1000)
    # 1 + 128 / 16 + 2 = 11 blocks of 8,192 bytes are needed; 3 / 4 of 80,000 bytes is far less.
    with pytest.raises(ValueError, match="11 blocks = 90112 bytes"):
        DiskOffloadCache(MODEL, tmp_path, hot_tokens=128, max_resident_bytes=80_000)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="directory"):
        DiskOffloadCache(MODEL, tmp_path / "file")


def test_registered_as_disk() -> None:
    spec = get_cache_spec("disk")
    cache = spec.build(MODEL)
    assert isinstance(cache, DiskOffloadCache) and spec.lossless
    cache.release()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 3])
def test_cuda_pinned_read_ahead_and_copy_stream(tmp_path: Path, batch: int) -> None:
    model = tiny_llama(num_kv_heads=2).cuda()
    inputs = {k: v.cuda() for k, v in prompts(batch=batch, length=37, pad_first=5 if batch > 1 else 0).items()}
    torch.manual_seed(0)
    expected = model.generate(**inputs, cache=DynamicCache(), max_new_tokens=20, do_sample=False)
    cache = DiskOffloadCache(model, tmp_path, hot_tokens=6, block_size=4)
    got = model.generate(**inputs, cache=cache, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, expected)
    stats = cache.stats()
    assert stats.prefetched > 0 and stats.spills > 0 and stats.read_buffer_bytes > 0
    assert cache.prefetcher is not None and cache.prefetcher._host is not None
    assert all(rows.is_pinned() for rows in cache.prefetcher._host)
    cache.release()
