"""Benchmark of DiskOffloadCache against PagedCache on SmolLM2: bytes moved, fetch latency, decode speed.

A 2,048-token context (random token ids, batch 1) is prefilled once with DynamicCache; every cache then
receives the same K/V through `update`, 512 tokens at a time (as a chunked prefill stores them), and
runs greedy decode steps, timed. Caches measured:

- ``paged``: PagedCache, everything in memory (the baseline).
- ``disk``: DiskOffloadCache, 128-token hot window, read-ahead thread on.
- ``disk-no-prefetch``: the same, every spilled block read when its layer asks.
- ``disk-cold``: read-ahead on, and the OS page cache of the spill file dropped before every step, so
  reads come from the device (the honest SSD figure; the others mostly hit the page cache).

Rounds are interleaved and the median is reported, since this machine is shared and noisy. Torch runs
on `--threads` threads (default 1): on a shared 2-core machine two intra-op threads stall on each other
whenever another process takes a core (a 0.2 ms matmul then takes 8 ms), which swamps what is measured;
one thread also leaves a core to the read-ahead thread, as a server leaves cores for I/O.

    python eval/bench_disk.py                  # ~3 minutes on 2 CPU cores; writes eval/out/bench_disk.json
    python eval/bench_disk.py --steps 8 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov.bench.timing import interleaved, machine_description
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.models import load_model

OUT = Path(__file__).resolve().parent / "out"
CHUNK = 512
MB = 1e6

CACHES = {
    "paged": lambda model, directory, hot: PagedCache(model),
    "disk": lambda model, directory, hot: DiskOffloadCache(model, directory, hot_tokens=hot),
    "disk-no-prefetch": lambda model, directory, hot: DiskOffloadCache(
        model, directory, hot_tokens=hot, prefetch=False
    ),
    "disk-cold": lambda model, directory, hot: DiskOffloadCache(model, directory, hot_tokens=hot),
}


def prefill(model: Any, context: int) -> tuple[DynamicCache, torch.Tensor]:
    """K/V of `context` random tokens, and the greedy next token."""
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    reference = DynamicCache(config=model.config)
    logits = model(ids, cache=reference, logits_to_keep=1).logits
    return reference, logits[:, -1:].argmax(-1)


def fill(cache: Any, reference: DynamicCache) -> None:
    """Give `cache` the reference's K/V through `update`, CHUNK tokens at a time, as a chunked prefill would."""
    length = reference.get_seq_length()
    for start in range(0, length, CHUNK):
        for index, layer in enumerate(reference.layers):
            cache.update(layer.keys[:, :, start : start + CHUNK], layer.values[:, :, start : start + CHUNK], index)


def measure(model: Any, name: str, reference: DynamicCache, token: torch.Tensor, steps: int, hot: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvgov-bench-") as directory:
        cache = CACHES[name](model, directory, hot)
        fill(cache, reference)
        before = cache.stats()
        seconds = 0.0
        for _ in range(steps):
            if name == "disk-cold":
                cache.drop_page_cache()
            start = time.perf_counter()
            token = model(token, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            seconds += time.perf_counter() - start
        after = cache.stats()
        cache.release()
    row: dict[str, Any] = {"cache": name, "tokens_per_s": steps / seconds, "resident_bytes": after.bytes_used}
    if isinstance(cache, DiskOffloadCache):
        row |= {
            "bytes_written_prefill": before.bytes_written,
            "bytes_written_decode": after.bytes_written - before.bytes_written,
            "bytes_read_per_token": (after.bytes_read - before.bytes_read) / steps,
            "fetches_per_token": (after.fetches - before.fetches) / steps,
            "fetch_mean_ms": 1000 * after.fetch_latency_mean_s,
            "fetch_p99_ms": 1000 * after.fetch_latency_p99_s,
            "wait_ms_per_token": 1000 * (after.fetch_wait_s - before.fetch_wait_s) / steps,
            "write_amplification": after.write_amplification,
            "spilled_blocks": after.spilled_blocks,
        }
    return row


def run(caches: list[str], context: int, steps: int, rounds: int, hot: int) -> list[dict]:
    model, _ = load_model("smollm2")
    with torch.inference_mode():
        reference, token = prefill(model, context)
        samples = interleaved(caches, rounds, lambda name: measure(model, name, reference, token, steps, hot))
    rows = []
    for name in caches:
        row = dict(samples[name][-1])
        row["tokens_per_s"] = statistics.median(s["tokens_per_s"] for s in samples[name])
        rows.append(row)
    base = rows[0]["tokens_per_s"]
    for row in rows:
        row["ratio_vs_paged"] = row["tokens_per_s"] / base
    return rows


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"SmolLM2-135M fp32, context {report['context']}, hot window {report['hot_tokens']}, batch 1, "
        f"{report['steps']} decode steps x {report['rounds']} rounds ({report['machine']})",
        "",
        "| cache | decode tok/s | vs paged | resident KV MB | written MB (prefill + decode) | read MB/token "
        "| fetches/token | fetch mean ms | fetch p99 ms | I/O wait ms/token | write ampl. |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report["rows"]:
        head = f"| {r['cache']} | {r['tokens_per_s']:.2f} | {r['ratio_vs_paged']:.2f} | {r['resident_bytes'] / MB:.1f} "
        if "bytes_read_per_token" not in r:
            lines.append(head + "| - | - | - | - | - | - | - |")
            continue
        written = f"{r['bytes_written_prefill'] / MB:.1f} + {r['bytes_written_decode'] / MB:.1f}"
        lines.append(
            head + f"| {written} | {r['bytes_read_per_token'] / MB:.1f} | {r['fetches_per_token']:.0f} "
            f"| {r['fetch_mean_ms']:.3f} | {r['fetch_p99_ms']:.3f} | {r['wait_ms_per_token']:.1f} "
            f"| {r['write_amplification']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", default=",".join(CACHES))
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--hot-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    caches = args.caches.split(",")
    if caches[0] != "paged":
        parser.error("the first cache must be 'paged': ratios are relative to it")
    report: dict[str, Any] = {
        "machine": machine_description(),
        "context": args.context,
        "hot_tokens": args.hot_tokens,
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": run(caches, args.context, args.steps, args.rounds, args.hot_tokens),
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_disk.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
