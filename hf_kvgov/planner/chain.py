"""The governance chain: techniques applied one after another, each step a CacheSetup.

A chain is a comma-separated list of technique names, e.g. ``static,paged,prefix,int8,h2o,spill`` (the
default) or the article's order ``static,paged,prefix,h2o,int8,spill``. Each technique is a registry
entry that turns the previous step's setup into the next one; ``static`` can only come first, and every
other technique works on paged blocks, so it needs ``paged`` before it.

``spill`` moves cold blocks to disk (what `DiskOffloadCache` does). ``recall`` is what hf_kvgov builds for a
policy with ``spill=Disk(path)``: H2O keeps per-head slots in pool blocks (`CacheSetup.eviction_slots`), each
evicted token goes to a disk page once, and ``recall_pages`` pages come back per step into a bounded buffer
(`hf_kvgov.engine.slots.recall`). It needs ``h2o`` before it, and excludes ``spill``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_kvgov.format_defaults import format_defaults
from hf_kvgov.planner.setup import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_H2O_RECENT,
    DEFAULT_RECALL_BUFFER,
    DEFAULT_RECALL_SUMMARY,
    DEFAULT_SPILL_HOT_TOKENS,
    CacheSetup,
)

DEFAULT_CHAIN = ("static", "paged", "prefix", "int8", "h2o", "spill")
DEFAULT_SHARED_FRACTION = 0.5
DEFAULT_H2O_BUDGET = 0.2
# `hf_kvgov.tiers.recall_pages.Recall`'s defaults (a test keeps them equal; the planner imports no torch).
DEFAULT_RECALL_PAGES = 8
DEFAULT_RECALL_PAGE_TOKENS = 16
# What hf_kvgov's eviction caches keep per slot and KV head besides K/V: H2O's fp32 attention mass, and the
# RoPE position (int64) with a validity flag (bool).
SLOT_SCORE_BYTES = 4
SLOT_METADATA_BYTES = 8 + 1


@dataclass(frozen=True)
class ChainOptions:
    """The knob each technique turns (see CacheSetup for their meaning)."""

    max_len: int
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_dtype: str = "fp16"
    shared_fraction: float = DEFAULT_SHARED_FRACTION
    share_group: int | None = None
    h2o_budget: float = DEFAULT_H2O_BUDGET
    h2o_recent: int = DEFAULT_H2O_RECENT
    spill_hot_tokens: int = DEFAULT_SPILL_HOT_TOKENS
    sink_blocks: int = 1
    residual: int = 0
    scale_bytes: int = 2
    group_size: int | None = None
    recall_pages: int = DEFAULT_RECALL_PAGES
    recall_page_tokens: int = DEFAULT_RECALL_PAGE_TOKENS
    recall_summary: str = DEFAULT_RECALL_SUMMARY
    recall_buffer: str = DEFAULT_RECALL_BUFFER
    step_tokens: int = 0

    def __post_init__(self) -> None:
        # Every knob is checked up front, even for techniques the chain leaves out.
        CacheSetup(
            max_len=self.max_len,
            block_size=self.block_size,
            kv_dtype=self.kv_dtype,
            shared_fraction=self.shared_fraction,
            share_group=self.share_group,
            h2o_budget=self.h2o_budget,
            h2o_recent=self.h2o_recent,
            spill_hot_tokens=self.spill_hot_tokens,
            sink_blocks=self.sink_blocks,
            residual=self.residual,
            scale_bytes=self.scale_bytes,
            group_size=self.group_size,
            step_tokens=self.step_tokens,
        )
        # The recall knobs are checked as a recalling setup takes them.
        CacheSetup(
            h2o_budget=self.h2o_budget,
            eviction_slots=True,
            recall_pages=self.recall_pages,
            recall_page_tokens=self.recall_page_tokens,
            recall_summary=self.recall_summary,
            recall_buffer=self.recall_buffer,
        )


@dataclass(frozen=True)
class Technique:
    """One step of the chain: how it is labelled and how it changes the setup before it."""

    name: str
    label: Callable[[ChainOptions], str]
    apply: Callable[[CacheSetup, ChainOptions], CacheSetup]


def _static(_: CacheSetup, o: ChainOptions) -> CacheSetup:
    return CacheSetup(paged=False, max_len=o.max_len, block_size=o.block_size, kv_dtype=o.kv_dtype)


def _paged(s: CacheSetup, o: ChainOptions) -> CacheSetup:
    return dataclasses.replace(s, paged=True, block_size=o.block_size, kv_dtype=o.kv_dtype, step_tokens=o.step_tokens)


def _prefix(s: CacheSetup, o: ChainOptions) -> CacheSetup:
    return dataclasses.replace(s, shared_fraction=o.shared_fraction, share_group=o.share_group)


def _codec(name: str) -> Callable[[CacheSetup, ChainOptions], CacheSetup]:
    def apply(s: CacheSetup, o: ChainOptions) -> CacheSetup:
        return dataclasses.replace(
            s,
            codec=name,
            sink_blocks=o.sink_blocks,
            residual=o.residual,
            scale_bytes=o.scale_bytes,
            group_size=o.group_size,
        )

    return apply


def _h2o(s: CacheSetup, o: ChainOptions) -> CacheSetup:
    return dataclasses.replace(s, h2o_budget=o.h2o_budget, h2o_recent=o.h2o_recent)


def _spill(s: CacheSetup, o: ChainOptions) -> CacheSetup:
    return dataclasses.replace(s, spill_hot_tokens=o.spill_hot_tokens)


def _recall(s: CacheSetup, o: ChainOptions) -> CacheSetup:
    # H2O as hf_kvgov's eviction caches hold it (per-head slots in pool blocks), plus the recall tier.
    return dataclasses.replace(
        s,
        eviction_slots=True,
        h2o_score_bytes=SLOT_SCORE_BYTES,
        h2o_metadata_bytes=SLOT_METADATA_BYTES,
        recall_pages=o.recall_pages,
        recall_page_tokens=o.recall_page_tokens,
        recall_summary=o.recall_summary,
        recall_buffer=o.recall_buffer,
    )


TECHNIQUES: dict[str, Technique] = {
    t.name: t
    for t in (
        Technique("static", lambda o: f"static pre-allocation ({o.max_len:,} tokens)", _static),
        Technique("paged", lambda o: f"paged ({o.block_size}-token blocks)", _paged),
        Technique("prefix", lambda o: f"+ prefix sharing ({o.shared_fraction:.0%} shared)", _prefix),
        Technique("int8", lambda o: "+ int8 (KIVI)", _codec("int8")),
        Technique("int4", lambda o: "+ int4 (KIVI)", _codec("int4")),
        Technique("int2", lambda o: "+ int2 (KIVI)", _codec("int2")),
        Technique("fp8", lambda o: "+ fp8", _codec("fp8")),
        Technique("h2o", lambda o: f"+ H2O {o.h2o_budget:.0%}", _h2o),
        Technique("spill", lambda o: f"+ disk spill (hot {o.spill_hot_tokens:,} tokens)", _spill),
        Technique(
            "recall",
            lambda o: f"+ evicted tokens to disk, {o.recall_pages} pages of {o.recall_page_tokens} recalled per step",
            _recall,
        ),
    )
}
# The chain's codec steps and the bits each seals with (fp8 is an 8-bit format).
CODEC_BITS = {"int8": 8, "int4": 4, "int2": 2, "fp8": 8}


def codec_settings(
    chain: tuple[str, ...],
    head_dim: int,
    residual: int | None = None,
    group_size: int | None = None,
    scale_bytes: int | None = None,
) -> dict[str, Any]:
    """`ChainOptions`' residual, group_size and scale_bytes: as given, else as the built cache fills them in.

    Sealed blocks take `format_defaults` (int2: KIVI's 32-token window and value groups of 32); the slot codes
    of an eviction cache (the chain's ``recall`` step holds H2O's kept tokens as slots) are the bare format.
    """
    bits = next((CODEC_BITS[step] for step in chain if step in CODEC_BITS), 8)
    filled = format_defaults(bits if "recall" not in chain else 8, head_dim)
    given = {"residual": residual, "group_size": group_size, "scale_bytes": scale_bytes}
    return {name: filled[name] if value is None else value for name, value in given.items()}


def parse_chain(spec: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Technique names from 'static,paged,prefix,int8,h2o,spill' (or a sequence), checked for order."""
    names = tuple(n.strip().lower() for n in (spec.split(",") if isinstance(spec, str) else spec) if n.strip())
    unknown = [n for n in names if n not in TECHNIQUES]
    if not names or unknown:
        raise ValueError(
            f"Unknown chain step(s) {unknown or [spec]}; a chain is a comma-separated list of "
            f"{', '.join(TECHNIQUES)}, e.g. '{','.join(DEFAULT_CHAIN)}'."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"The chain {','.join(names)} names a step twice; list each technique once.")
    if "static" in names[1:]:
        raise ValueError("'static' (pre-allocation) can only be the first step of the chain.")
    if len(CODEC_BITS.keys() & set(names)) > 1:
        raise ValueError(
            f"The chain {','.join(names)} has more than one codec; pick one of {', '.join(sorted(CODEC_BITS))}."
        )
    if "recall" in names and ("h2o" not in names or names.index("h2o") > names.index("recall")):
        raise ValueError(f"'recall' brings back what H2O evicted, so 'h2o' must come before it; got {','.join(names)}.")
    if {"recall", "spill"} <= set(names):
        raise ValueError(
            "'spill' moves cold blocks to disk and 'recall' moves H2O's evicted tokens there; an eviction cache "
            f"does one of them, so list one; got {','.join(names)}."
        )
    first_paged = names.index("paged") if "paged" in names else len(names)
    early = [n for n in names[:first_paged] if n != "static"]
    if early:
        raise ValueError(
            f"Chain step(s) {early} work on paged blocks, so 'paged' must come before them; got {','.join(names)}."
        )
    return names


def build_chain(names: tuple[str, ...], options: ChainOptions) -> list[tuple[str, str, CacheSetup]]:
    """(name, label, setup) for each step; every setup is the previous one with one technique added."""
    setup = CacheSetup(max_len=options.max_len, block_size=options.block_size, kv_dtype=options.kv_dtype)
    steps = []
    for name in parse_chain(names):
        technique = TECHNIQUES[name]
        setup = technique.apply(setup, options)
        steps.append((name, technique.label(options), setup))
    return steps
