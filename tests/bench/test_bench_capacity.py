"""`kvgov bench capacity` on the tiny model: counts derived by hand from the model's geometry."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hf_kvgov.bench import allocation
from hf_kvgov.bench.capacity import CapacityConfig, CapacityReport, capacity_markdown, run_capacity
from hf_kvgov.planner.lengths import parse_lengths
from tests.bench.conftest import BLOCK, BYTES_PER_BLOCK, BYTES_PER_TOKEN

LENGTHS = (40, 7, 7)
BUDGET = 12 * BYTES_PER_BLOCK + 100  # a pool of 12 blocks; the 100 bytes cannot make a 13th
# One int8 block sealed: codes 2 x 16 x 16, fp16 scale + zero per key channel (16) and per value token (16),
# per layer and KV head.
SEALED_INT8_BLOCK = 2 * 2 * (2 * 16 * 16 + 16 * 2 * 2 + 16 * 2 * 2)


def count_by_hand(order: tuple[int, ...], cost: dict[int, int], capacity: int) -> tuple[int, int]:
    """(sequences taken in order, cycling, before one does not fit in `capacity`; the units they hold)."""
    taken = held = 0
    while held + cost[order[taken % len(order)]] <= capacity:
        held += cost[order[taken % len(order)]]
        taken += 1
    return taken, held


@pytest.fixture(scope="module")
def report(tiny: tuple[Any, Any]) -> CapacityReport:
    model, tokenizer = tiny
    config = CapacityConfig(("dynamic", "paged", "paged-attn", "int8", "h2o"), parse_lengths("40,7,7"), BUDGET)
    return run_capacity(model, tokenizer, config, model_name="tiny", progress=False)


def _row(report: CapacityReport, cache: str) -> Any:
    (row,) = [r for r in report.rows if r.cache == cache]
    return row


@pytest.mark.parametrize("cache", ["paged", "paged-attn"])
def test_paged_count_is_the_blocks_that_fit_in_the_pool(report: CapacityReport, cache: str) -> None:
    blocks = {length: math.ceil(length / BLOCK) for length in LENGTHS}  # 40 -> 3, 7 -> 1
    fit, held_blocks = count_by_hand(LENGTHS, blocks, BUDGET // BYTES_PER_BLOCK)
    assert (fit, held_blocks) == (6, 10)
    row = _row(report, cache)
    assert row.method == "pool refused"
    assert row.sequences == fit
    assert row.kv_bytes_held == held_blocks * BYTES_PER_BLOCK
    assert row.refused_length == 40
    # The planner divides the budget by the mean bytes of a sequence: 12.01 blocks / (5/3 blocks) -> 7.
    mean_bytes = sum(blocks[length] for length in LENGTHS) * BYTES_PER_BLOCK / len(LENGTHS)
    assert row.predicted_sequences == math.floor(BUDGET / mean_bytes) == 7
    assert row.predicted_bytes_per_sequence == pytest.approx(mean_bytes)
    assert row.measured_vs_predicted == pytest.approx(6 / 7)
    assert row.planner_setup == "block 16"


def test_dynamic_count_is_the_tokens_that_fit(report: CapacityReport) -> None:
    cost = {length: length * BYTES_PER_TOKEN for length in LENGTHS}
    fit, held = count_by_hand(LENGTHS, cost, BUDGET)
    assert (fit, held) == (9, 82_944)
    row = _row(report, "dynamic")
    assert (row.method, row.sequences, row.kv_bytes_held, row.refused_length) == ("measured bytes", 9, held, 40)
    assert row.bytes_per_token == BYTES_PER_TOKEN
    assert row.predicted_sequences == math.floor(BUDGET / (sum(LENGTHS) / 3 * BYTES_PER_TOKEN)) == 10


def test_int8_count_uses_the_sealed_block_sizes(report: CapacityReport) -> None:
    # 40 tokens: sink block and tail in fp32, one sealed int8 block; 7 tokens: one fp32 block.
    cost = {40: 2 * BYTES_PER_BLOCK + SEALED_INT8_BLOCK, 7: BYTES_PER_BLOCK}
    fit, held = count_by_hand(LENGTHS, cost, BUDGET)
    row = _row(report, "int8")
    assert (row.method, row.sequences, row.kv_bytes_held, row.refused_length) == ("measured bytes", fit, held, 7)
    assert fit == 8
    mean = sum(cost[length] for length in LENGTHS) / 3
    assert row.predicted_sequences == math.floor(BUDGET / mean) == 8
    assert row.planner_setup == "block 16, int8 (sink 1 block)"


def test_h2o_is_measured_and_planned(report: CapacityReport) -> None:
    row = _row(report, "h2o")
    assert row.method == "measured bytes" and row.sequences > _row(report, "dynamic").sequences
    assert row.predicted_sequences is not None and row.predicted_sequences > 0
    assert row.planner_setup == "block 1, budget 20% (at least 1)"


def test_markdown_and_json_carry_the_prediction(report: CapacityReport) -> None:
    text = capacity_markdown(report)
    assert "| paged | pool refused | 6 | 7 | 0.86 | 81,920 |" in text
    data = report.to_dict()
    assert data["budget_bytes"] == BUDGET and [r["cache"] for r in data["rows"]][:2] == ["dynamic", "paged"]
    assert data["rows"][1]["predicted_sequences"] == 7


def test_a_budget_larger_than_free_memory_is_refused(tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = tiny
    monkeypatch.setattr(allocation, "available_memory", lambda device: 10 * BYTES_PER_BLOCK)
    config = CapacityConfig(("paged",), parse_lengths("7"), BUDGET)
    with pytest.raises(ValueError, match=r"allocates the whole budget .* only 81,920 bytes are available"):
        run_capacity(model, tokenizer, config, progress=False)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="budget_bytes must be a positive int"):
        CapacityConfig(("paged",), parse_lengths("7"), 0)
    with pytest.raises(TypeError, match="lengths must be a LengthDistribution"):
        CapacityConfig(("paged",), [7], 100)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown cache 'nope'"):
        CapacityConfig(("nope",), parse_lengths("7"), 100)
