"""A block cache with layer groups against the same cache with one group, and against DynamicCache.

On a hybrid model (Gemma-3-270M: 15 of 18 layers slide over 512 tokens) layer groups let the sliding layers
free the blocks that left their window; a cache of one group keeps every token in every layer. For each
prompt length: KV bytes held after greedy generation (`registry.kv_bytes`, the caches' own accounting:
resident bytes for a disk cache; DynamicCache's tensors), the ratio to DynamicCache, the wall time, and
whether the grouped cache's tokens equal the one-group cache's and DynamicCache's. `--cache disk` also
reports the bytes each wrote to its spill file (a grouped cache writes full-attention layers only).

    OMP_NUM_THREADS=1 python eval/bench_layer_groups.py --lengths 3072,4096,8192 --new-tokens 8
    OMP_NUM_THREADS=1 python eval/bench_layer_groups.py --cache disk --lengths 1024,4096,8192 --new-tokens 8

Prompts are Pride and Prejudice from character 20,000 (the package's copy); the block caches prefill in
512-token chunks (`prefill_chunk_size`), so no step holds a whole long prompt in every layer.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov import DiskOffloadCache, QuantizedCache
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import pride_and_prejudice
from hf_kvgov.models import load_model
from hf_kvgov.registry import kv_bytes


class OneGroupQuantizedCache(QuantizedCache):
    groups_layers = False  # one table for every layer, as before layer groups


class OneGroupDiskCache(DiskOffloadCache):
    groups_layers = False


CACHES = {"int8": (QuantizedCache, OneGroupQuantizedCache), "disk": (DiskOffloadCache, OneGroupDiskCache)}


def written(cache: Any) -> str:
    """Bytes a disk cache wrote to its spill file ('' for a cache without one)."""
    return f", wrote {cache.stats().bytes_written / 1e6:.2f} MB" if isinstance(cache, DiskOffloadCache) else ""


def run(model: Any, ids: torch.Tensor, cache: Any, new_tokens: int, chunked: bool) -> tuple[list[int], int, float]:
    """(generated tokens, KV bytes held at the end, seconds)."""
    began = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new_tokens, do_sample=False,
            prefill_chunk_size=512 if chunked else None,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist(), kv_bytes(cache), time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--lengths", default="3072,4096,8192", help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--cache", choices=sorted(CACHES), default="int8")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    grouped_kind, single_kind = CACHES[args.cache]
    print(f"{args.model}, {model.dtype}; {machine_description()}")
    name = args.cache
    print(f"| tokens | DynamicCache | {name} (layer groups) | {name} (one group) | = one group | = DynamicCache |")
    print("| ---: | ---: | ---: | ---: | :---: | :---: |")
    text = pride_and_prejudice()[20_000:]
    for length in (int(part) for part in args.lengths.split(",")):
        ids = tokenizer(text[: 8 * length], return_tensors="pt")["input_ids"][:, :length]
        dynamic = run(model, ids, DynamicCache(config=model.config), args.new_tokens, chunked=False)
        grouped_cache, single_cache = grouped_kind(model), single_kind(model)
        grouped = run(model, ids, grouped_cache, args.new_tokens, chunked=True)
        single = run(model, ids, single_cache, args.new_tokens, chunked=True)
        cells = [
            f"{dynamic[1] / 1e6:.2f} MB",
            f"{grouped[1] / 1e6:.2f} MB, {grouped[1] / dynamic[1]:.3f}x, {grouped[2]:.0f} s{written(grouped_cache)}",
            f"{single[1] / 1e6:.2f} MB, {single[1] / dynamic[1]:.3f}x, {single[2]:.0f} s{written(single_cache)}",
            "yes" if grouped[0] == single[0] else "no",
            "yes" if grouped[0] == dynamic[0] else "no",
        ]
        print(f"| {ids.shape[1]:,} (+{args.new_tokens}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
