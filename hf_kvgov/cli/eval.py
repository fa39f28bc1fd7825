"""`kvgov eval`: quality of each KV cache on perplexity, LongBench and synthetic long-context tasks.

`HELP`, the `--help` text, gives examples, the outputs, how to split a run over processes and what Ctrl-C keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hf_kvgov import models
from hf_kvgov.cli.interrupted import run_reported
from hf_kvgov.cli.refusal import refuse
from hf_kvgov.evaluation.longbench.data import HUB_DATASET
from hf_kvgov.partial import Progress

if TYPE_CHECKING:
    from hf_kvgov.evaluation.distributed import Workers
    from hf_kvgov.evaluation.report import EvalReport

# The runners (torch, transformers) are imported when a benchmark runs: `kvgov --help` stays instant.

HELP = """\
`kvgov eval`: quality of each KV cache on perplexity, LongBench and synthetic long-context tasks.

    kvgov eval ppl --caches dynamic,int8,h2o@0.2,sink@4+252 --tokens 2048 --json ppl.json --plots plots/
    kvgov eval longbench --data ./longbench_data --tasks hotpotqa,trec --limit 20 --caches dynamic,int4
    kvgov eval synthetic --tasks passkey,niah_single --lengths 1024,4096 --samples 5 --caches dynamic,h2o@0.2
    kvgov eval synthetic --tasks needles --compress context --caches dynamic,kvzip@0.2,snapkv@0.2

Every command prints a Markdown table, writes JSON with --json (per-sample details included) and PNG
plots with --plots. Run it under `accelerate launch --multi_gpu --num_processes N -m hf_kvgov.cli.main
eval ...` (or `torchrun --nproc_per_node N`) to split the examples over N processes; only the first
process prints and writes.

Ctrl-C stops a run with one line on stderr and exit status 130. The rows finished so far are kept: the
table of them is printed, and --json gets the same JSON with "partial": true and "completed" (rows done,
total, unit) at its top. A row is, for ppl, a cache scored on every document; for longbench and
synthetic, a sample generated with every cache (the scores are over those samples). No plots are
drawn, and when no row had finished nothing is written. Over several processes the first process
keeps only the rows it finished itself.
"""

DEFAULT_CACHES = "dynamic,int8,int4,h2o@0.2,sink@4+252"

# A prepared run: given the loaded model and tokenizer and the processes, returns the report.
Job = Callable[[Any, Any, "Workers"], "EvalReport"]


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _names(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts such as 1024,4096; got {text!r}"
        ) from None


def _common(parser: argparse.ArgumentParser, caches: str) -> None:
    parser.add_argument(
        "--model",
        default=models.DEFAULT_MODEL,
        help="embedded name, .gguf path, local directory or hub id (default: %(default)s)",
    )
    parser.add_argument(
        "--caches", type=_names, default=_names(caches), help=f"comma-separated cache names (default: {caches})"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="write the full report as JSON to PATH ('-' for stdout); after Ctrl-C, the rows finished so far "
        'with "partial": true (nothing when none had finished)',
    )
    parser.add_argument("--plots", metavar="DIR", help="write PNG plots into DIR")


def _add_ppl(subparsers: Any) -> None:
    parser = subparsers.add_parser("ppl", help="perplexity with the cache in the loop, and the sliding-window standard")
    _common(parser, DEFAULT_CACHES)
    parser.add_argument(
        "--text", metavar="PATH", help="UTF-8 text file, or jsonl with --jsonl-field (default: built-in text)"
    )
    parser.add_argument(
        "--jsonl-field", metavar="FIELD", help="--text is a jsonl file: score this field of each record"
    )
    parser.add_argument("--join", action="store_true", help="join the jsonl records into one document")
    parser.add_argument("--documents", type=int, metavar="N", help="score the first N documents only")
    parser.add_argument(
        "--dataset", metavar="ID", help="a datasets id, e.g. wikitext (needs `datasets` and the network)"
    )
    parser.add_argument("--dataset-config", metavar="NAME", help="its configuration, e.g. wikitext-2-raw-v1")
    parser.add_argument("--split", default="test", help="its split (default: %(default)s)")
    parser.add_argument("--dataset-field", default="text", help="its text column (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens scored per document (default: %(default)s)")
    parser.add_argument(
        "--chunk",
        type=int,
        default=16,
        help="tokens fed per step (default: %(default)s, a block: paged and quantized caches score as in generation); "
        "1 feeds a token a step as decoding does, for eviction policies that choose every step (16x slower)",
    )
    parser.add_argument("--rows", type=int, default=8, help="caches scored in one batch (default: %(default)s)")
    parser.add_argument(
        "--window", type=int, help="sliding-window size (default: the model's context, at most --tokens)"
    )
    parser.add_argument("--stride", type=int, help="sliding-window stride (default: half the window)")
    parser.add_argument("--no-sliding-window", action="store_true", help="skip the sliding-window baseline")
    parser.add_argument(
        "--bin", type=int, default=64, help="positions per point of the loss curve (default: %(default)s)"
    )
    parser.set_defaults(func=lambda args: _main(args, "ppl", _prepare_ppl), loads_model=True)


def _prepare_ppl(args: argparse.Namespace) -> Job:
    from hf_kvgov.evaluation.ppl_run import PerplexityOptions, run_perplexity
    from hf_kvgov.evaluation.texts import TextSource, load_documents
    from hf_kvgov.hf.compat import decoder_config

    source = TextSource(
        path=args.text, jsonl_field=args.jsonl_field, dataset=args.dataset, dataset_config=args.dataset_config,
        split=args.split, dataset_field=args.dataset_field, max_documents=args.documents, join=args.join,
    )  # fmt: skip
    # Without --window the window is refined once the model's context is known (see job below).
    window = None if args.no_sliding_window else (args.tokens if args.window is None else args.window)
    options = PerplexityOptions(
        caches=args.caches, chunk_tokens=args.chunk, max_tokens=args.tokens, rows=args.rows,
        window=window, stride=args.stride, bin_tokens=args.bin,
    )  # fmt: skip
    documents = load_documents(source)

    def job(model: Any, tokenizer: Any, workers: Workers) -> EvalReport:
        final = options
        if args.window is None and options.window is not None:
            context = getattr(decoder_config(model), "max_position_embeddings", None) or options.max_tokens
            final = dataclasses.replace(options, window=min(context, options.max_tokens))
        return run_perplexity(model, tokenizer, documents, final, workers, args.model, source.describe())

    return job


# evaluation.generation.COMPRESS_INPUTS (named here so that --help imports no torch; a test keeps them equal)
COMPRESS_CHOICES = ("prompt", "context")


def _compress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compress",
        choices=COMPRESS_CHOICES,
        default="prompt",
        help="what a compressing cache has seen when it compresses: the whole prompt, its question included "
        "(default), or only the context, the question following (kvpress's protocol; kvzip@... runs only so)",
    )


def _add_longbench(subparsers: Any) -> None:
    parser = subparsers.add_parser("longbench", help="LongBench with the official prompts, truncation and metrics")
    _common(parser, "dynamic,int8,h2o@0.2")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--data", metavar="DIR", help="directory of the official <task>.jsonl files (LongBench's data.zip)"
    )
    where.add_argument(
        "--hub", nargs="?", const=HUB_DATASET, metavar="ID", help=f"a hub dataset (default: {HUB_DATASET})"
    )
    parser.add_argument("--tasks", type=_names, help="comma-separated tasks (default: every task found)")
    parser.add_argument("-e", "--longbench-e", action="store_true", help="LongBench-E: the <task>_e files")
    parser.add_argument("--limit", type=int, help="samples per task (default: all)")
    parser.add_argument("--max-length", type=int, help="prompt tokens after the middle cut (default: context - answer)")
    parser.add_argument("--max-new-tokens", type=int, help="cap the official answer lengths (quick runs only)")
    _compress(parser)
    parser.set_defaults(func=lambda args: _main(args, "longbench", _prepare_longbench), loads_model=True)


def _prepare_longbench(args: argparse.Namespace) -> Job:
    from hf_kvgov.evaluation.longbench.run import LongBenchOptions, load_items, run_longbench

    options = LongBenchOptions(
        caches=args.caches, max_length=args.max_length, max_new_tokens=args.max_new_tokens, compress=args.compress
    )
    items = load_items(args.tasks, data_dir=args.data, hub=args.hub, longbench_e=args.longbench_e, limit=args.limit)

    def job(model: Any, tokenizer: Any, workers: Workers) -> EvalReport:
        return run_longbench(model, tokenizer, items, options, workers, args.model)

    return job


def _add_synthetic(subparsers: Any) -> None:
    parser = subparsers.add_parser("synthetic", help="passkey / needle / variable-tracking / common-words accuracy")
    _common(parser, "dynamic,int8,h2o@0.2,sink@4+252")
    from hf_kvgov.evaluation.registry import synthetic_tasks  # task generators only: no model, no torch

    parser.add_argument(
        "--tasks",
        type=_names,
        default=("passkey", "niah_single"),
        help=f"comma-separated tasks among {', '.join(synthetic_tasks())} (default: passkey,niah_single)",
    )
    parser.add_argument("--lengths", type=_lengths, default=(1024,), help="prompt lengths in tokens (default: 1024)")
    parser.add_argument("--samples", type=int, default=4, help="samples per task and length (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the samples (default: %(default)s)")
    parser.add_argument("--filler", metavar="PATH", help="filler text file (default: the built-in text)")
    parser.add_argument(
        "--no-chat-template", action="store_true", help="feed prompts raw even if the model has a template"
    )
    parser.add_argument("--max-new-tokens", type=int, help="cap the tasks' answer lengths")
    _compress(parser)
    parser.set_defaults(func=lambda args: _main(args, "synthetic", _prepare_synthetic), loads_model=True)


def _prepare_synthetic(args: argparse.Namespace) -> Job:
    from hf_kvgov.evaluation.synthetic_run import SyntheticOptions, build_items, run_synthetic
    from hf_kvgov.evaluation.texts import TextSource, load_documents

    options = SyntheticOptions(
        caches=args.caches, tasks=args.tasks, lengths=args.lengths, samples=args.samples, seed=args.seed,
        chat_template=not args.no_chat_template, max_new_tokens=args.max_new_tokens, compress=args.compress,
    )  # fmt: skip
    filler = load_documents(TextSource(path=args.filler))[0].text

    def job(model: Any, tokenizer: Any, workers: Workers) -> EvalReport:
        items = build_items(tokenizer, filler, options)
        return run_synthetic(model, tokenizer, items, options, workers, args.model)

    return job


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate caches: perplexity, LongBench, synthetic long-context tasks",
        description=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="eval_command", metavar="BENCHMARK")
    for add in (_add_ppl, _add_longbench, _add_synthetic):
        add(commands)
    parser.set_defaults(func=lambda args: _missing_benchmark(parser))


def _missing_benchmark(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _main(args: argparse.Namespace, name: str, prepare: Callable[[argparse.Namespace], Job]) -> int:
    """Check the options and read the data before loading the model, so mistakes fail fast."""
    from hf_kvgov.evaluation.distributed import current_workers
    from hf_kvgov.evaluation.report import emit

    command = f"kvgov eval {name}"
    try:
        job = prepare(args)
    except (ValueError, TypeError, OSError, ImportError, RuntimeError) as error:
        return refuse(command, error)
    workers = current_workers()

    def run() -> EvalReport:
        if workers.is_main:
            print(f"[kvgov] loading {args.model} on {workers.count} process(es) ...", file=sys.stderr, flush=True)
        model, tokenizer = models.load_model(args.model, device=str(workers.device))
        return job(model, tokenizer, workers)

    def show(report: EvalReport, completed: Progress | None) -> None:
        emit(report, args.json, args.plots, completed)

    completed = False
    try:
        code = run_reported(command, run, show, args.json, workers.is_main)
        completed = code == 0  # an interrupted process may have peers that never reach the barrier
        return code
    except ValueError as error:  # options that only the tokenizer or the model can refuse (e.g. too short a length)
        return refuse(command, error)
    finally:
        workers.finish(completed)
