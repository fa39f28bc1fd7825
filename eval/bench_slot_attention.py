"""Time `attend_slots`, the eviction caches' attention over per-head kept slots, at decode and prefill shapes.

Random tensors at the shapes of SmolLM2-135M (9 query heads over 3 KV heads of 64) and Gemma-3-270M (4 over 1 of
256), batch 4: one decode query over 410 slots (H2O 20% of 2,048) with the attention mass, and a 256-query prefill
chunk over 2,048 slots. Prints the median milliseconds per call. To compare two versions, run it from each (a
worktree with ``PYTHONPATH`` set to it), alternating.

    OMP_NUM_THREADS=1 python eval/bench_slot_attention.py
"""

from __future__ import annotations

import statistics
import time

import torch

from hf_kvgov.engine.slots.slot_attention import attend_slots

SHAPES = {  # name: (batch, query heads, KV heads, head_dim, queries, slots)
    "SmolLM2 decode": (4, 9, 3, 64, 1, 410),
    "Gemma-3 decode": (4, 4, 1, 256, 1, 410),
    "SmolLM2 prefill chunk": (4, 9, 3, 64, 256, 2048),
}


def _median_ms(batch: int, q_heads: int, kv_heads: int, head_dim: int, q_len: int, slots: int) -> float:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, q_heads, q_len, head_dim, generator=generator)
    keys = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    values = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)
    kept = slots - q_len
    valid = torch.ones(batch, kv_heads, kept, dtype=torch.bool)
    mass = torch.zeros(batch, kv_heads, kept)
    calls = max(5, 2000 // q_len)
    times = []
    for _ in range(calls + 3):
        start = time.perf_counter()
        attend_slots(query, keys, values, valid, None, head_dim**-0.5, scores=mass, want_scores=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[3:]) * 1e3


def main() -> None:
    for name, shape in SHAPES.items():
        print(f"{name}: {_median_ms(*shape):.3f} ms")


if __name__ == "__main__":
    main()
