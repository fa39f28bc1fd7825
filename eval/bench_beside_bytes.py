"""What eviction caches keep beside their pooled slots, which their pool's cap now counts (`BlockPool.charge`).

SmolLM2-135M, one request of the embedded Pride and Prejudice (the bytes do not depend on the text), each cache on
its own eviction pool, the prompt then a few decode steps. Per cache: the pool's block bytes (the kept slots), the
bytes charged beside them (positions, validity, attention mass, a running forecast's float64 query statistics,
recall's pending pages, summaries, table and buffer), and their share of everything held. Before the charge, those
bytes were outside `max_bytes`.

    python eval/bench_beside_bytes.py
    python eval/bench_beside_bytes.py --tokens 4096 --new 8
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from hf_kvgov import HeavyHitterCache, PolicyCache, Recall, eviction_attention, eviction_pool
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import pride_and_prejudice
from hf_kvgov.models import load_model
from hf_kvgov.policies import SnapKV
from hf_kvgov.policies.expected_attention import running_expected_attention

Make = Callable[[Any, Any, str], Any]

CACHES: dict[str, tuple[str | None, Make]] = {
    "H2O 20%": (None, lambda model, pool, path: HeavyHitterCache(model, budget=0.2, pool=pool)),
    "H2O 20%, int8 slots": (
        "int8", lambda model, pool, path: HeavyHitterCache(model, budget=0.2, codec="int8", pool=pool)
    ),
    "SnapKV 20%": (None, lambda model, pool, path: PolicyCache(model, SnapKV(), 0.2, pool=pool)),
    "Expected Attention 20%, running statistics": (
        None, lambda model, pool, path: PolicyCache(model, running_expected_attention(), 0.2, pool=pool)
    ),
    "H2O 20% + recall (shared buffer)": (
        None, lambda model, pool, path: HeavyHitterCache(model, budget=0.2, recall=Recall(path), pool=pool)
    ),
    "H2O 20%, int8 slots + recall (shared buffer)": (
        "int8",
        lambda model, pool, path: HeavyHitterCache(model, budget=0.2, codec="int8", recall=Recall(path), pool=pool),
    ),
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--new", type=int, default=4, help="decode steps after the prompt")
    parser.add_argument("--offset", type=int, default=100_000, help="character offset into the novel")
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_model("smollm2")
    ids = tokenizer(pride_and_prejudice()[args.offset :], return_tensors="pt").input_ids[:, : args.tokens]
    print(f"{machine_description()}; SmolLM2-135M, {ids.shape[1]:,} prompt tokens + {args.new} decoded\n")
    print("| cache | slot blocks (B) | charged beside them (B) | of which recall (B) | beside / all held |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, (codec, make) in CACHES.items():
        pool = eviction_pool(model, codec=codec)
        with tempfile.TemporaryDirectory() as path, torch.inference_mode(), eviction_attention(model):
            cache = make(model, pool, path)
            model.generate(ids, cache=cache, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)
            stats = cache.stats()
            assert pool.bytes_charged == stats.metadata_bytes + stats.recall_bytes
            blocks = pool.num_used * pool.bytes_per_block
            charged = pool.bytes_charged
            print(
                f"| {name} | {blocks:,} | {charged:,} | {stats.recall_bytes:,} | {charged / (blocks + charged):.1%} |"
            )
            cache.release()


if __name__ == "__main__":
    main()
