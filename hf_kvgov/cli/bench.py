"""`kvgov bench NAME`: scenario benchmarks on the default (or any) model, by name.

`HELP`, the `--help` text, gives examples and what Ctrl-C keeps of a run.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_kvgov import models
from hf_kvgov.cli.interrupted import run_reported
from hf_kvgov.cli.refusal import refuse
from hf_kvgov.data_text import demo_text
from hf_kvgov.partial import Progress, mark_partial, partial_note

HELP = """\
`kvgov bench NAME`: scenario benchmarks on the default (or any) model, by name.

Examples::

    kvgov bench prefix --requests 20
    kvgov bench prefix --remote redis://127.0.0.1:6379/0 --workers 4   # processes sharing prefixes on Redis
    kvgov bench speed --caches dynamic,paged,int8,h2o,disk --contexts 512,2048 --batches 1,8 --json speed.json
    kvgov bench capacity --caches dynamic,paged,int8,h2o --lengths 256,512,1024,2048 --budget 1GiB --plots out/
    kvgov bench serve --requests 32 --rate inf --kv-budget 32MiB --plots out/   # a burst, every configuration
    kvgov bench serve --rate 2 --burstiness 0.5 --configs transformers,prefix --json serve.json

Ctrl-C stops a benchmark with one line on stderr and exit status 130, after printing the rows finished
so far (prefix: the modes; speed: every cache at the (batch, context) points measured; capacity: the
caches; serve: the configurations) and writing them to --json with "partial": true and "completed" (rows
done, total, unit) at its top. No plots are drawn, and when no row had finished nothing is written.
"""

DEFAULT_CACHES = "dynamic,paged,int8,h2o,disk"
PREFIX_NEW_TOKENS = 8
SPEED_NEW_TOKENS = 32
SERVE_NEW_TOKENS = 32


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
        if args.threads < 1:
            raise ValueError(f"--threads must be at least 1; got {args.threads}.")
        import torch

        torch.set_num_threads(args.threads)
    return models.load_model(args.model)


def _show(
    table: str,
    data: dict[str, Any],
    args: argparse.Namespace,
    completed: Progress | None,
    plots: Callable[[str], list[Path]] | None = None,
) -> None:
    """Print the table, write --json and (a whole run only) the plots into --plots; ``completed``: the rows are those
    finished before Ctrl-C (marked so)."""
    print(partial_note(completed) + table)
    if args.json:
        _write_json(args.json, mark_partial(data, completed))
    if plots is not None and args.plots and completed is None:
        for path in plots(args.plots):
            print(f"Wrote {path}")


def _prefix(args: argparse.Namespace) -> Any:
    from hf_kvgov.bench import prefix_qa

    for option, value in (("--requests", args.requests), ("--document-chars", args.document_chars)):
        if value < 1:
            raise ValueError(f"{option} must be at least 1; got {value}.")
    if args.new_tokens is not None and args.new_tokens < 1:
        raise ValueError(f"--new-tokens must be at least 1; got {args.new_tokens}.")
    document = demo_text(max_chars=args.document_chars)
    asks = prefix_qa.questions(args.requests)
    new_tokens = args.new_tokens if args.new_tokens is not None else PREFIX_NEW_TOKENS
    if args.remote:
        return _prefix_remote(args, document, asks, new_tokens)
    model, tokenizer = models.load_model(args.model)
    return prefix_qa.run_prefix(model, tokenizer, document, asks, new_tokens, args.block_size, args.model)


def _prefix_remote(args: argparse.Namespace, document: str, asks: list[str], new_tokens: int) -> Any:
    import contextlib

    from hf_kvgov.bench import prefix_remote
    from hf_kvgov.tiers.local_redis import LocalRedis

    load = functools.partial(models.load_model, args.model)
    with LocalRedis() if args.remote == "local" else contextlib.nullcontext() as server:
        url = server.url if server is not None else args.remote
        return prefix_remote.run_remote(
            load, url, document, asks, args.workers, new_tokens, args.block_size, args.model
        )  # fmt: skip


def _show_prefix(report: Any, args: argparse.Namespace, completed: Progress | None) -> None:
    from hf_kvgov.bench import prefix_qa, prefix_remote

    if isinstance(report, prefix_remote.RemoteReport):
        _show(prefix_remote.render(report), report.to_dict(), args, completed)
        return
    _show(prefix_qa.render(list(report.rows), report.document_chars), report.to_dict(), args, completed)


def _speed(args: argparse.Namespace) -> Any:
    from hf_kvgov.bench import speed

    config = speed.SpeedConfig(
        caches=_names(args.caches),
        contexts=_int_list(args.contexts, "--contexts"),
        batches=_int_list(args.batches, "--batches"),
        new_tokens=args.new_tokens if args.new_tokens is not None else SPEED_NEW_TOKENS,
        rounds=args.rounds,
    )
    model, tokenizer = _load(args)
    return speed.run_speed(model, tokenizer, config, model_name=args.model)


def _show_speed(report: Any, args: argparse.Namespace, completed: Progress | None) -> None:
    from hf_kvgov.bench import speed
    from hf_kvgov.bench.plots import write_speed_plots

    _show(
        speed.speed_markdown(report),
        report.to_dict(),
        args,
        completed,
        functools.partial(write_speed_plots, report),
    )


def _capacity(args: argparse.Namespace) -> Any:
    from hf_kvgov.bench import capacity
    from hf_kvgov.planner.lengths import parse_lengths
    from hf_kvgov.planner.units import parse_memory

    config = capacity.CapacityConfig(
        caches=_names(args.caches),
        lengths=parse_lengths(args.lengths),
        budget_bytes=parse_memory(args.budget, "KV memory budget"),
    )
    model, tokenizer = _load(args)
    return capacity.run_capacity(model, tokenizer, config, model_name=args.model)


def _show_capacity(report: Any, args: argparse.Namespace, completed: Progress | None) -> None:
    from hf_kvgov.bench import capacity
    from hf_kvgov.bench.plots import write_capacity_plots

    _show(
        capacity.capacity_markdown(report),
        report.to_dict(),
        args,
        completed,
        functools.partial(write_capacity_plots, report),
    )


def _serve(args: argparse.Namespace) -> Any:
    from hf_kvgov.bench import serve
    from hf_kvgov.bench.serve_workload import TraceConfig
    from hf_kvgov.planner.units import parse_memory

    new = args.new_tokens if args.new_tokens is not None else SERVE_NEW_TOKENS
    try:
        rate = float(args.rate)
    except ValueError:
        raise ValueError(
            f"--rate takes requests per second (a number, or 'inf' for a burst); got {args.rate!r}."
        ) from None
    trace = TraceConfig(
        requests=args.requests,
        rate=rate,
        burstiness=args.burstiness,
        documents=args.documents,
        document_tokens=args.document_tokens,
        min_new_tokens=max(1, new // 2),
        max_new_tokens=new,
        seed=args.seed,
    )
    config = serve.ServeConfig(
        configs=_names(args.configs),
        trace=trace,
        kv_bytes=parse_memory(args.kv_budget, "KV byte cap"),
        block_size=args.block_size,
        max_batched_tokens=args.max_batched_tokens,
        slo_ttft_s=args.slo_ttft,
        slo_tpot_s=args.slo_tpot,
    )
    model, tokenizer = _load(args)
    return serve.run_serve(model, tokenizer, config, model_name=args.model)


def _show_serve(report: Any, args: argparse.Namespace, completed: Progress | None) -> None:
    from hf_kvgov.bench import serve
    from hf_kvgov.bench.plots import write_serve_plots

    _show(
        serve.serve_markdown(report),
        report.to_dict(),
        args,
        completed,
        functools.partial(write_serve_plots, report),
    )


@dataclass(frozen=True)
class Benchmark:
    """One scenario: ``run`` checks the options, loads the model and measures, returning a report (raising
    `hf_kvgov.partial.Interrupted` on Ctrl-C); ``show`` prints and writes a report, whole or partial."""

    help: str
    run: Callable[[argparse.Namespace], Any]
    show: Callable[[Any, argparse.Namespace, Progress | None], None]


BENCHMARKS: dict[str, Benchmark] = {
    "prefix": Benchmark(
        "document QA: N questions about one document, with and without prefix sharing", _prefix, _show_prefix
    ),
    "speed": Benchmark(
        "TTFT, time per output token, tokens/s, KV bytes and peak memory per cache", _speed, _show_speed
    ),
    "capacity": Benchmark(
        "sequences that fit in a KV budget per cache, measured, beside the planner's figure", _capacity, _show_capacity
    ),
    "serve": Benchmark(
        "one arrival trace served under one KV cap: static batches, transformers' continuous batching, the engine",
        _serve,
        _show_serve,
    ),
}


def _run(args: argparse.Namespace) -> int:
    command, bench = f"kvgov bench {args.name}", BENCHMARKS[args.name]
    try:
        return run_reported(command, lambda: bench.run(args), lambda r, done: bench.show(r, args, done), args.json)
    except ValueError as err:
        return refuse(command, err)
    except ImportError as err:  # matplotlib missing for --plots
        return refuse(command, err, status=1)


def _common(parser: argparse.ArgumentParser, new_tokens: int | None) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help="embedded name, .gguf path, directory or hub id")
    if new_tokens is not None:
        parser.add_argument("--new-tokens", type=int, help=f"tokens generated per request [{new_tokens}]")
    parser.add_argument(
        "--json",
        help='also write the results as JSON to this path; after Ctrl-C, the rows finished so far with "partial": '
        "true (nothing when none had finished)",
    )


def _measured(parser: argparse.ArgumentParser, caches: bool = True) -> None:
    if caches:
        parser.add_argument("--caches", default=DEFAULT_CACHES, help="registry names, comma-separated [%(default)s]")
    parser.add_argument("--plots", metavar="DIR", help="also write PNG plots into this directory")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="scenario benchmarks (" + ", ".join(BENCHMARKS) + ")",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    names = parser.add_subparsers(dest="name", metavar="NAME", required=True)
    each = {name: names.add_parser(name, help=bench.help, description=bench.help) for name, bench in BENCHMARKS.items()}
    for sub in each.values():
        sub.set_defaults(func=_run, loads_model=True)

    prefix = each["prefix"]
    _common(prefix, PREFIX_NEW_TOKENS)
    prefix.add_argument("--requests", type=int, default=20, help="questions about the document [%(default)s]")
    prefix.add_argument("--document-chars", type=int, default=5000, help="characters of the document [%(default)s]")
    prefix.add_argument("--block-size", type=int, default=16, help="tokens per KV block [%(default)s]")
    prefix.add_argument(
        "--remote",
        metavar="URL",
        help="share prefixes across --workers processes through this Redis (redis://host:port/db), or 'local' "
        "to start a throwaway redis-server on loopback for the run",
    )
    prefix.add_argument("--workers", type=int, default=2, help="worker processes with --remote [%(default)s]")

    speed = each["speed"]
    _common(speed, SPEED_NEW_TOKENS)
    _measured(speed)
    speed.add_argument("--contexts", default="512,2048", help="prompt lengths in tokens [%(default)s]")
    speed.add_argument("--batches", default="1", help="batch sizes [%(default)s]")
    speed.add_argument("--rounds", type=int, default=3, help="interleaved rounds, medians [%(default)s]")

    capacity = each["capacity"]
    _common(capacity, None)
    _measured(capacity)
    capacity.add_argument(
        "--lengths",
        default="256,512,1024,2048",
        help="sequence lengths, taken in order and cycled: '512,2048', a .csv/.json file, or "
        "'lognormal:median=300,max=2048,n=100' (one prefill per distinct length) [%(default)s]",
    )
    capacity.add_argument("--budget", default="1GiB", help="KV memory budget, e.g. 512MiB [%(default)s]")

    served = each["serve"]
    _common(served, SERVE_NEW_TOKENS)
    _measured(served, caches=False)
    served.add_argument(
        "--configs",
        default="static,transformers,paged,prefix,int8,h2o",
        help="configurations, comma-separated [%(default)s]",
    )
    served.add_argument("--requests", type=int, default=20, help="requests in the trace [%(default)s]")
    served.add_argument("--rate", default="inf", help="arrivals per second, or 'inf' for a burst [%(default)s]")
    served.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    served.add_argument("--documents", type=int, default=4, help="documents the requests ask about [%(default)s]")
    served.add_argument("--document-tokens", type=int, default=256, help="tokens per document [%(default)s]")
    served.add_argument("--kv-budget", default="32MiB", help="the KV byte cap of every configuration [%(default)s]")
    served.add_argument("--block-size", type=int, default=16, help="tokens per KV block [%(default)s]")
    served.add_argument("--max-batched-tokens", type=int, default=512, help="tokens one step computes at most")
    served.add_argument("--slo-ttft", type=float, default=2.0, help="goodput: time to first token, seconds")
    served.add_argument("--slo-tpot", type=float, default=0.5, help="goodput: time per output token, seconds")
    served.add_argument("--seed", type=int, default=0, help="the trace's seed [%(default)s]")
