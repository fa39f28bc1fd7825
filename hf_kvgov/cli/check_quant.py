"""`kvgov check-quant`: how much does int8 / fp8 / int4 KV cost on this model and this text?

    kvgov check-quant --model smollm2                                  # report only
    kvgov check-quant --model ./my-model --text domain.txt --formats int8 --max-ppl-increase 0.5 --json out.json

Exit status: 0 when every listed format is within `--max-ppl-increase` (or no gate was given), 1 when one
exceeds it, so the command can gate a deployment (list only the format you deploy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_kvgov import models
from hf_kvgov.quality.check import FORMAT_OPTIONS, CheckOptions, check_quantization


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-quant",
        help="measure the perplexity / KL / top-1 cost of int8, fp8 and int4 KV caches on a model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        default=models.DEFAULT_MODEL,
        help="embedded name, .gguf path, local directory or hub id (default: %(default)s)",
    )
    parser.add_argument("--text", type=Path, help="UTF-8 text file to score (default: a built-in passage)")
    parser.add_argument(
        "--formats",
        default="int8,fp8,int4",
        help=f"comma-separated formats among {', '.join(FORMAT_OPTIONS)} (default: %(default)s)",
    )
    parser.add_argument(
        "--max-ppl-increase",
        type=float,
        metavar="PCT",
        help="gate: exit with status 1 when a listed format raises perplexity by more than PCT percent",
    )
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text to score (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default: %(default)s)")
    parser.add_argument("--chunk", type=int, help="tokens fed per step (default: the block size, as in generation)")
    parser.add_argument("--residual", type=int, default=0, help="newest tokens kept in full precision (default: 0)")
    parser.add_argument("--sink-blocks", type=int, default=1, help="leading blocks kept in full precision (default: 1)")
    parser.add_argument("--no-scan", action="store_true", help="skip the per-layer sensitivity scan")
    parser.add_argument("--scan-format", choices=sorted(FORMAT_OPTIONS), help="format of the per-layer scan")
    parser.add_argument("--scan-tokens", type=int, default=512, help="tokens used by the scan (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=8, help="caches scored per batched pass (default: %(default)s)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH ('-' for stdout)")
    parser.set_defaults(func=run)


def options_from_args(args: argparse.Namespace) -> CheckOptions:
    return CheckOptions(
        formats=tuple(name.strip() for name in args.formats.split(",") if name.strip()),
        max_tokens=args.tokens,
        block_size=args.block_size,
        residual=args.residual,
        sink_blocks=args.sink_blocks,
        chunk_tokens=args.chunk,
        max_ppl_increase=args.max_ppl_increase,
        scan=not args.no_scan,
        scan_format=args.scan_format,
        scan_tokens=args.scan_tokens,
        max_rows=args.rows,
    )


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
        text = args.text.read_text(encoding="utf-8") if args.text is not None else None
    except (ValueError, OSError) as error:
        print(f"kvgov check-quant: {error}", file=sys.stderr)
        return 2
    print(f"[kvgov] loading {args.model} ...", file=sys.stderr, flush=True)
    model, tokenizer = models.load_model(args.model)
    report = check_quantization(model, tokenizer, text, options, model_name=args.model, progress=True)
    if args.json == "-":
        print(report.to_json())
    else:
        print(report.render())
        if args.json:
            Path(args.json).write_text(report.to_json() + "\n", encoding="utf-8")
    return 0 if report.passed else 1
