"""PNG plots of the speed and capacity benchmarks (matplotlib with the Agg backend, imported only here)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_kvgov.bench.capacity import CapacityReport
from hf_kvgov.bench.serve import ServeReport
from hf_kvgov.bench.speed import SpeedReport, SpeedRow

MB = 1e6


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window or need a display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            f"Writing benchmark plots needs matplotlib, which is not installed ({err}). Install it with "
            "`pip install hf-kvgov[eval]` (or `pip install matplotlib`), or leave out --plots."
        ) from err
    return plt


def _save(figure: Any, plt: Any, path: Path) -> Path:
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, format="png")
    plt.close(figure)
    return path


def _caches(rows: Sequence[SpeedRow]) -> list[str]:
    return list(dict.fromkeys(row.cache for row in rows))


def plot_memory_vs_context(report: SpeedReport, path: str | Path) -> Path:
    """KV bytes held (top) and peak memory (bottom) against context length: one line per cache, one column
    per batch size."""
    plt = _pyplot()
    batches = sorted({row.batch for row in report.rows})
    figure, axes = plt.subplots(2, len(batches), figsize=(5.0 * len(batches), 7.0), squeeze=False)
    kind = report.rows[0].memory_kind if report.rows else "peak memory"
    for column, batch in enumerate(batches):
        for cache in _caches(report.rows):
            points = sorted((r.context, r) for r in report.rows if r.cache == cache and r.batch == batch)
            contexts = [context for context, _ in points]
            axes[0][column].plot(contexts, [r.kv_bytes / MB for _, r in points], marker="o", label=cache)
            axes[1][column].plot(contexts, [r.peak_memory_bytes / MB for _, r in points], marker="o", label=cache)
        axes[0][column].set_title(f"batch {batch}: KV held after generate", fontsize=10)
        axes[1][column].set_title(f"batch {batch}: {kind} during generate", fontsize=10)
        for row, label in ((0, "KV MB"), (1, f"{kind} MB")):
            axes[row][column].set_xlabel("context length (tokens)")
            axes[row][column].set_ylabel(label)
            axes[row][column].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(f"{report.model or 'model'}: memory vs context", fontsize=11)
    return _save(figure, plt, Path(path))


def plot_tokens_per_s(report: SpeedReport, path: str | Path) -> Path:
    """Generated tokens per second (prefill included) per cache: one bar per (batch, context)."""
    plt = _pyplot()
    caches = _caches(report.rows)
    points = sorted({(row.batch, row.context) for row in report.rows})
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(caches) * max(1, len(points)) / 2), 4.5))
    width = 0.8 / max(1, len(points))
    for index, (batch, context) in enumerate(points):
        speeds = {r.cache: r.tokens_per_s for r in report.rows if (r.batch, r.context) == (batch, context)}
        xs = [i + (index - (len(points) - 1) / 2) * width for i in range(len(caches))]
        axes.bar(xs, [speeds.get(c, 0.0) for c in caches], width, label=f"batch {batch}, context {context}")
    axes.set_xticks(range(len(caches)), caches, rotation=20, ha="right", fontsize=8)
    axes.set_ylabel("tokens/s (generate, prefill included)")
    axes.set_title(f"{report.model or 'model'}: {report.config.new_tokens} new tokens per row", fontsize=10)
    axes.legend(fontsize=8)
    axes.grid(axis="y", alpha=0.3)
    return _save(figure, plt, Path(path))


def plot_capacity(report: CapacityReport, path: str | Path) -> Path:
    """Sequences that fit per cache: measured beside the planner's prediction."""
    plt = _pyplot()
    names = [row.cache for row in report.rows]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(names)), 4.5))
    xs = range(len(names))
    measured = axes.bar([x - 0.2 for x in xs], [r.sequences for r in report.rows], 0.4, label="measured")
    predicted = [r.predicted_sequences or 0 for r in report.rows]
    planned = axes.bar([x + 0.2 for x in xs], predicted, 0.4, label="planner (0: no model)")
    axes.bar_label(measured, fontsize=7, padding=2)
    axes.bar_label(planned, fontsize=7, padding=2)
    axes.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    axes.set_ylabel("sequences that fit")
    axes.set_title(f"{report.model or 'model'}, KV budget {report.budget_bytes / MB:,.1f} MB", fontsize=10)
    axes.legend(fontsize=8)
    return _save(figure, plt, Path(path))


def write_speed_plots(report: SpeedReport, directory: str | Path) -> list[Path]:
    """memory_vs_context.png and tokens_per_s.png in `directory` (created if missing)."""
    folder = Path(directory)
    return [
        plot_memory_vs_context(report, folder / "memory_vs_context.png"),
        plot_tokens_per_s(report, folder / "tokens_per_s.png"),
    ]


def write_capacity_plots(report: CapacityReport, directory: str | Path) -> list[Path]:
    """capacity.png in `directory` (created if missing)."""
    return [plot_capacity(report, Path(directory) / "capacity.png")]


def plot_running(report: ServeReport, path: str | Path) -> Path:
    """Requests running (top) and KV bytes in use (bottom) over the trace, one line per configuration."""
    plt = _pyplot()
    figure, axes = plt.subplots(2, 1, figsize=(8.0, 6.5), sharex=True)
    for row in report.rows:
        times = [s.t for s in row.samples]
        axes[0].step(times, [s.running for s in row.samples], where="post", label=row.config)
        axes[1].step(times, [s.kv_bytes / MB for s in row.samples], where="post", label=row.config)
    axes[1].axhline(report.config.kv_bytes / MB, color="grey", linestyle="--", linewidth=1, label="KV cap")
    axes[0].set_ylabel("requests running")
    axes[1].set_ylabel("KV MB in use")
    axes[1].set_xlabel("seconds since the trace started")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axes[0].set_title(f"{report.model or 'model'}: {report.config.trace.requests} requests", fontsize=10)
    return _save(figure, plt, Path(path))


def plot_latency_cdf(report: ServeReport, path: str | Path) -> Path:
    """The distribution of time to first token per configuration (the fraction of requests served within t)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7.0, 4.5))
    for row in report.rows:
        ordered = sorted(row.ttfts)
        fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
        axes.step(ordered, fractions, where="post", label=row.config)
    axes.axvline(report.config.slo_ttft_s, color="grey", linestyle="--", linewidth=1, label="TTFT SLO")
    axes.set_xlabel("time to first token (s)")
    axes.set_ylabel("fraction of requests")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, plt, Path(path))


def write_serve_plots(report: ServeReport, directory: str | Path) -> list[Path]:
    """running.png and ttft_cdf.png in `directory` (created if missing)."""
    folder = Path(directory)
    return [plot_running(report, folder / "running.png"), plot_latency_cdf(report, folder / "ttft_cdf.png")]
