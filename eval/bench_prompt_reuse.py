"""transformers' prompt reuse with each cache: one prompt run once, then several continuations, each from
``copy.deepcopy`` of the prompt's cache, all alive at once (as a server holds concurrent requests). Reports the KV
bytes every copy together holds, and whether each continuation's tokens equal `DynamicCache`'s.

`DynamicCache`'s copies each hold the whole prompt again. A `PagedCache` or `QuantizedCache` copy shares the
prompt's blocks through one pool (a block is copied only when a copy writes into it), so the prompt is held once.

    python eval/bench_prompt_reuse.py                                     # SmolLM2, 1,024 + 8 x (32 + 16)
    python eval/bench_prompt_reuse.py --model gemma3-270m --copies 16
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov import PagedCache, QuantizedCache, load_model
from hf_kvgov.bench.prompts import text_token_ids
from hf_kvgov.bench.timing import machine_description


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def held_bytes(caches: list[Any]) -> int:
    """The KV bytes `caches` hold together: the pool's blocks in use (and sealed codes) for block caches, which share
    it; every copy's tensors for `DynamicCache`."""
    if isinstance(caches[0], DynamicCache):
        return sum(dynamic_bytes(cache) for cache in caches)
    stats = caches[0].pool.stats()
    sealed = getattr(stats, "sealed", None)
    return int(stats.bytes_used) + (0 if sealed is None else int(sealed.bytes_used))


def continuations(model: Any, cache: Any, prompt: torch.Tensor, questions: list[torch.Tensor], new: int) -> Any:
    """The prompt into `cache`, then each question from a copy of it; returns (answers, every cache held)."""
    with torch.no_grad():
        model(prompt, cache=cache)
    copies, answers = [], []
    for question in questions:
        ids = torch.cat([prompt, question], dim=1)
        twin = copy.deepcopy(cache)
        out = model.generate(ids, cache=twin, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        answers.append(out[0, ids.shape[1] :].tolist())
        copies.append(twin)
    return answers, [cache, *copies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens")
    parser.add_argument("--copies", type=int, default=8, help="continuations, each from a copy")
    parser.add_argument("--question", type=int, default=32, help="tokens each continuation adds")
    parser.add_argument("--new", type=int, default=16, help="tokens each continuation generates")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model)
    text = text_token_ids(tokenizer)
    prompt = torch.tensor([text[: args.prompt]])
    starts = [args.prompt + i * args.question for i in range(args.copies)]
    questions = [torch.tensor([text[start : start + args.question]]) for start in starts]
    print(f"{machine_description()}; {args.model}: a {args.prompt}-token prompt, {args.copies} copies, each "
          f"{args.question} tokens more and {args.new} generated\n")  # fmt: skip
    print("| cache | KV bytes held by the prompt and every copy | x DynamicCache | answers equal DynamicCache's |")
    print("| --- | ---: | ---: | ---: |")
    builders = {
        "DynamicCache": lambda: DynamicCache(config=model.config),
        "PagedCache": lambda: PagedCache(model),
        "QuantizedCache (int8)": lambda: QuantizedCache(model),
    }
    reference: list[list[int]] = []
    dynamic = 0
    for name, build in builders.items():
        answers, caches = continuations(model, build(), prompt, questions, args.new)
        held = held_bytes(caches)
        if not reference:
            reference, dynamic = answers, held
        equal = sum(a == b for a, b in zip(answers, reference, strict=True))
        print(f"| {name} | {held:,} | {held / dynamic:.3f} | {equal}/{len(answers)} |", flush=True)


if __name__ == "__main__":
    main()
