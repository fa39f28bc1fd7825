"""Benchmark of the foundation: memory utilization of paging, and decode speed of PagedCache.

1. Utilization. 200 sequences with long-tailed lengths (log-normal, median ~300, capped at 4,096) are
   held at once. Pre-allocating the maximum length per sequence (what StaticCache does) is compared with
   a real `BlockPool` + `BlockTables` at block sizes 16 and 256: waste = 1 - tokens / slots reserved.
2. Decode speed. On SmolLM2 (the embedded model), for batch 1 and 8 and contexts 512 and 2,048: prefill
   the context, then time greedy decode steps with DynamicCache, PagedCache (contiguous K/V) and
   PagedCache read in place by the hf_kvgov paged attention. Caches are measured in interleaved rounds
   and reported as ratios to DynamicCache from the same run, since this machine is noisy.

    python eval/bench_paged.py                 # everything, writes eval/out/bench_paged.json
    python eval/bench_paged.py --skip-speed    # utilization only (seconds)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hf_kvgov.bench.timing import interleaved, machine_description
from hf_kvgov.models import load_model
from hf_kvgov.registry import get_cache_spec
from hf_kvgov.storage.block_table import BlockTables
from hf_kvgov.storage.pool import BlockPool, KVGeometry

OUT = Path(__file__).resolve().parent / "out"


def long_tailed_lengths(n: int = 200, median: int = 300, max_len: int = 4096, seed: int = 0) -> list[int]:
    """Log-normal lengths with the given median (sigma 1.0), clipped to [1, max_len]."""
    generator = torch.Generator().manual_seed(seed)
    normal = torch.randn(n, generator=generator, dtype=torch.float64)
    lengths = torch.exp(math.log(median) + normal).round().clamp(1, max_len)
    return [int(x) for x in lengths]


def paged_utilization(lengths: list[int], block_size: int) -> dict[str, float]:
    """Hold every sequence in a real pool at once and measure slots reserved by the block tables."""
    pool = BlockPool(KVGeometry(num_layers=1, num_kv_heads=1, head_dim=1), block_size=block_size)
    batches = []
    for length in lengths:
        tables = BlockTables(pool)
        tables.slots_for(1, 0, length)
        batches.append(tables)
    slots = pool.num_used * block_size
    result = {"tokens": sum(lengths), "slots": slots, "waste": 1 - sum(lengths) / slots}
    for tables in batches:
        tables.release()
    assert pool.num_used == 0
    return result


def utilization_report(lengths: list[int], max_len: int) -> dict[str, Any]:
    static_slots = len(lengths) * max_len
    return {
        "sequences": len(lengths),
        "median_length": statistics.median(lengths),
        "max_length": max(lengths),
        "static": {"tokens": sum(lengths), "slots": static_slots, "waste": 1 - sum(lengths) / static_slots},
        "paged_16": paged_utilization(lengths, 16),
        "paged_256": paged_utilization(lengths, 256),
    }


def decode_tokens_per_s(model: Any, cache_name: str, ids: torch.Tensor, steps: int) -> float:
    """Prefill `ids` [batch, context] into a fresh cache, then time `steps` greedy decode steps."""
    spec = get_cache_spec(cache_name)
    cache = spec.build(model)
    with spec.attention(model), torch.inference_mode():
        logits = model(ids, cache=cache, logits_to_keep=1).logits
        token = logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            token = model(token, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        seconds = time.perf_counter() - start
    return ids.shape[0] * steps / seconds


def speed_report(caches: list[str], batches: list[int], contexts: list[int], steps: int, rounds: int) -> list[dict]:
    model, _ = load_model("smollm2")
    generator = torch.Generator().manual_seed(0)
    rows = []
    configs = [(b, c) for b in batches for c in contexts]
    for batch, context in tqdm(configs, desc="decode configs"):
        ids = torch.randint(100, 20000, (batch, context), generator=generator)
        samples = interleaved(caches, rounds, functools.partial(decode_tokens_per_s, model, ids=ids, steps=steps))
        base = statistics.median(samples["dynamic"])
        for name in caches:
            speed = statistics.median(samples[name])
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "cache": name,
                    "tokens_per_s": speed,
                    "ratio_vs_dynamic": speed / base,
                }
            )
    return rows


def markdown(report: dict[str, Any]) -> str:
    u = report["utilization"]
    lines = [
        f"Utilization: {u['sequences']} sequences, median length {u['median_length']}, max {u['max_length']}",
        "",
        "| layout | tokens | slots reserved | waste |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label in (
        ("static", "pre-allocate 4,096"),
        ("paged_16", "paged, block 16"),
        ("paged_256", "paged, block 256"),
    ):
        lines.append(f"| {label} | {u[key]['tokens']:,} | {u[key]['slots']:,} | {100 * u[key]['waste']:.1f}% |")
    if report.get("speed"):
        lines += [
            "",
            "| batch | context | cache | decode tokens/s | ratio vs DynamicCache |",
            "| ---: | ---: | --- | ---: | ---: |",
        ]
        for row in report["speed"]:
            lines.append(
                f"| {row['batch']} | {row['context']} | {row['cache']} | {row['tokens_per_s']:.1f} | "
                f"{row['ratio_vs_dynamic']:.2f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--caches", default="dynamic,paged,paged-attn")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    report: dict[str, Any] = {
        "machine": machine_description(),
        "utilization": utilization_report(long_tailed_lengths(), 4096),
    }
    if not args.skip_speed:
        caches = args.caches.split(",")
        assert caches[0] == "dynamic", "DynamicCache must be measured first: ratios are relative to it"
        report["speed"] = speed_report(
            caches,
            [int(b) for b in args.batches.split(",")],
            [int(c) for c in args.contexts.split(",")],
            args.steps,
            args.rounds,
        )
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_paged.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
