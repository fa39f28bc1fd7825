"""PNG plots of evaluation results, drawn with matplotlib's Agg backend (no display needed).

matplotlib is imported on the first plot only, so the evaluation runs without it when no plots are asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hf_kvgov.evaluation._deps import INSTALL_HINT

# (label, x, y): one point per cache configuration
Point = tuple[str, float, float]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError(
            f"Plots need the package 'matplotlib'; install the evaluation extras with `{INSTALL_HINT}`, "
            "or leave out --plots."
        ) from err
    matplotlib.use("Agg")  # files only: never open a window, work on machines without a display
    import matplotlib.pyplot as plt

    return plt


def _save(figure: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    _pyplot().close(figure)
    return path


def quality_vs_bytes(
    points: Sequence[Point],
    path: Path,
    ylabel: str,
    title: str,
    baselines: Mapping[str, float] | None = None,
) -> Path:
    """A scatter of quality against KV bytes held, each point labelled with its cache; ``baselines`` are
    horizontal dashed lines (results without a cache, such as the sliding-window perplexity)."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, kv_bytes, quality in points:
        axes.scatter([kv_bytes / 2**20], [quality], s=36)
        axes.annotate(label, (kv_bytes / 2**20, quality), textcoords="offset points", xytext=(5, 4), fontsize=8)
    for label, value in (baselines or {}).items():
        axes.axhline(value, linestyle="--", linewidth=1, color="grey", label=label)
    if baselines:
        axes.legend(fontsize=8)
    held = [kv_bytes for _, kv_bytes, _ in points if kv_bytes > 0]
    if held and max(held) > 20 * min(held):  # caches far apart in size: a linear axis would pile up the small ones
        axes.set_xscale("log")
    axes.set_xlabel("KV cache held (MiB)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    return _save(figure, path)


def curves(
    series: Mapping[str, Sequence[tuple[float, float]]],
    path: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    log_x: bool = False,
) -> Path:
    """One line per label through its (x, y) points: loss against position, accuracy against length.

    Lines that coincide (a lossless cache on the full cache) stay visible: each has its own line style and marker,
    drawn thinner and half transparent, so a later one never hides an earlier one.
    """
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    styles, markers = ("-", "--", "-.", ":"), ("o", "s", "^", "v", "D", "x", "+", "*")
    for index, (label, points) in enumerate(series.items()):
        axes.plot(
            [x for x, _ in points],
            [y for _, y in points],
            linestyle=styles[index % len(styles)],
            marker=markers[index % len(markers)],
            markevery=max(1, len(points) // 12),
            markersize=4,
            linewidth=1.2,
            alpha=0.75,
            label=label,
        )
    if log_x:
        axes.set_xscale("log", base=2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)
