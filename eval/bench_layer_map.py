"""A per-layer map chosen on one passage, checked on another: does it hold its budget on text it never saw?

`recommend_layer_formats` (what `kvgov check-quant --recommend` runs) chooses a format per layer among
int8 / int4 / int2 for a perplexity budget on passage A of Pride and Prejudice; then the map and uniform int8
are scored together, with the cache in the loop, on passage B, 2,048 tokens fed one 16-token block at a time.

    python eval/bench_layer_map.py --model smollm2 --budget 0.5 --json eval/results/layer_map_smollm2.json
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

CHOSEN_ON = 30_000  # passage A starts at this character
CHECKED_ON = 200_000  # passage B
TEXT_CHARS = 12_000  # enough characters for 2,048 tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--budget", type=float, default=0.5, help="perplexity budget in percent")
    parser.add_argument("--formats", default="int8,int4,int2")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    text = pride_and_prejudice_path().read_text(encoding="utf-8")
    model, tokenizer = load_model(args.model)
    options = CheckOptions(formats=tuple(args.formats.split(",")), max_ppl_increase=args.budget)
    layer_map = recommend_layer_formats(
        model, tokenizer, text[CHOSEN_ON : CHOSEN_ON + TEXT_CHARS], args.budget, options.formats, options
    )
    print(layer_map.render(), flush=True)
    ids = tokenize(tokenizer, text[CHECKED_ON : CHECKED_ON + TEXT_CHARS], options.max_tokens, options.block_size)
    with grouped_sdpa_on_cpu(model):
        configs = {"map": layer_map.config, "int8": options.config("int8")}
        scores = ConfigRunner(model, options, None).score(ids, configs, "second passage").scores
    checked = {name: score.ppl_increase_pct for name, score in scores.items()}
    print(
        f"On the second passage: map {checked['map']:+.3f}%, uniform int8 {checked['int8']:+.3f}% "
        f"(budget +{args.budget:g}%); bytes per token {layer_map.bytes_per_token:,.0f} against "
        f"{layer_map.baseline_bytes_per_token:,.0f}",
        flush=True,
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "machine": machine_description(), "model": args.model, "budget_pct": args.budget,
            "chosen_on_chars": CHOSEN_ON, "checked_on_chars": CHECKED_ON, "map": layer_map.to_json(),
            "second_passage_pct": checked,
        }  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
