"""A plan as a text table for the terminal and as a JSON document (exact bytes, no rounding)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hf_kvgov.planner.assumptions import plan_assumptions
from hf_kvgov.planner.planner import Plan, StepResult
from hf_kvgov.planner.scenario import Claim
from hf_kvgov.planner.units import format_bytes, format_ratio

_STEP_HEADER = ("step", "bytes/token", "bytes/seq", "disk/seq", "sequences", "x prev", "x first")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right_from: int = 1) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [c.ljust(w) if i < right_from else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        return "  ".join(cells).rstrip()

    return [line(header), "  ".join("-" * w for w in widths), *map(line, rows)]


def _step_row(step: StepResult) -> list[str]:
    concurrent = f"{step.concurrent:,}" + (" (disk)" if step.limited_by == "disk" else "")
    disk = format_bytes(step.disk_bytes_per_sequence) if step.disk_bytes_per_sequence else "-"
    return [
        step.label,
        format_bytes(step.bytes_per_token),
        format_bytes(step.bytes_per_sequence),
        disk,
        concurrent,
        format_ratio(step.vs_previous),
        format_ratio(step.vs_first),
    ]


def render_plan(plan: Plan, claims: Sequence[Claim] = (), title: str | None = None) -> str:
    """The plan as text: inputs, one row per chain step, the article's claims if any, and assumptions."""
    inputs = plan.inputs
    per_token = inputs.geometry.kv_bytes_per_token(plan.options.kv_dtype)
    lines = [title, ""] if title else []
    lines += [
        f"Model:   {inputs.geometry.describe()}",
        f"KV:      {per_token:,} B ({format_bytes(per_token)}) per token in {plan.options.kv_dtype}; "
        "KV memory = bytes per token x tokens per sequence x concurrent sequences",
        f"Memory:  {inputs.budget.describe()}",
        f"Lengths: {inputs.lengths.summary()}",
        "",
        *_table(_STEP_HEADER, [_step_row(s) for s in plan.steps]),
        "",
        "bytes/seq: accelerator bytes per sequence (a shared prefix spread over the sequences sharing it); "
        "bytes/token: bytes/seq over the mean length; 'x first' compares with the first step.",
    ]
    if claims:
        lines += ["", "The article's claims, checked:", *render_claims(claims)]
    lines += ["", "Assumptions:", *(f"  - {text}" for text in plan_assumptions(plan))]
    return "\n".join(lines)


def render_claims(claims: Sequence[Claim]) -> list[str]:
    rows = [[c.what, c.claimed, c.computed, c.verdict] for c in claims]
    table = _table(("claim", "article", "computed", "verdict"), rows, right_from=1)
    notes = [f"  - {c.what}: {c.verdict}. {c.note}" for c in claims]
    return [*table, "", *notes]


def plan_to_dict(plan: Plan, claims: Sequence[Claim] = ()) -> dict[str, Any]:
    """A JSON-ready dict: inputs, steps (exact floats and ints), claims and assumptions."""
    inputs = plan.inputs
    g = inputs.geometry
    return {
        "model": {**dataclasses.asdict(g), "sliding_layers": list(g.sliding_layers)},
        "kv_bytes_per_token": g.kv_bytes_per_token(plan.options.kv_dtype),
        "memory": {
            "accelerator_bytes": inputs.budget.accelerator_bytes,
            "weight_bytes": inputs.budget.weight_bytes,
            "reserve_bytes": inputs.budget.reserve_bytes,
            "kv_budget_bytes": inputs.budget.kv_bytes,
            "weights": inputs.budget.description,
        },
        "lengths": {
            "description": inputs.lengths.description,
            "count": len(inputs.lengths.lengths),
            "mean": inputs.lengths.mean,
            "median": inputs.lengths.quantile(0.5),
            "p99": inputs.lengths.quantile(0.99),
            "max": inputs.lengths.max,
        },
        "disk_bytes": inputs.disk_bytes,
        "options": dataclasses.asdict(plan.options),
        "steps": [dataclasses.asdict(step) for step in plan.steps],
        "claims": [{**dataclasses.asdict(c), "verdict": c.verdict} for c in claims],
        "assumptions": plan_assumptions(plan),
    }
