"""`EvictionCache`: the transformers `Cache` that H2O and StreamingLLM share.

Each layer (`EvictionLayer`) holds per-slot tensors, a slot being one kept token of one (sequence, KV head). Heads keep
different tokens, so attention runs through the eviction attention (`slot_attention`); `EvictionCache` gives the
layout and how a step is committed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from hf_kvgov.engine.parts import COMPRESS_MODES
from hf_kvgov.engine.slots.budget_basis import BudgetBasis, check_budget_of, fraction_label
from hf_kvgov.engine.slots.forecast_hooks import forecast_hook, forecasts_running, observer_hook
from hf_kvgov.engine.slots.layer_budgets import LayerBudgets, LayerBudgetSpec, check_head_budgets, check_layer_budgets
from hf_kvgov.engine.slots.recall import (
    Recall,
    RecallCounters,
    RecalledSlots,
    RecallStats,
    layer_recalls,
    page_tier_for,
    recall_stats,
)
from hf_kvgov.engine.slots.shared_prefix import SharedPrefix, check_prefix, check_prefix_geometry, match_empty
from hf_kvgov.engine.slots.slot_attention import DEFAULT_QUERY_CHUNK
from hf_kvgov.engine.slots.slot_codecs import CodecSpec, slot_formats
from hf_kvgov.engine.slots.slot_steps import (
    check_attention,
    check_shapes,
    newest,
    visible_to_next_queries,
    with_new_slots,
)
from hf_kvgov.engine.slots.stats import EvictionStats, layer_stats
from hf_kvgov.engine.slots.view import VIEW_KEY, EvictionView, KeyReader
from hf_kvgov.hf.compat import attention_implementation, kv_heads_and_head_dim
from hf_kvgov.hf.eviction.layer import EvictionLayer
from hf_kvgov.hf.eviction.model_inputs import checked_decoder_config, layer_windows, new_token_positions
from hf_kvgov.hf.eviction.pooled_slots import eviction_pool, pooled_homes
from hf_kvgov.hf.eviction.rotary import LayerFrequencies
from hf_kvgov.hf.governed import GovernedCacheBase
from hf_kvgov.policies import EvictionPolicy, FactNeeds, HeadAdaptive, SlotFacts, gather_kept
from hf_kvgov.policies.base import RankingPolicy
from hf_kvgov.policies.budget import BudgetSpec, resolve_budget
from hf_kvgov.policies.pyramid import Pyramid
from hf_kvgov.policies.query_forecast import QueryStatistics
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool

PolicyFactory = Callable[[int], EvictionPolicy]


class EvictionCache(GovernedCacheBase):
    """A fixed budget of slots per (sequence, KV head), kept by an eviction policy.

    Use a subclass (`HeavyHitterCache`, `SinkCache`) under ``with hf_kvgov.eviction_attention(model):``.

    Each layer (`EvictionLayer`) holds per-slot tensors; a slot is one kept token of one (sequence, KV head)::

        K/V            [batch, kv_heads, slots, head_dim]   as cached (after RoPE); dense, or codes + scales
                                                            (``codec=``)
        positions      long  [batch, kv_heads, slots]         the RoPE position each key was rotated at
        valid          bool  [batch, kv_heads, slots]         False: left padding or an empty filler slot
        scores         float [batch, kv_heads, slots]         accumulated attention mass (policies that rank by it)

    Heads keep different tokens, so ``update`` stages a step for the eviction attention (`slot_attention`), whose
    commit keeps ``policy.select(...)`` (``decode_policy`` after the first chunk, if given): at most
    ``budget + q_len`` slots per (sequence, head) in a step, ``budget`` between. ``update`` returns only the new
    K/V and ``get_mask_sizes(q)`` says so, which makes transformers' mask exactly the causal + padding mask of the
    new tokens.

    Args:
        model: the transformers model the cache serves (an attention-only decoder). Sliding-window layers
            keep at most ``min(budget, window - 1)`` slots, all inside their window: the policy chooses among
            the tokens the next query can still see, so with a budget of at least the window such a layer
            holds exactly what `DynamicCache` holds.
        budget: slots per (sequence, KV head), or a float fraction of ``budget_of`` tokens, or of generate's
            prompt when ``budget_of`` is None (see ``budget_basis``: anywhere else an undeclared fraction is
            refused on the first forward).
        policy_for: budget -> the policy that chooses kept slots.
        min_budget: the smallest budget the policy accepts; a fractional budget is raised to it.
        read_keys: optional hook turning stored keys into the keys attention reads.
        query_chunk: queries attended at a time (memory O(query_chunk x slots)).
        codec: how kept slots are stored: None (the model's precision), a codec name ("int8", "int4",
            "fp8" = "fp8_e4m3", "fp8_e5m2") or a `QuantConfig` (its ``full_precision_layers`` keep their
            slots unquantized; ``residual`` and ``sink_blocks`` have no meaning here and must stay default).
            Keys and values are both encoded per slot (why keys are not grouped per channel: see
            ``slot_store``), so eviction gathers codes and scales as it gathers dense slots.
        layer_budgets: per-layer budgets overriding ``budget`` (``{0: 1.0, 5: 128}``): ints, or fractions
            like ``budget``. Sliding-window layers still cap theirs at ``window - 1``. Or ``Pyramid()``:
            the budget, once resolved, split over the evicting layers, more below, the same total.
        head_budgets: ``HeadAdaptive()``: each layer's KV heads share its ``kv_heads x budget`` slots by the
            policy's priority, with a floor per head (AdaKV); None: every head keeps the layer's budget. The
            slots then live in pool blocks, which hold only the slots kept (a cache without ``pool=`` builds
            a private one), so a head that keeps fewer frees real memory. Needs a policy with a
            ``priority`` (every built-in one).
        decode_policy: the policy for every step after the first chunk (None: the same policy throughout).
            Its budget is the layer's; the attention mass is accumulated from the prompt on if it needs it.
        budget_of: the number of tokens fractional budgets are fractions of (the whole text's length for a
            chunked stream); None: generate's prompt.
        compress: "always" (every step evicts down to the budget) or "prefill" (only the first chunk is
            evicted; later steps append, as a cache compressed once at prefill and then decoded in full).
            Sliding-window layers still drop what leaves their window, as `DynamicCache` does.
        pool: a `BlockPool` from `eviction_pool(model, codec=...)`, shared with other eviction caches: the
            kept slots live in its blocks between steps (see ``pooled_slots``), a full pool raises
            `PoolExhausted`, and ``release()`` gives the blocks back; None: the slots are this cache's own
            tensors.
        prefix: a `PrefixCache` over a full-precision pool (`prefix_tree(model)`): `match` takes each row's
            longest cached prefix, which every step attends in full and never evicts, and the budget governs
            the tokens after it (see ``shared_prefix``); None: no sharing.
        namespace: the tree namespace `match` looks in (a tenant salt).
        recall: a `Recall` (spill path, pages recalled per step, page size): evicted tokens are written once
            to disk pages and the pages the queries bound highest are attended beside the kept slots at each
            step (see ``recall``); None: evicted tokens are dropped. Needs keys attended as stored (not a
            cache that re-rotates them, such as `SinkCache`).
    """

    def __init__(
        self,
        model: Any,
        budget: BudgetSpec,
        policy_for: PolicyFactory,
        min_budget: int,
        read_keys: KeyReader | None = None,
        query_chunk: int = DEFAULT_QUERY_CHUNK,
        *,
        codec: CodecSpec = None,
        layer_budgets: LayerBudgetSpec = None,
        head_budgets: HeadAdaptive | None = None,
        decode_policy: EvictionPolicy | None = None,
        budget_of: int | None = None,
        compress: str = "always",
        recall: Recall | None = None,
        pool: BlockPool | None = None,
        prefix: PrefixCache | None = None,
        namespace: str = "",
    ) -> None:
        name = type(self).__name__
        if compress not in COMPRESS_MODES:
            raise ValueError(f"{name}: compress must be one of {COMPRESS_MODES}; got {compress!r}.")
        if decode_policy is not None:
            min_budget = max(min_budget, decode_policy.min_budget)
        config = checked_decoder_config(model, name)
        self.num_kv_heads, self.head_dim = kv_heads_and_head_dim(config)
        if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
            raise ValueError(f"query_chunk must be a positive int number of queries; got {query_chunk!r}.")
        windows = layer_windows(config)
        formats, self.quant = slot_formats(codec, len(windows), self.num_kv_heads, self.head_dim, name)
        self.codec_name: str | None = None if self.quant is None else self.quant.codec_name
        self.layer_budgets = check_layer_budgets(name, layer_budgets, len(windows))
        allocator = layer_budgets if isinstance(layer_budgets, Pyramid) else None
        evicting = [i for i, window in enumerate(windows) if window is None]
        self._budgets = LayerBudgets(
            name, budget, self.layer_budgets, len(windows), policy_for, min_budget, allocator, evicting
        )
        self.budget_of = check_budget_of(name, budget_of, self._budgets.specs)
        self._basis = BudgetBasis(name, fraction_label(budget, self.layer_budgets), self.budget_of)
        self.compress = compress
        self._config = config
        # A policy that forecasts queries turns them with the layers' RoPE; a model without it is refused by
        # the cache that takes such a policy (`PolicyCache`), on construction.
        self._rotary = LayerFrequencies(model, name, "turns queries to the positions to come")
        self._budget_spec = budget
        self._policy_for = policy_for
        self.min_budget = min_budget
        self._read_keys = read_keys
        self.decode_policy = decode_policy
        self.query_chunk = query_chunk
        self.budget: int | None = budget if isinstance(budget, int) else None
        self.policy: EvictionPolicy | None = policy_for(budget) if isinstance(budget, int) else None
        self._awaiting_attention: int | None = None  # the layer whose staged step attention has not read
        self._user_defined = False
        pairs = enumerate(zip(windows, formats, strict=True))
        super().__init__(layers=[EvictionLayer(self, i, window, fmt) for i, (window, fmt) in pairs])
        self.head_budgets = check_head_budgets(name, head_budgets, policy_for, self.min_budget, decode_policy)
        if head_budgets is not None and pool is None:  # ragged heads are stored compactly only in pool blocks
            pool = eviction_pool(model, codec=codec)
        self.pool = pool
        if pool is not None:  # every layer's slots live in the pool's blocks between steps
            homes = pooled_homes(pool, model, windows, formats, self.num_kv_heads, self.head_dim, name)
            for layer, home in zip(self._eviction_layers, homes, strict=True):
                layer.home = home
        self.recall = recall
        self._recall_counters = RecallCounters()
        self._page_tier = None if recall is None else page_tier_for(recall, model, self.head_dim, read_keys, name)
        if self._page_tier is not None and recall is not None:
            indices = [layer.index for layer in self._eviction_layers]
            recalls = layer_recalls(self._page_tier, indices, recall, self._recall_counters, pool)
            for layer, layer_recall in zip(self._eviction_layers, recalls, strict=True):
                layer.recall = layer_recall
        self.prefix = None if prefix is None else check_prefix(prefix, name)
        if self.prefix is not None:
            check_prefix_geometry(self.prefix, windows, self.num_kv_heads, self.head_dim, name)
        if not isinstance(namespace, str):
            raise TypeError(f"{name}: namespace must be a str (a tenant salt); got {namespace!r}.")
        self.namespace = namespace
        self.shared: SharedPrefix | None = None  # the tree's blocks this request matched
        if self.budget_of is not None:
            self._resolve_budget(self.budget_of)

    @property
    def _eviction_layers(self) -> list[EvictionLayer]:
        return [layer for layer in self.layers if isinstance(layer, EvictionLayer)]

    # generate sets this on a cache the caller passes in, before its prefill: the mark `BudgetBasis` reads.
    @property
    def _is_user_defined(self) -> bool:
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._user_defined = value
        if value:
            self._basis.mark_generate()

    # ------------------------------------------------------------------ one step

    def stage(
        self, layer: EvictionLayer, key_states: Tensor, value_states: Tensor, attn_kwargs: dict[str, Any] | None
    ) -> tuple[Tensor, Tensor]:
        """Hand attention the kept + new slots of ``[batch, kv_heads, q_len, head_dim]`` new K/V."""
        attn_kwargs = self._check_attention(attn_kwargs)
        self._check_shapes(layer, key_states)
        batch, _, q_len, _ = key_states.shape
        if layer.index == 0:
            self._check_basis(q_len)
            if self.shared is not None:
                self.shared.expand_to(batch, type(self).__name__)
        new_positions = new_token_positions(
            attn_kwargs.get("position_ids"), batch, q_len, layer.seen, key_states.device
        )
        keys, values, positions, kept_valid = with_new_slots(layer, key_states, value_states, new_positions)
        policy, needs = self._step_policy(layer, q_len)
        wanted = needs.forecast
        forecast = None if wanted is None else forecast_hook(layer, wanted, self._rotary.of(layer.index))
        view = EvictionView(
            keys=keys,
            values=values,
            positions=positions,
            kept_valid=kept_valid,
            scores=layer.scores,
            needs=needs,
            # Keys moved for attention sinks serve full-context layers; a window layer never reaches the sinks.
            read_keys=self._read_keys if layer.window is None else None,
            commit=functools.partial(self._commit, layer, q_len, policy, needs.key_norm),
            chunk=self.query_chunk,
            window=layer.window,
            extra_slots=self._extra_slots_of(layer),
            forecast=forecast,
            observe=observer_hook(layer, self._rotary.of(layer.index)) if self._observes(layer) else None,
        )
        attn_kwargs[VIEW_KEY] = view
        self._awaiting_attention = layer.index
        return key_states, value_states

    def _observes(self, layer: EvictionLayer) -> bool:
        """Whether this step's queries join the layer's running statistics: a policy that may still evict it
        forecasts from them."""
        return not self._appends_only(layer) and forecasts_running(
            (self._budgets.policies[layer.index], self.decode_policy)
        )

    def _extra_slots_of(self, layer: EvictionLayer) -> Any:
        """The view's hook for slots attended beside the kept ones: the shared prefix, recalled pages; or None."""
        if self.shared is None and layer.recall is None:
            return None
        return functools.partial(self._extra_slots, layer)

    def _extra_slots(self, layer: EvictionLayer, query: Tensor, first_query: Tensor) -> RecalledSlots | None:
        shared = [] if self.shared is None or not self.shared.longest else [self.shared.slots(layer.index)]
        recalled = None if layer.recall is None else layer.recall.recalled(query, first_query, layer.window)
        return RecalledSlots.join([*shared, *([] if recalled is None else [recalled])])

    @property
    def budget_spec(self) -> BudgetSpec:
        """The budget as given: slots per (sequence, KV head), or a fraction of the prompt (or of `budget_of`)."""
        return self._budget_spec

    @property
    def keeps_mass(self) -> bool:
        """Whether each kept slot carries its attention mass between steps (a policy ranks by it)."""
        return any(p is not None and p.needs.mass for p in (self._policy_for(self.min_budget), self.decode_policy))

    @property
    def query_statistics_bytes(self) -> int:
        """Bytes of the running query statistics each layer keeps per sequence (0: no policy forecasts from them)."""
        if not forecasts_running((self._policy_for(self.min_budget), self.decode_policy)):
            return 0
        return QueryStatistics.row_bytes(int(self._config.num_attention_heads), self.head_dim)

    @property
    def shared_prefix_tokens(self) -> list[int]:
        """Tokens each row reads from the prefix tree (empty before `match`)."""
        return [] if self.shared is None else self.shared.tokens

    @property
    def shared_prefix_blocks(self) -> list[int]:
        """Pool blocks of the tree each row reads, over every layer group (empty before `match`): with layer
        groups a sliding group's blocks are only those of its window, so the tokens do not say it."""
        return [] if self.shared is None else self.shared.blocks

    def _started(self, layer: EvictionLayer) -> bool:
        """Whether the layer has stored a chunk of its own (the tokens after a matched prefix)."""
        return layer.seen > (0 if self.shared is None else self.shared.longest)

    # ------------------------------------------------------------------ prefix sharing

    def match(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, pad_token_id: int = 0
    ) -> dict[str, Tensor]:
        """Take each row's longest cached prefix from the tree (kept as computed, never evicted); return
        generate's inputs (``input_ids``, ``attention_mask``) laid out around the hits.

        Needs an empty cache built with ``prefix=``; the budget then governs the tokens after the prefix.
        """
        self.shared, inputs = match_empty(self, self.prefix, input_ids, attention_mask, pad_token_id)
        for layer in self._eviction_layers:
            layer.seen = self.shared.longest
        return inputs

    def _step_policy(self, layer: EvictionLayer, q_len: int) -> tuple[EvictionPolicy, FactNeeds]:
        """The policy that evicts after this step, and the facts to compute for it.

        The mass is kept whenever either policy ranks by it (a decode-time H2O needs the prompt's mass);
        the other facts are computed only for the policy in charge, and only when this step will evict.
        """
        policy, budget = self._budgets.policies[layer.index], self._budgets.budgets[layer.index]
        assert policy is not None and budget is not None
        if self._appends_only(layer):  # nothing will be evicted again: no fact is needed any more
            return policy, FactNeeds()
        mass = policy.needs.mass or (self.decode_policy is not None and self.decode_policy.needs.mass)
        if self._started(layer) and self.decode_policy is not None:
            policy = self.decode_policy
        if layer.slots + q_len <= budget:
            return policy, FactNeeds(mass=mass)
        needs = policy.needs
        return policy, FactNeeds(mass, needs.recent_queries, needs.key_norm, needs.forecast)

    def _commit(
        self,
        layer: EvictionLayer,
        q_len: int,
        policy: EvictionPolicy,
        key_norm: bool,
        keys: Tensor,
        values: Tensor,
        positions: Tensor,
        valid: Tensor,
        scores: Tensor | None,
        recent: Tensor | None,
        expected: Tensor | None,
    ) -> None:
        """Store the attended slots, then keep the policy's choice once they exceed the layer's budget."""
        budget = self._budgets.budgets[layer.index]
        assert budget is not None
        if self._appends_only(layer):  # every token stays (a window layer still drops what leaves its window)
            budget = layer.seen + q_len
        chooses = True  # the policy chooses (not a window layer that keeps all its window can see)
        store = layer.slot_format.store(layer.store, keys, values, q_len)
        if layer.window is not None:
            valid = visible_to_next_queries(positions, valid, q_len, layer.window)
            if budget >= layer.window - 1:  # all the next query can read fits: nothing to choose
                budget, chooses = layer.window - 1, False
        if store.count > budget:
            norms = keys.to(torch.promote_types(keys.dtype, torch.float32)).norm(dim=-1) if key_norm else None
            facts = SlotFacts(scores, recent, norms, expected, layer=layer.index)
            if not chooses:
                keep, kept = newest(facts, positions, valid, budget), None
            elif self.head_budgets is not None:
                # `check_head_budgets` made sure at construction that the policies rank: no check per step.
                priority = cast(RankingPolicy, policy).priority(facts, positions, valid, budget)
                keep, kept = self.head_budgets.select(priority, positions, valid, budget)
            else:
                keep, kept = policy.select(facts, positions, valid, budget), None
            if layer.recall is not None:  # what is evicted inside what later queries can see goes to disk
                marked = torch.zeros_like(valid).scatter_(
                    -1, keep, torch.ones_like(keep, dtype=torch.bool) if kept is None else kept
                )
                layer.recall.spill(keys, values, positions, valid & ~marked)
            store = store.gather(keep)
            positions, valid = gather_kept(positions, keep), gather_kept(valid, keep)
            valid = valid if kept is None else valid & kept
            scores = None if scores is None else gather_kept(scores, keep)
        layer.hold(store, positions, valid, scores)
        layer.seen += q_len
        self._awaiting_attention = None

    def _appends_only(self, layer: EvictionLayer) -> bool:
        return self.compress == "prefill" and self._started(layer)

    def _check_basis(self, q_len: int) -> None:
        """Resolve fractional budgets on a fresh cache's first forward; refuse a basis that is wrong."""
        if not self._budgets.resolved:
            self._resolve_budget(self._basis.length(q_len))
        elif self.budget_of is None:
            self._basis.check_step(q_len)

    def _resolve_budget(self, first_length: int) -> None:
        if self.policy is None:
            self.budget = resolve_budget(self._budget_spec, first_length, self.min_budget)
            self.policy = self._policy_for(self.budget)
        self._budgets.resolve(first_length)

    # ------------------------------------------------------------------ checks

    def _check_attention(self, attn_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        return check_attention(
            type(self).__name__, attention_implementation(self._config), self._awaiting_attention, attn_kwargs
        )

    def _check_shapes(self, layer: EvictionLayer, key_states: Tensor) -> None:
        check_shapes(type(self).__name__, layer, key_states, self.num_kv_heads, self.head_dim)

    # ------------------------------------------------------------------ generate's bookkeeping

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            if isinstance(layer, EvictionLayer):
                layer.crop(tokens_to_remove)

    def reset(self) -> None:
        """Forget every token; a fraction of generate's prompt is resolved again on the next prompt."""
        super().reset()
        if self.shared is not None:
            self.shared.release()
            self.shared = None
        self._recall_counters.reset()
        self._awaiting_attention = None
        self._budgets.reset()
        self._basis.reset()
        if not isinstance(self._budget_spec, int):
            self.budget, self.policy = None, None
        if self.budget_of is not None:
            self._resolve_budget(self.budget_of)

    # ------------------------------------------------------------------ accounting

    def stats(self) -> EvictionStats:
        """Tokens seen, tokens kept per layer and KV head, bytes held (recall's included), codec, each layer's
        budget and, with recall, what it wrote and read."""
        layers = self._eviction_layers
        recall = self.recall_stats()
        return layer_stats(layers, self.budget, self.num_kv_heads, self.codec_name, self._layer_caps(layers), recall)

    def recall_stats(self) -> RecallStats | None:
        """What the recall tier wrote, read and holds (None without recall)."""
        if self._page_tier is None or self.recall is None:
            return None
        tables = [layer.recall for layer in self._eviction_layers if layer.recall is not None]
        return recall_stats(self._page_tier, self._recall_counters, self.recall.pages, tables)

    def release(self) -> None:
        """Forget every token and delete the recall tier's spill file (a later step starts a new one)."""
        self.reset()
        if self._page_tier is not None:
            self._page_tier.close()

    def _layer_caps(self, layers: list[EvictionLayer]) -> tuple[int | None, ...]:
        """The most slots each layer keeps between steps: its budget, capped at ``window - 1`` in window layers."""
        caps = []
        for layer, budget in zip(layers, self._budgets.budgets, strict=True):
            if budget is not None and layer.window is not None:
                budget = min(budget, layer.window - 1)
            caps.append(budget)
        return tuple(caps)
