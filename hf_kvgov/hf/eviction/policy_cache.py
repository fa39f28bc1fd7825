"""`PolicyCache`: any eviction policy (SnapKV, TOVA, key-norm, H2O, sinks...) on a fixed KV budget."""

from __future__ import annotations

from typing import Any

from hf_kvgov.engine.parts import ChainParts, Disk, Evict, allocation_of, budget_overrides
from hf_kvgov.engine.slots.layer_budgets import LayerBudgetSpec
from hf_kvgov.engine.slots.recall import Recall
from hf_kvgov.engine.slots.slot_attention import DEFAULT_QUERY_CHUNK
from hf_kvgov.engine.slots.slot_codecs import CodecSpec
from hf_kvgov.hf.eviction.cache import EvictionCache
from hf_kvgov.policies import EvictionPolicy, HeadAdaptive, available_policies, make_policy
from hf_kvgov.policies.budget import BudgetSpec, check_budget_spec
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool

PolicySpec = EvictionPolicy | str

_NAME = "PolicyCache"


class PolicyCache(EvictionCache):
    """Keep ``budget`` slots per (sequence, KV head), chosen by ``policy`` at prefill and ``decode_policy`` after.

    Use it under ``with hf_kvgov.eviction_attention(model):`` (it refuses to run otherwise)::

        cache = PolicyCache(model, SnapKV(window=32), budget=0.2)       # or policy="snapkv", "tova", "key_norm"
        cache = PolicyCache(model, SnapKV(), budget=0.2, decode_policy=H2O(heavy=1.0, recent=32))
        with eviction_attention(model):
            model.generate(**inputs, cache=cache, max_new_tokens=64)

    Args:
        model: the model to serve (an attention-only decoder; sliding-window layers keep only their window).
        policy: a policy object, or a registered name built with its defaults (`hf_kvgov.policies.make_policy`).
            It evicts the first chunk the cache sees: the prompt, under generate.
        budget: slots per (sequence, KV head): an int, or a float fraction of the prompt (or of ``budget_of``),
            raised to what the policies always keep if smaller.
        decode_policy: the policy for every later step (None: ``policy`` throughout), given the same way.
        query_chunk: queries attended at a time; memory O(query_chunk x slots).
        codec: None (slots in the model's precision), "int8", "int4", "fp8" (e4m3), "fp8_e5m2" or a
            `QuantConfig`: kept slots are stored as codes + per-slot scales (see `EvictionCache`).
        layer_budgets: budgets of individual layers, ``{layer: int or fraction}``; the others use ``budget``.
            Or ``Pyramid()``: the budget split over the evicting layers, more below, the same total.
        head_budgets: ``HeadAdaptive()``: each layer's KV heads share its total by the policy's priority
            (AdaKV), the slots stored in pool blocks that hold only what is kept; None: every head keeps the
            budget.
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

    The policies' budget-independent configuration is fixed here, so H2O's parts are given as ints or as
    fractions of the budget inside `HeavyHitter` (use `HeavyHitterCache` for H2O's own defaults). Sinks
    chosen by `SinkWindow` keep their positions here; `SinkCache` is the one that re-rotates them.
    """

    def __init__(
        self,
        model: Any,
        policy: PolicySpec,
        budget: BudgetSpec = 0.2,
        *,
        decode_policy: PolicySpec | None = None,
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
        prefill = _built(policy, "policy")
        decode = None if decode_policy is None else _built(decode_policy, "decode_policy")
        fixed = max(p.min_budget for p in (prefill, decode) if p is not None)
        if isinstance(budget, int) and budget < fixed:
            raise ValueError(
                f"{_NAME}: the policies {prefill!r} and {decode!r} keep at least {fixed} slots per KV head, so "
                f"the budget must be at least {fixed}; got a budget of {budget}."
            )
        super().__init__(
            model,
            budget,
            lambda _budget: prefill,
            min_budget=prefill.min_budget,
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
            decode_policy=decode,
        )
        self.parts = ChainParts.of(
            policy=Evict(
                policy,
                budget,
                decode_policy,
                compress,
                query_chunk,
                budget_of,
                allocation_of(layer_budgets),
                head_budgets,
            ),
            pool=pool,
            prefix=prefix,
            namespace=namespace,
            codec=self.quant,
            spill=None if recall is None else Disk.of_recall(recall),
            layers=budget_overrides(layer_budgets),
        )
        if any(p is not None and p.needs.forecast is not None for p in (prefill, decode)):
            self._rotary.check_keys(model)  # refused now rather than at the first eviction


def _built(spec: PolicySpec, name: str) -> EvictionPolicy:
    """A policy object from a registered name or an object that follows the policy contract."""
    if isinstance(spec, str):
        try:
            return make_policy(spec)
        except ValueError as error:
            if spec not in available_policies():
                raise  # an unknown name, with the accepted ones
            raise ValueError(
                f"{_NAME}: {error} Give {name} as a policy object built with its settings "
                f"(hf_kvgov.policies.make_policy({spec!r}, ...)); HeavyHitterCache and SinkCache size H2O's parts "
                "and a sink window from the budget."
            ) from None
    if not isinstance(spec, EvictionPolicy):
        raise TypeError(
            f"{_NAME}: {name} must be a policy name or an object with needs, min_budget and select "
            f"(see hf_kvgov.policies.base); got {spec!r} of type {type(spec).__name__}."
        )
    return spec
