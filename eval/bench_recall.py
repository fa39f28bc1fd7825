"""Does recall pay? H2O (or another policy) alone, with spill/recall, and the full cache on passkey and streaming
perplexity.

All three run on the same prompts and tokens in one process. "20% resident" is the same K/V memory for
both eviction configurations, per (sequence, full-attention layer, KV head): 20% of the tokens as kept
slots for H2O alone; for H2O + recall the kept slots, one pending page, the recalled pages and one key
range per written page together (`Recall.kept_within`). Sliding-window layers keep their window in both
(they never hold more than ``window - 1`` tokens, which is what the full cache reads there).

- ``passkey``: the eval suite's passkey task (RULER's, the question in the prompt, the chat template),
  ``--samples`` per length, greedy; accuracy and resident bytes relative to `DynamicCache` at the end.
- ``stream``: protocol (b) of `policy_protocols` (2,048 tokens of Pride and Prejudice in 32-token chunks,
  scored from the first chunk that reads an evicted cache), on two passages.

    python eval/bench_recall.py --models gemma3-270m --tasks passkey --lengths 4096,8192 --samples 10
    python eval/bench_recall.py --models smollm2,gemma3-270m --tasks stream
    python eval/bench_recall.py --models gemma3-270m --tasks passkey --lengths 8192 --pages 16 --summary centroid
    python eval/bench_recall.py --models smollm2 --tasks stream \
        --configs expected_attention_running,expected_attention_running+recall
    python eval/bench_recall.py --models smollm2 --tasks stream --buffer shared
    python eval/bench_recall.py --models smollm2 --tasks stream --neighbours 1 --text emma.txt --offsets 100000 400000

Prints Markdown tables; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from policy_protocols import (
    CHUNK,
    KEEP,
    STREAM,
    add_passage_arguments,
    first_evicted,
    passage_ids,
    passages,
    plain_forward,
    stream_ppl,
)
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, PolicyCache, eviction_attention
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.evaluation.registry import get_synthetic_task
from hf_kvgov.evaluation.synthetic_run import SyntheticOptions, build_items, prompt_text
from hf_kvgov.evaluation.texts import demo_text
from hf_kvgov.hf.eviction.model_inputs import layer_windows
from hf_kvgov.models import load_model
from hf_kvgov.policies import make_policy
from hf_kvgov.registry import kv_bytes
from hf_kvgov.tiers.recall_pages import DEFAULT_BUFFER, DEFAULT_NEIGHBOURS, DEFAULT_SUMMARY, Recall

# The eviction policies: H2O, and Expected Attention forecasting from every query seen (the streaming setting).
POLICIES = ("h2o", "expected_attention_running")
CONFIGS = ("full", *(f"{p}{r}" for p in POLICIES for r in ("", "+recall")))
DEFAULT_CONFIGS = ("full", "h2o", "h2o+recall")


def eviction_cache(model: Any, config: str, tokens: int, recall: Recall, keep: float) -> Any:
    """The config's policy at ``keep`` of ``tokens`` resident slots per (sequence, full layer, KV head), with or
    without recall."""
    policy, _, recalled = config.partition("+")
    resident = max(1, math.floor(keep * tokens))
    sliding = {i: resident for i, window in enumerate(layer_windows(model.config)) if window is not None}
    if not recalled:
        return _evicting(model, policy, resident)
    kept = recalled_budget(model, recall, resident, tokens)
    return _evicting(model, policy, kept, layer_budgets=sliding or None, recall=recall)


def recalled_budget(model: Any, recall: Recall, resident: int, tokens: int) -> int:
    """The kept slots beside recall within ``resident`` slot-equivalents; a shared buffer's pages are spread over
    the full-attention layers, the ones that recall (sliding layers keep their window)."""
    recalling = sum(window is None for window in layer_windows(model.config))
    return recall.kept_within(resident, tokens, layers=recalling)


def _evicting(model: Any, policy: str, budget: int, **options: Any) -> Any:
    if policy == "h2o":
        return HeavyHitterCache(model, budget=budget, **options)
    return PolicyCache(model, make_policy(policy), budget=budget, **options)


def passkey_rows(
    model: Any,
    tokenizer: Any,
    name: str,
    lengths: list[int],
    samples: int,
    recall: Recall,
    keep: float,
    new: int,
    configs: tuple[str, ...] = DEFAULT_CONFIGS,
) -> list[dict[str, Any]]:
    options = SyntheticOptions(("dynamic",), ("passkey",), tuple(lengths), samples, max_new_tokens=new)
    task = get_synthetic_task("passkey")
    rows = []
    for item in build_items(tokenizer, demo_text(), options):
        sample = item.sample
        text, wrapped = prompt_text(sample, tokenizer, True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=not wrapped)["input_ids"]
        budget = min(sample.max_new_tokens, new)
        for config in configs:
            began = time.perf_counter()
            answer, cache = _generate(model, tokenizer, ids, config, recall, keep, budget)
            rows.append(
                {
                    "model": name, "task": "passkey", "length": sample.target_length, "sample": item.index,
                    "config": config, "prompt_tokens": int(ids.shape[1]), "answer": answer,
                    "expected": list(sample.answers), "score": task.score(answer, sample.answers),
                    "kv_bytes": kv_bytes(cache), "seconds": time.perf_counter() - began, **_recall_fields(cache),
                }
            )  # fmt: skip
            print(f"{name} {sample.target_length} #{item.index} {config:11s} {rows[-1]['score']:.0f} {answer!r}")
            _release(cache)
    return rows


def _generate(model: Any, tokenizer: Any, ids: torch.Tensor, config: str, recall: Recall, keep: float, new: int):  # type: ignore[no-untyped-def]
    tokens = int(ids.shape[1]) + new
    cache = (
        DynamicCache(config=model.config) if config == "full" else eviction_cache(model, config, tokens, recall, keep)
    )
    context = eviction_attention(model) if config != "full" else contextlib.nullcontext()
    with context, torch.inference_mode():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new, do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )  # fmt: skip
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), cache


def stream_rows(
    model: Any,
    tokenizer: Any,
    name: str,
    recall: Recall,
    keep: float,
    texts: dict[str, tuple[Path, int]],
    configs: tuple[str, ...] = DEFAULT_CONFIGS,
) -> list[dict[str, Any]]:
    forward = plain_forward(model)
    rows = []
    resident = math.floor(keep * STREAM)
    for passage, where in texts.items():
        ids = passage_ids(tokenizer, where, STREAM + 1)
        # Scored from the earlier of the two caches' first eviction.
        scored = first_evicted(recalled_budget(model, recall, resident, STREAM))
        full = stream_ppl(forward, DynamicCache(config=model.config), ids, scored)
        for config in (c for c in configs if c != "full"):
            cache = eviction_cache(model, config, STREAM, recall, keep)
            with eviction_attention(model):
                ppl = stream_ppl(forward, cache, ids, scored)
            rows.append(
                {
                    "model": name, "task": "stream", "passage": passage, "config": config, "ppl": ppl,
                    "full_ppl": full, "change_pct": 100 * (ppl / full - 1), "kv_bytes": kv_bytes(cache),
                    "scored_from": scored, **_recall_fields(cache),
                }
            )  # fmt: skip
            print(f"{name} {passage} {config:11s} ppl {ppl:.3f} (full {full:.3f}, {rows[-1]['change_pct']:+.2f}%)")
            _release(cache)
    return rows


def _recall_fields(cache: Any) -> dict[str, Any]:
    stats = getattr(cache, "recall_stats", lambda: None)()
    if stats is None:
        return {}
    steps = max(stats.layer_steps, 1)
    return {
        "budget": cache.budget, "pages_written": stats.pages_written, "write_amplification": stats.write_amplification,
        "pages_read": stats.pages_read, "pages_read_per_layer_step": stats.pages_read / steps,
        "max_pages_read_per_step": stats.max_pages_read_per_step, "recall_resident_bytes": stats.resident_bytes,
    }  # fmt: skip


def _release(cache: Any) -> None:
    release = getattr(cache, "release", None)
    if callable(release):
        release()


def passkey_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | length | samples | config | accuracy | resident KV vs full | pages read / layer step |"]
    lines.append("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
    keys = sorted({(r["model"], r["length"]) for r in rows if r["task"] == "passkey"})
    for model, length in keys:
        group = [r for r in rows if r["task"] == "passkey" and r["model"] == model and r["length"] == length]
        full = [r["kv_bytes"] for r in group if r["config"] == "full"]
        full_bytes = _mean(full) if full else float("nan")
        for config in [c for c in CONFIGS if any(r["config"] == c for r in group)]:
            mine = [r for r in group if r["config"] == config]
            recalled = "pages_read_per_layer_step" in mine[0]
            reads = f"{_mean([r['pages_read_per_layer_step'] for r in mine]):.2f}" if recalled else ""
            accuracy = 100 * _mean([r["score"] for r in mine])
            held = _mean([r["kv_bytes"] for r in mine]) / full_bytes
            lines.append(f"| {model} | {length} | {len(mine)} | {config} | {accuracy:.0f}% | {held:.3f}x | {reads} |")
    return "\n".join(lines)


def stream_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | passage | config | ppl | full ppl | change | pages read / layer step |"]
    lines.append("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in (r for r in rows if r["task"] == "stream"):
        reads = r.get("pages_read_per_layer_step")
        lines.append(
            f"| {r['model']} | {r['passage']} | {r['config']} | {r['ppl']:.3f} | {r['full_ppl']:.3f} | "
            f"{r['change_pct']:+.2f}% | {'' if reads is None else f'{reads:.2f}'} |"
        )
    return "\n".join(lines)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gemma3-270m")
    parser.add_argument("--tasks", default="passkey,stream")
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--pages", type=int, default=8, help="pages recalled per (sequence, layer, KV head) per step")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--summary", default=DEFAULT_SUMMARY, help="page summary ranking recalls: centroid or bounds")
    parser.add_argument("--buffer", default=DEFAULT_BUFFER, help="recall buffer: layer (one per layer) or shared")
    parser.add_argument("--neighbours", type=int, default=DEFAULT_NEIGHBOURS, help="pages each side of a chosen page")
    parser.add_argument("--keep", type=float, default=KEEP, help="resident fraction (default 0.2)")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"configurations among {CONFIGS}")
    parser.add_argument("--json", type=Path)
    add_passage_arguments(parser)
    args = parser.parse_args()
    recall = Recall(
        pages=args.pages, page_tokens=args.page_tokens, summary=args.summary, buffer=args.buffer,
        neighbours=args.neighbours,
    )  # fmt: skip
    tasks = args.tasks.split(",")
    rows: list[dict[str, Any]] = []
    configs = tuple(args.configs.split(","))
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; accepted: {', '.join(CONFIGS)}")
    for name in args.models.split(","):
        model, tokenizer = load_model(name)
        if "passkey" in tasks:
            lengths = [int(x) for x in args.lengths.split(",")]
            rows += passkey_rows(
                model, tokenizer, name, lengths, args.samples, recall, args.keep, args.new_tokens, configs
            )
        if "stream" in tasks:
            rows += stream_rows(model, tokenizer, name, recall, args.keep, passages(args), configs)
    print(f"\n{machine_description()}; Recall(pages={args.pages}, page_tokens={args.page_tokens}, "
          f"summary={args.summary!r}, buffer={args.buffer!r}, neighbours={args.neighbours}), "
          f"{100 * args.keep:g}% resident, {CHUNK}-token stream chunks\n")  # fmt: skip
    if "passkey" in tasks:
        print(passkey_table(rows) + "\n")
    if "stream" in tasks:
        print(stream_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine_description(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
