"""A plan as a text table for the terminal and as a JSON document (exact bytes, no rounding)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hf_kvgov.planner.assumptions import plan_assumptions
from hf_kvgov.planner.groups import GroupBytes, KindBytes, group_bytes
from hf_kvgov.planner.lengths import LengthDistribution
from hf_kvgov.planner.planner import Plan, StepResult
from hf_kvgov.planner.scenario import Claim
from hf_kvgov.planner.setup import CacheSetup
from hf_kvgov.planner.units import format_bytes, format_ratio

_STEP_HEADER = ("step", "bytes/token", "bytes/seq", "disk/seq", "sequences", "x prev", "x first")
_GROUP_HEADER = ("kind", "window", "layers", "groups", "tokens/layer", "bytes/token", "bytes/seq", "share")
# A list of at most this many distinct lengths gets one layer-group table per length; others, one at the mean.
_MAX_GROUP_TABLES = 3


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
    lines += render_layer_groups(plan)
    if claims:
        lines += ["", "The article's claims, checked:", *render_claims(claims)]
    lines += ["", "Assumptions:", *(f"  - {text}" for text in plan_assumptions(plan))]
    return "\n".join(lines)


def group_lengths(lengths: LengthDistribution) -> list[tuple[int, str]]:
    """(length, why that length) for each layer-group table: each of a few distinct lengths, else the mean."""
    distinct = sorted(lengths.counts())
    if len(distinct) == 1:
        return [(distinct[0], "the length of every sequence")]
    if len(distinct) <= _MAX_GROUP_TABLES:
        return [(length, f"one of the {len(distinct)} lengths") for length in distinct]
    return [(max(1, round(lengths.mean)), "the mean length")]


def plan_layer_groups(plan: Plan) -> list[tuple[str, GroupBytes]]:
    """(why this length, bytes per kind of layer) under the plan's paged blocks; none without sliding layers."""
    g, o = plan.inputs.geometry, plan.options
    if g.sliding_window is None:
        return []
    setup = CacheSetup(max_len=o.max_len, block_size=o.block_size, kv_dtype=o.kv_dtype)
    return [(why, group_bytes(g, setup, length)) for length, why in group_lengths(plan.inputs.lengths)]


def _kind_row(kind: KindBytes) -> list[str]:
    return [
        "full attention" if kind.window is None else "sliding window",
        "-" if kind.window is None else f"{kind.window:,}",
        f"{kind.layers}",
        f"{kind.groups}",
        f"{kind.tokens:,}",
        format_bytes(kind.bytes_per_token),
        format_bytes(kind.bytes_per_sequence),
        f"{kind.share:.0%}",
    ]


def _group_table(groups: GroupBytes) -> list[str]:
    layers, count = sum(k.layers for k in groups.kinds), sum(k.groups for k in groups.kinds)
    total = groups.bytes_per_sequence
    per_token = format_bytes(total / groups.length)
    total_row = ["total", "", f"{layers}", f"{count}", "", per_token, format_bytes(total), "100%"]
    return _table(_GROUP_HEADER, [*map(_kind_row, groups.kinds), total_row])


def render_layer_groups(plan: Plan) -> list[str]:
    """A table of bytes per kind of layer at each length of `group_lengths`, or nothing without sliding layers."""
    lines: list[str] = []
    for why, groups in plan_layer_groups(plan):
        lines += [
            "",
            f"Layer groups at {groups.length:,} tokens ({why}): groups of {groups.group_size} layers, "
            f"{plan.options.block_size}-token blocks, {plan.options.kv_dtype}",
            *_group_table(groups),
        ]
    if lines:
        lines += [
            "",
            "Layer groups: what each kind of layer holds of one paged sequence at that length, uncompressed (a "
            "sliding layer keeps only the blocks that overlap its last window); at one fixed length the total is "
            "the paged step's bytes/seq.",
        ]
    return lines


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
        "layer_groups": [
            {"at": why, **dataclasses.asdict(groups), "bytes_per_sequence": groups.bytes_per_sequence}
            for why, groups in plan_layer_groups(plan)
        ],
        "claims": [{**dataclasses.asdict(c), "verdict": c.verdict} for c in claims],
        "assumptions": plan_assumptions(plan),
    }
