"""SnapKV settings on passkey retrieval: which observation window, pooling kernel and pooling keep a needle.

The prompts of `hf_kvgov.bench.passkey_prompts`, which `tests/eviction/test_eviction_passkey.py` uses too
(SmolLM2-135M, ~1,000 tokens of Pride and Prejudice, a 5-digit pass key at 10% depth, RULER's question, the
answer's start "The pass key is"; the 8 of 10 draws the full cache answers), 20% of the prompt kept per KV
head, greedy. The perplexity protocols of `bench_policies.py` favour kvpress's settings slightly; this is the
retrieval side of the same choice.

    python eval/bench_snapkv_passkey.py
    python eval/bench_snapkv_passkey.py --settings 32,7,max 64,5,avg 64,7,max 32,5,avg
"""

from __future__ import annotations

import argparse

import torch

from hf_kvgov import PolicyCache, eviction_attention
from hf_kvgov.bench.passkey_prompts import passkey_prompts
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.models import load_model
from hf_kvgov.policies import SnapKV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["32,7,max", "64,5,avg", "64,7,max", "32,5,avg"],
                        help="window,kernel,pooling per SnapKV setting")  # fmt: skip
    parser.add_argument("--keep", type=float, default=0.2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2")
    samples = passkey_prompts(tokenizer)
    print(f"{machine_description()}; {len(samples)} prompts, {args.keep:.0%} kept\n")
    print("| SnapKV setting | pass keys | answers |\n| --- | ---: | --- |")
    for setting in args.settings:
        window, kernel, pooling = setting.split(",")
        policy = SnapKV(int(window), int(kernel), pooling)
        answers = []
        for key, prompt in samples:
            with torch.inference_mode(), eviction_attention(model):
                cache = PolicyCache(model, policy, budget=args.keep)
                out = model.generate(**prompt, cache=cache, max_new_tokens=7, do_sample=False)
            answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            answers.append((str(key) in answer, " ".join(answer.split())))
        found = sum(hit for hit, _ in answers)
        shown = ", ".join(text for _, text in answers)
        print(f"| `SnapKV({window}, {kernel}, {pooling!r})` | {found}/{len(samples)} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
