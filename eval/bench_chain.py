"""The governance chain measured step by step, against what `kvgov plan` predicts for the same budget.

For each cumulative step (paged -> + prefix sharing -> + int8 -> + H2O -> + disk spill, the last refused by
the chain's rules, plus the side rows "paged + disk spill", "int8 + disk spill", "prefix sharing + disk
spill" and "prefix sharing + int8 + disk spill", the last two with their own hot window, --spill-hot-shared,
so that a request's own blocks spill): KV bytes per token, perplexity with the cache
in the loop, passkey accuracy (when --passkey-samples > 0), decode tokens/s against step 1, and how many
sequences of --length tokens fit in --budget-mb, found by allocating them until the pool refuses, beside
the planner's prediction. `hf_kvgov.bench.chain` describes every figure and method.

    OMP_NUM_THREADS=2 python eval/bench_chain.py --model smollm2 --budget-mb 1000 --shared-tokens 1536 \\
        --ppl-chunk 64 --decode-steps 8 --json eval/results/chain_smollm2.json --plots eval/results/plots
    OMP_NUM_THREADS=2 python eval/bench_chain.py --model gemma3-270m --budget-mb 500 --shared-tokens 1536 \\
        --ppl-tokens 2048 --ppl-chunk 64 --passkey-samples 3 --passkey-new-tokens 16 \\
        --json eval/results/chain_gemma3.json --plots eval/results/plots

Prints a Markdown table; writes the JSON and chain_<model>_bytes_per_token.png / _capacity.png.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from hf_kvgov.bench.chain import ChainBenchConfig, chain_markdown, run_chain, write_chain_plots
from hf_kvgov.data_text import pride_and_prejudice_path
from hf_kvgov.models import load_model
from hf_kvgov.tiers.recall_pages import DEFAULT_BUFFER

TEXT = pride_and_prejudice_path()  # the complete novel the package ships


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3-270m, or a local model directory")
    parser.add_argument("--budget-mb", type=float, required=True, help="KV memory budget in MB (10^6 bytes)")
    parser.add_argument("--shared-tokens", type=int, required=True, help="tokens of the shared document")
    parser.add_argument("--length", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="tokens scored for perplexity (0: none)")
    parser.add_argument("--ppl-chunk", type=int, default=16, help="tokens per forward in the perplexity run")
    parser.add_argument("--passkey-samples", type=int, default=0, help="passkey samples per cache (0: none)")
    parser.add_argument("--passkey-length", type=int, default=4096)
    parser.add_argument("--passkey-new-tokens", type=int, help="cap on each answer's tokens (default: RULER's 128)")
    parser.add_argument("--spill-hot", type=int, default=512, help="hot window of the paged / int8 + disk rows")
    parser.add_argument(
        "--spill-hot-shared",
        type=int,
        default=128,
        help="hot window of the prefix + disk row (below a request's own part)",
    )
    parser.add_argument("--decode-steps", type=int, default=16, help="interleaved decode rounds")
    parser.add_argument("--recall-buffer", default=DEFAULT_BUFFER, help="the recall step's buffer: shared or layer")
    parser.add_argument("--text", type=Path, default=TEXT, help="text the requests and perplexity are cut from")
    parser.add_argument("--steps", help="comma-separated steps to run (default: all), e.g. paged,h2o,spill")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plots", type=Path, metavar="DIR", help="write the PNG plots into DIR")
    args = parser.parse_args()
    config = ChainBenchConfig(
        budget_bytes=round(args.budget_mb * 1e6),
        shared_tokens=args.shared_tokens,
        length=args.length,
        decode_steps=args.decode_steps,
        spill_hot_tokens=args.spill_hot,
        spill_hot_tokens_shared=args.spill_hot_shared,
        ppl_tokens=args.ppl_tokens,
        ppl_chunk=args.ppl_chunk,
        passkey_samples=args.passkey_samples,
        passkey_length=args.passkey_length,
        passkey_new_tokens=args.passkey_new_tokens,
        recall_buffer=args.recall_buffer,
        steps=None if args.steps is None else tuple(args.steps.split(",")),
    )
    text = args.text.read_text(encoding="utf-8")
    model, tokenizer = load_model(args.model)
    report = run_chain(model, tokenizer, config, text, model_name=args.model)
    print(chain_markdown(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_dict() | {"text": str(args.text)}, indent=2))
    if args.plots is not None:
        stem = "chain_" + re.sub(r"[^A-Za-z0-9]+", "_", Path(args.model).name).strip("_")
        for path in write_chain_plots(report, args.plots, stem):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
