"""Where an eviction cache keeps its slots between steps: its own dense tensors, or records in pool blocks.

SmolLM2-135M, a batch of requests of the embedded Pride and Prejudice, H2O 20% (dense and int8 slots): the prompt,
then decode steps. The two homes alternate step by step in one process (own, pooled, own, ...), so machine noise
falls on both; the figure is the median decode step of each and their ratio, with the bytes each holds. The
pooled home stores each row's valid slots as a stream of records (`hf_kvgov.engine.slots.pooled_slots`) and builds
the dense working set of a step from them; the own home keeps `[batch, kv_heads, slots]` tensors, padding included.

    OMP_NUM_THREADS=1 python eval/bench_slot_homes.py
    OMP_NUM_THREADS=1 python eval/bench_slot_homes.py --batch 4 --tokens 1024 --steps 24
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from hf_kvgov import HeavyHitterCache, eviction_attention, eviction_pool
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import pride_and_prejudice
from hf_kvgov.models import load_model


def _cache(model: Any, codec: str | None, pooled: bool, prompt: int) -> Any:
    pool = eviction_pool(model, codec=codec) if pooled else None
    return HeavyHitterCache(model, budget=0.2, codec=codec, pool=pool, budget_of=prompt)


def _prefill(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    with eviction_attention(model), torch.inference_mode():
        logits = model(ids, cache=cache, logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


def _step(model: Any, cache: Any, token: torch.Tensor) -> tuple[float, torch.Tensor]:
    with eviction_attention(model), torch.inference_mode():
        start = time.perf_counter()
        logits = model(token, cache=cache).logits
        seconds = time.perf_counter() - start
    return seconds, logits[:, -1:].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="requests decoded together")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt tokens of each request")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per home")
    args = parser.parse_args()
    model, tokenizer = load_model("smollm2")
    text = pride_and_prejudice()
    rows = [tokenizer(text[100_000 + 20_000 * i :]).input_ids[: args.tokens] for i in range(args.batch)]
    ids = torch.tensor(rows)
    print(f"{machine_description()}; SmolLM2-135M, batch {args.batch} x {args.tokens:,} prompt tokens, H2O 20%\n")
    print("| slots | own: median step (ms) | pooled: median step (ms) | pooled / own | own bytes | pooled bytes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for codec in (None, "int8"):
        caches = {home: _cache(model, codec, home == "pooled", args.tokens) for home in ("own", "pooled")}
        tokens = {home: _prefill(model, cache, ids) for home, cache in caches.items()}
        times: dict[str, list[float]] = {home: [] for home in caches}
        for _ in range(args.steps):
            for home, cache in caches.items():
                seconds, tokens[home] = _step(model, cache, tokens[home])
                times[home].append(seconds)
        if not torch.equal(tokens["own"], tokens["pooled"]):
            raise AssertionError("the two homes keep the same slots, so they must choose the same tokens")
        own, pooled = (statistics.median(times[home]) for home in ("own", "pooled"))
        held = {home: cache.stats().bytes_used for home, cache in caches.items()}
        print(
            f"| {codec or 'model dtype'} | {own * 1e3:.1f} | {pooled * 1e3:.1f} | {pooled / own:.2f}x "
            f"| {held['own']:,} | {held['pooled']:,} |"
        )
        for cache in caches.values():
            cache.release()


if __name__ == "__main__":
    main()
