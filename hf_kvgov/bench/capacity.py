"""`kvgov bench capacity`: how many sequences fit in a KV memory budget, measured, beside the planner's figure.

Sequences take their lengths from a `LengthDistribution`, in order, cycling, until one does not fit; the planner's
figure is `kvgov plan`'s for the cache's own setup (`plan_setups.py`), with the whole budget for KV. Two ways of
counting (`allocation.py` says which applies to a cache):

- **pool refused**: one cache per sequence writes real K/V into a pre-allocated `BlockPool` capped at the budget
  (as a serving engine does) until it raises `PoolExhausted`. The K/V are one prefill of the longest length, cut
  for shorter ones (a causal model's K/V of a prefix do not depend on what follows).
- **measured bytes**: one sequence per distinct length runs through the model, its last token as a decode step so
  that caches acting at step boundaries have acted; the bytes it holds are summed up to the budget.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from hf_kvgov.bench.allocation import (
    LayerKV,
    capped_pool,
    fill_until_refused,
    pooled_twin,
    reference_kv,
    release,
    run_sequence,
)
from hf_kvgov.bench.plan_setups import kv_dtype_name, planner_geometry, planner_setup, predict
from hf_kvgov.bench.prompts import prompt_ids, text_token_ids
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.partial import Interrupted, Progress, on_interrupt
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.lengths import LengthDistribution
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.progress import nested_bar
from hf_kvgov.registry import CacheSpec, get_cache_spec, kv_bytes


@dataclass(frozen=True)
class CapacityConfig:
    """What `run_capacity` measures.

    Args:
        caches: registry names (`hf_kvgov.registry`).
        lengths: sequence lengths in tokens, taken in order and cycled (see `hf_kvgov.planner.parse_lengths`).
        budget_bytes: memory for the KV cache, in bytes.
    """

    caches: tuple[str, ...]
    lengths: LengthDistribution
    budget_bytes: int

    def __post_init__(self) -> None:
        if not self.caches:
            raise ValueError("caches must name at least one cache of the registry, e.g. ('dynamic', 'paged').")
        for name in self.caches:
            get_cache_spec(name)  # raises ValueError naming the registered caches
        if not isinstance(self.lengths, LengthDistribution):
            raise TypeError(
                f"lengths must be a LengthDistribution (see hf_kvgov.planner.parse_lengths); "
                f"got {type(self.lengths).__name__}."
            )
        budget = self.budget_bytes
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"budget_bytes must be a positive int number of bytes; got {budget!r}.")


@dataclass(frozen=True)
class CapacityRow:
    """One cache: sequences that fit (measured) and what the planner predicts for the same budget."""

    cache: str
    method: str  # "pool refused" or "measured bytes"
    budget_bytes: int
    sequences: int
    kv_bytes_held: int  # bytes of the sequences that fit
    bytes_per_sequence: float  # mean over the sequences that fit
    bytes_per_token: float
    refused_length: int  # length of the first sequence that did not fit
    planner_setup: str | None
    predicted_sequences: int | None
    predicted_bytes_per_sequence: float | None
    measured_vs_predicted: float | None


@dataclass(frozen=True)
class CapacityReport:
    model: str
    machine: str
    lengths: str
    budget_bytes: int
    rows: tuple[CapacityRow, ...]

    def to_dict(self) -> dict[str, Any]:
        fields = {k: v for k, v in asdict(self).items() if k != "rows"}
        return fields | {"rows": [asdict(row) for row in self.rows]}


def fit_in_order(order: Sequence[int], bytes_of: Mapping[int, int], budget: int) -> tuple[int, int, int]:
    """Take lengths from `order`, cycling, while their bytes add up to at most `budget`.

    Returns:
        (sequences that fit, their bytes, the length of the first that does not).
    """
    if any(bytes_of[length] <= 0 for length in order):
        raise ValueError(f"Every sequence must hold some bytes to be counted against a budget; got {dict(bytes_of)}.")
    cycle = sum(bytes_of[length] for length in order)
    whole = budget // cycle  # whole passes over the order: arithmetic, not a loop of millions
    count, used = whole * len(order), whole * cycle
    for length in order:
        if used + bytes_of[length] > budget:
            return count, used, length
        count, used = count + 1, used + bytes_of[length]
    raise AssertionError("a whole further pass over the order cannot fit after the largest number of whole passes")


def describe_setup(setup: CacheSetup) -> str:
    """A short label of the planner's setup: 'block 16, int8 (sink 1 block)', 'block 1, budget 20% (at least 64)'."""
    parts = [f"block {setup.block_size}"]
    if setup.shared_fraction:
        parts.append(f"{setup.shared_fraction:.0%} shared")
    if setup.codec is not None:
        parts.append(
            f"{setup.codec} slots" if setup.eviction_slots else f"{setup.codec} (sink {setup.sink_blocks} block)"
        )
    if setup.h2o_budget is not None:
        parts.append(f"budget {setup.h2o_budget:.0%} (at least {setup.h2o_recent})")
    if setup.spill_hot_tokens is not None:
        parts.append(f"spill, hot {setup.spill_hot_tokens}")
    return ", ".join(parts)


def _measured_bytes(
    model: Any, spec: CacheSpec, ids: torch.Tensor, lengths: Sequence[int], progress: bool
) -> dict[int, int]:
    """Bytes one sequence of each distinct length holds in a cache of `spec`; `ids` is long `[1, >= max]`."""
    held = {}
    distinct = sorted(set(lengths))
    for length in nested_bar(distinct, desc=f"  {spec.name}: one sequence per length", disable=not progress):
        cache = run_sequence(model, spec, ids[:, :length])
        held[length] = kv_bytes(cache)
        release(cache)
    return held


def _row(
    name: str, method: str, config: CapacityConfig, fit: tuple[int, int, int], tokens: int, setup: CacheSetup | None
) -> CapacityRow:
    count, held, refused = fit
    return CapacityRow(
        cache=name,
        method=method,
        budget_bytes=config.budget_bytes,
        sequences=count,
        kv_bytes_held=held,
        bytes_per_sequence=held / count if count else 0.0,
        bytes_per_token=held / tokens if tokens else 0.0,
        refused_length=refused,
        planner_setup=describe_setup(setup) if setup is not None else None,
        predicted_sequences=None,
        predicted_bytes_per_sequence=None,
        measured_vs_predicted=None,
    )


def _with_prediction(
    row: CapacityRow, geometry: ModelGeometry, config: CapacityConfig, setup: CacheSetup
) -> CapacityRow:
    step = predict(geometry, setup, config.lengths, config.budget_bytes)
    return dataclasses.replace(
        row,
        predicted_sequences=step.concurrent,
        predicted_bytes_per_sequence=step.bytes_per_sequence,
        measured_vs_predicted=row.sequences / step.concurrent if step.concurrent else None,
    )


def _tokens_of(order: Sequence[int], count: int) -> int:
    whole, rest = divmod(count, len(order))
    return whole * sum(order) + sum(order[:rest])


def measure_cache(
    model: Any,
    name: str,
    config: CapacityConfig,
    ids: torch.Tensor,
    reference: Callable[[], LayerKV],
    geometry: ModelGeometry | None = None,
    progress: bool = True,
) -> CapacityRow:
    """Capacity of one registry cache.

    Args:
        ids: long `[1, >= longest length]`, the tokens every sequence is cut from.
        reference: returns every layer's K/V of a prefill of `ids` (computed once, for pooled caches only).
        geometry: the planner's view of the model; None leaves the prediction out.
    """
    spec = get_cache_spec(name)
    probe = spec.build(model)
    dtype = kv_dtype_name(next(model.parameters()).dtype)
    setup = planner_setup(probe, dtype) if dtype is not None else None
    twin = pooled_twin(probe, model)
    order = config.lengths.lengths
    if twin is not None and probe.pool is not None:
        method = "pool refused"
        pool = capped_pool(probe.pool, config.budget_bytes)
        with nested_bar(desc=f"  {name}: sequences written", disable=not progress) as bar:
            fit = fill_until_refused(twin, pool, reference(), order, bar)
    else:
        method = "measured bytes"
        fit = fit_in_order(order, _measured_bytes(model, spec, ids, order, progress), config.budget_bytes)
    release(probe)
    row = _row(name, method, config, fit, _tokens_of(order, fit[0]), setup)
    if setup is None or geometry is None:
        return row
    return _with_prediction(row, geometry, config, setup)


def run_capacity(
    model: Any, tokenizer: Any, config: CapacityConfig, model_name: str = "", progress: bool = True
) -> CapacityReport:
    """Measure every cache of `config`; rows in the order of `config.caches`.

    On Ctrl-C raises `hf_kvgov.partial.Interrupted` with the report of the caches measured.
    """
    device = next(model.parameters()).device
    ids = prompt_ids(text_token_ids(tokenizer), 1, config.lengths.max).to(device)
    reference = functools.cache(lambda: reference_kv(model, ids))
    geometry = planner_geometry(model, model_name)
    rows: list[CapacityRow] = []

    def report() -> CapacityReport:
        lengths = config.lengths.summary()
        return CapacityReport(model_name, machine_description(), lengths, config.budget_bytes, tuple(rows))

    with on_interrupt(lambda: Interrupted(report(), Progress(len(rows), len(config.caches), "caches"))):
        for name in tqdm(config.caches, desc="bench capacity", disable=not progress):
            rows.append(measure_cache(model, name, config, ids, reference, geometry, progress))
    return report()


def capacity_markdown(report: CapacityReport) -> str:
    """The rows as a Markdown table, with a line naming the model, budget and lengths."""
    lines = [
        f"{report.model or 'model'}: KV budget {report.budget_bytes:,} bytes; {report.lengths} ({report.machine})",
        "",
        "| cache | method | sequences that fit | planner predicts | measured / predicted | KV held | bytes/seq "
        "| planner bytes/seq | first refused length | planner setup |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in report.rows:
        predicted = "-" if r.predicted_sequences is None else f"{r.predicted_sequences:,}"
        ratio = "-" if r.measured_vs_predicted is None else f"{r.measured_vs_predicted:.2f}"
        planned = "-" if r.predicted_bytes_per_sequence is None else f"{r.predicted_bytes_per_sequence:,.0f}"
        lines.append(
            f"| {r.cache} | {r.method} | {r.sequences:,} | {predicted} | {ratio} | {r.kv_bytes_held:,} "
            f"| {r.bytes_per_sequence:,.0f} | {planned} | {r.refused_length:,} | {r.planner_setup or '-'} |"
        )
    return "\n".join(lines)
