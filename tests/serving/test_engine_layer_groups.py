"""Layer groups in the serving engine: on a hybrid model (tiny Gemma-3: two sliding layers of window 8, one full
layer) each group has its own tables and a sliding group's holds only the blocks its window sees, so a request holds
far less than one table for every layer; every request still answers as it would alone (`DynamicCache`, or
`QuantizedCache` with a codec) through chunked prefill, prefix hits of unequal length past the window, preemption by
recompute or swap, and every block comes back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hf_kvgov import Disk
from hf_kvgov.serving import ServingEngine
from tests.conftest import tiny_gemma3
from tests.serving.test_engine import alone, alone_quantized, greedy, prompts_with_shared_prefix

MODEL = tiny_gemma3()
WINDOW, SIZE, CHUNK, NEW = 8, 4, 16, 20
PROMPTS = prompts_with_shared_prefix(MODEL.config.vocab_size, (30, 3, 17, 9, 1, 25), shared=29)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return [alone(MODEL, p, NEW) for p in PROMPTS]


def sliding_bound() -> int:
    """The most blocks a sliding table holds: its window and one step's tokens, one block of slack each side."""
    return -(-(WINDOW + CHUNK - 1) // SIZE) + 1


def engine(**kwargs: Any) -> ServingEngine:
    return ServingEngine(MODEL, block_size=SIZE, max_batched_tokens=CHUNK, **kwargs)


def test_the_pool_groups_layers_by_window() -> None:
    with engine() as served:
        assert [(group.layers, group.window) for group in served.pool.groups] == [((0,), 8), ((2,), 8), ((1,), None)]
        assert served.pool.layers_per_block == 1  # a block is one layer's, not three


def test_sliding_tables_hold_only_their_window(reference: list[list[int]]) -> None:
    """Stepped by hand: after every step, each running request's sliding tables hold at most the window's blocks
    (the rest were given back) while its full table holds every token; the answers are those run alone."""
    with engine(prefix_sharing=False) as served:
        ids = [served.add_request(p, greedy(NEW)) for p in PROMPTS]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        freed_any = False
        while served.has_work:
            for event in served.step():
                outputs[event.request_id].append(event.token)  # type: ignore[arg-type]
            for request in served.scheduler.running:
                assert request.tables is not None
                for group, table in zip(served.pool.groups, request.tables.tables, strict=True):
                    if group.window is None:
                        assert table.freed == 0 and len(table) >= -(-request.stored // SIZE)
                    else:
                        assert len(table.live_ids) <= sliding_bound()
                        freed_any |= table.freed > 0
        assert freed_any
        assert [outputs[i] for i in ids] == reference
        assert served.pool.num_used == 0


def test_a_long_request_fits_a_cap_one_table_per_layer_would_not(reference: list[list[int]]) -> None:
    """59 prompt tokens + 20 new: 20 blocks per table. The full layer holds 20, each sliding layer at most
    `sliding_bound()`; a cap below 3 x 20 layer blocks serves it, and one below what the groups need refuses it."""
    prompt = PROMPTS[0]
    with engine() as probe:
        per_block = probe.pool.bytes_per_block
    needed = 20 + 2 * sliding_bound()
    assert needed < 3 * 20
    with engine(max_bytes=needed * per_block) as served:
        assert served.generate([prompt], greedy(NEW)) == [reference[0]]
        assert served.stats().kv_bytes_peak <= needed * per_block
    with engine(max_bytes=(needed - 1) * per_block) as served, pytest.raises(ValueError, match="3 layer groups"):
        served.add_request(prompt, greedy(NEW))


def test_prefix_hits_of_unequal_length_past_the_window(reference: list[list[int]]) -> None:
    """The shared 29 tokens are published chunk by chunk before the sliding groups free them, so later requests
    hit every full block of the document although each sliding layer kept only its window."""
    with engine() as served:
        first = served.generate(PROMPTS[:1], greedy(NEW))
        rest = served.generate(PROMPTS[1:], greedy(NEW))
        assert served.stats().prefix_hit_tokens >= (len(PROMPTS) - 1) * 28
        served.prefix.check_invariants()  # type: ignore[union-attr]
    assert first + rest == reference


def test_preemption_recomputes_or_swaps_under_a_small_cap(reference: list[list[int]], tmp_path: Path) -> None:
    with engine() as probe:
        per_block = probe.pool.bytes_per_block
    for spill in (None, Disk(path=str(tmp_path))):  # no reserve for decode growth: admission is optimistic
        with engine(max_bytes=48 * per_block, spill=spill, reserve_blocks=0) as served:
            assert served.generate(PROMPTS, greedy(NEW)) == reference
            stats = served.stats()
            assert stats.preemptions > 0 and stats.kv_bytes_peak <= 48 * per_block
            if spill is None:
                assert stats.recomputed_tokens > 0
            else:
                assert stats.swapped_blocks > 0 and stats.recomputed_tokens == 0 and stats.swap_fallbacks == 0
            served.prefix.check_invariants()  # type: ignore[union-attr]
        assert served.pool.num_used == 0


@pytest.mark.parametrize("prefix_sharing", [False, True])
def test_sealed_codes_in_every_group_answer_as_a_quantized_cache_alone(prefix_sharing: bool) -> None:
    expected = [alone_quantized(MODEL, p, 8) for p in PROMPTS]
    with engine(codec="int8", prefix_sharing=prefix_sharing) as served:
        assert len(served.pool.groups) == 3
        first = served.generate(PROMPTS[:1], greedy(NEW))
        assert first + served.generate(PROMPTS[1:], greedy(NEW)) == expected
        if prefix_sharing:
            assert served.pool.sealed_stats().used_blocks > 0  # the tree keeps codes
        served.close()
        assert served.pool.num_used == 0 and served.pool.sealed_stats().used_blocks == 0


def test_a_refusal_names_the_step_that_would_fit(reference: list[list[int]]) -> None:
    """A sliding table holds its window and one step's tokens, so a request too big at 512 tokens a step may fit at
    fewer: the refusal names the largest step that fits, and an engine with that step serves the request as alone."""
    prompt, want = PROMPTS[0], reference[0]  # 59 + 20 tokens: 20 blocks of the full table
    with engine() as probe:
        per_block = probe.pool.bytes_per_block
    cap = (20 + 2 * 7) * per_block  # the full table, and 7 blocks (the window and a 17-token step) per sliding one

    def served(step: int) -> ServingEngine:
        return ServingEngine(MODEL, block_size=SIZE, max_batched_tokens=step, max_bytes=cap)

    fits = r"holds at most 34; shorten it or give the engine a larger max_bytes, or give the engine max_batched_tokens="
    for step in (512, 18):
        with served(step) as refusing, pytest.raises(ValueError, match=fits + "17 or less"):
            refusing.add_request(prompt, greedy(NEW))
    with served(17) as fitting:
        assert fitting.generate([prompt], greedy(NEW)) == [want]


def test_prompts_longer_than_the_window_are_admitted_with_room_for_their_whole_prefill() -> None:
    """Admission gives a sliding group blocks up to a step past its first full window, the most it holds at once.
    Given only its first step's, a prompt past the window found no block for its next chunk under a tight cap,
    preempted itself and lost its chunk, step after step (at 40 blocks: 4 preemptions, 120 tokens recomputed)."""
    draw = random.Random(0)
    prompts = [[draw.randrange(4, MODEL.config.vocab_size) for _ in range(n)] for n in (60, 70, 55, 30, 80, 9)]
    expected = [alone(MODEL, p, 12) for p in prompts]
    with engine() as probe:
        per_block = probe.pool.bytes_per_block
    for blocks in (40, 45, 50):
        with engine(prefix_sharing=False, max_bytes=blocks * per_block) as served:
            assert served.generate(prompts, greedy(12)) == expected
            stats = served.stats()
            assert (stats.preemptions, stats.recomputed_tokens) == (0, 0), blocks
