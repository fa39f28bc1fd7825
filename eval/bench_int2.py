"""int2 (KIVI) settings against int4 and fp8: perplexity with the cache in the loop, and bytes held.

2,048 tokens of Pride and Prejudice (from character 30,000, as `bench_quant.py`) fed 16 tokens at a time,
every cache in one lockstep batch against a lossless PagedCache (`hf_kvgov.quality.score_in_lockstep`). The
settings vary what KIVI varies: the block (keys carry one scale and zero per channel per block), the newest
tokens kept in full precision (``residual``), the value groups (``group_size``) and the full-precision sink
block (``sink_blocks``), and the bytes of each scale and zero point (``scale_bytes``: 1 is a logarithmic scale
byte and an e4m3 zero, `hf_kvgov.codecs.numerics`).

Bytes are reported two ways, as fractions of float16 K + V of every token of every layer: as stored (the
full-precision sink, tail and residual in the model's dtype, float32 here), and as a 16-bit model would
store them (those tokens in 2 bytes). On a hybrid model (Gemma-3) the sliding-window layers hold only their
window, which both fractions count.

    python eval/bench_int2.py --models smollm2 gemma3-270m --json eval/results/int2_settings.json
    python eval/bench_int2.py --models smollm2 --dtype bfloat16 --settings "int2 b16 r32 g32 1B,int4 b16"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from bench_quant import TEXT, TEXT_START, fp16_bytes_per_token

from hf_kvgov.bench.timing import machine_description
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.models import load_model
from hf_kvgov.quality import score_in_lockstep

TOKENS = 2048
CHUNK = 16

# What a setting does not name is the bare format's (not `bits=2`'s KIVI defaults): each row varies from there.
BARE: dict[str, Any] = {"residual": 0, "group_size": None, "scale_bytes": 2}
SETTINGS: dict[str, dict[str, Any]] = {
    "int2 b16": {"bits": 2},
    "int2 b64": {"bits": 2, "block_size": 64},
    "int2 b32 g32": {"bits": 2, "block_size": 32, "group_size": 32},
    "int2 b16 r32 g32": {"bits": 2, "block_size": 16, "residual": 32, "group_size": 32},
    "int2 b32 r32 g32": {"bits": 2, "block_size": 32, "residual": 32, "group_size": 32},
    "int2 b32 r32 g32 s0": {"bits": 2, "block_size": 32, "residual": 32, "group_size": 32, "sink_blocks": 0},
    "int2 b64 r32 g32": {"bits": 2, "block_size": 64, "residual": 32, "group_size": 32},
    "int2 b16 r128 g32": {"bits": 2, "block_size": 16, "residual": 128, "group_size": 32},
    "int2 b32 r128 g32": {"bits": 2, "block_size": 32, "residual": 128, "group_size": 32},
    "int2 b16 r32 g32 1B": {"bits": 2, "block_size": 16, "residual": 32, "group_size": 32, "scale_bytes": 1},
    "int2 b32 r32 g32 1B": {"bits": 2, "block_size": 32, "residual": 32, "group_size": 32, "scale_bytes": 1},
    "int4 b16": {"bits": 4},
    "fp8 b16": {"bits": 8, "fmt": "fp8"},
}


def run_model(
    name: str, settings: dict[str, dict[str, Any]] = SETTINGS, dtype: torch.dtype = torch.float32
) -> list[dict[str, Any]]:
    """One row per setting (`QuantizedCache` options) on model `name` loaded in `dtype`, all scored in one
    lockstep batch against the full cache of the same model."""
    model, tokenizer = load_model(name, dtype=dtype)
    ids = tokenizer(TEXT.read_text(encoding="utf-8")[TEXT_START:], return_tensors="pt")["input_ids"][:, :TOKENS]
    built: dict[str, QuantizedCache] = {}
    builders = {s: (lambda s=s: built.setdefault(s, QuantizedCache(model, **(BARE | settings[s])))) for s in settings}
    result = score_in_lockstep(model, ids, builders, CHUNK, 16, max_rows=len(settings), progress=name)
    fp16 = fp16_bytes_per_token(model)
    element = model.dtype.itemsize
    rows = []
    for setting, score in result.scores.items():
        stats = built[setting].stats()
        tokens = built[setting].get_seq_length() * fp16
        sixteen_bit = stats.sealed_bytes + stats.full_precision_bytes * 2 / element
        rows.append({
            "model": name, "dtype": str(dtype), "setting": setting, "options": settings[setting],
            "perplexity": score.perplexity,
            "reference_perplexity": score.reference_perplexity, "ppl_increase_pct": score.ppl_increase_pct,
            "vs_fp16_as_stored": stats.bytes_used / tokens, "vs_fp16_16bit_model": sixteen_bit / tokens,
        })  # fmt: skip
        row = rows[-1]
        print(
            f"  {name} {setting}: {row['ppl_increase_pct']:+.2f}% perplexity, {row['vs_fp16_as_stored']:.3f}x fp16 "
            f"as stored, {row['vs_fp16_16bit_model']:.3f}x in a 16-bit model",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2", "gemma3-270m"])
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--settings", help=f"comma-separated subset of: {', '.join(SETTINGS)} [all]")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's dtype")
    args = parser.parse_args()
    names = SETTINGS if args.settings is None else [n.strip() for n in args.settings.split(",")]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}; accepted: {', '.join(SETTINGS)}")
    chosen = {n: SETTINGS[n] for n in names}
    rows = [row for name in args.models for row in run_model(name, chosen, getattr(torch, args.dtype))]
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine_description(), "tokens": TOKENS, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
