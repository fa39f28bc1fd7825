"""Where a batched decode step spends its time: one attention layer, and whole steps side by side.

1. ``layer``: one SmolLM2-shaped attention layer (3 KV heads, 9 query heads, head_dim 64) at
   ``--batch`` x ``--context``: DynamicCache's ``torch.cat`` + sdpa, the paged backends (``sdpa``: gather
   + sdpa; ``torch``: the block-chunked reference) over a pool with randomly permuted block ids.
2. ``steps``: a DynamicCache and a PagedCache (contiguous path) prefilled with the same random prompt in
   one forward, then decode steps alternating between them (the most noise-robust comparison on a shared
   machine); every step's time is printed, so a step that grows the pool stands out.

    python eval/bench_decode_step.py                      # batch 8 x 2,048, 1 thread, ~1 minute
    python eval/bench_decode_step.py --runs layer --batch 1 --context 512
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from hf_kvgov import PagedCache, load_model
from hf_kvgov.kernels.gathered_sdpa import paged_attention_gathered_sdpa
from hf_kvgov.kernels.reference import paged_attention_reference

KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16


def median_ms(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds of each function over ``rounds`` interleaved calls."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1000 * statistics.median(t) for name, t in times.items()}


def run_layer(batch: int, context: int, rounds: int) -> None:
    blocks = context // BLOCK
    pool_k = torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM)
    pool_v = torch.randn_like(pool_k)
    table = torch.randperm(batch * blocks).view(batch, blocks)
    past_k = torch.randn(batch, KV_HEADS, context - 1, HEAD_DIM)
    past_v = torch.randn_like(past_k)
    new = torch.randn(batch, KV_HEADS, 1, HEAD_DIM)
    query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM)
    scale = HEAD_DIM**-0.5

    def dynamic() -> torch.Tensor:
        keys, values = torch.cat([past_k, new], 2), torch.cat([past_v, new], 2)
        return torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=scale, enable_gqa=True)

    fns: dict[str, Callable[[], object]] = {
        "DynamicCache cat + sdpa": dynamic,
        "paged sdpa backend": lambda: paged_attention_gathered_sdpa(query, pool_k, pool_v, table, context, scale),
        "paged torch reference": lambda: paged_attention_reference(query, pool_k, pool_v, table, context, scale),
    }
    print(f"one layer, batch {batch} x {context} tokens, median of {rounds}:")
    for name, ms in median_ms(fns, rounds).items():
        print(f"  {name:26s} {ms:7.2f} ms")


def run_steps(batch: int, context: int, steps: int) -> None:
    model, _ = load_model("smollm2")
    ids = torch.randint(100, 20000, (batch, context), generator=torch.Generator().manual_seed(0))
    caches = {"dynamic": DynamicCache(config=model.config), "paged": PagedCache(model)}
    times: dict[str, list[float]] = {name: [] for name in caches}
    with torch.inference_mode():
        tokens = {n: model(ids, cache=c, logits_to_keep=1).logits[:, -1:].argmax(-1) for n, c in caches.items()}
        for _ in range(steps):
            for name, cache in caches.items():
                start = time.perf_counter()
                tokens[name] = model(tokens[name], cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
                times[name].append(time.perf_counter() - start)
    print(f"decode steps, batch {batch} x {context} tokens (ms per step, in order):")
    for name, values in times.items():
        print(f"  {name:8s} {[round(1000 * t) for t in values]}")
    ratio = statistics.median(times["dynamic"]) / statistics.median(times["paged"])
    print(f"  paged speed vs DynamicCache (median step): {ratio:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="layer,steps", help="comma-separated: layer, steps")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=2048, help="a multiple of 16")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved calls per layer variant")
    parser.add_argument("--steps", type=int, default=12, help="decode steps per cache")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    if not runs <= {"layer", "steps"} or args.context % BLOCK:
        parser.error(
            f"--runs takes layer and/or steps and --context a multiple of {BLOCK}; got {args.runs!r}, {args.context}."
        )
    torch.set_num_threads(args.threads)
    if "layer" in runs:
        run_layer(args.batch, args.context, args.rounds)
    if "steps" in runs:
        run_steps(args.batch, args.context, args.steps)


if __name__ == "__main__":
    main()
