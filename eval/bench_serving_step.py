"""The serving engine's per-step overhead: decode tokens/s at batch B with no memory pressure, against batched
`model.generate` with `DynamicCache` on the same prompts (equal lengths, so generate pads nothing), in one run.

Each round runs both on the same prompts, alternating which goes first; the engine is timed from its first decode
step (prefill excluded on both sides: generate's prefill is timed by a one-token run and subtracted). Prints
tokens/s of each and the engine's ratio per round and as the median.

    OMP_NUM_THREADS=1 python eval/bench_serving_step.py                  # SmolLM2, batch 8, 256 + 64 tokens
    OMP_NUM_THREADS=1 python eval/bench_serving_step.py --batch 16 --prompt 512 --new 32
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from hf_kvgov import load_model
from hf_kvgov.serving import SamplingParams, ServingEngine


def generate_seconds(model, prompts: torch.Tensor, new: int) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    model.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        cache=DynamicCache(config=model.config),
    )
    return time.perf_counter() - start


def engine_decode_seconds(model, prompts: list[list[int]], new: int) -> float:  # type: ignore[no-untyped-def]
    with ServingEngine(model, prefix_sharing=False, max_batched_tokens=len(prompts) * len(prompts[0])) as engine:
        for prompt in prompts:
            engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
        engine.step()  # every prefill, and each request's first token
        start = time.perf_counter()
        while engine.has_work:
            engine.step()
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, _ = load_model(args.model)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 20000, (args.batch, args.prompt), generator=generator)
    listed = prompts.tolist()
    decode_tokens = args.batch * (args.new - 1)
    generate_seconds(model, prompts[:, :16], 4)  # warm-up
    ratios = []
    for round_ in range(args.rounds):
        order = ["engine", "generate"] if round_ % 2 == 0 else ["generate", "engine"]
        seconds = {}
        for name in order:
            if name == "engine":
                seconds[name] = engine_decode_seconds(model, listed, args.new)
            else:
                seconds[name] = generate_seconds(model, prompts, args.new) - generate_seconds(model, prompts, 1)
        engine_tps, generate_tps = decode_tokens / seconds["engine"], decode_tokens / seconds["generate"]
        ratios.append(engine_tps / generate_tps)
        print(
            f"round {round_}: engine {engine_tps:.1f} tok/s, generate+DynamicCache {generate_tps:.1f} tok/s, "
            f"ratio {ratios[-1]:.2f}x"
        )
    print(
        f"median ratio {statistics.median(ratios):.2f}x (batch {args.batch}, prompt {args.prompt}, {args.new} new, "
        f"{torch.get_num_threads()} threads)"
    )


if __name__ == "__main__":
    main()
