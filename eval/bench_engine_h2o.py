"""H2O in the serving engine (whole blocks, one budget for every layer and head) against `HeavyHitterCache` (per KV
head and token), by streaming perplexity with the cache in the loop, against the full cache in the same run.

Each passage's ``STREAM`` tokens are one prompt. The engine scores it (`ServingEngine.score`, ``--block-size``): with
no policy (the full cache), and with `HeavyHitter(KEEP)`, which keeps ``KEEP`` of the prompt in blocks and streams
it (the weakest blocks go every 4 blocks past the budget). `HeavyHitterCache(budget=KEEP)` reads the same tokens in
``CHUNK``-token forwards (protocol (b) of `policy_protocols`). Perplexity counts the tokens from the first one the
engine predicts from an evicted cache (its budget and slack in blocks), the same tokens for every configuration.

    OMP_NUM_THREADS=1 python eval/bench_engine_h2o.py --text ../shared/data/text/austen/emma.txt --offsets 100000 400000
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from policy_protocols import CHUNK, KEEP, STREAM, add_passage_arguments, passage_ids, passages, plain_forward

from hf_kvgov import HeavyHitterCache, eviction_attention, load_model
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.engine.parts import HeavyHitter
from hf_kvgov.serving import ServingEngine
from hf_kvgov.serving.eviction import BlockEviction


def engine_losses(model, ids: list[int], policy: HeavyHitter | None, block: int) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Float ``[len(ids) - 1]``: the loss of each token after the first, as the engine scores the prompt."""
    with ServingEngine(model, block_size=block, prefix_sharing=False, policy=policy) as engine:
        (logprobs,) = engine.score([ids])
    return -torch.tensor(logprobs)


def cache_losses(model, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Float ``[STREAM - 1]``: losses through `HeavyHitterCache`, ``CHUNK`` tokens a forward."""
    forward = plain_forward(model)
    cache = HeavyHitterCache(model, budget=KEEP, budget_of=STREAM)
    losses = []
    with eviction_attention(model), torch.inference_mode():
        for first in range(0, STREAM - 1, CHUNK):
            last = min(first + CHUNK, STREAM - 1)
            logits = forward(ids[:, first:last], cache, torch.arange(first, last)[None])
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, first + 1 : last + 1], reduction="none"))
    return torch.cat(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2"])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--block-size", type=int, default=16, help="the engine's tokens per block [%(default)s]")
    add_passage_arguments(parser)
    args = parser.parse_args()
    policy = HeavyHitter(KEEP)
    eviction = BlockEviction(policy)
    block = args.block_size
    first = (eviction.budget_blocks(STREAM, block) + eviction.slack) * block  # the engine's first evicted read
    rows = []
    for name in args.models:
        model, tokenizer = load_model(name)
        for passage, where in passages(args).items():
            ids = passage_ids(tokenizer, where, STREAM)
            losses = {
                "full (engine)": engine_losses(model, ids[0].tolist(), None, block),
                f"engine H2O {KEEP:.0%}, blocks of {block}": engine_losses(model, ids[0].tolist(), policy, block),
                f"HeavyHitterCache {KEEP:.0%}": cache_losses(model, ids),
            }
            full = math.exp(losses["full (engine)"][first:].mean().item())
            for config, values in losses.items():
                ppl = math.exp(values[first:].mean().item())
                rows.append({"model": name, "passage": passage, "config": config, "ppl": ppl, "full_ppl": full})
                print(f"{name} {passage} {config}: {ppl:.3f} ({100 * (ppl / full - 1):+.2f}%)", flush=True)
    machine = machine_description()
    print(f"\n{STREAM} tokens, perplexity from token {first + 1} ({machine})\n")
    print("| model | passage | configuration | ppl | vs full |\n| --- | --- | --- | ---: | ---: |")
    for r in rows:
        change = 100 * (r["ppl"] / r["full_ppl"] - 1)
        print(f"| {r['model']} | {r['passage']} | {r['config']} | {r['ppl']:.3f} | {change:+.2f}% |")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "first_scored": first, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
