"""`kvgov bench NAME`: scenario benchmarks on the default (or any) model, by name."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from hf_kvgov import models
from hf_kvgov.data_text import demo_text


def _prefix(args: argparse.Namespace) -> int:
    from hf_kvgov.bench import prefix_qa

    model, tokenizer = models.load_model(args.model)
    document = demo_text(max_chars=args.document_chars)
    asks = prefix_qa.questions(args.requests)
    results = [
        prefix_qa.run_mode(model, tokenizer, document, asks, share, args.new_tokens, args.block_size)
        for share in (False, True)
    ]
    print(prefix_qa.render(results, len(document)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


BENCHMARKS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "prefix": ("document QA: N questions about one document, with and without prefix sharing", _prefix),
}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="scenario benchmarks (" + ", ".join(BENCHMARKS) + ")")
    parser.add_argument(
        "name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v[0]}" for k, v in BENCHMARKS.items())
    )
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--document-chars", type=int, default=5000)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", help="also write the results as JSON to this path")
    parser.set_defaults(func=lambda args: BENCHMARKS[args.name][1](args))
