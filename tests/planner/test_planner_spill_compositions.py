"""The planner's model of a disk tier composed with a codec and with a shared prefix, by hand and against caches.

A spilling cache moves cold blocks at the start of a step, counting the tokens stored before it, so a
sequence of L tokens keeps the block holding token L - 1 - hot (see `accounting.split_spill`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_kvgov.bench.plan_setups import planner_geometry, planner_setup, predict, with_shared_prefix
from hf_kvgov.chain.build import GovernedCache
from hf_kvgov.engine.parts import Disk, Paging
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache
from hf_kvgov.planner import CacheSetup, ModelGeometry
from hf_kvgov.planner.accounting import sequence_bytes
from hf_kvgov.planner.lengths import fixed
from hf_kvgov.prefix.sharing import PrefixCache
from tests.conftest import tiny_gemma3, tiny_llama

# unit geometry (conftest): 1 layer x 1 KV head x head_dim 8, fp16, 4-token blocks.
FP_BLOCK = 2 * 4 * 8 * 2  # 128
# int8 block: codes 2 x 4 x 8, fp16 scale + zero per key channel (8) and per value token (4).
INT8_BLOCK = 2 * 4 * 8 + 8 * 2 * 2 + 4 * 2 * 2  # 112


def test_int8_spill_keeps_sink_in_full_precision_and_hot_blocks_as_codes(unit: ModelGeometry) -> None:
    setup = CacheSetup(block_size=4, codec="int8", spill_hot_tokens=8, spill_pinned_blocks=1, spill_buffer_bytes=200)
    # 40 tokens = 10 blocks; 39 were stored when the last step spilled: blocks ending before token 31 (0-6) are
    # cold, except the pinned sink block 0. Disk: blocks 1-6 as codes. Device: sink (full precision), blocks
    # 7-9 as codes (the last one is full, so sealed), and the read-ahead buffers.
    result = sequence_bytes(unit, setup, 40)
    assert (result.device, result.disk) == (FP_BLOCK + 3 * INT8_BLOCK + 200, 6 * INT8_BLOCK) == (664, 672)
    # 42 tokens: block 10 holds 2 tokens, still being written, so in full precision; cold: blocks 1-7.
    result = sequence_bytes(unit, setup, 42)
    assert (result.device, result.disk) == (FP_BLOCK + 2 * INT8_BLOCK + FP_BLOCK + 200, 7 * INT8_BLOCK)


def test_nothing_spilled_means_no_read_ahead_buffers(unit: ModelGeometry) -> None:
    setup = CacheSetup(block_size=4, codec="int8", spill_hot_tokens=8, spill_pinned_blocks=1, spill_buffer_bytes=200)
    # 9 tokens: 8 were stored at the last step, all within the hot window.
    assert sequence_bytes(unit, setup, 9) == sequence_bytes(unit, CacheSetup(block_size=4, codec="int8"), 9)
    assert sequence_bytes(unit, setup, 9).device == FP_BLOCK + INT8_BLOCK + FP_BLOCK


def test_read_ahead_is_one_layer_of_the_spilled_blocks_up_to_its_cap() -> None:
    four_layers = ModelGeometry("four", num_layers=4, num_kv_heads=1, head_dim=8, max_position_embeddings=64)
    setup = CacheSetup(block_size=4, spill_hot_tokens=8, spill_pinned_blocks=1, spill_buffer_bytes=300)
    # Each layer's cold blocks as in the one-layer tests: at 40 tokens blocks 1-6 (one layer of them is 768 B,
    # over the 300 B cap); at 20 tokens block 1 only (the last spill saw 19 tokens: blocks ending before 11
    # go, but block 0 is pinned), one layer of it 128 B; at 9 tokens none, and no buffers.
    for length, cold, buffers in ((40, 6, 300), (20, 1, 128), (9, 0, 0)):
        kept = sequence_bytes(four_layers, dataclasses.replace(setup, spill_hot_tokens=None), length).device
        result = sequence_bytes(four_layers, setup, length)
        assert (result.disk, result.device) == (4 * cold * FP_BLOCK, kept - 4 * cold * FP_BLOCK + buffers)


def test_shared_prefix_stays_resident_and_only_own_blocks_spill(unit: ModelGeometry) -> None:
    setup = CacheSetup(block_size=4, spill_hot_tokens=4, spill_pinned_blocks=1, spill_buffer_bytes=100)
    shared = with_shared_prefix(setup, shared_tokens=20, length=40)
    # The document: blocks 0-4 (640 B), stored once and never spilled. Own part: blocks 5-9; the last spill saw
    # 39 tokens, so blocks ending before token 35 go (5-7, 384 B on disk) and 8-9 stay (256 B) + 100 B buffers.
    plan = predict(unit, shared, fixed(40), 10_000)
    assert plan.shared_store_bytes == 5 * FP_BLOCK
    assert plan.disk_bytes_per_sequence == 3 * FP_BLOCK
    # floor((10,000 - 640) / 356) = 26.
    assert plan.concurrent == (10_000 - 640) // (2 * FP_BLOCK + 100) == 26


# ------------------------------------------------------------------ against the caches on the tiny model

# tiny_llama: 2 layers x 2 KV heads x head_dim 16, float32; 16-token blocks.
TINY_BLOCK = 16 * 2 * 2 * 2 * 16 * 4  # 8,192 B
TINY_SEGMENT = TINY_BLOCK // 2  # one layer of one block: the read-ahead unit of a full-precision spill
TINY_INT8 = 2 * 2 * (2 * 16 * 16 + 16 * 2 * 2 + 16 * 2 * 2)  # 2,560 B: a sealed block, both layers


def _two_requests() -> tuple[torch.Tensor, torch.Tensor]:
    """Two requests of 96 tokens, long `[1, 96]` each, that share their first 48 (a document)."""
    generator = torch.Generator().manual_seed(0)
    document, own = (
        torch.randint(5, 60, (1, 48), generator=generator),
        torch.randint(5, 60, (2, 48), generator=generator),
    )
    return torch.cat([document, own[:1]], dim=1), torch.cat([document, own[1:]], dim=1)


def _run(model: Any, cache: Any, ids: torch.Tensor) -> None:
    """All tokens but the last as a prompt, the last as one decode step (the spill happens at its start)."""
    with torch.inference_mode():
        model(ids[:, :-1], cache=cache)
        model(ids[:, -1:], cache=cache)


def test_int8_disk_cache_holds_what_the_planner_predicts(tmp_path: Path) -> None:
    model = tiny_llama()
    spill = Disk(path=str(tmp_path), hot_tokens=32, read_buffer_bytes=2 * TINY_SEGMENT)
    cache = GovernedCache(model, pool=Paging(16), codec="int8", spill=spill)
    assert isinstance(cache, QuantizedDiskCache)
    _run(model, cache, torch.randint(5, 60, (1, 96), generator=torch.Generator().manual_seed(0)))
    setup = planner_setup(cache, "fp32")
    assert setup is not None and (setup.codec, setup.spill_hot_tokens, setup.spill_pinned_blocks) == ("int8", 32, 1)
    # Read-ahead rows are whole segments of codes: one layer of a sealed block is 1,280 B; the cap of 8,192 B
    # holds 6.
    assert setup.spill_buffer_bytes == 6 * (TINY_INT8 // 2) == 7_680
    # Blocks 1-2 spilled (ending before token 95 - 32 = 63); sink block 0 in float32, blocks 3-5 as codes,
    # and one read-ahead row per spilled block (one layer of codes each), under the cap.
    expected = TINY_BLOCK + 3 * TINY_INT8 + 2 * (TINY_INT8 // 2)
    assert cache.stats().bytes_used == sequence_bytes(planner_geometry(model), setup, 96).device == expected
    cache.release()


def test_a_residual_window_wider_than_the_hot_window_stays_resident(tmp_path: Path) -> None:
    model = tiny_llama()
    spill = Disk(path=str(tmp_path), hot_tokens=8, read_buffer_bytes=2 * TINY_SEGMENT)
    cache = GovernedCache(model, pool=Paging(16), codec=QuantConfig(bits=8, residual=40), spill=spill)
    _run(model, cache, torch.randint(5, 60, (1, 96), generator=torch.Generator().manual_seed(0)))
    setup = planner_setup(cache, "fp32")
    assert setup is not None and (setup.residual, setup.spill_hot_tokens) == (40, 8)
    # Blocks 1-2 are sealed (they end before token 96 - 40 = 56) and spilled; blocks 3-5 hold the residual
    # window in float32 and stay, beside the sink and one read-ahead row per spilled block.
    expected = 4 * TINY_BLOCK + 2 * (TINY_INT8 // 2)
    assert cache.stats().bytes_used == sequence_bytes(planner_geometry(model), setup, 96).device == expected
    cache.release()


def test_disk_cache_under_a_tree_holds_what_the_planner_predicts(tmp_path: Path) -> None:
    model = tiny_llama()
    prefix = PrefixCache(GovernedCache(model, pool=Paging(16)).pool)
    first = GovernedCache(model, prefix=prefix)
    first_ids, ids = _two_requests()
    _run(model, first, first_ids)
    first.publish(first_ids)
    spill = Disk(path=str(tmp_path), hot_tokens=8, read_buffer_bytes=2 * TINY_SEGMENT)
    second = GovernedCache(model, prefix=prefix, spill=spill)
    assert isinstance(second, DiskOffloadCache)
    second.match(ids)
    assert second.get_seq_length() == 48
    _run(model, second, ids[:, 48:])
    setup = planner_setup(second, "fp32")
    assert setup is not None
    shared = with_shared_prefix(setup, 48, 96)
    own_bytes = sequence_bytes(planner_geometry(model), shared, 96).device
    # Own blocks 3-4 spilled (ending before token 95 - 8 = 87); block 5 and two segments of buffers stay.
    assert own_bytes == TINY_BLOCK + 2 * TINY_SEGMENT
    # The cache's stats count the tree's three document blocks it uses in full.
    assert second.stats().bytes_used == 3 * TINY_BLOCK + own_bytes
    for cache in (second, first):
        cache.release()


@pytest.mark.parametrize("hot", [0, 15, 16, 17])
def test_cold_blocks_end_before_the_hot_window_of_the_last_spill(unit: ModelGeometry, hot: int) -> None:
    setup = CacheSetup(block_size=4, spill_hot_tokens=hot)
    # 40 tokens, 39 stored at the last spill: full blocks ending at or before token 39 - hot go to disk.
    cold = sum(1 for block in range(10) if 4 * block + 4 <= 39 - hot)
    assert sequence_bytes(unit, setup, 40).disk == cold * FP_BLOCK
    assert cold == {0: 9, 15: 6, 16: 5, 17: 5}[hot]


def test_disk_cache_under_a_tree_keeps_its_sliding_window_resident(tmp_path: Path) -> None:
    # tiny_gemma3: sliding, full, sliding layers (window 32), 2 KV heads x head_dim 16, float32: three groups of
    # one layer, a 16-token block of one layer is 4,096 B (also the read-ahead segment).
    model, block = tiny_gemma3(window=32), 16 * 2 * 2 * 16 * 4
    prefix = PrefixCache(GovernedCache(model, pool=Paging(16)).pool)
    first = GovernedCache(model, prefix=prefix)
    first_ids, ids = _two_requests()
    first.match(first_ids)  # nothing cached yet: it lays the row out, so its sliding blocks join the tree as computed
    _run(model, first, first_ids)
    first.publish(first_ids)
    second = GovernedCache(model, prefix=prefix, spill=Disk(path=str(tmp_path), hot_tokens=8, read_buffer_bytes=block))
    second.match(ids)
    # The hit: the full layer's blocks 0-2; each sliding layer's blocks 1-2, which hold what a query at 48 sees
    # (17 on). The planner's shared store is that copy of the document.
    assert second.get_seq_length() == 48 and second.stats().bytes_used == 7 * block
    _run(model, second, ids[:, 48:])
    setup = planner_setup(second, "fp32")
    assert setup is not None
    plan = predict(planner_geometry(model), with_shared_prefix(setup, 48, 96), fixed(96), 10**6)
    assert plan.shared_store_bytes == 7 * block
    # Full layer: own blocks 3-4 spill (they end before token 95 - 8 = 87), block 5 stays, with one read-ahead
    # segment (the cap). Sliding layers: blocks 4-5 hold the window of a query at 95 (64 on); block 4 joined the
    # tree as computed, so it stays resident though it is older than the hot window.
    own_bytes = block + block + 2 * 2 * block
    assert plan.bytes_per_sequence - plan.shared_store_bytes / plan.concurrent == pytest.approx(own_bytes)
    assert second.stats().bytes_used == 3 * block + own_bytes
    assert second.stats().spilled_blocks == 2
    for cache in (second, first):
        cache.release()
