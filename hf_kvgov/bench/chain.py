"""The governance chain measured step by step, beside what the planner predicts (`eval/bench_chain.py`).

For each step of `chain_rows.STEPS` (the cumulative chain, then its side rows with a disk tier):

- KV bytes per token: the probe's `stats().bytes_used` holding one `length`-token sequence, and at capacity the
  bytes the sequences that fit hold over their tokens (shared blocks once);
- capacity: sequences that fit in `budget_bytes`, by allocation, beside `kvgov plan`'s prediction (`plan_setups`);
- decode tokens/s: batch 1 after `length` tokens, the median of interleaved rounds, and its ratio to the first step;
- perplexity and passkey accuracy, by registry name; a step reusing another's numerics says so.

A refused step (`ChainRefused`) has no numbers, only the rules' sentence (the eviction step carries several).
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from hf_kvgov.bench import allocation as alloc
from hf_kvgov.bench.capacity import describe_setup
from hf_kvgov.bench.chain_rows import STEPS, ChainStep
from hf_kvgov.bench.chain_steps import ChainBenchConfig, Context, Probe, shared_document
from hf_kvgov.bench.plan_setups import kv_dtype_name, planner_geometry, planner_setup, predict, with_shared_prefix
from hf_kvgov.bench.plots import _pyplot, _save
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import demo_text
from hf_kvgov.engine.rules import ChainRefused
from hf_kvgov.evaluation.ppl_run import PerplexityOptions, run_perplexity
from hf_kvgov.evaluation.synthetic_run import SyntheticOptions, build_items, run_synthetic
from hf_kvgov.evaluation.texts import Document
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.lengths import fixed
from hf_kvgov.progress import nested_bar
from hf_kvgov.registry import kv_bytes

__all__ = ["STEPS", "ChainBenchConfig", "ChainReport", "StepRow", "chain_markdown", "run_chain", "write_chain_plots"]


@dataclass(frozen=True)
class StepRow:
    """One step. None where a figure does not apply (a refused step has only `refused`)."""

    step: str
    label: str
    side: bool
    refused: str | None = None  # the ChainRefused sentence
    notes: tuple[str, ...] = ()  # sentences refusing other links next to this step's
    chain: str | None = None  # the built cache's parts, as `ChainParts.describe()` says them
    kv_bytes_per_token: float | None = None
    capacity_method: str | None = None
    sequences: int | None = None
    held_bytes: int | None = None
    held_bytes_per_token: float | None = None
    predicted_sequences: int | None = None
    predicted_bytes_per_sequence: float | None = None
    measured_vs_predicted: float | None = None
    planner_setup: str | None = None
    decode_tokens_per_s: float | None = None
    decode_vs_first: float | None = None
    numerics: str | None = None  # the registry name of the ppl / passkey runs, or "= <step>" when reused
    perplexity: float | None = None
    passkey_accuracy: float | None = None


@dataclass(frozen=True)
class ChainReport:
    model: str
    machine: str
    config: ChainBenchConfig
    rows: tuple[StepRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def row(self, step: str) -> StepRow:
        for row in self.rows:
            if row.step == step:
                return row
        raise KeyError(f"The report has no step {step!r}; its steps are {[r.step for r in self.rows]}.")


def _refusals(ctx: Context, step: ChainStep) -> tuple[str, ...]:
    sentences = []
    for parts in step.refusals(ctx):
        try:
            alloc.release(ctx.build(**parts))
        except ChainRefused as refused:
            sentences.append(str(refused))
    return tuple(sentences)


def _describe(cache: Any) -> str:
    parts = getattr(cache, "parts", None)
    return f"{type(cache).__name__}: {parts.describe()}" if parts is not None else type(cache).__name__


def _measure(ctx: Context, step: ChainStep, geometry: ModelGeometry | None, dtype: str | None) -> tuple[StepRow, Probe]:
    """The probe's bytes, the capacity by allocation and the planner's figure; the probe stays for decoding."""
    c = ctx.config
    probe = step.probe(ctx)
    probe.step(ctx.model)  # the length-th token: steps that seal or spill at a step boundary have acted
    count, held, _ = step.capacity(ctx, probe)
    row = StepRow(
        step.name, step.label.format(**asdict(c)), step.side, notes=_refusals(ctx, step),
        chain=_describe(probe.cache), kv_bytes_per_token=(kv_bytes(probe.cache) + probe.shared_bytes) / c.length,
        capacity_method=step.method, sequences=count, held_bytes=held,
        held_bytes_per_token=held / (count * c.length) if count else None,
    )  # fmt: skip
    setup = planner_setup(probe.cache, dtype) if dtype is not None else None
    if setup is None or geometry is None:
        return row, probe
    if step.shares_document:
        setup = with_shared_prefix(setup, c.shared_tokens, c.length)
    if step.fills_in_steps:  # each request writes its own tokens in `chunk`-token steps
        setup = dataclasses.replace(setup, step_tokens=c.chunk)
    plan = predict(geometry, setup, fixed(c.length), c.budget_bytes)
    ratio = count / plan.concurrent if plan.concurrent else None
    return dataclasses.replace(
        row,
        predicted_sequences=plan.concurrent,
        predicted_bytes_per_sequence=plan.bytes_per_sequence,
        measured_vs_predicted=ratio,
        planner_setup=describe_setup(setup),
    ), probe


def _decode(ctx: Context, probes: dict[str, Probe], progress: bool) -> dict[str, float]:
    """Decode tokens/s of every probe: one step each per round, interleaved, the median step."""
    seconds: dict[str, list[float]] = {name: [] for name in probes}
    for _ in nested_bar(range(ctx.config.decode_steps), desc="decode rounds", disable=not progress):
        for name, probe in probes.items():
            seconds[name].append(probe.step(ctx.model))
    return {name: 1.0 / statistics.median(times) for name, times in seconds.items()}


def _quality(model: Any, tokenizer: Any, config: ChainBenchConfig, text: str, names: list[str]) -> dict[str, Any]:
    """name -> (perplexity, passkey accuracy or None) with each cache in the loop."""
    ppl: dict[str, float] = {}
    if config.ppl_tokens:
        options = PerplexityOptions(tuple(names), config.ppl_chunk, config.ppl_tokens, window=None)
        report = run_perplexity(model, tokenizer, [Document("text", text)], options)
        ppl = {r.name: r.perplexity for r in report.results}
    passkey: dict[str, float] = {}
    if config.passkey_samples:
        options_k = SyntheticOptions(
            tuple(names),
            ("passkey",),
            (config.passkey_length,),
            config.passkey_samples,
            max_new_tokens=config.passkey_new_tokens,
        )
        items = build_items(tokenizer, demo_text(), options_k)  # the eval suite's default filler
        passkey = run_synthetic(model, tokenizer, items, options_k).averages()
    return {name: (ppl.get(name), passkey.get(name)) for name in names}


def _with_numerics(rows: list[StepRow], config: ChainBenchConfig, quality: dict[str, Any]) -> list[StepRow]:
    by_step = {step.name: step for step in STEPS}
    result: list[StepRow] = []
    for row in rows:
        step = by_step[row.step]
        source = step if step.reuses is None else by_step[step.reuses]
        if row.refused is not None or source.numerics is None:
            result.append(row)
            continue
        name = source.numerics.format(**asdict(config))
        ppl, passkey = quality.get(name, (None, None))
        label = name if step.reuses is None else f"= {step.reuses} ({name}: same K/V)"
        result.append(dataclasses.replace(row, numerics=label, perplexity=ppl, passkey_accuracy=passkey))
    return result


def run_chain(model: Any, tokenizer: Any, config: ChainBenchConfig, text: str, model_name: str = "",
              progress: bool = True) -> ChainReport:  # fmt: skip
    """Measure every step of `STEPS` on `model`; requests and perplexity are cut from `text`."""
    selected = selected_steps(config)
    stream = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    requests = shared_document(tokenizer, stream, config.shared_tokens, config.length)
    geometry = planner_geometry(model, model_name)
    dtype = kv_dtype_name(next(model.parameters()).dtype)
    rows: list[StepRow] = []
    probes: dict[str, Probe] = {}
    with tempfile.TemporaryDirectory(prefix="kvgov-chain-") as spill_dir:
        ids = torch.tensor([requests.tokens(0)], device=next(model.parameters()).device)
        ctx = Context(model, config, requests, alloc.reference_kv(model, ids), spill_dir, progress)
        try:
            for step in tqdm(selected, desc="chain steps", disable=not progress):
                try:
                    row, probes[step.name] = _measure(ctx, step, geometry, dtype)
                except ChainRefused as refused:
                    row = StepRow(step.name, step.label.format(**asdict(config)), step.side, refused=str(refused))
                rows.append(row)
            rates = _decode(ctx, probes, progress)
        finally:
            for probe in probes.values():
                probe.release()
    first = rates.get(STEPS[0].name)  # None when the first step is not run: no ratios
    rows = [
        r if r.step not in rates else dataclasses.replace(
            r, decode_tokens_per_s=rates[r.step], decode_vs_first=rates[r.step] / first if first else None
        )
        for r in rows
    ]  # fmt: skip
    names = [s.numerics.format(**asdict(config)) for s in selected if s.numerics and s.name in probes]
    rows = _with_numerics(rows, config, _quality(model, tokenizer, config, text, names))
    return ChainReport(model_name, machine_description(), config, tuple(rows))


def selected_steps(config: ChainBenchConfig) -> tuple[ChainStep, ...]:
    """The steps `config.steps` names, in the chain's order (all when None); a step whose numerics are another
    step's needs that step too."""
    if config.steps is None:
        return STEPS
    known = {step.name: step for step in STEPS}
    unknown = [name for name in config.steps if name not in known]
    if unknown or not config.steps:
        raise ValueError(f"Unknown chain bench step(s) {unknown}; the steps are {', '.join(known)}.")
    for name in config.steps:
        source = known[name].reuses
        if source is not None and source not in config.steps:
            raise ValueError(f"Step {name!r} reuses the numerics of {source!r}; run {source!r} too.")
    return tuple(step for step in STEPS if step.name in config.steps)


def _cell(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def chain_markdown(report: ChainReport) -> str:
    """The rows as a Markdown table, with a line naming the model, budget and workload."""
    c = report.config
    lines = [
        f"{report.model or 'model'}: KV budget {c.budget_bytes:,} bytes; sequences of {c.length:,} tokens, "
        f"{c.shared_tokens:,} of them one shared document in the prefix steps; perplexity on {c.ppl_tokens:,} "
        f"tokens, {c.ppl_chunk} per forward; passkey at {c.passkey_length:,} tokens, {c.passkey_samples} "
        f"sample(s) ({report.machine})",
        "",
        "| step | cache built | KV B/token | perplexity | passkey % | ppl / passkey run | decode tok/s | vs step 1 "
        "| sequences that fit | planner | measured / predicted | B/token held at capacity | capacity method | notes |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in report.rows:
        notes = "; ".join(([f"refused: {r.refused}"] if r.refused else []) + [f"refused: {n}" for n in r.notes])
        lines.append(
            f"| {r.label} | {r.chain or '-'} | {_cell(r.kv_bytes_per_token, ',.0f')} | {_cell(r.perplexity, '.3f')} "
            f"| {_cell(r.passkey_accuracy, '.0f')} | {r.numerics or '-'} | {_cell(r.decode_tokens_per_s, '.2f')} "
            f"| {_cell(r.decode_vs_first, '.2f')} | {_cell(r.sequences, ',')} | {_cell(r.predicted_sequences, ',')} "
            f"| {_cell(r.measured_vs_predicted, '.3f')} | {_cell(r.held_bytes_per_token, ',.0f')} "
            f"| {r.capacity_method or '-'} | {notes or '-'} |"
        )
    return "\n".join(lines)


def write_chain_plots(report: ChainReport, directory: str | Path, stem: str) -> list[Path]:
    """`<stem>_bytes_per_token.png` and `<stem>_capacity.png` in `directory`: one group of bars per built step."""
    plt = _pyplot()
    rows = [r for r in report.rows if r.refused is None]
    names, xs = [r.step for r in rows], range(len(rows))
    title = f"{report.model or 'model'}, sequences of {report.config.length:,} tokens"
    figures: list[tuple[str, dict[str, list[Any]], str]] = [
        ("bytes_per_token", {"one sequence (stats)": [r.kv_bytes_per_token for r in rows],
                             "held at capacity": [r.held_bytes_per_token for r in rows]}, "KV bytes per token"),
        ("capacity", {"measured (allocated)": [r.sequences for r in rows],
                      "planner": [r.predicted_sequences for r in rows]}, "sequences that fit"),
    ]  # fmt: skip
    paths = []
    for suffix, series, label in figures:
        figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(rows)), 4.5))
        for offset, (name, values) in zip((-0.2, 0.2), series.items(), strict=True):
            bars = axes.bar([x + offset for x in xs], [v or 0 for v in values], 0.4, label=name)
            axes.bar_label(bars, fmt="{:,.0f}", fontsize=7, padding=2)
        axes.set_xticks(list(xs), names)
        axes.set_ylabel(label)
        axes.set_title(f"{title}, KV budget {report.config.budget_bytes / 1e6:,.0f} MB", fontsize=10)
        axes.legend(fontsize=8)
        paths.append(_save(figure, plt, Path(directory) / f"{stem}_{suffix}.png"))
    return paths
