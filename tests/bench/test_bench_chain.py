"""The chain benchmark on the tiny model: every step, refusals, and capacity counted by hand.

Geometry (tests/bench/conftest.py): 2 layers x 2 KV heads x head_dim 16, float32: 512 B per token, a block
of 16 tokens 8,192 B. Sequences of 96 tokens (6 full blocks), the first 48 (3 blocks) one shared document.
A disk cache spills at the start of a step, counting the tokens stored before it: after the 96th token's
step it has moved the full blocks that end before token 95 - hot (except block 0, which never spills).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from hf_kvgov.bench.chain import (
    STEPS,
    ChainBenchConfig,
    ChainReport,
    chain_markdown,
    run_chain,
    selected_steps,
    write_chain_plots,
)
from hf_kvgov.bench.chain_steps import shared_document
from hf_kvgov.data_text import demo_text
from hf_kvgov.engine.rules import REFUSED_PAIRS
from tests.bench.conftest import BYTES_PER_BLOCK, BYTES_PER_TOKEN

LENGTH, SHARED = 96, 48
BLOCKS, SHARED_BLOCKS = LENGTH // 16, SHARED // 16  # 6 and 3
BUDGET = 40 * BYTES_PER_BLOCK + 100  # 40 blocks; the 100 bytes cannot make a 41st
# One sealed int8 block: codes 2 x 16 x 16, fp16 scale + zero per key channel (16) and per value token (16),
# per layer and KV head.
SEALED_INT8_BLOCK = 2 * 2 * (2 * 16 * 16 + 16 * 2 * 2 + 16 * 2 * 2)  # 2,560
SEGMENT = 2 * 16 * 2 * 16 * 4  # K and V of one layer of one block: the disk cache's read-ahead unit
SEALED_SEGMENT = SEALED_INT8_BLOCK // 2  # one layer of a sealed block: QuantizedDiskCache's read-ahead unit


@pytest.fixture(scope="module")
def report(tiny: tuple[Any, Any]) -> ChainReport:
    model, tokenizer = tiny
    config = ChainBenchConfig(
        budget_bytes=BUDGET,
        shared_tokens=SHARED,
        length=LENGTH,
        decode_steps=2,
        spill_hot_tokens=32,
        spill_hot_tokens_shared=8,
        spill_buffer_bytes=2 * SEGMENT,
        chunk=32,
        ppl_tokens=48,
        passkey_samples=1,
        passkey_length=300,
        passkey_new_tokens=4,
    )
    return run_chain(model, tokenizer, config, demo_text(), model_name="tiny", progress=False)


def test_every_step_is_present_in_the_chain_order(report: ChainReport) -> None:
    assert [r.step for r in report.rows] == [
        "paged", "prefix", "int8", "h2o", "spill", "disk", "int8_disk", "prefix_disk", "prefix_int8_disk",
    ]  # fmt: skip
    assert [r.step for r in report.rows] == [s.name for s in STEPS]
    assert [r.side for r in report.rows] == [False] * 5 + [True] * 4


def test_every_step_is_built(report: ChainReport) -> None:
    assert all(row.refused is None and not row.notes for row in report.rows)
    assert REFUSED_PAIRS == {}  # every pair of links is built
    assert "refused: " not in chain_markdown(report)


def test_paged_capacity_is_the_sequences_whose_blocks_fit(report: ChainReport) -> None:
    row = report.row("paged")
    assert row.capacity_method == "pool refused"
    assert row.sequences == 40 // BLOCKS == 6  # 36 blocks; a 7th sequence would need 42
    assert row.held_bytes == 6 * BLOCKS * BYTES_PER_BLOCK
    assert row.kv_bytes_per_token == BYTES_PER_TOKEN
    assert row.predicted_sequences == math.floor(BUDGET / (BLOCKS * BYTES_PER_BLOCK)) == 6
    assert row.measured_vs_predicted == 1.0


def test_prefix_sharing_fits_more_than_paged(report: ChainReport) -> None:
    row = report.row("prefix")
    # The document's 3 blocks once, then 3 blocks per request: 3 + 3n <= 40 -> 12 requests (39 blocks).
    assert row.sequences == 12 and row.sequences > report.row("paged").sequences
    assert row.held_bytes == (SHARED_BLOCKS + 12 * 3) * BYTES_PER_BLOCK
    assert row.held_bytes_per_token == pytest.approx(39 * BYTES_PER_BLOCK / (12 * LENGTH))
    assert row.kv_bytes_per_token == BYTES_PER_TOKEN  # one request's own view counts the shared blocks too
    # The planner: floor((budget - one stored document) / one request's own blocks).
    assert row.predicted_sequences == (BUDGET - 3 * BYTES_PER_BLOCK) // (3 * BYTES_PER_BLOCK) == 12


def test_int8_with_prefix_counts_full_precision_and_sealed_bytes(report: ChainReport) -> None:
    row = report.row("int8")
    document = BYTES_PER_BLOCK + 2 * SEALED_INT8_BLOCK  # the sink block stays in full precision
    own = 3 * SEALED_INT8_BLOCK  # every own block is full, so sealed
    fit = (BUDGET - document) // own
    assert fit == 40
    # The pool's cap counts every byte it holds, a step's blocks before they are sealed too: the 40th request's first
    # 32-token chunk writes two full-precision blocks on top of what 39 requests hold, past the budget. The planner
    # keeps room for one such step (`step_tokens`: two blocks in full precision rather than codes), so it names 39.
    in_flight = 2 * BYTES_PER_BLOCK
    assert document + (fit - 1) * own + in_flight > BUDGET
    assert document + fit * own + 2 * (BYTES_PER_BLOCK - SEALED_INT8_BLOCK) > BUDGET  # the planner's room
    served = fit - 1
    assert (row.sequences, row.held_bytes) == (served, document + served * own)
    assert row.predicted_sequences == served and row.measured_vs_predicted == 1.0
    assert "full-precision and sealed bytes" in (row.capacity_method or "")
    assert row.kv_bytes_per_token == (BYTES_PER_BLOCK + 5 * SEALED_INT8_BLOCK) / LENGTH


def test_measured_capacity_is_within_ten_percent_of_the_planner(report: ChainReport) -> None:
    for step in ("paged", "prefix", "int8", "h2o", "spill", "disk", "int8_disk", "prefix_disk", "prefix_int8_disk"):
        row = report.row(step)
        assert row.measured_vs_predicted is not None, step
        assert abs(row.measured_vs_predicted - 1) <= 0.10, (step, row.sequences, row.predicted_sequences)


# One layer's block of 16 slot rows in the eviction pool: K and V records of 2 KV heads, each int8 codes (16)
# with an fp16 scale and zero (4), 20 bytes, which is 5 float32 elements.
SLOT_BLOCK = 16 * 2 * 20 * 2  # 1,280


def test_h2o_reads_the_document_and_keeps_its_own_slots_in_pool_blocks(report: ChainReport) -> None:
    row = report.row("h2o")
    assert row.capacity_method is not None and row.capacity_method.startswith("measured bytes")
    assert "prefix sharing" in (row.chain or "")
    # Request 1 reads the 48-token document from the tree (3 float32 blocks) and has 48 tokens of its own: 20% of
    # the 47 fed to the model = 9 slots per layer and KV head, one block of slot rows per layer; per slot and KV
    # head an fp32 attention mass (4), an int64 position and a bool (9).
    document = SHARED_BLOCKS * BYTES_PER_BLOCK
    own = 2 * SLOT_BLOCK + 2 * 2 * 9 * (4 + 9)
    assert own == 3_028
    assert row.kv_bytes_per_token == (document + own) / LENGTH
    assert row.sequences == (BUDGET - document) // own == 100
    assert row.held_bytes == document + 100 * own
    assert row.predicted_sequences == 100  # the planner: the document stored once, H2O on the own tokens


def test_recall_row_counts_the_kept_slots_and_the_recall_tier(report: ChainReport) -> None:
    row = report.row("spill")
    assert (row.chain or "").startswith("HeavyHitterCache") and row.numerics == "h2o@0.2:int8+recall"
    assert "prefix sharing" in (row.chain or "") and "disk spill with recall" in (row.chain or "")
    assert "shared buffer" in row.label
    # As the H2O row, and 48 - 9 = 39 own tokens evicted per layer and KV head: 2 pages of 16 written, 7 pending.
    # Resident besides the slots: the pending page (16 x (K, V fp32 + int64 position) + its count), the page
    # table (2 written + 16 spare entries of a mean key, the default summary, and two int64) with its count; and,
    # in the shared buffer (the default), the 2 pages of each of the 2 KV heads recalled by the last layer step.
    token = 2 * 16 * 4 + 8
    per_head = 16 * token + 8 + 8 + (2 + 16) * (16 * 4 + 16)
    own = 2 * SLOT_BLOCK + 2 * 2 * (9 * (4 + 9) + per_head) + 2 * 2 * 16 * token
    document = SHARED_BLOCKS * BYTES_PER_BLOCK
    assert row.kv_bytes_per_token == (document + own) / LENGTH
    assert row.sequences == row.predicted_sequences == (BUDGET - document) // own == 11


def test_disk_side_row_counts_resident_blocks_and_read_ahead(report: ChainReport) -> None:
    row = report.row("disk")
    # At the last step 95 tokens are stored: blocks before (95 - 32) // 16 = 3 spill except block 0, so
    # blocks 0, 3, 4, 5 stay, plus two segments of read-ahead.
    resident = 4 * BYTES_PER_BLOCK + 2 * SEGMENT
    assert row.kv_bytes_per_token == resident / LENGTH
    assert row.sequences == BUDGET // resident == 8
    assert row.predicted_sequences == 8  # the planner keeps block 3, which holds token 95 - 32 = 63, too


def test_int8_disk_row_keeps_the_hot_window_as_codes(report: ChainReport) -> None:
    row = report.row("int8_disk")
    assert (row.chain or "").startswith("QuantizedDiskCache")
    # Blocks 1-2 spill as codes (block 0 is the full-precision sink); blocks 3-5 stay sealed (block 5 filled
    # and sealed at the end of the last step). Read-ahead: one sealed segment of 1,280 B per spilled block,
    # under the cap (2 x 4,096 B hold 6).
    buffers = 2 * SEALED_SEGMENT
    resident = BYTES_PER_BLOCK + 3 * SEALED_INT8_BLOCK + buffers
    assert (buffers, resident) == (2_560, 18_432)
    assert row.kv_bytes_per_token == resident / LENGTH
    assert row.capacity_method is not None and row.capacity_method.startswith("measured bytes")
    assert row.sequences == row.predicted_sequences == BUDGET // resident == 17
    assert row.planner_setup == "block 16, int8 (sink 1 block), spill, hot 32"


def test_prefix_disk_row_fills_one_tree_and_counts_read_ahead(report: ChainReport) -> None:
    row = report.row("prefix_disk")
    assert (row.chain or "").startswith("DiskOffloadCache")
    # Request 1: the document's 3 tree blocks stay; own blocks 3-4 end before token 95 - 8 = 87 and spill;
    # block 5 stays, with two segments of read-ahead allocated by the read-back.
    assert row.kv_bytes_per_token == (3 * BYTES_PER_BLOCK + BYTES_PER_BLOCK + 2 * SEGMENT) / LENGTH
    # The fill: request 0 publishes the document's 3 blocks (24,576 B) and keeps its own part as every request does:
    # 1 block + buffers = 16,384 B. A request writes tokens 48-79 (two new blocks, 16,384 B), then 80-94 with block
    # 3 spilled and block 4 not yet, reading block 3 back (two blocks and one segment of read-ahead, 20,480 B), then
    # token 95 alone. Request n + 1 fits while 24,576 + 16,384 n + 20,480 <= budget: n = 17, so 18 requests.
    document, later, writing = 3 * BYTES_PER_BLOCK, BYTES_PER_BLOCK + 2 * SEGMENT, 2 * BYTES_PER_BLOCK + SEGMENT
    assert document + 17 * later + writing <= BUDGET < document + 18 * later + writing
    assert (row.sequences, row.held_bytes) == (18, document + 18 * later)
    # The planner keeps room for the newest request's largest step (`step_tokens` = the 32-token chunk): its steps
    # hold 2 blocks (tokens 48-79), then 1 + 1 (80-95; block 3 spilled), against 1 block in the steady state, so
    # one block once: floor((budget - the document's 3 blocks - 1 block) / one request's 1 block + buffers) = 18.
    assert row.predicted_sequences == (BUDGET - 4 * BYTES_PER_BLOCK) // later == 18
    assert "read-ahead" in (row.capacity_method or "")


def test_prefix_int8_disk_row_spills_own_sealed_blocks(report: ChainReport) -> None:
    row = report.row("prefix_int8_disk")
    assert (row.chain or "").startswith("QuantizedDiskCache") and "prefix sharing" in (row.chain or "")
    document = BYTES_PER_BLOCK + 2 * SEALED_INT8_BLOCK  # the tree's sink block in float32, blocks 1-2 as codes
    # Request 1: own blocks 3-4 spill as codes; block 5, filled by the last step, sealed at its end. Read-ahead:
    # one sealed segment of 1,280 B per spilled block (the cap, 2 x 4,096 B, holds 6).
    buffers = 2 * SEALED_SEGMENT
    assert row.kv_bytes_per_token == (document + SEALED_INT8_BLOCK + buffers) / LENGTH
    # Capacity from the probe's bytes: (budget - the document) // (1 sealed block + buffers) = 61 requests.
    later = SEALED_INT8_BLOCK + buffers
    assert row.capacity_method is not None and row.capacity_method.startswith("measured bytes")
    assert (row.sequences, row.held_bytes) == ((BUDGET - document) // later, document + 61 * later) == (61, 325_632)
    # The planner's own arithmetic (shared store + own resident blocks + read-ahead) gives the same.
    assert row.predicted_sequences == 61
    assert row.numerics == "= int8 (int8@16: same K/V)"


def test_numerics_are_reused_where_identical(report: ChainReport) -> None:
    assert report.row("paged").numerics == "paged@16"
    assert report.row("prefix").numerics == "= paged (paged@16: same K/V)"
    assert report.row("prefix").perplexity == report.row("paged").perplexity
    assert report.row("int8").numerics == "int8@16"
    assert report.row("h2o").numerics == "h2o@0.2:int8"
    assert report.row("disk").numerics == "= paged (paged@16: same K/V)"  # spilled blocks return bit for bit
    assert report.row("prefix_disk").numerics == "= paged (paged@16: same K/V)"
    assert report.row("int8_disk").numerics == "= int8 (int8@16: same K/V)"  # codes spill as stored
    assert report.row("int8_disk").perplexity == report.row("int8").perplexity
    for step in ("paged", "int8", "h2o", "disk", "int8_disk", "prefix_disk"):
        row = report.row(step)
        assert row.perplexity is not None and row.perplexity > 1, step
        assert row.passkey_accuracy is not None and 0 <= row.passkey_accuracy <= 100, step
        assert row.decode_tokens_per_s is not None and row.decode_tokens_per_s > 0, step
    assert report.row("paged").decode_vs_first == 1.0


def test_requests_share_exactly_the_document(tiny: tuple[Any, Any]) -> None:
    _, tokenizer = tiny
    requests = shared_document(tokenizer, list(range(4, 40)), shared=20, length=30)
    first, second = requests.tokens(0), requests.tokens(1)
    assert len(first) == len(second) == 30
    assert first[:20] == second[:20] == list(range(4, 24))
    assert first[20] != second[20]  # each request's own part starts with its own token
    assert first[20] not in tokenizer.all_special_ids


def test_json_and_plots(report: ChainReport, tmp_path: Any) -> None:
    data = report.to_dict()
    assert data["config"]["budget_bytes"] == BUDGET and len(data["rows"]) == len(STEPS)
    paths = write_chain_plots(report, tmp_path, "chain_tiny")
    assert [p.name for p in paths] == ["chain_tiny_bytes_per_token.png", "chain_tiny_capacity.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="shared_tokens is the document every request starts with"):
        ChainBenchConfig(budget_bytes=BUDGET, shared_tokens=96, length=96)
    with pytest.raises(ValueError, match=r"ChainBenchConfig.budget_bytes must be an int >= 1; got 0"):
        ChainBenchConfig(budget_bytes=0, shared_tokens=0)
    with pytest.raises(ValueError, match="budget"):
        ChainBenchConfig(budget_bytes=BUDGET, shared_tokens=0, h2o_budget=1.5)
    # Own part 48 tokens (blocks 3-5): the spill at token 96 moves blocks ending before token 95 - hot, so block
    # 3 (tokens 48-63) spills only if 64 <= 95 - hot, i.e. hot <= 31.
    with pytest.raises(ValueError, match="spill_hot_tokens_shared=32 keeps every full block of a request's own 48"):
        ChainBenchConfig(budget_bytes=BUDGET, shared_tokens=SHARED, length=LENGTH, spill_hot_tokens_shared=32)
    ChainBenchConfig(budget_bytes=BUDGET, shared_tokens=SHARED, length=LENGTH, spill_hot_tokens_shared=31)


def test_a_chosen_subset_of_steps_runs_alone(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    config = ChainBenchConfig(
        budget_bytes=BUDGET, shared_tokens=SHARED, length=LENGTH, decode_steps=1, ppl_tokens=0,
        spill_hot_tokens_shared=8, steps=("spill", "paged"),
    )  # fmt: skip
    report = run_chain(model, tokenizer, config, demo_text(), model_name="tiny", progress=False)
    assert [r.step for r in report.rows] == ["paged", "spill"]  # in the chain's order
    assert report.row("spill").sequences == 11  # as in the full run


def test_one_recall_buffer_per_layer_holds_every_layers_pages_and_fits_fewer(tiny: tuple[Any, Any]) -> None:
    model, tokenizer = tiny
    config = ChainBenchConfig(
        budget_bytes=BUDGET, shared_tokens=SHARED, length=LENGTH, decode_steps=1, ppl_tokens=0,
        spill_hot_tokens_shared=8, steps=("paged", "spill"), recall_buffer="layer",
    )  # fmt: skip
    report = run_chain(model, tokenizer, config, demo_text(), model_name="tiny", progress=False)
    row = report.row("spill")
    assert "layer buffer" in row.label
    # As the recall row of the full run, but each of the 2 layers holds its 2 recalled pages per KV head.
    token = 2 * 16 * 4 + 8
    per_head = 16 * token + 8 + 8 + (2 + 16) * (16 * 4 + 16) + 2 * 16 * token
    own = 2 * SLOT_BLOCK + 2 * 2 * (9 * (4 + 9) + per_head)
    document = SHARED_BLOCKS * BYTES_PER_BLOCK
    assert row.kv_bytes_per_token == (document + own) / LENGTH
    assert row.sequences == row.predicted_sequences == (BUDGET - document) // own == 8  # shared: 11
    with pytest.raises(ValueError, match="recall_buffer must be one of layer, shared; got 'all'"):
        ChainBenchConfig(BUDGET, SHARED, length=LENGTH, spill_hot_tokens_shared=8, recall_buffer="all")


@pytest.mark.parametrize(
    ("steps", "message"), [(("paged", "nope"), r"Unknown chain bench step\(s\) \['nope'\]"), (("prefix",), "reuses")]
)
def test_bad_step_subsets_are_refused(steps: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config = ChainBenchConfig(BUDGET, SHARED, length=LENGTH, spill_hot_tokens_shared=8, steps=steps)
        selected_steps(config)


def test_on_layer_groups_the_eviction_steps_read_the_tree_and_match_the_planner() -> None:
    from tests.char_tokenizer import char_tokenizer
    from tests.conftest import tiny_gemma3

    model = tiny_gemma3(window=8)
    config = ChainBenchConfig(
        budget_bytes=BUDGET, shared_tokens=SHARED, length=LENGTH, decode_steps=1, ppl_tokens=0,
        spill_hot_tokens_shared=8, steps=("paged", "h2o", "spill"),
    )  # fmt: skip
    report = run_chain(model, char_tokenizer(), config, demo_text(), model_name="tiny-gemma3", progress=False)
    for step in ("h2o", "spill"):
        row = report.row(step)
        assert "prefix sharing" in (row.chain or ""), row.notes
        assert not row.notes
        assert row.measured_vs_predicted == 1.0, (step, row.sequences, row.predicted_sequences)
