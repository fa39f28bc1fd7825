"""Bytes one sequence of L tokens takes under a CacheSetup, layer kind by layer kind.

A layer holds the blocks of one sequence as *runs* of consecutive blocks::

    full-attention layer, prefix P (whole blocks) shared:   [ shared P tokens | private L-P tokens ]
    sliding layer (window W), L > W:           freed ... [ first block overlapping the window ... tail ]

Every run's blocks are full except its last (the tail). With a codec, the sequence's first
``sink_blocks`` blocks and a partially filled tail stay in full precision, and so do the blocks holding the
newest ``residual`` tokens; every other block is sealed (quantized), as ``QuantizedCache`` does when a block
fills up and leaves the residual window.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.setup import RECALL_SUMMARY_ROWS, CacheSetup
from hf_kvgov.planner.units import KV_DTYPE_BYTES
from hf_kvgov.storage.layer_groups import LayerGroup

# 0.2 * 2045 is 408.99999999999994 in floating point; the caches add the same epsilon before rounding down.
_EPSILON = 1e-9


@dataclass(frozen=True)
class Run:
    """``tokens`` slots in consecutive blocks of one layer; ``at_sink``: the run starts at block 0; ``at_end``:
    it ends at the sequence's newest token (a spilled run ends before it)."""

    tokens: int
    at_sink: bool
    at_end: bool = True


@dataclass(frozen=True)
class SequenceBytes:
    """Bytes of one sequence: its own on the accelerator, its own on disk, and its shared prefix tokens."""

    device: int
    disk: int
    shared_tokens: int


def layer_kinds(geometry: ModelGeometry) -> list[tuple[int, int | None]]:
    """(number of layers, window or None) for the full-attention and the sliding-window layers."""
    kinds = [(geometry.num_full_layers, None), (geometry.num_sliding_layers, geometry.sliding_window)]
    return [(count, window) for count, window in kinds if count]


def layer_setups(geometry: ModelGeometry, setup: CacheSetup) -> list[tuple[int, int | None, CacheSetup]]:
    """(number of layers, window or None, the setup those layers store with), one entry per distinct pair.

    Without ``layer_codecs`` these are `layer_kinds` with ``setup`` itself; with them, a layer given its own
    codec (or full precision) is counted with ``setup`` under that codec.
    """
    if not setup.layer_codecs:
        return [(count, window, setup) for count, window in layer_kinds(geometry)]
    outside = [layer for layer, _ in setup.layer_codecs if layer >= geometry.num_layers]
    if outside:
        raise ValueError(
            f"layer_codecs names layers {outside}, but {geometry.name} has layers 0..{geometry.num_layers - 1}."
        )
    own = dict(setup.layer_codecs)
    sliding = set(geometry.sliding_layers)
    counts: dict[tuple[int | None, str | None], int] = {}
    for layer in range(geometry.num_layers):
        key = (geometry.sliding_window if layer in sliding else None, own.get(layer, setup.codec))
        counts[key] = counts.get(key, 0) + 1
    return [
        (count, window, dataclasses.replace(setup, codec=codec, layer_codecs=()))
        for (window, codec), count in counts.items()
    ]


def held_window(setup: CacheSetup, window: int | None) -> int | None:
    """The window that bounds the blocks a layer holds: None when the cache keeps every token anyway."""
    return window if setup.window_frees or setup.h2o_budget is not None else None


def shared_prefix_tokens(setup: CacheSetup, length: int) -> int:
    """Tokens of a sequence of ``length`` that are a shared prefix: whole blocks only, as the radix tree
    shares full blocks."""
    return math.floor(setup.shared_fraction * length / setup.block_size) * setup.block_size


def run_bytes(run: Run, setup: CacheSetup, head_dim: int) -> int:
    """Bytes of one run for one layer and one KV head (codes and scales)."""
    bs = setup.block_size
    blocks = math.ceil(run.tokens / bs)
    full = setup.full_format.block_bytes(bs, head_dim)
    if setup.codec is None or blocks == 0:
        return blocks * full
    sink = min(setup.sink_blocks, blocks) if run.at_sink else 0
    sealed = max(0, _sealable_blocks(run, setup) - sink)
    return (blocks - sealed) * full + sealed * setup.sealed_format.block_bytes(bs, head_dim)


def _sealable_blocks(run: Run, setup: CacheSetup) -> int:
    """The run's leading blocks that are full and, at the sequence's end, older than the residual window (the
    tail is still being written); the run starts at a block boundary, so counting from it gives the same floor."""
    return (run.tokens - (setup.residual if run.at_end else 0)) // setup.block_size


def first_kept_token(window: int | None, length: int, block_size: int) -> int:
    """The first token a layer of ``window`` (None: full attention) still holds for a sequence of ``length``
    tokens: the library's `LayerGroup.first_kept` for queries from the newest token (at ``length - 1``) on."""
    return LayerGroup((), window).first_kept(length - 1, block_size)


def private_run(setup: CacheSetup, length: int, prefix: int, window: int | None) -> Run:
    """The blocks of one layer that belong to this sequence alone (``prefix`` is a multiple of blocks)."""
    bs = setup.block_size
    # Blocks that lie wholly before the window are freed; the one holding its first token stays.
    start = max(first_kept_token(window, length, bs), prefix) // bs
    return Run(tokens=length - start * bs, at_sink=start == 0)


def apply_h2o(run: Run, setup: CacheSetup, own_tokens: int, window: int | None) -> Run:
    """The run after H2O keeps its budget of slots, as hf_kvgov's eviction caches do.

    The budget is ``h2o_budget`` of the sequence's own tokens (rounded down, never below ``h2o_recent``),
    the same number of slots in every layer; a sliding-window layer keeps at most ``window - 1`` of them,
    the keys its next query can still read.
    """
    if setup.h2o_budget is None:
        return run
    budget = max(math.floor(setup.h2o_budget * own_tokens + _EPSILON), setup.h2o_recent, 1)
    room = run.tokens if window is None else min(run.tokens, window - 1)
    return Run(tokens=min(room, budget), at_sink=run.at_sink, at_end=run.at_end)


def split_spill(run: Run, setup: CacheSetup) -> tuple[Run, Run]:
    """(hot run on the accelerator, cold run on disk), as a spilling cache holds a decoding sequence.

    The cache spills at the start of a step, counting the tokens stored before it: a sequence of L tokens
    (its L-th just written) has moved the full blocks that end before its last ``spill_hot_tokens`` of L - 1,
    except the run's first ``spill_pinned_blocks`` (a sink block every query reads). So the block holding
    token L - 1 - hot stays too, and a run of whole blocks keeps one block more than ceil(hot / block).
    """
    if setup.spill_hot_tokens is None:
        return run, Run(0, False, at_end=False)
    bs = setup.block_size
    pinned = setup.spill_pinned_blocks if run.at_sink else 0
    # Blocks are counted from the run's start: a prefix before it is whole blocks, so the floor is the same.
    cold_blocks = max(0, (run.tokens - 1 - setup.spill_hot_tokens) // bs - pinned)
    if setup.codec is not None:  # only sealed blocks spill: none of the residual window's
        cold_blocks = min(cold_blocks, max(0, _sealable_blocks(run, setup) - pinned))
    hot = Run(tokens=run.tokens - cold_blocks * bs, at_sink=run.at_sink and (cold_blocks == 0 or pinned > 0))
    return hot, Run(tokens=cold_blocks * bs, at_sink=run.at_sink and pinned == 0, at_end=False)


def tree_holds_window(setup: CacheSetup) -> bool:
    """Whether a sliding layer keeps its whole window resident although a disk tier spills: under a prefix tree
    hf_kvgov's block caches publish a sliding layer's prompt blocks as they are computed (they leave the window
    before `publish` runs), and a block the tree holds never spills."""
    return setup.spill_hot_tokens is not None and bool(setup.shared_fraction) and setup.h2o_budget is None


def _static_bytes(geometry: ModelGeometry, setup: CacheSetup) -> int:
    assert setup.max_len is not None
    total = 0
    for count, window in layer_kinds(geometry):
        slots = setup.max_len if window is None else min(setup.max_len, window)
        total += count * geometry.num_kv_heads * setup.full_format.block_bytes(slots, geometry.head_dim)
    return total


def sequence_bytes(geometry: ModelGeometry, setup: CacheSetup, length: int) -> SequenceBytes:
    """Bytes one sequence of ``length`` tokens holds by itself (its shared prefix is not included)."""
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"A sequence length must be a positive int; got {length!r}.")
    if not setup.paged:
        assert setup.max_len is not None
        if length > setup.max_len:
            raise ValueError(f"A sequence of {length} tokens does not fit a static buffer of {setup.max_len}.")
        return SequenceBytes(device=_static_bytes(geometry, setup), disk=0, shared_tokens=0)
    prefix = shared_prefix_tokens(setup, length)
    device = disk = one_layer_disk = buffers = one_layer_buffer = 0
    for count, window, layer_setup in layer_setups(geometry, setup):
        own = _own_layer_bytes(layer_setup, length, prefix, held_window(setup, window), geometry.head_dim)
        layer_device, layer_disk, layer_buffer = own
        device += count * geometry.num_kv_heads * layer_device
        disk += count * geometry.num_kv_heads * layer_disk
        one_layer_disk = max(one_layer_disk, geometry.num_kv_heads * layer_disk)
        buffers += count * geometry.num_kv_heads * layer_buffer
        one_layer_buffer = max(one_layer_buffer, geometry.num_kv_heads * layer_buffer)
    # Recalled pages: every layer's buffer, or one buffer shared by the layers, holding one layer's pages.
    device += one_layer_buffer if setup.recall_buffer == "shared" else buffers
    if setup.eviction_slots:  # a running forecast's statistics, per layer and sequence
        device += geometry.num_layers * setup.query_statistics_bytes
    # A sequence that reads blocks back holds read-ahead rows: one layer of its spilled blocks, up to the cap.
    device += min(setup.spill_buffer_bytes, one_layer_disk)
    return SequenceBytes(device=device, disk=disk, shared_tokens=prefix)


def staging_bytes(geometry: ModelGeometry, setup: CacheSetup, length: int) -> int:
    """Bytes the newest sequence holds at its largest moment beyond its steady state at ``length`` tokens.

    It writes its own tokens (those after a matched prefix) in steps of ``step_tokens``. A step's new blocks are
    in full precision until the step seals them (a codec) or the next spills them (a disk tier), on top of what
    the tokens before it hold: the steady state at the step's start (a disk tier spills at a step's start).
    Counted once, for the sequence being admitted; an eviction setup encodes its slots at once (it stages nothing).
    """
    prefix = shared_prefix_tokens(setup, length)
    if not setup.step_tokens or length <= prefix or not setup.paged or setup.eviction_slots:
        return 0
    bs, head_dim, step = setup.block_size, geometry.head_dim, setup.step_tokens
    total = 0
    for count, window, layer_setup in layer_setups(geometry, setup):
        held = held_window(setup, window)
        full = layer_setup.full_format.block_bytes(bs, head_dim)
        peak = max(
            _device_bytes(layer_setup, start, prefix, held, head_dim)
            + (math.ceil(min(start + step, length) / bs) - math.ceil(start / bs)) * full
            for start in range(prefix, length, step)
        )
        steady = _device_bytes(layer_setup, length, prefix, held, head_dim)
        total += count * geometry.num_kv_heads * max(0, peak - steady)
    return total


def _device_bytes(setup: CacheSetup, length: int, prefix: int, window: int | None, head_dim: int) -> int:
    """Accelerator bytes of one layer and KV head's own tokens in the steady state at ``length`` (0: none yet)."""
    return _own_layer_bytes(setup, length, prefix, window, head_dim)[0] if length > prefix else 0


def _own_layer_bytes(
    setup: CacheSetup, length: int, prefix: int, window: int | None, head_dim: int
) -> tuple[int, int, int]:
    """(accelerator, disk, recall buffer) bytes that one layer and KV head hold for this sequence alone (the
    recall buffer apart: a shared one is counted once per sequence)."""
    visible = private_run(setup, length, prefix, window)
    run = apply_h2o(visible, setup, length - prefix, window)
    if setup.eviction_slots:
        kept = _slot_bytes(setup, run.tokens, head_dim)
        if setup.recall_pages is None:
            return kept, 0, 0
        # What the policy evicted of what later queries can see (a sliding layer's window - 1 at most).
        seen = visible.tokens if window is None else min(visible.tokens, window - 1)
        resident, disk, buffer = recall_bytes(setup, seen - run.tokens, head_dim)
        return kept + resident, disk, buffer
    if window is not None and tree_holds_window(setup):
        hot, cold = run, Run(0, False, at_end=False)
    else:  # a sliding layer's run is its window already: only its older part spills
        hot, cold = split_spill(run, setup)
    device = run_bytes(hot, setup, head_dim)
    if setup.h2o_budget is not None:
        # H2O keeps the attention mass and bookkeeping of every kept slot (spilled ones too) on the accelerator.
        per_slot = setup.h2o_score_bytes + setup.h2o_metadata_bytes
        device += math.ceil(run.tokens / setup.block_size) * setup.block_size * per_slot
    return device, run_bytes(cold, setup, head_dim), 0


# The recall tier's page table keeps this many spare entries (`hf_kvgov.engine.slots.recall.GROWTH_PAGES`).
_RECALL_SPARE_PAGES = 16
_INDEX_BYTES = 8  # int64 positions, handles and counts


def recall_bytes(setup: CacheSetup, evicted: int, head_dim: int) -> tuple[int, int, int]:
    """(resident, disk, buffer) bytes of one layer and KV head's recall tier once ``evicted`` tokens were evicted.

    As the cache holds them after a decode step: nothing before the first eviction; then, resident, one pending
    page (K/V in the model's dtype, positions, its count), one summary (min and max: a token's K/V bytes; a
    centroid: half), handle and newest position per written page and spare table entries; in the recall
    buffer, up to ``recall_pages`` written pages (K/V and positions). On disk: each written page's K/V and
    positions.
    """
    assert setup.recall_pages is not None
    if evicted <= 0:
        return 0, 0, 0
    size = setup.recall_page_tokens
    token = 2 * head_dim * KV_DTYPE_BYTES[setup.kv_dtype] + _INDEX_BYTES  # K, V and position of one token
    written = evicted // size
    pending = size * token + _INDEX_BYTES
    table = _INDEX_BYTES
    if written:
        summary = RECALL_SUMMARY_ROWS[setup.recall_summary] * head_dim * KV_DTYPE_BYTES[setup.kv_dtype]
        table += (written + _RECALL_SPARE_PAGES) * (summary + 2 * _INDEX_BYTES)
    buffer = min(setup.recall_pages, written) * size * token
    return pending + table, written * size * token, buffer


def _slot_bytes(setup: CacheSetup, kept: int, head_dim: int) -> int:
    """Bytes of ``kept`` eviction slots of one layer and KV head: K/V as stored, then mass and bookkeeping.

    In a pool (``block_size`` > 1) the K/V take whole blocks of slot rows; mass and bookkeeping are per slot.
    """
    rows = math.ceil(kept / setup.block_size) * setup.block_size
    return rows * setup.slot_format.slot_bytes(head_dim) + kept * (setup.h2o_score_bytes + setup.h2o_metadata_bytes)


def shared_store_bytes(geometry: ModelGeometry, setup: CacheSetup, prefix: int) -> int:
    """Bytes of one stored copy of a ``prefix``-token shared prefix (on the accelerator, never evicted).

    In a sliding layer only the blocks a hit at ``prefix`` reads (and references) are counted: its window's, from
    the one holding the first token its next query sees; the tree lets go of the older sliding blocks when the
    pool needs room.
    """
    if not setup.paged or prefix == 0:
        return 0
    bs, total = setup.block_size, 0
    for count, kind_window, layer_setup in layer_setups(geometry, setup):
        window = held_window(setup, kind_window)
        first = 0 if window is None else LayerGroup((), window).first_kept(prefix, bs)
        # An eviction cache reads a tree of full-precision blocks (the prefix as computed), whatever its slots.
        stored = dataclasses.replace(layer_setup, codec=None) if setup.eviction_slots else layer_setup
        # The tree's blocks are served sealed (but the sink), the newest ones too (`QuantizedCache`).
        per_head = run_bytes(Run(prefix - first, at_sink=first == 0, at_end=False), stored, geometry.head_dim)
        total += count * geometry.num_kv_heads * per_head
    return total
