"""Eviction quality on real text, cache in the loop: H2O and StreamingLLM against the full cache.

Two runs on SmolLM2-135M (float32, CPU), text from Pride and Prejudice (shipped in ``hf_kvgov/data/text``):

- ``budget``: ``--tokens`` tokens (default 2,048) fed ``--chunk`` tokens at a time through each cache;
  perplexity of the tokens predicted after the first eviction, for H2O, sinks + window and the recent
  window alone at each budget of ``--budgets`` (fractions of the text), against ``DynamicCache`` on the
  same tokens. This is the brief's "H2O keeps 20% at ~2% loss" claim.
- ``stream``: ``--stream-factor`` x the model's ``max_position_embeddings`` tokens (default 4.25 x 8,192)
  through ``SinkCache(n_sink=4, window=1020)`` and through ``DynamicCache``, which keeps everything and
  so must attend past the positions the model was trained on. Perplexity per ``--segment``-token segment
  shows StreamingLLM's result: the sink cache stays flat, the full cache degrades past the limit.

    python eval/bench_eviction.py                       # both runs, ~25 minutes on 2 CPU cores
    python eval/bench_eviction.py --runs budget --tokens 2048
    python eval/bench_eviction.py --runs stream --stream-factor 1.5   # a quicker look

Writes eval/out/bench_eviction.json and prints Markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, SinkCache, eviction_attention
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import pride_and_prejudice_path
from hf_kvgov.models import load_model

OUT = Path(__file__).resolve().parent / "out"
TEXT = pride_and_prejudice_path()  # the complete novel the package ships
N_SINK = 4


def token_stream(tokenizer: Any, tokens: int, start_char: int) -> torch.Tensor:
    """Long ``[1, tokens]`` of the novel from ``start_char`` on; the text repeats if it is too short."""
    text = TEXT.read_text(encoding="utf-8")
    ids = tokenizer(text[start_char:] + "\n\n" + text, return_tensors="pt")["input_ids"]
    while ids.shape[1] < tokens:
        ids = torch.cat((ids, ids), dim=1)
    return ids[:, :tokens]


def stream_nll(model: Any, cache: Any, ids: torch.Tensor, chunk: int, label: str) -> torch.Tensor:
    """Float ``[n - 1]``: the loss of token ``i + 1`` predicted at position ``i``, ``chunk`` tokens a forward."""
    losses = []
    with torch.inference_mode():
        for start in tqdm(range(0, ids.shape[1], chunk), desc=label, unit="chunk", leave=False):
            piece = ids[:, start : start + chunk + 1]  # one extra token: the target of the chunk's last position
            logits = model(piece[:, :chunk], cache=cache).logits[0].float()
            targets = piece[0, 1:]
            losses.append(torch.nn.functional.cross_entropy(logits[: targets.shape[0]], targets, reduction="none"))
    return torch.cat(losses)


def run_budgets(model: Any, tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    ids = token_stream(tokenizer, args.tokens, args.start_char)
    full_nll = stream_nll(model, DynamicCache(config=model.config), ids, args.chunk, "full cache")
    rows = []
    for fraction in args.budgets:
        budget = int(args.tokens * fraction)
        first_evicted = (budget // args.chunk + 1) * args.chunk  # first chunk that reads an evicted cache
        full = math.exp(full_nll[first_evicted:].mean().item())
        caches: dict[str, Callable[[], Any]] = {
            "h2o": lambda b=budget: HeavyHitterCache(model, budget=b),
            "sink": lambda b=budget: SinkCache(model, n_sink=N_SINK, window=b - N_SINK),
            "recent window": lambda b=budget: SinkCache(model, n_sink=0, window=b),
        }
        for name, make in caches.items():
            with eviction_attention(model):
                nll = stream_nll(model, make(), ids, args.chunk, f"{name} @ {fraction:.0%}")
            ppl = math.exp(nll[first_evicted:].mean().item())
            rows.append(
                {"cache": name, "budget_fraction": fraction, "budget_slots": budget, "scored_from": first_evicted}
                | {"perplexity": ppl, "full_perplexity": full, "increase_pct": 100 * (ppl / full - 1)}
            )
    return rows


def run_stream(model: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    limit = int(model.config.max_position_embeddings)
    tokens = int(limit * args.stream_factor)
    ids = token_stream(tokenizer, tokens, args.start_char)
    chunk = args.stream_chunk
    with eviction_attention(model):
        sink = stream_nll(model, SinkCache(model, n_sink=N_SINK, window=1020), ids, chunk, "sink 4+1020")
    full = stream_nll(model, DynamicCache(config=model.config), ids, chunk, "full cache")
    segments = []
    for start in range(0, tokens - 1, args.segment):
        stop = min(start + args.segment, tokens - 1)
        segments.append(
            {"from": start, "to": stop, "past_limit": start >= limit}
            | {"sink": math.exp(sink[start:stop].mean().item()), "full": math.exp(full[start:stop].mean().item())}
        )
    return {"tokens": tokens, "max_position_embeddings": limit, "segments": segments}


def render_budgets(rows: list[dict[str, Any]]) -> str:
    lines = ["| budget | cache | perplexity | full cache | increase |", "| ---: | --- | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(
            f"| {r['budget_fraction']:.0%} ({r['budget_slots']}) | {r['cache']} | {r['perplexity']:.2f} "
            f"| {r['full_perplexity']:.2f} | {r['increase_pct']:+.1f}% |"
        )
    return "\n".join(lines)


def render_stream(result: dict[str, Any]) -> str:
    lines = ["| tokens | past the limit | sink 4+1020 | full cache |", "| --- | --- | ---: | ---: |"]
    for s in result["segments"]:
        past = "yes" if s["past_limit"] else "no"
        lines.append(f"| {s['from']:,}-{s['to']:,} | {past} | {s['sink']:.2f} | {s['full']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="budget,stream", help="comma-separated: budget, stream")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=64, help="tokens per forward in the budget run")
    parser.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 0.3, 0.5])
    parser.add_argument("--start-char", type=int, default=20000)
    parser.add_argument("--stream-factor", type=float, default=4.25)
    parser.add_argument("--stream-chunk", type=int, default=256)
    parser.add_argument("--segment", type=int, default=2048)
    args = parser.parse_args()
    runs = set(args.runs.split(","))
    if not runs <= {"budget", "stream"}:
        parser.error(f"--runs accepts budget and stream; got {args.runs!r}.")
    model, tokenizer = load_model("smollm2")
    result: dict[str, Any] = {"machine": machine_description(), "args": vars(args)}
    print(f"SmolLM2-135M fp32, {result['machine']}\n")
    if "budget" in runs:
        result["budget"] = run_budgets(model, tokenizer, args)
        print(f"{args.tokens} tokens, {args.chunk} per forward\n\n{render_budgets(result['budget'])}\n")
    if "stream" in runs:
        result["stream"] = run_stream(model, tokenizer, args)
        table = render_stream(result["stream"])
        print(f"{result['stream']['tokens']} tokens, {args.stream_chunk} per forward\n\n{table}")
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_eviction.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
