"""Preemption by swap (`ServingEngine(spill=Disk(path))`): a preempted request's blocks go to the disk tier and
come back, so its tokens are not computed again, and each request still answers as it would alone. A disk that
refuses the write or a block damaged on disk falls back to computing the request again, counted, with the same
answers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hf_kvgov import Disk
from hf_kvgov.serving import ServingEngine
from tests.conftest import tiny_llama
from tests.serving.test_engine import alone, alone_quantized, greedy, prompts_with_shared_prefix
from tests.spill_damage import flip_byte

MODEL = tiny_llama()
PROMPTS = prompts_with_shared_prefix(MODEL.config.vocab_size, (5, 17, 3, 2, 9, 11, 4, 8), shared=37)
NEW = 20


def capped(blocks: int, **kwargs: Any) -> ServingEngine:
    probe = ServingEngine(MODEL, block_size=4)
    bytes_per_block = probe.pool.bytes_per_block
    probe.close()
    return ServingEngine(MODEL, block_size=4, max_bytes=blocks * bytes_per_block, max_batched_tokens=32, **kwargs)


def test_preempted_requests_swap_out_and_back_instead_of_computing_again(tmp_path: Path) -> None:
    reference = [alone(MODEL, p, NEW) for p in PROMPTS]
    with capped(20, spill=Disk(path=str(tmp_path))) as engine:
        assert engine.generate(PROMPTS, greedy(NEW)) == reference
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.swapped_blocks > 0  # the cap forced it, and the victims swapped
        assert stats.recomputed_tokens == 0 and stats.swap_fallbacks == 0  # nothing was computed twice
        assert engine.swap is not None and engine.swap.counters.blocks_in == stats.swapped_blocks  # all came back
        assert engine.pool.num_used == len(engine.prefix.tree)  # type: ignore[union-attr]
    assert os.listdir(tmp_path) == []  # closing the engine deletes its swap files
    with capped(20) as engine:  # the same trace without a swap space computes the victims again
        assert engine.generate(PROMPTS, greedy(NEW)) == reference
        assert engine.stats().recomputed_tokens > 0


def test_sealed_blocks_swap_as_their_codes(tmp_path: Path) -> None:
    reference = [alone_quantized(MODEL, p, 8, NEW) for p in PROMPTS]
    with capped(24, spill=Disk(path=str(tmp_path)), codec="int8", prefix_sharing=False) as engine:
        assert engine.generate(PROMPTS, greedy(NEW)) == reference
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.swapped_blocks > 0 and stats.recomputed_tokens == 0
        assert engine.pool.num_used == 0 and engine.pool.sealed_stats().used_blocks == 0


def test_a_refused_write_computes_the_victim_again(tmp_path: Path) -> None:
    reference = [alone(MODEL, p, NEW) for p in PROMPTS]
    with capped(20, spill=Disk(path=str(tmp_path), max_write_bytes=1)) as engine:
        assert engine.generate(PROMPTS, greedy(NEW)) == reference
        stats = engine.stats()
        assert stats.preemptions > 0 and stats.swapped_blocks == 0
        assert stats.swap_fallbacks == stats.preemptions and stats.recomputed_tokens > 0


def test_a_block_damaged_on_disk_is_caught_and_computed_again(tmp_path: Path) -> None:
    reference = [alone(MODEL, p, NEW) for p in PROMPTS]
    with capped(20, spill=Disk(path=str(tmp_path))) as engine:
        ids = [engine.add_request(p, greedy(NEW)) for p in PROMPTS]
        outputs: dict[int, list[int]] = {i: [] for i in ids}
        damaged = False
        while engine.has_work:
            for event in engine.step():
                if event.token is not None:
                    outputs[event.request_id].append(event.token)
            swapped = [r for r in engine.scheduler.waiting if r.swapped is not None]
            if swapped and not damaged:  # every block of the first swapped-out request, damaged in place
                assert engine.swap is not None and swapped[0].swapped is not None
                for path, offset in engine.swap.locations(swapped[0].swapped):
                    flip_byte(path, offset)
                damaged = True
        assert damaged and [outputs[i] for i in ids] == reference
        stats = engine.stats()
        assert stats.swap_fallbacks >= 1 and stats.recomputed_tokens > 0


def test_spill_takes_a_disk_part() -> None:
    with pytest.raises(TypeError, match=r"spill must be a Disk\(path=...\) or None; got a str"):
        ServingEngine(MODEL, spill="/tmp")  # type: ignore[arg-type]
