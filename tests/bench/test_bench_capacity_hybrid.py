"""`kvgov bench capacity` on a hybrid model: a PagedCache's sliding layer groups free what left their window,
the fill counts that (a prompt written a block a step, then a decode step), and so does the planner.

Tiny Gemma-3 layout: layers sliding (window 8), full, sliding; 2 KV heads of dim 16, float32, 16-token
blocks. Layer groups of one layer each, so a block is one layer's 16 tokens: 2 x 2 x 16 x 4 x 16 = 4,096 B.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from hf_kvgov.bench.capacity import CapacityConfig, run_capacity
from hf_kvgov.planner.lengths import parse_lengths
from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_gemma3

LENGTH, WINDOW, BLOCK = 64, 8, 16
LAYER_BLOCK = 2 * 2 * 16 * 4 * BLOCK  # K and V, 2 KV heads, dim 16, fp32, 16 tokens: one layer's block
# A decoding request of 64 tokens (its last query at 63 sees 56..63): the full layer holds 4 blocks, each
# sliding layer block 3 (48-63) alone.
STEADY = 4 + 1 + 1
# While its prompt is written a block a step, the last prompt step (queries from 48 on see 41..) still holds
# blocks 2 and 3 in each sliding layer: a request being filled peaks at 4 + 2 + 2 blocks.
PEAK = 4 + 2 + 2


@pytest.fixture(scope="module")
def gemma3_and_tokenizer() -> tuple[Any, Any]:
    return tiny_gemma3(window=WINDOW), char_tokenizer()


@pytest.mark.parametrize("capacity_blocks", [30, 32])
def test_paged_capacity_counts_the_windows_only(gemma3_and_tokenizer: tuple[Any, Any], capacity_blocks: int) -> None:
    model, tokenizer = gemma3_and_tokenizer
    budget = capacity_blocks * LAYER_BLOCK + 100
    config = CapacityConfig(("paged",), parse_lengths(str(LENGTH)), budget)
    (row,) = run_capacity(model, tokenizer, config, model_name="tiny-gemma3", progress=False).rows
    held = 0
    while held + PEAK <= capacity_blocks:  # the next request fits while it is written
        held += STEADY
    assert row.method == "pool refused" and row.sequences == held // STEADY
    assert row.kv_bytes_held == held * LAYER_BLOCK
    # The planner counts decoding requests: floor(budget / 6 blocks). With 32 blocks both say 5; with 30 the
    # fill refuses the fifth request at its peak (24 + 8 > 30) where the planner still fits it.
    assert row.predicted_sequences == math.floor(budget / (STEADY * LAYER_BLOCK))
    assert (row.sequences, row.predicted_sequences) == ((5, 5) if capacity_blocks == 32 else (4, 5))


def test_disk_capacity_spills_only_the_full_layer(gemma3_and_tokenizer: tuple[Any, Any]) -> None:
    model, tokenizer = gemma3_and_tokenizer
    config = CapacityConfig(("disk@16",), parse_lengths(str(LENGTH)), 40 * LAYER_BLOCK + 100)
    (row,) = run_capacity(model, tokenizer, config, model_name="tiny-gemma3", progress=False).rows
    # A decoding request of 64 tokens with a 16-token hot window: the full layer spilled block 1 ((63 - 16) // 16
    # - the sink block = 1) and holds blocks 0, 2 and 3; each sliding layer holds block 3 (48-63) and spills
    # nothing (its 8-token window is shorter than the hot window); reading block 1 back takes one layer's block of
    # read-ahead. 3 + 1 + 1 + 1 = 6 blocks (every layer spilling, as before layer groups: 3 blocks in each of 3
    # layers + the read-ahead = 10).
    assert row.bytes_per_sequence == 6 * LAYER_BLOCK
    assert row.predicted_bytes_per_sequence == 6 * LAYER_BLOCK and row.sequences == row.predicted_sequences == 6
