"""A bar chart of concurrent sequences per chain step (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hf_kvgov.planner.planner import Plan
from hf_kvgov.planner.scenario import CLAIMED_USERS
from hf_kvgov.planner.units import format_bytes


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never open a window or need a display
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            f"Writing a plot needs matplotlib, which is not installed ({err}). Install it with "
            "`pip install hf-kvgov[eval]` (or `pip install matplotlib`), or leave out --plot."
        ) from err
    return plt


def plot_plan(plan: Plan, path: str | Path, show_claims: bool = False) -> Path:
    """Write a PNG bar chart of concurrent sequences per step (log scale) to ``path``; returns the path.

    With ``show_claims``, the article's claimed user counts are drawn as markers over their steps.
    """
    plt = _pyplot()
    path = Path(path)
    labels = [step.label for step in plan.steps]
    values = [step.concurrent for step in plan.steps]
    figure, axes = plt.subplots(figsize=(max(6.0, 1.6 * len(labels)), 4.5))
    bars = axes.bar(range(len(values)), values, color="#4C72B0", label="computed")
    axes.bar_label(bars, labels=[f"{v:,}" for v in values], padding=2, fontsize=8)
    if show_claims:
        _draw_claims(axes, [step.name for step in plan.steps])
    axes.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    axes.set_yscale("log" if min(values, default=0) > 0 else "linear")
    axes.set_ylabel("concurrent sequences")
    inputs = plan.inputs
    memory = format_bytes(inputs.budget.accelerator_bytes)
    title = f"{inputs.geometry.name}, {memory}: {inputs.lengths.description}"
    axes.set_title(title, fontsize=10)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, format="png")
    plt.close(figure)
    return path


def _draw_claims(axes: Any, names: Sequence[str]) -> None:
    points = [(i, CLAIMED_USERS[n]) for i, n in enumerate(names) if n in CLAIMED_USERS]
    if points:
        xs, ys = zip(*points, strict=True)
        axes.scatter(xs, ys, marker="D", color="#C44E52", zorder=3, label="article's claim")
