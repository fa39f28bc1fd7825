"""A per-layer map chosen on some passages, checked on others: does it hold its budget on text it never saw?

`recommend_layer_formats` (what `kvgov check-quant --recommend` runs) chooses a format per layer among the
given formats for a perplexity budget on the passages of Pride and Prejudice starting at the characters of
``--chosen-on`` (on several, the map must hold on each); then the map and uniform int8 are scored together,
with the cache in the loop, on each passage of ``--checked-on``, 2,048 tokens fed one 16-token block at a time.

    python eval/bench_layer_map.py --model smollm2 --budget 0.5 --formats int8,int4 \\
        --chosen-on 30000,120000 --checked-on 200000,400000 --json eval/results/layer_map_smollm2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import pride_and_prejudice_path
from hf_kvgov.models import load_model
from hf_kvgov.quality.check import CheckOptions, ConfigRunner, tokenize
from hf_kvgov.quality.grouped_attention import grouped_sdpa_on_cpu
from hf_kvgov.quality.layer_map import recommend_layer_formats

TEXT_CHARS = 12_000  # enough characters for 2,048 tokens


def _offsets(value: str) -> list[int]:
    return [int(part) for part in value.split(",") if part.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.5, help="perplexity budget in percent")
    parser.add_argument("--formats", default="int8,int4,int2")
    parser.add_argument("--chosen-on", type=_offsets, default=[30_000], help="characters where passages start")
    parser.add_argument("--checked-on", type=_offsets, default=[200_000], help="characters of the unseen passages")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--save-map", type=Path, help="also write the map as `kvgov check-quant --recommend` does")
    args = parser.parse_args()
    text = pride_and_prejudice_path().read_text(encoding="utf-8")
    model, tokenizer = load_model(args.model)
    options = CheckOptions(formats=tuple(args.formats.split(",")), max_tokens=2048, max_ppl_increase=args.budget)
    chosen_on = [text[start : start + TEXT_CHARS] for start in args.chosen_on]
    layer_map = recommend_layer_formats(model, tokenizer, chosen_on, args.budget, options.formats, options)
    print(layer_map.render(), flush=True)
    if args.save_map is not None:
        layer_map.save(args.save_map)  # loads as a cache: QuantizedCache.from_config, or the name quant@PATH
    checked: dict[int, dict[str, float]] = {}
    for start in args.checked_on:
        ids = tokenize(tokenizer, text[start : start + TEXT_CHARS], options.max_tokens, options.block_size)
        with grouped_sdpa_on_cpu(model):
            configs = {"map": layer_map.config, "int8": options.config("int8")}
            scores = ConfigRunner(model, options, None).score(ids, configs, "unseen passage").scores
        checked[start] = {name: score.ppl_increase_pct for name, score in scores.items()}
        print(
            f"On the unseen passage at character {start:,}: map {checked[start]['map']:+.3f}%, uniform int8 "
            f"{checked[start]['int8']:+.3f}% (budget +{args.budget:g}%); bytes per token "
            f"{layer_map.bytes_per_token:,.0f} against {layer_map.baseline_bytes_per_token:,.0f}",
            flush=True,
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "machine": machine_description(), "model": args.model, "budget_pct": args.budget,
            "chosen_on_chars": args.chosen_on, "checked_on_chars": args.checked_on, "map": layer_map.to_json(),
            "unseen_passages_pct": {str(start): pcts for start, pcts in checked.items()},
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
