"""`kvgov demo`: one prompt through every registered cache, compared with DynamicCache in the same run.

Per cache: KV bytes held after generation and per token, the prefill's time and the decode's tokens/s, each also as
a ratio to DynamicCache's, and whether the greedy output equals DynamicCache's (it must, for lossless caches). A
warm-up generation runs first, so no cache pays for the first call's one-time costs; prefill and decode are timed
apart from the moment each step hands out its token. About 30 s a cache on 2 CPU cores with the defaults: the run
says its estimate once DynamicCache has run.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_kvgov import models
from hf_kvgov.data_text import demo_text

if TYPE_CHECKING:
    import torch

    from hf_kvgov.bench.timing import TokenClock

# torch, transformers and the registry are imported when the demo runs: `kvgov --help` stays instant.


@dataclass(frozen=True)
class DemoRow:
    cache: str
    kv_bytes: int
    tokens: int
    prefill_s: float
    decode_tokens_per_s: float
    same_output: bool
    lossless: bool


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run one prompt with DynamicCache and every hf_kvgov cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=models.DEFAULT_MODEL,
        help="embedded name, .gguf path, local directory or hub id (default: %(default)s)",
    )
    parser.add_argument("--prompt", help="prompt text (default: the opening of Pride and Prejudice)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per cache [%(default)s]")
    parser.add_argument("--caches", help="comma-separated cache names (default: every fixed name; --list-caches)")
    parser.add_argument(
        "--list-caches", action="store_true", help="print every accepted cache name and form, then exit"
    )
    parser.set_defaults(func=run, loads_model=True)


def default_prompt() -> str:
    return demo_text(max_chars=2500) + "\nSummarize the passage above in one sentence:"


def run(args: argparse.Namespace) -> int:
    from hf_kvgov.registry import CACHES, cache_name_forms, get_cache_spec

    if args.list_caches:
        print(cache_name_forms())
        return 0
    if args.max_new_tokens < 2:
        raise ValueError(
            f"--max-new-tokens must be at least 2 (a prefill and a decode step); got {args.max_new_tokens}."
        )
    names = [name.strip() for name in (args.caches or ",".join(CACHES)).split(",") if name.strip()]
    specs = [get_cache_spec(name) for name in ["dynamic", *[n for n in names if n != "dynamic"]]]  # before loading
    print(f"[kvgov] loading {args.model} ...", flush=True)
    model, tokenizer = models.load_model(args.model)
    inputs = tokenizer(args.prompt or default_prompt(), return_tensors="pt")
    prompt_tokens = inputs["input_ids"].shape[1]
    print(
        f"[kvgov] one prompt of {prompt_tokens} tokens and {args.max_new_tokens} greedy new tokens through "
        f"{len(specs)} caches: KV bytes, prefill time and decode speed against DynamicCache in this run",
        flush=True,
    )
    import torch
    from tqdm import tqdm

    from hf_kvgov.registry import kv_bytes

    _generate(model, specs[0], inputs, 2)  # warm-up: the first call's one-time costs go to no cache
    rows: list[DemoRow] = []
    reference: torch.Tensor | None = None
    started = time.perf_counter()
    for spec in tqdm(specs, desc="caches", unit="cache"):
        output, clock, cache = _generate(model, spec, inputs, args.max_new_tokens)
        if reference is None:
            reference = output
            estimate = (time.perf_counter() - started) * 1.5 * (len(specs) - 1)  # eviction/disk caches run slower
            tqdm.write(f"[kvgov] about {estimate:.0f} s for the other {len(specs) - 1} caches")
        rows.append(
            DemoRow(
                spec.name,
                kv_bytes(cache),
                cache.get_seq_length(),
                clock.first_token_s,
                1 / clock.per_output_token_s,
                torch.equal(output, reference),
                spec.lossless,
            )
        )
    print(render(rows, prompt_tokens))
    assert reference is not None
    print("\noutput:", tokenizer.decode(reference[0, prompt_tokens:], skip_special_tokens=True))
    failed = [row.cache for row in rows if row.lossless and not row.same_output]
    if failed:
        print(f"\nLOSSLESS CACHES DIFFER FROM DynamicCache: {', '.join(failed)}")
    return 1 if failed else 0


def _generate(model: Any, spec: Any, inputs: Any, max_new_tokens: int) -> tuple[torch.Tensor, TokenClock, Any]:
    """(output, the clock of its new tokens, the cache)."""
    import torch

    from hf_kvgov.bench.timing import TokenClock

    cache = spec.build(model)
    clock = TokenClock()
    with spec.attention(model), torch.inference_mode():
        clock.start()
        output = model.generate(
            **inputs, cache=cache, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            streamer=clock,
        )  # fmt: skip
    return output, clock, cache


def render(rows: list[DemoRow], prompt_tokens: int) -> str:
    """The table: a row per cache, ratios against the first row (DynamicCache)."""
    base = rows[0]
    header = (
        f"{'cache':<12} {'KV bytes':>12} {'bytes/token':>11} {'prefill s':>9} {'x dynamic':>9} "
        f"{'decode tok/s':>12} {'x dynamic':>9}  same as DynamicCache"
    )
    lines = [f"prompt: {prompt_tokens} tokens", header, "-" * len(header)]
    for row in rows:
        verdict = "yes" if row.same_output else ("no (lossy)" if not row.lossless else "NO")
        lines.append(
            f"{row.cache:<12} {row.kv_bytes:>12,} {row.kv_bytes / row.tokens:>11,.0f} {row.prefill_s:>9.2f} "
            f"{row.prefill_s / base.prefill_s:>9.2f} {row.decode_tokens_per_s:>12.1f} "
            f"{row.decode_tokens_per_s / base.decode_tokens_per_s:>9.2f}  {verdict}"
        )
    return "\n".join(lines)
