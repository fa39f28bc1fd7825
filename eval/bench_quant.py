"""transformers' own QuantizedCache backends against hf_kvgov's QuantizedCache, side by side on SmolLM2.

At the same bit widths, in one run:

    int2   transformers quanto (optimum-quanto)                            hf_kvgov int2 (KIVI)
    int4   transformers quanto (optimum-quanto)   transformers HQQ (hqq)   hf_kvgov int4
    int8   transformers HQQ (hqq)                                          hf_kvgov int8
    fp8    transformers fp8 (one e4m3 scale per tensor)                    hf_kvgov fp8 (e4m3, KIVI scales)

and DynamicCache. transformers' caches run with their defaults (q_group_size 64, residual_length 128,
axis 0 for keys and values; fp8 takes no options); hf_kvgov's with blocks of `COMPACT_BLOCK_SIZE`
(128) and, as `*-b16`, with its default 16-token blocks, each with one full-precision sink block. Measured:

1. Perplexity with the cache in the loop: `--tokens` tokens of Pride and Prejudice fed in chunks of 128,
   every cache in one batch against a lossless PagedCache (hf_kvgov.quality.score_in_lockstep). A chunk of
   128 is both hf_kvgov's block and transformers' residual window, so each token sees exactly what it
   would see in generation: the quantized past, and its own chunk in full precision.
2. KV bytes held at the end of (1), per token and relative to float16 storage of the same tokens: codes,
   scales and zero points as each backend stores them (quanto's and HQQ's statistics follow the model's
   dtype, float32 here; hf_kvgov's are float16), plus what each keeps in full precision (transformers'
   residual tokens; hf_kvgov's sink and tail blocks).
3. Decode speed: a `--context`-token random prompt is prefilled once with DynamicCache and handed to every
   cache through `update`, 128 tokens at a time; then `--steps` greedy steps are timed, in interleaved
   rounds (median reported), as ratios to DynamicCache from the same run.

Optional packages, needed only here (never by the tests): `pip install optimum-quanto hqq` (measured with
optimum-quanto 0.2.7 and hqq 0.2.8.post1, torch 2.13 CPU; both work). A backend whose package is missing
or fails is reported with the reason instead of numbers. Beware that transformers imports hqq whenever it
is installed (cache_utils), which pulls in torch's inductor: every `import transformers` then takes ~3 s
longer, so keep hqq out of the environment the tests run in.

    python eval/bench_quant.py              # about 10 minutes on one CPU thread; writes eval/out/bench_quant.json
    python eval/bench_quant.py --tokens 256 --context 256 --steps 4 --rounds 1      # a smoke run, ~4 minutes

The perplexity pass dominates: at every 128-token flush transformers' quanto and HQQ caches dequantize and
re-quantize their whole history (HQQ with its iterative optimizer), so their cost grows with the square
of the text; the 2,048-token pass took 3-7 minutes of the 10 on a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache
from transformers import QuantizedCache as HFQuantizedCache

from hf_kvgov.bench.timing import interleaved, machine_description
from hf_kvgov.data_text import pride_and_prejudice_path
from hf_kvgov.engine.quant_config import COMPACT_BLOCK_SIZE
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.models import load_model
from hf_kvgov.quality import score_in_lockstep
from hf_kvgov.registry import int2_kivi

OUT = Path(__file__).resolve().parent / "out"
TEXT = pride_and_prejudice_path()  # the complete novel the package ships
CHUNK = 128  # hf_kvgov's block and transformers' residual window: see the docstring, point 1
TEXT_START = 30_000  # the character where the scored text starts (the one tests/quantized uses)

Builder = Callable[[Any], Any]  # model -> a fresh cache
CANDIDATES: dict[str, tuple[str, Builder]] = {
    "dynamic": ("fp32", lambda m: DynamicCache(config=m.config)),
    "hf-quanto-int4": ("int4", lambda m: HFQuantizedCache("quanto", m.config, nbits=4)),
    "hf-hqq-int4": ("int4", lambda m: HFQuantizedCache("hqq", m.config, nbits=4)),
    "kvgov-int4": ("int4", lambda m: QuantizedCache(m, bits=4, block_size=COMPACT_BLOCK_SIZE)),
    "hf-hqq-int8": ("int8", lambda m: HFQuantizedCache("hqq", m.config, nbits=8)),
    "kvgov-int8": ("int8", lambda m: QuantizedCache(m, bits=8, block_size=COMPACT_BLOCK_SIZE)),
    "hf-fp8": ("fp8", lambda m: HFQuantizedCache("fp8", m.config)),
    "kvgov-fp8": ("fp8", lambda m: QuantizedCache(m, bits=8, fmt="fp8", block_size=COMPACT_BLOCK_SIZE)),
    # The default 16-token blocks: fewer full-precision tokens (sink + tail), more scales per token.
    "kvgov-int4-b16": ("int4", lambda m: QuantizedCache(m, bits=4)),
    "kvgov-int8-b16": ("int8", lambda m: QuantizedCache(m, bits=8)),
    "kvgov-fp8-b16": ("fp8", lambda m: QuantizedCache(m, bits=8, fmt="fp8")),
    # 2 bits: transformers' quanto int2 with its defaults, and hf_kvgov's int2 as its `int2` cache name runs it
    # (KIVI: 16-token blocks, the newest 32 tokens in full precision, values in groups of 32 channels, one-byte
    # scales and zeros), and the same with fp16 statistics (16- and 32-token blocks).
    "hf-quanto-int2": ("int2", lambda m: HFQuantizedCache("quanto", m.config, nbits=2)),
    "kvgov-int2": ("int2", lambda m: int2_kivi(m)),
    "kvgov-int2-fp16": ("int2", lambda m: QuantizedCache(m, bits=2, residual=32, group_size=32, scale_bytes=2)),
    "kvgov-int2-b32-fp16": (
        "int2",
        lambda m: QuantizedCache(m, bits=2, block_size=32, residual=32, group_size=32, scale_bytes=2),
    ),
}


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in `obj`: nested tuples, lists and dicts, and tensor subclasses (quanto's
    QTensors) through their inner tensors."""
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:
            names, _ = obj.__tensor_flatten__()
            return sum(tensor_bytes(getattr(obj, name)) for name in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(value) for value in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(value) for value in obj)
    return 0


def held_bytes(cache: Any) -> int:
    """KV bytes a cache holds: hf_kvgov's own accounting, else every tensor of every layer."""
    if isinstance(cache, QuantizedCache):
        return int(cache.stats().bytes_used)
    names = ("keys", "values", "_quantized_keys", "_quantized_values")
    return sum(tensor_bytes(getattr(layer, name, None)) for layer in cache.layers for name in names)


def fp16_bytes_per_token(model: Any) -> int:
    config = model.config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2


def unavailable(model: Any, names: list[str], ids: torch.Tensor) -> dict[str, str]:
    """name -> why its cache does not work here (a missing package, a failing kernel), for those that fail.

    Each cache is tried on two steps of the model: a prefill (quantized at once by transformers' caches)
    and a decode step (dequantized).
    """
    reasons = {}
    for name in names:
        try:
            cache = CANDIDATES[name][1](model)
            model(ids[:, :CHUNK], cache=cache)
            model(ids[:, CHUNK : CHUNK + 1], cache=cache)
        except Exception as error:  # any failure is reported in the table instead of numbers
            reasons[name] = f"{type(error).__name__}: {error}".splitlines()[0]
    return reasons


def quality_rows(model: Any, ids: torch.Tensor, names: list[str]) -> dict[str, dict[str, Any]]:
    """Perplexity, KL, top-1 and bytes of every cache with the text fed CHUNK tokens per step."""
    built: dict[str, Any] = {}

    def builder(name: str) -> Callable[[], Any]:
        return lambda: built.setdefault(name, CANDIDATES[name][1](model))

    builders = {name: builder(name) for name in names}
    result = score_in_lockstep(model, ids, builders, CHUNK, CHUNK, max_rows=len(names), progress="perplexity")
    fp16 = fp16_bytes_per_token(model)
    rows = {}
    for name, score in result.scores.items():
        tokens = int(built[name].get_seq_length())
        held = held_bytes(built[name])
        rows[name] = {
            "perplexity": score.perplexity,
            "reference_perplexity": score.reference_perplexity,
            "ppl_increase_pct": score.ppl_increase_pct,
            "kl_mean": score.kl_mean,
            "top1_agreement": score.top1_agreement,
            "tokens_held": tokens,
            "bytes_held": held,
            "bytes_per_token": held / tokens,
            "vs_fp16": held / (tokens * fp16),
        }
    return rows


def dynamic_row(model: Any, perplexity: float) -> dict[str, Any]:
    """DynamicCache is lossless: the reference's perplexity, and K/V in the model's dtype."""
    ratio = model.dtype.itemsize / 2
    return {
        "perplexity": perplexity,
        "ppl_increase_pct": 0.0,
        "kl_mean": 0.0,
        "top1_agreement": 1.0,
        "bytes_per_token": fp16_bytes_per_token(model) * ratio,
        "vs_fp16": ratio,
    }


def prefill(model: Any, context: int) -> tuple[DynamicCache, torch.Tensor]:
    """K/V of `context` random tokens in a DynamicCache, and the greedy next token."""
    ids = torch.randint(100, 20000, (1, context), generator=torch.Generator().manual_seed(0))
    reference = DynamicCache(config=model.config)
    logits = model(ids, cache=reference, logits_to_keep=1).logits
    return reference, logits[:, -1:].argmax(-1)


def decode_tokens_per_s(model: Any, name: str, reference: DynamicCache, token: torch.Tensor, steps: int) -> float:
    cache = CANDIDATES[name][1](model)
    layers: list[Any] = list(reference.layers)
    for start in range(0, reference.get_seq_length(), CHUNK):  # the prompt, as a chunked prefill stores it
        for index, layer in enumerate(layers):
            cache.update(layer.keys[:, :, start : start + CHUNK], layer.values[:, :, start : start + CHUNK], index)
    begin = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
    return steps / (time.perf_counter() - begin)


def speed_rows(model: Any, names: list[str], context: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    reference, token = prefill(model, context)
    samples = interleaved(names, rounds, lambda name: decode_tokens_per_s(model, name, reference, token, steps))
    speeds = {name: statistics.median(samples[name]) for name in names}
    return {name: {"tokens_per_s": s, "ratio_vs_dynamic": s / speeds["dynamic"]} for name, s in speeds.items()}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"SmolLM2-135M {report['dtype']}, {report['tokens']:,} tokens of Pride and Prejudice in chunks of {CHUNK}; "
        f"decode after a {report['context']}-token prompt, {report['steps']} steps x {report['rounds']} rounds "
        f"({report['machine']})",
        "",
        "| cache | bits | ppl | Δppl | KL nats | top-1 | KV bytes/token | vs fp16 | decode tok/s | vs Dynamic |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in report["rows"].items():
        if "unavailable" in row:
            lines.append(f"| {name} | {row['bits']} | not measured: {row['unavailable']} |" + " |" * 7)
            continue
        speed = row.get("speed", {})
        decode = f"{speed['tokens_per_s']:.1f} | {speed['ratio_vs_dynamic']:.2f}" if speed else "- | -"
        lines.append(
            f"| {name} | {row['bits']} | {row['perplexity']:.3f} | {row['ppl_increase_pct']:+.3f}% | "
            f"{row['kl_mean']:.2e} | {100 * row['top1_agreement']:.1f}% | {row['bytes_per_token']:,.0f} | "
            f"{row['vs_fp16']:.3f} | {decode} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--caches", default=",".join(CANDIDATES), help="comma-separated, 'dynamic' first")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens scored for perplexity")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before the timed decode steps")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    names = args.caches.split(",")
    if names[0] != "dynamic" or any(name not in CANDIDATES for name in names):
        parser.error(f"--caches must start with 'dynamic' and name only {', '.join(CANDIDATES)}")
    model, tokenizer = load_model("smollm2")
    ids = tokenizer(TEXT.read_text(encoding="utf-8")[TEXT_START:], return_tensors="pt")["input_ids"][:, : args.tokens]
    with torch.inference_mode():
        missing = unavailable(model, names, ids)
        measured = [name for name in names if name not in missing]
        quality = quality_rows(model, ids, measured[1:])
        speed = {} if args.skip_speed else speed_rows(model, measured, args.context, args.steps, args.rounds)
    rows = {name: {"bits": CANDIDATES[name][0]} for name in names}
    for name in names:
        if name in missing:
            rows[name]["unavailable"] = missing[name]
        rows[name] |= quality.get(name, {}) | ({"speed": speed[name]} if name in speed else {})
    if "dynamic" not in missing:
        rows["dynamic"] |= dynamic_row(model, next(iter(quality.values()))["reference_perplexity"])
    report = {
        "machine": machine_description(),
        "dtype": str(model.dtype).removeprefix("torch."),
        "tokens": int(ids.shape[1]),
        "context": args.context,
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
    }
    OUT.mkdir(exist_ok=True)
    (OUT / "bench_quant.json").write_text(json.dumps(report, indent=2))
    print(markdown(report))


if __name__ == "__main__":
    main()
