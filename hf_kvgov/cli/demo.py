"""`kvgov demo`: one prompt through every registered cache, compared with DynamicCache.

Prints, per cache: KV bytes held after generation, bytes per token, tokens/s, and whether the greedy
output equals the full-cache output (it must, for lossless caches).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from hf_kvgov import models
from hf_kvgov.data_text import demo_text
from hf_kvgov.registry import CACHES, get_cache_spec, kv_bytes


@dataclass(frozen=True)
class DemoRow:
    cache: str
    kv_bytes: int
    tokens: int
    tokens_per_s: float
    same_output: bool
    lossless: bool


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("demo", help="run one prompt with DynamicCache and every hf_kvgov cache")
    parser.add_argument(
        "--model",
        default=models.DEFAULT_MODEL,
        help="embedded name, .gguf path, local directory or hub id (default: %(default)s)",
    )
    parser.add_argument("--prompt", help="prompt text (default: the opening of Pride and Prejudice)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--caches", default=",".join(CACHES), help="comma-separated cache names (default: %(default)s)")
    parser.set_defaults(func=run)


def default_prompt() -> str:
    return demo_text(max_chars=2500) + "\nSummarize the passage above in one sentence:"


def run(args: argparse.Namespace) -> int:
    print(f"[kvgov] loading {args.model} ...", flush=True)
    model, tokenizer = models.load_model(args.model)
    inputs = tokenizer(args.prompt or default_prompt(), return_tensors="pt")
    names = [name.strip() for name in args.caches.split(",") if name.strip()]
    specs = [get_cache_spec(name) for name in ["dynamic", *[n for n in names if n != "dynamic"]]]
    rows: list[DemoRow] = []
    reference: torch.Tensor | None = None
    for spec in tqdm(specs, desc="caches", unit="cache"):
        output, seconds, cache = _generate(model, spec, inputs, args.max_new_tokens)
        reference = output if reference is None else reference
        new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
        rows.append(
            DemoRow(
                spec.name,
                kv_bytes(cache),
                cache.get_seq_length(),
                new_tokens / seconds,
                torch.equal(output, reference),
                spec.lossless,
            )
        )
    print(render(rows, inputs["input_ids"].shape[1]))
    assert reference is not None
    print("\noutput:", tokenizer.decode(reference[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
    failed = [row.cache for row in rows if row.lossless and not row.same_output]
    if failed:
        print(f"\nLOSSLESS CACHES DIFFER FROM DynamicCache: {', '.join(failed)}")
    return 1 if failed else 0


def _generate(model: Any, spec: Any, inputs: Any, max_new_tokens: int) -> tuple[torch.Tensor, float, Any]:
    cache = spec.build(model)
    with spec.attention(model), torch.inference_mode():
        start = time.perf_counter()
        output = model.generate(**inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False)
        seconds = time.perf_counter() - start
    return output, seconds, cache


def render(rows: list[DemoRow], prompt_tokens: int) -> str:
    header = f"{'cache':<12} {'KV bytes':>12} {'bytes/token':>12} {'tokens/s':>9}  same as DynamicCache"
    lines = [f"prompt: {prompt_tokens} tokens", header, "-" * len(header)]
    for row in rows:
        verdict = "yes" if row.same_output else ("no (lossy)" if not row.lossless else "NO")
        lines.append(
            f"{row.cache:<12} {row.kv_bytes:>12,} {row.kv_bytes / row.tokens:>12,.0f} "
            f"{row.tokens_per_s:>9.1f}  {verdict}"
        )
    return "\n".join(lines)
