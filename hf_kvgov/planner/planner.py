"""How many sequences fit, step by step along the governance chain.

Concurrency at one step, with p the mean bytes a sequence holds by itself on the accelerator, S the bytes
of one stored shared prefix and M the KV budget::

    no sharing:                N = floor(M / p)
    one prefix shared by all:  N = floor((M - S) / p)
    groups of g sharing one:   the largest N with N * p + ceil(N / g) * S <= M

p is a mean over the length distribution: a steady-state average, which a burst of long sequences can
exceed. A static (pre-allocating) cache takes the same bytes for every sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hf_kvgov.planner.accounting import sequence_bytes, shared_prefix_tokens, shared_store_bytes, staging_bytes
from hf_kvgov.planner.chain import ChainOptions, build_chain, parse_chain
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.lengths import LengthDistribution
from hf_kvgov.planner.memory import MemoryBudget
from hf_kvgov.planner.setup import CacheSetup


@dataclass(frozen=True)
class SetupCost:
    """Mean bytes per sequence under one setup, over a length distribution."""

    device: float
    disk: float
    shared_store: int
    staging: int = 0  # one step of the newest sequence beyond its steady state (`staging_bytes`), counted once


@dataclass(frozen=True)
class StepResult:
    """One row of the plan. Bytes are on the accelerator unless named disk; per token = per seq / mean L."""

    name: str
    label: str
    setup: CacheSetup
    bytes_per_token: float
    bytes_per_sequence: float
    disk_bytes_per_sequence: float
    shared_store_bytes: int
    concurrent: int
    vs_previous: float | None
    vs_first: float | None
    limited_by: str


@dataclass(frozen=True)
class PlanInputs:
    """What every step is evaluated against."""

    geometry: ModelGeometry
    budget: MemoryBudget
    lengths: LengthDistribution
    disk_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.disk_bytes is not None and self.disk_bytes <= 0:
            raise ValueError(f"The disk capacity must be positive; got {self.disk_bytes} bytes.")


@dataclass(frozen=True)
class Plan:
    """The whole answer: inputs, one StepResult per chain step, and the chain's knobs."""

    inputs: PlanInputs
    options: ChainOptions
    steps: tuple[StepResult, ...]

    def step(self, name: str) -> StepResult:
        for result in self.steps:
            if result.name == name:
                return result
        raise KeyError(f"The plan has no step {name!r}; its steps are {[s.name for s in self.steps]}.")


def setup_cost(geometry: ModelGeometry, setup: CacheSetup, lengths: LengthDistribution) -> SetupCost:
    """Mean own bytes (accelerator, disk) per sequence, and one shared prefix copy for the longest one."""
    device = disk = 0
    for length, count in lengths.counts().items():
        own = sequence_bytes(geometry, setup, length)
        device += count * own.device
        disk += count * own.disk
    n = len(lengths.lengths)
    # A radix tree holds the union of nested prefixes of one document: the longest one.
    store = shared_store_bytes(geometry, setup, shared_prefix_tokens(setup, lengths.max)) if setup.paged else 0
    staging = staging_bytes(geometry, setup, lengths.max)  # the longest sequence's step: the most it can stage
    return SetupCost(device=device / n, disk=disk / n, shared_store=store, staging=staging)


def _share_groups(n: int, group: int | None) -> int:
    if n == 0:
        return 0
    return 1 if group is None else math.ceil(n / group)


def concurrency(kv_bytes: int, cost: SetupCost, group: int | None) -> int:
    """The most sequences whose own bytes plus their shared prefix copies fit in ``kv_bytes``."""
    if cost.shared_store == 0:
        return math.floor(kv_bytes / cost.device)
    if group is None:
        return max(0, math.floor((kv_bytes - cost.shared_store) / cost.device))
    n = math.floor(kv_bytes / (cost.device + cost.shared_store / group))
    while n > 0 and n * cost.device + _share_groups(n, group) * cost.shared_store > kv_bytes:
        n -= 1  # ceil(n / group) copies can exceed the amortised n / group: step down to what fits
    return n


def evaluate(inputs: PlanInputs, setup: CacheSetup, name: str = "", label: str = "") -> StepResult:
    """One row of the plan for ``setup`` (ratios to other steps left unset)."""
    cost = setup_cost(inputs.geometry, setup, inputs.lengths)
    n, limit = concurrency(max(0, inputs.budget.kv_bytes - cost.staging), cost, setup.share_group), "accelerator"
    if inputs.disk_bytes is not None and cost.disk > 0 and inputs.disk_bytes / cost.disk < n:
        n, limit = math.floor(inputs.disk_bytes / cost.disk), "disk"
    shared = _share_groups(n, setup.share_group) * cost.shared_store / n if n else cost.shared_store
    per_sequence = cost.device + shared
    return StepResult(
        name=name,
        label=label,
        setup=setup,
        bytes_per_token=per_sequence / inputs.lengths.mean,
        bytes_per_sequence=per_sequence,
        disk_bytes_per_sequence=cost.disk,
        shared_store_bytes=cost.shared_store,
        concurrent=n,
        vs_previous=None,
        vs_first=None,
        limited_by=limit,
    )


def _ratio(a: int, b: int) -> float | None:
    return a / b if b else None


def check_lengths(lengths: LengthDistribution, options: ChainOptions, names: tuple[str, ...]) -> None:
    """Raise ValueError if a static buffer of ``max_len`` cannot hold the longest sequence."""
    if "static" in names and lengths.max > options.max_len:
        raise ValueError(
            f"The longest sequence ({lengths.max:,} tokens) is longer than the static buffer of max_len "
            f"{options.max_len:,} tokens (the model's context unless --max-len is given); raise max_len or "
            "drop 'static' from the chain."
        )


def make_plan(inputs: PlanInputs, names: tuple[str, ...] | str, options: ChainOptions) -> Plan:
    """Evaluate every step of the chain ``names`` (see chain.parse_chain) under ``inputs.budget``."""
    chain = build_chain(names if isinstance(names, tuple) else parse_chain(names), options)
    check_lengths(inputs.lengths, options, tuple(name for name, _, _ in chain))
    steps: list[StepResult] = []
    for name, label, setup in chain:
        row = evaluate(inputs, setup, name, label)
        first = steps[0].concurrent if steps else row.concurrent
        previous = _ratio(row.concurrent, steps[-1].concurrent) if steps else None
        steps.append(replace(row, vs_previous=previous, vs_first=_ratio(row.concurrent, first)))
    return Plan(inputs, options, tuple(steps))
