"""Model-free parts of the benchmarks: prompts, interleaving, the token clock, peak memory, counting."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hf_kvgov.bench import memory
from hf_kvgov.bench.capacity import fit_in_order
from hf_kvgov.bench.prompts import prompt_ids
from hf_kvgov.bench.timing import TokenClock, interleaved


def test_prompts_are_cut_from_the_stream_at_row_offsets_and_tiled() -> None:
    stream = list(range(10))
    ids = prompt_ids(stream, batch=3, context=12)
    assert ids.dtype == torch.long and ids.shape == (3, 12)
    assert ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert ids[1].tolist() == [3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]  # offset 1 * 10 // 3
    assert ids[2].tolist() == [6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 7]  # offset 2 * 10 // 3
    with pytest.raises(ValueError, match="context must be a positive int; got 0"):
        prompt_ids(stream, 1, 0)
    with pytest.raises(ValueError, match="empty token stream"):
        prompt_ids([], 1, 4)


def test_interleaved_measures_every_name_once_per_round_in_order() -> None:
    calls: list[str] = []

    def measure(name: str) -> int:
        calls.append(name)
        return len(calls)

    samples = interleaved(["a", "b", "c"], 2, measure)
    assert calls == ["a", "b", "c", "a", "b", "c"]
    assert samples == {"a": [1, 4], "b": [2, 5], "c": [3, 6]}
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        interleaved(["a"], 0, measure)


def test_token_clock_ignores_the_prompt_and_times_each_new_token() -> None:
    clock = TokenClock()
    clock.start()
    clock.put(torch.zeros(1, 5))  # the prompt
    time.sleep(0.01)
    for _ in range(3):
        clock.put(torch.zeros(1))
        time.sleep(0.005)
    clock.end()
    assert len(clock.token_times) == 3
    assert clock.first_token_s >= 0.01
    assert clock.per_output_token_s == pytest.approx((clock.token_times[2] - clock.token_times[0]) / 2)
    assert clock.per_output_token_s >= 0.005
    assert clock.elapsed_s() > clock.first_token_s


def test_token_clock_needs_two_tokens_for_a_decode_time() -> None:
    clock = TokenClock()
    clock.start()
    clock.put(torch.zeros(1, 5))
    clock.put(torch.zeros(1))
    with pytest.raises(RuntimeError, match="at least 2 new tokens"):
        _ = clock.per_output_token_s


def test_peak_rss_is_reset_between_measurements() -> None:
    peak = memory.ProcessPeakRss()
    peak.reset()
    before = peak.peak_bytes()
    # Fresh anonymous pages: a torch tensor may reuse memory the allocator kept from earlier tests.
    block = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(block), mmap.PAGESIZE):  # touch 64 MiB
        block[offset] = 1
    grown = peak.peak_bytes()
    block.close()
    peak.reset()
    after = peak.peak_bytes()
    assert peak.resettable and before > 0
    assert grown - before >= 60 * 2**20
    assert after < grown - 32 * 2**20  # the reset dropped the 64 MiB peak


def test_peak_rss_falls_back_to_the_lifetime_peak(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(memory, "_CLEAR_REFS", tmp_path / "missing" / "clear_refs")
    peak = memory.ProcessPeakRss()
    peak.reset()
    assert not peak.resettable
    assert peak.peak_bytes() == memory._lifetime_peak_rss() > 0
    assert memory.peak_memory_for(torch.device("cpu")).kind == "peak RSS"
    assert memory.peak_memory_for(torch.device("meta")).kind == "peak RSS"


def _fit_one_by_one(order: list[int], bytes_of: dict[int, int], budget: int) -> tuple[int, int, int]:
    """The reference: add sequences one at a time until one does not fit."""
    count = used = 0
    while True:
        length = order[count % len(order)]
        if used + bytes_of[length] > budget:
            return count, used, length
        count, used = count + 1, used + bytes_of[length]


@given(
    order=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    sizes=st.lists(st.integers(1, 50), min_size=6, max_size=6),
    budget=st.integers(0, 3000),
)
def test_fit_in_order_matches_adding_one_sequence_at_a_time(order: list[int], sizes: list[int], budget: int) -> None:
    bytes_of = {length: sizes[length - 1] for length in range(1, 7)}
    assert fit_in_order(order, bytes_of, budget) == _fit_one_by_one(order, bytes_of, budget)


def test_fit_in_order_by_hand() -> None:
    # 40 tokens take 3 units, 7 tokens 1: 3, 4, 5, 8, 9, 10 fit in 12; the 7th (40 tokens, 13 units) does not.
    assert fit_in_order([40, 7, 7], {40: 3, 7: 1}, 12) == (6, 10, 40)
    with pytest.raises(ValueError, match="must hold some bytes"):
        fit_in_order([4], {4: 0}, 10)
