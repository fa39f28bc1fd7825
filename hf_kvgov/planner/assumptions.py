"""The assumptions behind a plan, in words, so nobody mistakes a modelled figure for a measured one."""

from __future__ import annotations

from hf_kvgov.planner.accounting import tree_holds_window
from hf_kvgov.planner.planner import Plan
from hf_kvgov.planner.units import KV_DTYPE_BYTES, format_bytes
from hf_kvgov.storage.layer_groups import layer_groups

_SUMMARY_WORDS = {"centroid": "mean key", "bounds": "key range (min and max)"}  # what a page leaves resident
_BUFFER_WORDS = {"layer": "each layer's buffer", "shared": "one buffer the layers share (one layer's pages)"}

# Sequential read bandwidth of a PCIe 4.0 NVMe SSD, used to price reading spilled KV back.
DEFAULT_SSD_READ_BYTES_PER_S = 7e9

# scale_bytes -> how the assumptions name a codec's scale (an integer codec's zero point is stored alike, or
# as one e4m3 byte beside a one-byte scale; fp8 keys' zero point is one e4m3 byte whatever the scale).
_SCALE_WORDS = {2: "an fp16 scale", 4: "an fp32 scale", 1: "a one-byte logarithmic scale"}


def _geometry_lines(plan: Plan) -> list[str]:
    g, o = plan.inputs.geometry, plan.options
    element = KV_DTYPE_BYTES[o.kv_dtype]
    lines = [
        f"KV bytes per token = 2 (K and V) x {g.num_layers} layers x {g.num_kv_heads} KV heads x "
        f"{g.head_dim} x {element} B ({o.kv_dtype}) = {g.kv_bytes_per_token(o.kv_dtype):,} B."
    ]
    if g.sliding_window is not None:
        lines.append(
            f"{g.num_sliding_layers} of {g.num_layers} layers attend in a {g.sliding_window:,}-token window: "
            "they keep only the blocks that overlap a sequence's last window (a static buffer: "
            "min(max_len, window))."
        )
    return lines


def _positions(plan: Plan) -> int:
    """Layers per block of the pool (all layers, or one layer group's): the distinct tensors of keys, or values."""
    return len(layer_groups(plan.inputs.geometry.layer_windows())[0].layers)


def _length_lines(plan: Plan) -> list[str]:
    lengths, g = plan.inputs.lengths, plan.inputs.geometry
    lines = []
    if len(set(lengths.lengths)) > 1:
        lines.append(
            "Concurrency uses the mean bytes per sequence over the length distribution: a steady-state "
            "average; a burst of long sequences needs more."
        )
    if lengths.max > g.max_position_embeddings:
        lines.append(
            f"Some sequences ({lengths.max:,} tokens) are longer than {g.name}'s trained context "
            f"({g.max_position_embeddings:,}); only a sink/window cache runs that far with sane output."
        )
    return lines


def _step_lines(plan: Plan, ssd_bytes_per_s: float) -> list[str]:
    o, names = plan.options, {s.name for s in plan.steps}
    lines = []
    if "static" in names:
        lines.append(f"Static pre-allocation reserves max_len = {o.max_len:,} tokens for every sequence, used or not.")
    if "paged" in names:
        lines.append(
            f"Paged: a sequence of L tokens holds ceil(L / {o.block_size}) blocks per layer; block tables "
            "and pool metadata (a few bytes per block) are not counted. A pool that grows (not preallocated) "
            "copies its tensors one at a time, so while it resizes it also holds one old tensor (one layer "
            f"position's keys or values): leave 1/{2 * _positions(plan)} of its size free beside it."
        )
    if "prefix" in names:
        who = "all concurrent sequences" if o.share_group is None else f"groups of {o.share_group} sequences"
        lines.append(
            f"Prefix sharing: {o.shared_fraction:.0%} of each sequence's tokens (rounded down to whole "
            f"blocks) is a prefix shared by {who}, stored once on the accelerator (sealed blocks quantized "
            "if a codec is on), never evicted by H2O nor spilled. This step's gain depends entirely on "
            "that fraction, which is your workload's, not the library's."
        )
    codec = next((n for n in ("int8", "int4", "int2", "fp8") if n in names), None)
    scale = _SCALE_WORDS[o.scale_bytes]
    statistics = f"{scale} and {'an e4m3' if o.scale_bytes == 1 else 'a'} zero point"
    residual = f", and the blocks holding its newest {o.residual} tokens," if o.residual else ""
    if codec in ("int8", "int4", "int2"):
        lines.append(
            f"{codec}: keys per channel, values per token (KIVI), {statistics} each; each sequence's first "
            f"{o.sink_blocks} block(s){residual} and its partly filled tail block stay in {o.kv_dtype}. Quality "
            "loss is not modelled: measure it on your model (kvgov eval)."
        )
    if codec == "fp8":
        lines.append(
            f"fp8: one byte per element; keys centred per channel ({scale} and an e4m3 zero point), values one "
            f"scale per token and head group; first{residual} and tail blocks stay in full precision. Quality "
            "loss is not modelled."
        )
    if o.step_tokens and (codec is not None or "spill" in names):
        lines.append(
            f"One step of {o.step_tokens:,} tokens (--step-tokens) is written in {o.kv_dtype} before it is sealed or "
            "spilled: the budget keeps room for it once, for the sequence being admitted."
        )
    if "h2o" in names:
        lines.append(
            f"H2O keeps {o.h2o_budget:.0%} of each layer's own tokens (never fewer than the "
            f"{o.h2o_recent} most recent), plus 4 B of attention mass per kept slot and KV head; a shared "
            "prefix is kept whole. The quality cost (the article says ~2%) is not modelled: measure it "
            "(kvgov eval)."
        )
        if plan.inputs.geometry.shared_kv_layers:
            lines.append(
                "This model's layers that reuse earlier layers' K/V need them whole from cache.update, so hf_kvgov's "
                "eviction caches (HeavyHitterCache, PolicyCache, SinkCache) refuse it: the H2O step is what they "
                "would hold. The serving engine's H2O, which keeps whole blocks (kvgov serve --h2o), serves it."
            )
    if "spill" in names:
        lines.extend(_spill_lines(plan, ssd_bytes_per_s))
    if "recall" in names:
        lines.append(
            "Recall: H2O keeps per-head slots in pool blocks (with each slot's position and validity, 9 B per "
            "KV head); every evicted token is written once to a disk page of "
            f"{o.recall_page_tokens} tokens per layer and KV head, whose {_SUMMARY_WORDS[o.recall_summary]} stays "
            f"resident with a pending page in {o.kv_dtype}, and {o.recall_pages} pages per layer come back "
            f"per decode step into {_BUFFER_WORDS[o.recall_buffer]}, counted here. Reads are capped at those pages, "
            "not the whole spilled history."
        )
    return lines


def _spill_lines(plan: Plan, ssd_bytes_per_s: float) -> list[str]:
    step = plan.step("spill")
    lines = [
        f"Spill keeps the blocks of each layer's last {plan.options.spill_hot_tokens:,} tokens on the "
        "accelerator (counted when the step before the newest token spilled, so one block more at a block "
        "boundary) and moves older sealed blocks to disk; read-back staging buffers count in the reserve."
    ]
    if tree_holds_window(step.setup) and plan.inputs.geometry.num_sliding_layers:
        lines.append(
            "With prefix sharing, sliding-window layers spill nothing: their prompt blocks join the prefix tree as "
            "they are computed, and blocks the tree holds stay on the accelerator (the whole window counts)."
        )
    if step.disk_bytes_per_sequence > 0:
        per_step = step.concurrent * step.disk_bytes_per_sequence
        seconds = per_step / ssd_bytes_per_s
        lines.append(
            "Attention still reads every spilled block each decode step: "
            f"{format_bytes(step.disk_bytes_per_sequence)} per sequence, {format_bytes(per_step)} for all "
            f"{step.concurrent:,}, i.e. at least {seconds:.3g} s per generated token at "
            f"{format_bytes(ssd_bytes_per_s)}/s from disk: spill suits batch jobs, not chat."
        )
    else:
        lines.append("No sequence is longer than the hot window, so nothing spills at this step.")
    return lines


def plan_assumptions(plan: Plan, ssd_bytes_per_s: float = DEFAULT_SSD_READ_BYTES_PER_S) -> list[str]:
    """Every assumption the plan's figures rest on, one sentence or two each."""
    budget = plan.inputs.budget
    memory = [
        f"Memory: {budget.describe()}. The {budget.reserve_fraction:.0%} reserve stands for activations, "
        "the CUDA context, library workspaces and fragmentation (--reserve)."
    ]
    return _geometry_lines(plan) + memory + _length_lines(plan) + _step_lines(plan, ssd_bytes_per_s)
