"""`kvgov bench NAME`: scenario benchmarks on the default (or any) model, by name.

Examples::

    kvgov bench prefix --requests 20
    kvgov bench speed --caches dynamic,paged,int8,h2o,disk --contexts 512,2048 --batches 1,8 --json speed.json
    kvgov bench capacity --caches dynamic,paged,int8,h2o --lengths 256,512,1024,2048 --budget 1GiB --plots out/
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hf_kvgov import models
from hf_kvgov.data_text import demo_text

DEFAULT_CACHES = "dynamic,paged,int8,h2o,disk"
PREFIX_NEW_TOKENS = 8
SPEED_NEW_TOKENS = 32


def _int_list(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{option} takes a comma-separated list of positive integers, e.g. '512,2048'; got {text!r}.")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _write_json(path: str, data: Any) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(f"Wrote {target}")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    return models.load_model(args.model)


def _prefix(args: argparse.Namespace) -> int:
    from hf_kvgov.bench import prefix_qa

    model, tokenizer = models.load_model(args.model)
    document = demo_text(max_chars=args.document_chars)
    asks = prefix_qa.questions(args.requests)
    new_tokens = args.new_tokens if args.new_tokens is not None else PREFIX_NEW_TOKENS
    results = [
        prefix_qa.run_mode(model, tokenizer, document, asks, share, new_tokens, args.block_size)
        for share in (False, True)
    ]
    print(prefix_qa.render(results, len(document)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0


def _speed(args: argparse.Namespace) -> int:
    from hf_kvgov.bench import speed

    config = speed.SpeedConfig(
        caches=_names(args.caches),
        contexts=_int_list(args.contexts, "--contexts"),
        batches=_int_list(args.batches, "--batches"),
        new_tokens=args.new_tokens if args.new_tokens is not None else SPEED_NEW_TOKENS,
        rounds=args.rounds,
    )
    model, tokenizer = _load(args)
    report = speed.run_speed(model, tokenizer, config, model_name=args.model)
    print(speed.speed_markdown(report))
    if args.json:
        _write_json(args.json, report.to_dict())
    if args.plots:
        from hf_kvgov.bench.plots import write_speed_plots

        for path in write_speed_plots(report, args.plots):
            print(f"Wrote {path}")
    return 0


def _capacity(args: argparse.Namespace) -> int:
    from hf_kvgov.bench import capacity
    from hf_kvgov.planner.lengths import parse_lengths
    from hf_kvgov.planner.units import parse_memory

    config = capacity.CapacityConfig(
        caches=_names(args.caches),
        lengths=parse_lengths(args.lengths),
        budget_bytes=parse_memory(args.budget, "KV memory budget"),
    )
    model, tokenizer = _load(args)
    report = capacity.run_capacity(model, tokenizer, config, model_name=args.model)
    print(capacity.capacity_markdown(report))
    if args.json:
        _write_json(args.json, report.to_dict())
    if args.plots:
        from hf_kvgov.bench.plots import write_capacity_plots

        for path in write_capacity_plots(report, args.plots):
            print(f"Wrote {path}")
    return 0


BENCHMARKS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "prefix": ("document QA: N questions about one document, with and without prefix sharing", _prefix),
    "speed": ("TTFT, time per output token, tokens/s, KV bytes and peak memory per cache", _speed),
    "capacity": ("sequences that fit in a KV budget per cache, measured, beside the planner's figure", _capacity),
}


def _run(args: argparse.Namespace) -> int:
    try:
        return BENCHMARKS[args.name][1](args)
    except ValueError as err:
        print(f"kvgov bench {args.name}: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:  # matplotlib missing for --plots
        print(f"kvgov bench {args.name}: error: {err}", file=sys.stderr)
        return 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="scenario benchmarks (" + ", ".join(BENCHMARKS) + ")",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "name", choices=sorted(BENCHMARKS), help="; ".join(f"{k}: {v[0]}" for k, v in BENCHMARKS.items())
    )
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument(
        "--new-tokens",
        type=int,
        help=f"tokens generated per request (prefix: {PREFIX_NEW_TOKENS}, speed: {SPEED_NEW_TOKENS})",
    )
    parser.add_argument("--json", help="also write the results as JSON to this path")
    prefix = parser.add_argument_group("prefix")
    prefix.add_argument("--requests", type=int, default=20)
    prefix.add_argument("--document-chars", type=int, default=5000)
    prefix.add_argument("--block-size", type=int, default=16)
    measured = parser.add_argument_group("speed and capacity")
    measured.add_argument("--caches", default=DEFAULT_CACHES, help="registry names, comma-separated [%(default)s]")
    measured.add_argument("--plots", metavar="DIR", help="also write PNG plots into this directory")
    measured.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    measured.add_argument("--contexts", default="512,2048", help="speed: prompt lengths in tokens [%(default)s]")
    measured.add_argument("--batches", default="1", help="speed: batch sizes [%(default)s]")
    measured.add_argument("--rounds", type=int, default=3, help="speed: interleaved rounds, medians [%(default)s]")
    measured.add_argument(
        "--lengths",
        default="256,512,1024,2048",
        help="capacity: sequence lengths, taken in order and cycled: '512,2048', a .csv/.json file, or "
        "'lognormal:median=300,max=2048,n=100' (one prefill per distinct length) [%(default)s]",
    )
    measured.add_argument("--budget", default="1GiB", help="capacity: KV memory budget, e.g. 512MiB [%(default)s]")
    parser.set_defaults(func=_run)
