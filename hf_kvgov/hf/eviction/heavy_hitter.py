"""`HeavyHitterCache`: H2O (Zhang et al., 2023) on a fixed KV budget per (sequence, KV head)."""

from __future__ import annotations

from typing import Any

from hf_kvgov.engine.parts import ChainParts, Disk, HeavyHitter, allocation_of, budget_overrides
from hf_kvgov.engine.slots.layer_budgets import LayerBudgetSpec
from hf_kvgov.engine.slots.recall import Recall
from hf_kvgov.engine.slots.slot_attention import DEFAULT_QUERY_CHUNK
from hf_kvgov.engine.slots.slot_codecs import CodecSpec
from hf_kvgov.hf.eviction.cache import EvictionCache
from hf_kvgov.policies import H2O, HeadAdaptive
from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec, fraction_of
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool

_NAME = "HeavyHitterCache"


class HeavyHitterCache(EvictionCache):
    """Keep a recent window plus the tokens that collected the most attention, separately in each KV head.

    Every query's softmax probabilities are added to the mass of the slots it read (summed over the query
    heads that share a KV head); once a (sequence, head) holds more than ``budget`` slots, the slots with the
    least mass outside the recent window go. The prompt is attended in full first, then cut to the budget;
    each decode step then evicts one token per head. Keys keep the positions they were rotated at.

    Use it under ``with hf_kvgov.eviction_attention(model):`` (it refuses to run otherwise)::

        cache = HeavyHitterCache(model, budget=0.2)                 # or codec="int8": kept slots as int8
        with eviction_attention(model):
            model.generate(**inputs, cache=cache, max_new_tokens=64)

    Args:
        model: the model to serve (an attention-only decoder; sliding-window layers keep only their window).
        budget: slots per (sequence, KV head): an int, or a float fraction of generate's prompt (or of
            ``budget_of`` tokens), resolved then and raised to the int parts below if smaller.
        recent: most recent tokens always kept: an int, or a float fraction of the budget (default: half,
            H2O's split).
        heavy: heavy-hitter slots: an int, a float fraction of the budget, or None for the rest of the
            budget. When ``heavy + recent`` is below the budget the recent window takes the difference.
        query_chunk: queries attended at a time; memory for the mass is O(query_chunk x slots).
        codec: None (slots in the model's precision), "int8", "int4", "fp8" (e4m3), "fp8_e5m2" or a
            `QuantConfig`: kept slots are stored as codes + per-slot scales (see `EvictionCache`).
        layer_budgets: budgets of individual layers, ``{layer: int or fraction}``; the others use ``budget``.
            Or ``Pyramid()``: the budget split over the evicting layers, more below, the same total.
        head_budgets: ``HeadAdaptive()``: each layer's KV heads share its total by their mass (AdaKV), the
            slots stored in pool blocks that hold only what is kept; None: every head keeps the budget.
        budget_of: the number of tokens a fractional budget is a fraction of (a stream's whole length);
            None: generate's prompt (a fraction is refused on any other first forward).
        compress: "always" (every step evicts down to the budget) or "prefill" (only the first chunk is
            evicted; later tokens are appended, as after a one-time compression of the prompt).
        recall: a `Recall`: evicted tokens go to disk pages and the pages the queries need are attended
            again (see `hf_kvgov.engine.slots.recall`); None: evicted tokens are dropped.
        pool: a `BlockPool` from `hf_kvgov.eviction_pool(model, codec=...)` shared with other eviction caches:
            the kept slots live in its blocks (a full pool raises `PoolExhausted`); None: the cache's own tensors.
        prefix, namespace: a `PrefixCache` over a full-precision pool and the namespace `match` looks in: a
            matched prefix is attended as computed and never evicted, the budget governs the tokens after it.
    """

    def __init__(
        self,
        model: Any,
        budget: BudgetSpec = 0.2,
        recent: BudgetSpec = 0.5,
        heavy: BudgetSpec | None = None,
        *,
        query_chunk: int = DEFAULT_QUERY_CHUNK,
        codec: CodecSpec = None,
        layer_budgets: LayerBudgetSpec = None,
        head_budgets: HeadAdaptive | None = None,
        budget_of: int | None = None,
        compress: str = "always",
        recall: Recall | None = None,
        pool: BlockPool | None = None,
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        check_budget_spec(_NAME, "budget", budget)
        check_budget_spec(_NAME, "recent", recent, allow_zero=True)
        if heavy is not None:
            check_budget_spec(_NAME, "heavy", heavy, allow_zero=True)
        if isinstance(recent, float) and isinstance(heavy, float) and recent + heavy > 1.0 + 1e-9:
            raise ValueError(
                f"{_NAME}: recent={recent} and heavy={heavy} are fractions of the budget adding up to "
                f"{recent + heavy:g}, more than the whole budget; they may add up to at most 1."
            )
        self.recent = recent
        self.heavy = heavy
        fixed = sum(part for part in (recent, heavy) if isinstance(part, int))
        super().__init__(
            model,
            budget,
            self._policy,
            min_budget=max(fixed, 1),
            query_chunk=query_chunk,
            codec=codec,
            layer_budgets=layer_budgets,
            head_budgets=head_budgets,
            budget_of=budget_of,
            compress=compress,
            recall=recall,
            pool=pool,
            prefix=prefix,
            namespace=namespace,
        )
        policy = HeavyHitter(
            budget, recent, heavy, query_chunk, allocation=allocation_of(layer_budgets), heads=head_budgets
        )
        spill = None if recall is None else Disk.of_recall(recall)
        self.parts = ChainParts.of(
            policy=policy,
            pool=pool,
            prefix=prefix,
            namespace=namespace,
            codec=self.quant,
            spill=spill,
            layers=budget_overrides(layer_budgets),
        )

    def _policy(self, budget: int) -> H2O:
        """The H2O policy for a resolved budget; raises if the recent and heavy parts do not fit in it."""
        recent = fraction_of(self.recent, budget)
        heavy = max(budget - recent, 0) if self.heavy is None else fraction_of(self.heavy, budget)
        if recent + heavy > budget:
            raise ValueError(
                f"{_NAME}(recent={self.recent!r}, heavy={self.heavy!r}) keeps {recent} recent + {heavy} heavy-hitter "
                f"= {recent + heavy} slots, so the budget must be at least {recent + heavy}; got a budget of {budget}."
            )
        return H2O(heavy=heavy, recent=recent)
