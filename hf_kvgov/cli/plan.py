"""`kvgov plan`: how many sequences fit on one accelerator, step by step along the governance chain.

Examples::

    kvgov plan --scenario brief                       # the article's §7 claims, checked
    kvgov plan --model Llama-3-8B --memory 80GB --lengths lognormal:median=600,max=8192
    kvgov plan --model ./my-model/config.json --memory 24GiB --chain static,paged,int8 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hf_kvgov.cli.refusal import refuse
from hf_kvgov.planner.chain import (
    DEFAULT_CHAIN,
    DEFAULT_H2O_BUDGET,
    DEFAULT_RECALL_PAGE_TOKENS,
    DEFAULT_RECALL_PAGES,
    DEFAULT_SHARED_FRACTION,
    ChainOptions,
    codec_settings,
    parse_chain,
)
from hf_kvgov.planner.config_loading import resolve_model
from hf_kvgov.planner.lengths import parse_lengths
from hf_kvgov.planner.memory import DEFAULT_RESERVE, budget_for_model
from hf_kvgov.planner.planner import Plan, PlanInputs, make_plan
from hf_kvgov.planner.report import plan_to_dict, render_plan
from hf_kvgov.planner.scenario import SCENARIOS, Claim, Scenario, check_claims, find_scenario
from hf_kvgov.planner.setup import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_H2O_RECENT,
    DEFAULT_RECALL_BUFFER,
    DEFAULT_RECALL_SUMMARY,
    DEFAULT_SPILL_HOT_TOKENS,
)
from hf_kvgov.planner.units import KV_DTYPE_BYTES, WEIGHT_DTYPE_BYTES, parse_count, parse_memory

DEFAULT_MEMORY = "80GiB"
DEFAULT_LENGTHS = "2048"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``plan`` subcommand on an argparse subparsers object; its ``func`` is :func:`run`."""
    parser = subparsers.add_parser(
        "plan",
        help="capacity planner: concurrent sequences per accelerator along the governance chain",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(parser)
    _add_knobs(parser)
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the table, claims and assumptions as JSON ('-': only the JSON, to stdout)",
    )
    parser.add_argument("--plot", metavar="PATH", help="also write a PNG bar chart (needs matplotlib)")
    parser.set_defaults(func=run)
    return parser


def _add_inputs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model, memory and workload")
    group.add_argument("--scenario", choices=sorted(SCENARIOS), help="a preset; 'brief' checks the article's §7")
    group.add_argument("--model", help="built-in name (e.g. LLaMA-13B), a config.json path, or a cached hub id")
    group.add_argument(
        "--memory", help=f"accelerator memory: '80GB', '80GiB', or a number of GiB (default {DEFAULT_MEMORY})"
    )
    group.add_argument("--weight-dtype", help=f"weight dtype: {', '.join(WEIGHT_DTYPE_BYTES)} (default fp16)")
    group.add_argument("--kv-dtype", help=f"full-precision KV dtype: {', '.join(KV_DTYPE_BYTES)} (default fp16)")
    group.add_argument("--params", help="parameter count for weight memory, e.g. 7.2B (default: the model's)")
    group.add_argument(
        "--reserve",
        type=float,
        default=DEFAULT_RESERVE,
        help=f"share of memory kept for activations and overheads (default {DEFAULT_RESERVE})",
    )
    group.add_argument(
        "--lengths",
        help=f"sequence lengths: '2048', '300,1200,4000', a .csv/.json file, or "
        f"'lognormal:median=600,max=8192[,sigma=1,n=10000,seed=0]' (default {DEFAULT_LENGTHS})",
    )
    group.add_argument("--max-len", type=int, help="tokens a static buffer pre-allocates (default: model context)")
    group.add_argument("--disk", help="disk capacity for spilled KV, e.g. 2TB (default: unlimited)")


def _add_knobs(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("governance chain (defaults in brackets)")
    knobs: list[tuple[str, type, object, str]] = [
        ("--block-size", int, DEFAULT_BLOCK_SIZE, "tokens per KV block"),
        (
            "--shared-fraction",
            float,
            DEFAULT_SHARED_FRACTION,
            "part of each sequence that is a shared prefix, in [0, 1): your workload's figure",
        ),
        ("--share-group", int, None, "sequences per shared prefix (none: all)"),
        ("--h2o-budget", float, DEFAULT_H2O_BUDGET, "fraction of each layer's tokens H2O keeps"),
        ("--h2o-recent", int, DEFAULT_H2O_RECENT, "recent tokens H2O always keeps"),
        ("--spill-hot", int, DEFAULT_SPILL_HOT_TOKENS, "recent tokens per layer kept on the accelerator"),
        ("--recall-pages", int, DEFAULT_RECALL_PAGES, "pages of evicted tokens recalled per step ('recall' step)"),
        ("--recall-page-tokens", int, DEFAULT_RECALL_PAGE_TOKENS, "tokens per page of evicted tokens"),
        ("--recall-summary", str, DEFAULT_RECALL_SUMMARY, "what ranks a page of evicted tokens: centroid or bounds"),
        ("--recall-buffer", str, DEFAULT_RECALL_BUFFER, "where recalled pages are held: layer or shared"),
        ("--sink-blocks", int, 1, "leading blocks a quantized cache keeps in full precision"),
        ("--residual", int, None, f"newest tokens a quantized cache keeps in full precision {MEASURED}"),
        ("--group-size", int, None, f"quantization group along head_dim (head_dim: one per head) {MEASURED}"),
        ("--scale-bytes", int, None, f"scale and zero bytes: 2 (fp16), 4 (fp32), 1 (one byte) {MEASURED}"),
        (
            "--step-tokens",
            int,
            0,
            "tokens a request writes in one step (your prefill chunk): they stay in full precision until the step "
            "seals them or the next spills them, and the budget keeps room for one request's largest step (0: steady "
            "state only)",
        ),
    ]
    group.add_argument("--chain", help=f"comma-separated steps [{','.join(DEFAULT_CHAIN)}]")
    for flag, kind, default, text in knobs:
        group.add_argument(flag, type=kind, default=default, help=f"{text} [%(default)s]")


# What the three codec settings default to: the codec's own, as the built caches fill them in.
MEASURED = "(none given: the codec's measured setting, as QuantizedCache(model, bits=...) takes it)"


def _pick(given: str | None, scenario: Scenario | None, attribute: str, default: str) -> str:
    if given is not None:
        return given
    return str(getattr(scenario, attribute)) if scenario is not None else default


def build_plan(args: argparse.Namespace) -> tuple[Plan, list[Claim]]:
    """The plan (and, for a scenario, its claims checked) from parsed ``kvgov plan`` arguments."""
    scenario = find_scenario(args.scenario) if args.scenario else None
    if scenario is not None and args.chain is not None and parse_chain(args.chain) != scenario.chain:
        raise ValueError(
            f"The {scenario.name!r} scenario checks the article's claims step by step, so it uses the "
            f"article's chain {','.join(scenario.chain)}; leave out --chain (or drop --scenario)."
        )
    if scenario is None and args.model is None:
        raise ValueError("Give --model (a built-in name, a config.json path or a cached hub id) or --scenario brief.")
    geometry = resolve_model(_pick(args.model, scenario, "model", ""))
    params = parse_count(args.params) if args.params is not None else None
    memory = parse_memory(_pick(args.memory, scenario, "memory", DEFAULT_MEMORY))
    weight_dtype = _pick(args.weight_dtype, scenario, "weight_dtype", "fp16")
    budget = budget_for_model(geometry, memory, weight_dtype, args.reserve, params)
    lengths = parse_lengths(_pick(args.lengths, scenario, "user_tokens", DEFAULT_LENGTHS))
    disk = parse_memory(args.disk, "disk capacity") if args.disk is not None else None
    _check_counts(args)
    chain = scenario.chain if scenario is not None else parse_chain(args.chain or ",".join(DEFAULT_CHAIN))
    options = ChainOptions(
        max_len=args.max_len if args.max_len is not None else geometry.max_position_embeddings,
        block_size=args.block_size,
        kv_dtype=_pick(args.kv_dtype, scenario, "kv_dtype", "fp16"),
        shared_fraction=args.shared_fraction,
        share_group=args.share_group,
        h2o_budget=args.h2o_budget,
        h2o_recent=args.h2o_recent,
        spill_hot_tokens=args.spill_hot,
        recall_pages=args.recall_pages,
        recall_page_tokens=args.recall_page_tokens,
        recall_summary=args.recall_summary,
        recall_buffer=args.recall_buffer,
        sink_blocks=args.sink_blocks,
        step_tokens=args.step_tokens,
        **codec_settings(chain, geometry.head_dim, args.residual, args.group_size, args.scale_bytes),
    )
    plan = make_plan(PlanInputs(geometry, budget, lengths, disk), chain, options)
    return plan, (check_claims(plan, scenario) if scenario is not None else [])


def _check_counts(args: argparse.Namespace) -> None:
    """Refuse a count out of range by the option the user typed (not by the planner's field behind it)."""
    least = {"block_size": 1, "recall_pages": 1, "recall_page_tokens": 1, "group_size": 1}
    least |= {"h2o_recent": 0, "spill_hot": 0, "sink_blocks": 0, "residual": 0, "step_tokens": 0}
    for name, minimum in least.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be at least {minimum}; got {value}.")


def _write_json(path: str, plan: Plan, claims: list[Claim]) -> None:
    text = json.dumps(plan_to_dict(plan, claims), indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text, encoding="utf-8")
    print(f"Wrote {target}")


def run(args: argparse.Namespace) -> int:
    """Run ``kvgov plan``: 0 on success, 2 for bad input, 1 when the plot cannot be drawn."""
    try:
        plan, claims = build_plan(args)
    except (ValueError, TypeError) as err:
        return refuse("kvgov plan", err)
    title = f"Scenario {args.scenario!r}: {find_scenario(args.scenario).description}" if args.scenario else None
    if args.json != "-":
        print(render_plan(plan, claims, title))
    if args.json:
        try:
            _write_json(args.json, plan, claims)
        except OSError as err:
            print(f"kvgov plan: error: cannot write the JSON to {args.json}: {err.strerror or err}", file=sys.stderr)
            return 2
    if args.plot:
        from hf_kvgov.planner.plot import plot_plan

        try:
            print(f"Wrote {plot_plan(plan, args.plot, show_claims=bool(claims))}")
        except ImportError as err:
            return refuse("kvgov plan", err, status=1)
    return 0
