"""The contract every eviction policy follows, and the input checks they share.

A policy is a pure function from per-slot facts to the slots worth keeping, never touching K/V memory: the cache
calls ``select``, then moves its tensors (:func:`hf_kvgov.policies.selection.gather_kept`), so a policy never depends
on how a cache stores its slots. `FactNeeds` lists the facts, `EvictionPolicy.select` the arguments and result.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from hf_kvgov.policies.query_forecast import QueryForecast


@dataclass(frozen=True)
class FactNeeds:
    """Which per-slot facts a policy reads; the cache computes nothing else.

    The facts: ``mass`` (attention over every query so far), ``recent_attention`` (of the step's last
    ``recent_queries`` queries; in decode, the one new query), ``key_norm`` (as cached: RoPE preserves norms)
    and ``expected_attention`` (:mod:`hf_kvgov.policies.query_forecast`). Attention facts are summed over the
    query heads sharing a KV head, so GQA groups rank as one.

    Args:
        mass: accumulated attention mass, kept per slot across steps.
        recent_queries: how many of the step's last queries ``recent_attention`` sums (0: not needed).
        key_norm: the L2 norm of each slot's key.
        forecast: how to estimate the queries to come for ``expected_attention`` (None: not needed).
    """

    mass: bool = False
    recent_queries: int = 0
    key_norm: bool = False
    forecast: QueryForecast | None = None

    def __post_init__(self) -> None:
        check_count("FactNeeds", "recent_queries", self.recent_queries)
        if self.forecast is not None and not isinstance(self.forecast, QueryForecast):
            raise TypeError(f"FactNeeds.forecast must be a QueryForecast or None; got {self.forecast!r}.")


@dataclass(frozen=True)
class SlotFacts:
    """The per-slot facts of one eviction, each float ``[batch, kv_heads, slots]`` or None if not computed."""

    mass: Tensor | None = None
    recent_attention: Tensor | None = None
    key_norm: Tensor | None = None
    expected_attention: Tensor | None = None
    layer: int | None = None  # the decoder layer evicting (not a fact): for scores given per layer beforehand

    def require(self, name: str, owner: str) -> Tensor:
        """The fact ``name``; raises ``ValueError`` naming ``owner`` when the cache did not compute it."""
        fact = getattr(self, name)
        if fact is None:
            raise ValueError(
                f"{owner} ranks slots by {name}, so facts.{name} must be a tensor [batch, kv_heads, slots]; got None."
            )
        return fact


@runtime_checkable
class EvictionPolicy(Protocol):
    """Chooses, per KV head, which stored slots survive an eviction.

    Implementations are frozen dataclasses validated in ``__post_init__``, one per file.
    """

    @property
    def needs(self) -> FactNeeds:
        """The facts ``select`` reads; a cache pays only for these."""
        ...

    @property
    def min_budget(self) -> int:
        """The smallest budget this configuration accepts (its fixed parts: sinks, windows)."""
        ...

    def select(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Return long ``[batch, kv_heads, min(budget, slots)]`` slot indices to keep.

        The arguments and result::

            facts      a SlotFacts: each fact float [batch, kv_heads, slots], None where not needed
            positions  long [batch, kv_heads, slots]: each slot's absolute position; slots may be stored in
                       any order, so a policy ranks by position, never by slot index
            valid      bool [batch, kv_heads, slots]: False for left padding and empty slots, never kept,
                       facts ignored
            budget     int: how many slots each (row, head) may keep
            result     long [batch, kv_heads, min(budget, slots)]: one count for every row and head, so K/V
                       stay one dense tensor; a row short of valid slots gets invalid fillers first (lowest
                       indices, masked by the caller through gather_kept(valid, keep_idx)), then its valid
                       slots in ascending position: left-padded
        """
        ...


@runtime_checkable
class RankingPolicy(EvictionPolicy, Protocol):
    """A policy whose choice is a ranking: it keeps the ``kept`` slots of highest ``priority``.

    Every built-in policy is one, and its ``select`` is `select_by_priority` of its ``priority``. A
    priority says what each slot is worth, with the slots the policy always keeps (sinks, windows) at
    +inf, so that wrappers and budget allocators can rank slots across policies and across heads:
    `WithSinks` adds sinks to one, and `HeadAdaptive` compares the heads of a layer by it.
    """

    def priority(self, facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
        """Float ``[batch, kv_heads, slots]`` priorities for a selection under ``budget`` (arguments as
        `EvictionPolicy.select`)."""
        ...


def ranking_of(policy: object, owner: str) -> RankingPolicy:
    """``policy`` as a `RankingPolicy`; raises ``TypeError`` naming ``owner`` when it has no ``priority``."""
    if not isinstance(policy, RankingPolicy):
        raise TypeError(
            f"{owner} ranks slots by a policy's priority(facts, positions, valid, budget), which {policy!r} "
            "does not have; use a built-in policy (h2o, snapkv, tova, key_norm, mean_mass, expected_attention, "
            "sink) or give yours a priority method."
        )
    return policy


def check_slot_tensors(facts: SlotFacts, positions: Tensor, valid: Tensor) -> None:
    """Raise a ``TypeError``/``ValueError`` unless the per-slot tensors follow `EvictionPolicy.select`'s contract."""
    if not isinstance(facts, SlotFacts):
        raise TypeError(f"facts must be a SlotFacts; got {facts!r} of type {type(facts).__name__}.")
    if positions.dim() != 3:
        raise ValueError(
            "positions must have shape [batch, kv_heads, slots]; "
            f"got a {positions.dim()}-D tensor of shape {tuple(positions.shape)}."
        )
    if positions.dtype != torch.long:
        raise TypeError(f"positions must be a torch.long tensor; got dtype {positions.dtype}.")
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a torch.bool tensor; got dtype {valid.dtype}.")
    if valid.shape != positions.shape:
        raise ValueError(
            f"valid has shape {tuple(valid.shape)} but positions has shape {tuple(positions.shape)}; they must match."
        )
    for field in fields(facts):
        fact = getattr(facts, field.name)
        if fact is None or field.name == "layer":
            continue
        if not fact.is_floating_point():
            raise TypeError(f"facts.{field.name} must be a floating-point tensor; got dtype {fact.dtype}.")
        if fact.shape != positions.shape:
            raise ValueError(
                f"facts.{field.name} has shape {tuple(fact.shape)} but positions has shape "
                f"{tuple(positions.shape)}; they must match."
            )


def check_budget(budget: int) -> None:
    """Raise unless ``budget`` is a positive Python int (bool is rejected: ``True`` is not a budget)."""
    if isinstance(budget, bool) or not isinstance(budget, int):
        raise TypeError(f"budget must be an int number of slots; got {budget!r} of type {type(budget).__name__}.")
    if budget <= 0:
        raise ValueError(f"budget must be a positive number of slots to keep per KV head; got {budget}.")


def check_count(owner: str, name: str, value: object, minimum: int = 0) -> None:
    """Raise unless a config field is an int ``>= minimum`` (used by policies' ``__post_init__``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.{name} must be an int; got {value!r} of type {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be at least {minimum}; got {value}.")


def check_budget_fits(policy: object, budget: int, fixed: int, parts: str) -> None:
    """Raise unless ``budget`` is a valid budget of at least the ``fixed`` slots ``policy`` always keeps."""
    check_budget(budget)
    if budget < fixed:
        raise ValueError(
            f"{policy!r} always keeps {parts}, so the budget must be at least {fixed}; got a budget of {budget}."
        )
