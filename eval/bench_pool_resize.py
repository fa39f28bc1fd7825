"""Peak bytes of a pool resize at a real model's geometry: growth by doubling, and the shrink that gives a charge
the free end of the tensors, measured from torch's allocation records (`torch.profiler`, ``profile_memory``).

Prints, for each, the tensors' bytes before and after and the most bytes held at once while it ran (allocations
made inside the run, from an empty process heap: the pool is built inside it).

    python eval/bench_pool_resize.py                      # SmolLM2-135M's geometry: 30 layers, 3 KV heads of 64
    python eval/bench_pool_resize.py --layers 18 --heads 1 --head-dim 256 --hybrid   # Gemma-3-270M's, its groups
"""

from __future__ import annotations

import argparse

import torch

from hf_kvgov.bench.memory import peak_tensor_bytes
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.storage.layer_groups import layer_groups
from hf_kvgov.storage.pool import BlockPool, KVGeometry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=1024, help="blocks before the growth (16 tokens each)")
    parser.add_argument(
        "--hybrid", action="store_true", help="Gemma-3's layout: five sliding layers to one full, in layer groups"
    )
    args = parser.parse_args()
    geometry = KVGeometry(args.layers, args.heads, args.head_dim, torch.bfloat16)
    windows = [None if layer % 6 == 5 else 512 for layer in range(args.layers)] if args.hybrid else None
    groups = None if windows is None else layer_groups(windows)
    per_block = BlockPool(geometry, 16, groups=groups).bytes_per_block
    held: dict[str, int] = {}

    def grow() -> None:
        pool = BlockPool(geometry, 16, growth_blocks=args.blocks, groups=groups)
        pool.allocate(args.blocks)
        held["grow_before"] = pool.capacity * per_block
        pool.allocate(args.blocks + 1)
        held["grow_after"] = pool.capacity * per_block

    def shrink() -> None:
        pool = BlockPool(geometry, 16, max_bytes=args.blocks * per_block, preallocate=True, groups=groups)
        ids = pool.allocate(args.blocks)
        pool.decref(ids[args.blocks // 2 :])
        held["shrink_before"] = pool.capacity * per_block
        pool.charge("holder", args.blocks // 2 * per_block)
        held["shrink_after"] = pool.capacity * per_block

    print(machine_description())
    for name, run in (("grow", grow), ("shrink", shrink)):
        peak = peak_tensor_bytes(run)
        before, after = held[f"{name}_before"], held[f"{name}_after"]
        print(
            f"{name}: tensors {before / 2**20:.1f} -> {after / 2**20:.1f} MiB, peak {peak / 2**20:.1f} MiB "
            f"({peak / max(before, after):.3f}x the larger)"
        )


if __name__ == "__main__":
    main()
