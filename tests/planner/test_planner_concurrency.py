"""Concurrent sequences that fit, computed by hand for small cases and for the article's setup."""

from __future__ import annotations

from typing import Any

import pytest

from hf_kvgov.planner import (
    ChainOptions,
    LengthDistribution,
    MemoryBudget,
    ModelGeometry,
    Plan,
    PlanInputs,
    budget_for_model,
    fixed,
    make_plan,
    parse_memory,
    resolve_model,
)

# 10,000 B for KV, no weights, no reserve.
BUDGET = MemoryBudget(accelerator_bytes=10_000, weight_bytes=0, reserve_fraction=0.0)


def _plan(geometry: ModelGeometry, lengths: LengthDistribution, chain: str, **knobs: Any) -> Plan:
    options = ChainOptions(max_len=16, block_size=4, **knobs)
    return make_plan(PlanInputs(geometry, BUDGET, lengths), chain, options)


def test_static_paged_prefix_counts_by_hand(unit: ModelGeometry) -> None:
    plan = _plan(unit, fixed(10), "static,paged,prefix", shared_fraction=0.5)
    # static: 16 slots x 32 B = 512 B -> floor(10000 / 512) = 19.
    # paged: 10 tokens -> 3 blocks x 128 B = 384 B -> floor(10000 / 384) = 26.
    # prefix: 4 shared tokens stored once (128 B), 2 own blocks (256 B) -> floor((10000 - 128) / 256) = 38.
    assert [s.concurrent for s in plan.steps] == [19, 26, 38]
    assert plan.step("paged").vs_previous == pytest.approx(26 / 19)
    assert plan.step("prefix").vs_first == pytest.approx(38 / 19)
    assert plan.step("static").bytes_per_sequence == 512
    assert plan.step("static").bytes_per_token == pytest.approx(51.2)


def test_share_groups_store_one_prefix_per_group(unit: ModelGeometry) -> None:
    plan = _plan(unit, fixed(10), "paged,prefix", shared_fraction=0.5, share_group=4)
    # 256 N + ceil(N / 4) x 128 <= 10000: N = 34 uses 8704 + 9 x 128 = 9856; N = 35 would use 10112.
    assert plan.step("prefix").concurrent == 34


def test_length_distribution_uses_mean_blocks(unit: ModelGeometry) -> None:
    lengths = LengthDistribution("three", (4, 8, 12))
    plan = _plan(unit, lengths, "static,paged")
    # paged: 1, 2, 3 blocks -> mean 256 B -> 39; static: 512 B each -> 19.
    assert [s.concurrent for s in plan.steps] == [19, 39]
    assert plan.step("paged").bytes_per_token == pytest.approx(256 / 8)


def test_disk_capacity_limits_spill(unit: ModelGeometry) -> None:
    options = ChainOptions(max_len=64, block_size=4, spill_hot_tokens=8)
    inputs = PlanInputs(unit, BUDGET, fixed(40), disk_bytes=2_000)
    spill = make_plan(inputs, "paged,spill", options).step("spill")
    # 10 blocks. The spill at the start of the 40th token's step saw 39 tokens: blocks ending before token
    # 39 - 8 = 31, i.e. blocks 0-6, went to disk (896 B); blocks 7-9 stay (384 B, token 31 is in block 7).
    # The disk holds floor(2,000 / 896) = 2 sequences' worth, the accelerator 26.
    assert (spill.bytes_per_sequence, spill.disk_bytes_per_sequence) == (384, 896)
    assert (spill.concurrent, spill.limited_by) == (2, "disk")


def test_llama_13b_on_80gib_a100_holds_30_full_length_users() -> None:
    geometry = resolve_model("LLaMA-13B")
    budget = budget_for_model(geometry, parse_memory("80GiB"), "fp16", 0.10)
    # 80 x 2^30 - 10% reserve - 13,015,864,320 x 2 B of weights.
    assert budget.kv_bytes == 85_899_345_920 - 8_589_934_592 - 26_031_728_640
    plan = make_plan(PlanInputs(geometry, budget, fixed(2048)), "static,paged", ChainOptions(max_len=2048))
    # 51,277,682,688 // 1,677,721,600 = 30: paging cannot help when every user is as long as the buffer.
    assert [s.concurrent for s in plan.steps] == [30, 30]


def test_static_buffer_shorter_than_longest_sequence_is_an_error(unit: ModelGeometry) -> None:
    with pytest.raises(ValueError, match=r"longest sequence \(20 tokens\) is longer than the static buffer"):
        _plan(unit, fixed(20), "static,paged")


def test_one_step_written_in_full_precision_is_kept_room_for_once(unit: ModelGeometry) -> None:
    # unit, block 4: fp16 block 2 x 4 x 8 x 2 = 128 B, int8 block 64 codes + 32 key + 16 value statistics = 112 B.
    # 40 tokens int8: the sink block in fp16, 9 sealed: 128 + 9 x 112 = 1,136 B; 8 sequences are 9,088 B.
    # Steps of 16 tokens: 0-15 hold 4 fp16 blocks (512 B); 16-31 the sink and 3 sealed (464 B) + 4 fp16 blocks
    # (976 B); 32-39 the sink and 7 sealed (912 B) + 2 fp16 blocks (1,168 B), the most: 32 B over 1,136, once.
    def plan(budget: int, step: int, chain: str = "paged,int8") -> Plan:
        inputs = PlanInputs(unit, MemoryBudget(budget, weight_bytes=0, reserve_fraction=0.0), fixed(40))
        return make_plan(inputs, chain, ChainOptions(max_len=16, block_size=4, step_tokens=step))

    assert plan(9_088, 0).step("int8").concurrent == 8
    assert plan(9_120, 16).step("int8").concurrent == 8
    assert plan(9_119, 16).step("int8").concurrent == 7
    # Bytes per sequence stay the steady state's: the step's room is the budget's, not a sequence's.
    assert plan(9_119, 16).step("int8").bytes_per_sequence == 1136
    # Full precision stages nothing: a step's tokens cost what they cost after it (10 blocks: 1,280 B, 7 fit).
    assert plan(8_960, 16, "paged").step("paged").concurrent == 7

    # A disk tier keeping 8 hot tokens spills at a step's start the blocks that ended before its tokens - 1 - 8:
    # at 40 tokens blocks 0-6 (7-9 stay: 384 B). Steps of 16: 0-15 write 4 blocks (512 B); 16-31 start with
    # blocks 1-3 resident (block 0 spilled) and write 4 (896 B), the most: 512 B over 384, once; 32-39 start with
    # blocks 5-7 and write 2 (640 B).
    def spilled(budget: int) -> Plan:
        inputs = PlanInputs(unit, MemoryBudget(budget, weight_bytes=0, reserve_fraction=0.0), fixed(40))
        options = ChainOptions(max_len=16, block_size=4, step_tokens=16, spill_hot_tokens=8)
        return make_plan(inputs, "paged,spill", options)

    assert spilled(10 * 384 + 512).step("spill").bytes_per_sequence == 384
    assert spilled(10 * 384 + 512).step("spill").concurrent == 10
    assert spilled(10 * 384 + 511).step("spill").concurrent == 9
