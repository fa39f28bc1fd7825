"""hf_kvgov's eviction policies on the two compression protocols of `policy_protocols`, against the full cache.

(a) ``continue``: prefill 1,536 tokens keeping 20% (307 slots per KV head) with ``compress="prefill"``, then
    score the next 512 tokens teacher-forced in 32-token chunks, appended without further eviction.
(b) ``stream``: 2,048 tokens in 32-token chunks through a cache of 20% of 2,048 (409 slots) throughout,
    scored from the first chunk that reads an evicted cache.

Both declare what the 20% is a fraction of (``budget_of=``); a fraction of the first chunk would be 20% of
32 tokens. Models: SmolLM2-135M and Gemma-3-270M (float32, CPU), two passages of Pride and Prejudice.
Configurations: H2O (half recent window, H2O's split, and a 32-token window), sinks + window (StreamingLLM),
SnapKV, TOVA, key-norm, mean attention mass, Expected Attention, SnapKV at prefill then H2O (stream only: in
(a) nothing is evicted after the prefill), KVzip (``kvzip``, ``kvzip layerwise``; (a) only: it compresses the
context in reconstruction passes of its own), and with ``--pyramid`` SnapKV, Expected Attention and H2O with
PyramidKV's per-layer budgets (`hf_kvgov.policies.Pyramid`: more in the lower layers, the same total), and
with ``--adaptive`` those three and mean attention mass with AdaKV's head-adaptive budgets
(`hf_kvgov.policies.HeadAdaptive`: a layer's heads share its total by score; with both flags, also pyramid
and head-adaptive together).

    python eval/bench_policies.py                 # both protocols, both models: ~35 min on 2 CPU cores
    python eval/bench_policies.py --models smollm2 --protocols continue --json eval/out/policies.json

Prints Markdown tables; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from policy_protocols import (
    CHUNK,
    KEEP,
    PREFILL,
    SCORED,
    STREAM,
    add_passage_arguments,
    continue_ppl,
    first_evicted,
    markdown,
    passage_ids,
    passages,
    plain_forward,
    row,
    stream_ppl,
)
from transformers import DynamicCache

from hf_kvgov import HeavyHitterCache, PolicyCache, SinkCache, eviction_attention, kvzip_cache
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.models import load_model
from hf_kvgov.policies import H2O, ExpectedAttention, HeadAdaptive, Pyramid, QueryForecast, SnapKV

RUNNING_EA = ExpectedAttention(forecast=QueryForecast(running=True))
CacheFactory = Callable[..., Any]  # (model, budget_of=..., compress=..., layer_budgets=...) -> cache


def configurations(stream: bool, selected: list[str] | None = None) -> dict[str, CacheFactory]:
    """Name -> factory of an hf_kvgov cache keeping ``KEEP`` of ``budget_of`` tokens.

    Besides the fixed names, any selected ``snapkv window=W kernel=K pooling=P`` (each part optional) is SnapKV
    with those settings: ``snapkv window=64 kernel=5 pooling=avg`` is kvpress's SnapKVPress.
    """
    configs: dict[str, CacheFactory] = {
        "h2o": lambda m, **kw: HeavyHitterCache(m, budget=KEEP, **kw),
        "h2o recent=32": lambda m, **kw: HeavyHitterCache(m, budget=KEEP, recent=32, **kw),
        # The recent window's share of the budget (H2O's default: half).
        "h2o recent=0.75": lambda m, **kw: HeavyHitterCache(m, budget=KEEP, recent=0.75, **kw),
        "h2o recent=0.9": lambda m, **kw: HeavyHitterCache(m, budget=KEEP, recent=0.9, **kw),
        "sink": lambda m, **kw: SinkCache(m, n_sink=4, window=60, budget=KEEP, **kw),
        "snapkv": lambda m, **kw: PolicyCache(m, "snapkv", budget=KEEP, **kw),
        "tova": lambda m, **kw: PolicyCache(m, "tova", budget=KEEP, **kw),
        "key_norm": lambda m, **kw: PolicyCache(m, "key_norm", budget=KEEP, **kw),
        "mean_mass": lambda m, **kw: PolicyCache(m, "mean_mass", budget=KEEP, **kw),
        "expected_attention": lambda m, **kw: PolicyCache(m, "expected_attention", budget=KEEP, **kw),
        # The forecast from every query seen so far instead of the step's own.
        "expected_attention running": lambda m, **kw: PolicyCache(m, RUNNING_EA, budget=KEEP, **kw),
        "expected_attention running recent=128": lambda m, **kw: PolicyCache(
            m, ExpectedAttention(recent=128, forecast=QueryForecast(running=True)), budget=KEEP, **kw
        ),
        "expected_attention running recent=200": lambda m, **kw: PolicyCache(
            m, ExpectedAttention(recent=200, forecast=QueryForecast(running=True)), budget=KEEP, **kw
        ),
    }
    for name in selected or []:
        if name.startswith("snapkv "):
            configs[name] = _snapkv_variant(name)
    if stream:
        decode = H2O(heavy=0.5, recent=32)
        configs["snapkv+h2o decode"] = lambda m, **kw: PolicyCache(m, "snapkv", KEEP, decode_policy=decode, **kw)
    return configs


def _snapkv_variant(name: str) -> CacheFactory:
    """``snapkv window=W kernel=K pooling=P`` -> a factory of PolicyCache with that SnapKV."""
    settings: dict[str, Any] = {}
    for part in name.split()[1:]:
        key, _, value = part.partition("=")
        if key not in ("window", "kernel", "pooling") or not value:
            raise SystemExit(f"{name!r}: give snapkv settings as window=W kernel=K pooling=max|avg; got {part!r}.")
        settings[key] = value if key == "pooling" or not value.isdigit() else int(value)
    try:
        policy = SnapKV(**settings)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"{name!r}: {error}") from None
    return lambda m, **kw: PolicyCache(m, policy, budget=KEEP, **kw)


# KVzip (`hf_kvgov.kvzip_cache`): its layers' slots ranked together (its default), or each layer the same total.
KVZIP = ("kvzip", "kvzip layerwise")

# The policies run with budget allocators (and every SnapKV variant).
ALLOCATED = ("snapkv", "expected_attention", "expected_attention running", "h2o", "mean_mass")


def allocations(with_pyramid: bool, adaptive: bool) -> list[tuple[str, dict[str, Any]]]:
    """(suffix, cache keywords) of each budget allocation the flags ask for, besides the uniform budget."""
    chosen = []
    if with_pyramid:
        chosen.append(("+pyramid", {"layer_budgets": Pyramid()}))
    if adaptive:
        chosen.append(("+ada", {"head_budgets": HeadAdaptive()}))
    if with_pyramid and adaptive:
        chosen.append(("+pyramid+ada", {"layer_budgets": Pyramid(), "head_budgets": HeadAdaptive()}))
    return chosen


def run_model(
    name: str,
    protocols: list[str],
    allocated: list[tuple[str, dict[str, Any]]],
    selected: list[str] | None,
    texts: dict[str, tuple[Path, int]],
) -> list[dict[str, Any]]:
    model, tokenizer = load_model(name)
    forward = plain_forward(model)
    rows: list[dict[str, Any]] = []
    for passage, where in texts.items():
        ids = passage_ids(tokenizer, where, STREAM + 1)
        for protocol in protocols:
            rows += _protocol_rows(model, tokenizer, name, passage, ids, protocol, forward, allocated, selected)
    return rows


def _protocol_rows(
    model: Any,
    tokenizer: Any,
    name: str,
    passage: str,
    ids: torch.Tensor,
    protocol: str,
    forward: Any,
    allocated: list[tuple[str, dict[str, Any]]],
    selected: list[str] | None,
) -> list[dict[str, Any]]:
    stream = protocol == "stream"
    tokens = STREAM if stream else PREFILL
    kept = int(KEEP * tokens)
    full = _ppl(forward, DynamicCache(), ids, stream, kept)
    configs = {c: f for c, f in configurations(stream, selected).items() if selected is None or c in selected}
    variants: list[tuple[str, CacheFactory, dict[str, Any]]] = [(c, f, {}) for c, f in configs.items()]
    for suffix, keywords in allocated:
        allocatable = {c: f for c, f in configs.items() if c in ALLOCATED or c.startswith("snapkv ")}
        variants += [(f"{c} {suffix}", f, keywords) for c, f in allocatable.items()]
    rows = []
    for config, make, extra in variants:
        cache = make(model, budget_of=tokens, compress="always" if stream else "prefill", **extra)
        with eviction_attention(model):
            ppl = _ppl(forward, cache, ids, stream, kept)
        rows.append(row(name, passage, config, kept, ppl, full) | {"protocol": protocol})
        print(f"  {name} {passage} {protocol} {config}: {ppl:.3f} (full {full:.3f})", flush=True)
    for config in [c for c in KVZIP if not stream and (selected is None or c in selected)]:
        # KVzip compresses the context in passes of its own before the continuation is scored.
        cache = kvzip_cache(model, tokenizer, ids[:, :PREFILL], budget=kept, layerwise=config == "kvzip layerwise")
        with eviction_attention(model):
            ppl = continue_ppl(lambda *_: None, forward, cache, ids[:, : PREFILL + SCORED + 1])
        rows.append(row(name, passage, config, kept, ppl, full) | {"protocol": protocol})
        print(f"  {name} {passage} {protocol} {config}: {ppl:.3f} (full {full:.3f})", flush=True)
    return rows


def _ppl(forward: Any, cache: Any, ids: torch.Tensor, stream: bool, kept: int) -> float:
    if stream:
        return stream_ppl(forward, cache, ids, first_evicted(kept))
    return continue_ppl(forward, forward, cache, ids[:, : PREFILL + SCORED + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--protocols", nargs="+", choices=["continue", "stream"], default=["continue", "stream"])
    parser.add_argument("--pyramid", action="store_true", help="add PyramidKV budgets to 3 policies")
    parser.add_argument("--adaptive", action="store_true", help="add AdaKV head-adaptive budgets to 3 policies")
    parser.add_argument("--configs", nargs="+", help="run only these configurations (default: all)")
    parser.add_argument("--json", type=Path, help="write every row here")
    add_passage_arguments(parser)
    args = parser.parse_args()
    allocated = allocations(args.pyramid, args.adaptive)
    rows = [r for m in args.models for r in run_model(m, args.protocols, allocated, args.configs, passages(args))]
    machine = machine_description()
    titles = {
        "continue": f"(a) compress, then continue: {PREFILL} prefill -> {int(KEEP * PREFILL)} kept, {SCORED} scored",
        "stream": f"(b) streaming: {STREAM} tokens in {CHUNK}-token chunks, {int(KEEP * STREAM)} kept",
    }
    for protocol in args.protocols:
        print("\n" + markdown([r for r in rows if r["protocol"] == protocol], f"{titles[protocol]} ({machine})"))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
