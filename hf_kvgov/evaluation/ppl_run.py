"""`kvgov eval ppl`: perplexity with each cache in the loop, against the sliding-window standard.

Work is cut into units, one per (document, group of caches) and one per document for the sliding-window
baseline; processes take units in turn and the main process pools every unit's per-token losses. The
units and their batches do not depend on the number of processes, so a run split over N processes
gives the numbers of a single-process run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hf_kvgov.evaluation import plots
from hf_kvgov.evaluation.distributed import Workers, single_process
from hf_kvgov.evaluation.generation import release
from hf_kvgov.evaluation.perplexity import check_window, chunked_token_losses, sliding_window_token_losses
from hf_kvgov.evaluation.report import markdown_table
from hf_kvgov.evaluation.texts import Document
from hf_kvgov.partial import Interrupted, Progress, on_interrupt
from hf_kvgov.registry import get_cache_spec, kv_bytes

SLIDING_WINDOW = "sliding-window"


@dataclass(frozen=True)
class PerplexityOptions:
    """How the text is scored.

    Attributes:
        caches: registered cache names; the first is the reference of the "vs" column.
        chunk_tokens: tokens fed per step with the cache in the loop (1: decode-faithful).
        max_tokens: tokens scored per document (its first ones).
        rows: caches scored together in one batch (those needing their own attention run alone).
        window: sliding-window size of the baseline in tokens; None: no baseline.
        stride: sliding-window stride; None: half the window.
        bin_tokens: positions per point of the loss-against-position curve.
    """

    caches: tuple[str, ...] = ("dynamic",)
    chunk_tokens: int = 1
    max_tokens: int = 1024
    rows: int = 8
    window: int | None = 1024
    stride: int | None = None
    bin_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "max_tokens", "rows", "bin_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}.")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be at least 2 (one token to predict); got {self.max_tokens}.")
        if not self.caches or len(set(self.caches)) != len(self.caches):
            raise ValueError(f"caches must name at least one cache, each once; got {list(self.caches)}.")
        for name in self.caches:
            get_cache_spec(name)  # a full-sentence ValueError for an unknown name, before any model work
        if self.window is not None:
            check_window(self.window, self.effective_stride)

    @property
    def effective_stride(self) -> int:
        assert self.window is not None
        return self.stride if self.stride is not None else max(1, self.window // 2)


@dataclass(frozen=True)
class Unit:
    document: int
    method: str  # "chunked" or SLIDING_WINDOW
    caches: tuple[str, ...] = ()


@dataclass(frozen=True)
class UnitLosses:
    """Per-token losses of one document under one cache (or the sliding-window baseline)."""

    document: int
    name: str
    losses: list[float]  # entry i: loss of token i + 1
    kv_bytes: int | None  # held after the document; None without a cache


@dataclass(frozen=True)
class PositionBin:
    start: int  # positions [start, stop) of the predicting tokens
    stop: int
    tokens: int  # losses pooled over every document
    loss: float


@dataclass(frozen=True)
class PerplexityResult:
    name: str
    tokens: int
    nll: float  # mean loss per predicted token (nats)
    perplexity: float
    vs_reference_pct: float  # perplexity change against the first cache
    kv_bytes: float | None  # mean over documents of the KV bytes held at the end
    bytes_per_token: float | None  # KV bytes held / tokens fed, pooled over documents
    positions: tuple[PositionBin, ...]


def plan_units(documents: int, options: PerplexityOptions) -> list[Unit]:
    """The batches of caches (alone when a cache needs its own attention) over every document, then the baseline.

    Batch after batch, in the order of their first cache, so a row of the table (one cache over every
    document) finishes as soon as its batch has, the reference's first: Ctrl-C keeps the rows finished.
    """
    groups: list[tuple[str, ...]] = []
    batch: list[str] = []
    for name in options.caches:
        if get_cache_spec(name).needs_attention_context:
            groups.append((name,))
            continue
        batch.append(name)
        if len(batch) == options.rows:
            groups.append(tuple(batch))
            batch = []
    groups += [tuple(batch)] if batch else []
    groups.sort(key=lambda group: options.caches.index(group[0]))
    units = [Unit(document, "chunked", group) for group in groups for document in range(documents)]
    if options.window is not None:
        units += [Unit(document, SLIDING_WINDOW) for document in range(documents)]
    return units


def _run_chunked(model: Any, ids: Any, unit: Unit, options: PerplexityOptions, label: str | None) -> list[UnitLosses]:
    specs = [get_cache_spec(name) for name in unit.caches]
    losses, caches = chunked_token_losses(model, ids, specs, options.chunk_tokens, label)
    results = [
        UnitLosses(unit.document, name, row.tolist(), kv_bytes(cache))
        for name, row, cache in zip(unit.caches, losses, caches, strict=True)
    ]
    for cache in caches:
        release(cache)
    return results


def _run_sliding(model: Any, ids: Any, unit: Unit, options: PerplexityOptions, label: str | None) -> list[UnitLosses]:
    assert options.window is not None
    losses = sliding_window_token_losses(model, ids, options.window, options.effective_stride, label)
    return [UnitLosses(unit.document, SLIDING_WINDOW, losses.tolist(), None)]


UnitRunner = Callable[[Any, Any, Unit, PerplexityOptions, str | None], list[UnitLosses]]
UNIT_RUNNERS: dict[str, UnitRunner] = {"chunked": _run_chunked, SLIDING_WINDOW: _run_sliding}


def run_perplexity(
    model: Any,
    tokenizer: Any,
    documents: Sequence[Document],
    options: PerplexityOptions,
    workers: Workers | None = None,
    model_name: str = "",
    source: str = "",
) -> PerplexityReport:
    """Score ``documents`` with every cache of ``options`` (this process's share of the units) and pool.

    On Ctrl-C raises `hf_kvgov.partial.Interrupted` with the report of the rows (caches) scored on every
    document by this process.
    """
    workers = workers or single_process()
    texts = [_token_ids(tokenizer, document, options.max_tokens) for document in documents]
    kept = [(document, ids) for document, ids in zip(documents, texts, strict=True) if ids.shape[1] >= 2]
    if not kept:
        raise ValueError("Every document is shorter than 2 tokens; there is nothing to score.")
    names = [*options.caches, *([SLIDING_WINDOW] if options.window is not None else [])]
    docs = tuple((document.name, int(ids.shape[1])) for document, ids in kept)

    def report(pooled: Sequence[UnitLosses], rows: Sequence[str]) -> PerplexityReport:
        results = merge_losses(pooled, rows, options.bin_tokens, reference=options.caches[0])
        return PerplexityReport(model_name, source, docs, options, tuple(results), workers.count)

    mine: list[UnitLosses] = []

    def interrupted() -> Interrupted:
        rows = finished_rows(mine, names, len(kept))
        progress = Progress(len(rows), len(names), "caches", workers.count)
        return Interrupted(report(mine, rows) if rows else None, progress)

    units = workers.share(plan_units(len(kept), options))
    with on_interrupt(interrupted):
        for unit in tqdm(units, desc="ppl units", unit="unit", disable=not workers.is_main):
            label = f"{unit.method} {','.join(unit.caches)} doc {unit.document}" if workers.is_main else None
            mine += UNIT_RUNNERS[unit.method](model, kept[unit.document][1], unit, options, label)
        pooled = workers.gather(mine)
    return report(pooled, names)


def finished_rows(pooled: Sequence[UnitLosses], names: Sequence[str], documents: int) -> list[str]:
    """The names (in table order) whose losses ``pooled`` holds for every one of the ``documents``."""
    scored = {name: {unit.document for unit in pooled if unit.name == name} for name in names}
    return [name for name in names if len(scored[name]) == documents]


def _token_ids(tokenizer: Any, document: Document, max_tokens: int) -> Any:
    return tokenizer(document.text, return_tensors="pt")["input_ids"][:, :max_tokens]


def merge_losses(
    pooled: Sequence[UnitLosses], names: Sequence[str], bin_tokens: int, reference: str | None = None
) -> list[PerplexityResult]:
    """One result per name, pooling its documents in document order (so the sums do not depend on who ran what).

    The "vs" change is against ``reference`` (default: the first name); NaN when it is not among ``names``.
    """
    by_name = {name: sorted((u for u in pooled if u.name == name), key=lambda u: u.document) for name in names}
    results = [_pool(name, units, bin_tokens) for name, units in by_name.items()]
    base = {result.name: result.perplexity for result in results}.get(reference or names[0], math.nan)
    return [replace(result, vs_reference_pct=100 * (result.perplexity / base - 1)) for result in results]


def _pool(name: str, units: Sequence[UnitLosses], bin_tokens: int) -> PerplexityResult:
    if not units:
        raise RuntimeError(f"No process returned losses for {name!r}; the gathered results are incomplete.")
    tokens = sum(len(unit.losses) for unit in units)
    nll = sum(sum(unit.losses) for unit in units) / tokens
    held = [unit.kv_bytes for unit in units if unit.kv_bytes is not None]
    fed = sum(len(unit.losses) + 1 for unit in units)
    return PerplexityResult(
        name=name,
        tokens=tokens,
        nll=nll,
        perplexity=math.exp(nll),
        vs_reference_pct=math.nan,
        kv_bytes=sum(held) / len(held) if held else None,
        bytes_per_token=sum(held) / fed if held else None,
        positions=_position_bins(units, bin_tokens),
    )


def _position_bins(units: Sequence[UnitLosses], bin_tokens: int) -> tuple[PositionBin, ...]:
    longest = max(len(unit.losses) for unit in units)
    bins = []
    for start in range(0, longest, bin_tokens):
        stop = min(start + bin_tokens, longest)
        values = [loss for unit in units for loss in unit.losses[start:stop]]
        bins.append(PositionBin(start, stop, len(values), sum(values) / len(values)))
    return tuple(bins)


@dataclass(frozen=True)
class PerplexityReport:
    model: str
    source: str
    documents: tuple[tuple[str, int], ...]  # (name, tokens scored)
    options: PerplexityOptions
    results: tuple[PerplexityResult, ...]
    processes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "ppl",
            "model": self.model,
            "source": self.source,
            "processes": self.processes,
            "options": {
                **asdict(self.options),
                "stride": self.options.stride if self.options.window is None else self.options.effective_stride,
            },
            "documents": [{"name": name, "tokens": tokens} for name, tokens in self.documents],
            "reference": self.options.caches[0],
            "results": [asdict(result) for result in self.results],
        }

    def markdown(self) -> str:
        headers = [
            "cache",
            "tokens",
            "perplexity",
            f"vs {self.options.caches[0]} %",
            "mean NLL",
            "KV bytes",
            "bytes/token",
        ]
        rows = [
            [
                r.name,
                r.tokens,
                r.perplexity,
                r.vs_reference_pct,
                r.nll,
                None if r.kv_bytes is None else round(r.kv_bytes),
                r.bytes_per_token,
            ]
            for r in self.results
        ]
        title = f"Perplexity, {len(self.documents)} document(s), chunks of {self.options.chunk_tokens} token(s)"
        return f"### {title}\n\n" + markdown_table(headers, rows)

    def plots(self, directory: Path) -> list[Path]:
        cached = [(r.name, r.kv_bytes, r.perplexity) for r in self.results if r.kv_bytes is not None]
        baselines = {r.name: r.perplexity for r in self.results if r.kv_bytes is None}
        title = f"{self.model or 'model'}: perplexity vs KV held"
        scatter = plots.quality_vs_bytes(cached, directory / "ppl_vs_kv_bytes.png", "perplexity", title, baselines)
        series = {r.name: [((b.start + b.stop) / 2, b.loss) for b in r.positions] for r in self.results}
        text = self.source or f"{len(self.documents)} document(s)"
        curve_title = f"{self.model or 'model'} on {text}: loss vs position (chunks of {self.options.chunk_tokens})"
        curve = plots.curves(
            series, directory / "ppl_loss_vs_position.png", "position (tokens)", "mean loss (nats)", curve_title
        )
        return [scatter, curve]
