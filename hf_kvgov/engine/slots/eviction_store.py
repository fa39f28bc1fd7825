"""`EvictionStore`: the slots every layer of an eviction cache keeps, and how each step keeps them (no transformers).

A step hands attention the layer's kept slots followed by the new ones (`view`); attention commits what it read,
and the store keeps the policy's choice within the layer's budget, spilling what recall keeps and gathering the
rest. `hf_kvgov.hf.eviction.cache.EvictionCache` reads the model and puts transformers' `Cache` interface on it,
as `PagedCache` does over the block store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from hf_kvgov.engine.parts import COMPRESS_MODES
from hf_kvgov.engine.slots.budget_basis import BudgetBasis, check_budget_of, fraction_label
from hf_kvgov.engine.slots.forecast_hooks import forecast_hook, forecasts_running, observer_hook
from hf_kvgov.engine.slots.layer_budgets import LayerBudgets, LayerBudgetSpec, check_head_budgets, check_layer_budgets
from hf_kvgov.engine.slots.pooled_slots import PooledSlotHome
from hf_kvgov.engine.slots.recall import (
    Recall,
    RecallCounters,
    RecalledSlots,
    RecallStats,
    layer_recalls,
    recall_stats,
)
from hf_kvgov.engine.slots.shared_prefix import (
    SharedPrefix,
    check_prefix,
    check_prefix_geometry,
    codes_namespace,
    match_rows,
)
from hf_kvgov.engine.slots.slot_codecs import CodecSpec, slot_formats
from hf_kvgov.engine.slots.slot_layer import SlotLayer
from hf_kvgov.engine.slots.slot_steps import newest, visible_to_next_queries, with_new_slots
from hf_kvgov.engine.slots.stats import EvictionStats, layer_stats
from hf_kvgov.engine.slots.view import EvictionView, LayerKeyReader
from hf_kvgov.errors import PoolExhausted
from hf_kvgov.policies import EvictionPolicy, FactNeeds, HeadAdaptive, SlotFacts, gather_kept
from hf_kvgov.policies.base import RankingPolicy
from hf_kvgov.policies.budget import BudgetSpec, resolve_budget
from hf_kvgov.policies.pyramid import Pyramid
from hf_kvgov.policies.query_forecast import QueryStatistics
from hf_kvgov.policies.rope import LayerRope
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.recall_pages import PageTier

PolicyFactory = Callable[[int], EvictionPolicy]


class Frequencies(Protocol):
    """Each layer's RoPE (a policy that forecasts queries turns them with it)."""

    def of(self, layer: int) -> LayerRope: ...


class EvictionStore:
    """A fixed budget of slots per (sequence, KV head), kept by an eviction policy, in every layer.

    Args:
        windows: each layer's sliding window (None: the layer sees the whole context).
        num_kv_heads, head_dim, num_query_heads: the attention geometry.
        frequencies: each layer's RoPE frequencies (asked only by policies that forecast queries).
        budget, policy_for, min_budget, read_keys, query_chunk, codec, layer_budgets, head_budgets,
            decode_policy, budget_of, compress, recall, prefix, namespace: as `EvictionCache`.
    """

    def __init__(
        self,
        windows: Sequence[int | None],
        num_kv_heads: int,
        head_dim: int,
        num_query_heads: int,
        frequencies: Frequencies,
        budget: BudgetSpec,
        policy_for: PolicyFactory,
        min_budget: int,
        read_keys: LayerKeyReader | None,
        query_chunk: int,
        *,
        codec: CodecSpec,
        layer_budgets: LayerBudgetSpec,
        head_budgets: HeadAdaptive | None,
        decode_policy: EvictionPolicy | None,
        budget_of: int | None,
        compress: str,
        recall: Recall | None,
        prefix: PrefixCache | None,
        namespace: str,
    ) -> None:
        owner = type(self).__name__
        if compress not in COMPRESS_MODES:
            raise ValueError(f"{owner}: compress must be one of {COMPRESS_MODES}; got {compress!r}.")
        if isinstance(query_chunk, bool) or not isinstance(query_chunk, int) or query_chunk < 1:
            raise ValueError(f"query_chunk must be a positive int number of queries; got {query_chunk!r}.")
        self.num_kv_heads, self.head_dim, self.num_query_heads = num_kv_heads, head_dim, num_query_heads
        self.formats, self.quant = slot_formats(codec, len(windows), num_kv_heads, head_dim, owner)
        self.codec_name: str | None = None if self.quant is None else self.quant.codec_name
        if decode_policy is not None:
            min_budget = max(min_budget, decode_policy.min_budget)
        self.layer_budgets = check_layer_budgets(owner, layer_budgets, len(windows))
        allocator = layer_budgets if isinstance(layer_budgets, Pyramid) else None
        evicting = [i for i, window in enumerate(windows) if window is None]
        self._budgets = LayerBudgets(
            owner, budget, self.layer_budgets, len(windows), policy_for, min_budget, allocator, evicting
        )
        self.budget_of = check_budget_of(owner, budget_of, self._budgets.specs)
        self._basis = BudgetBasis(owner, fraction_label(budget, self.layer_budgets), self.budget_of)
        self.compress = compress
        self._frequencies = frequencies
        self._budget_spec = budget
        self._policy_for = policy_for
        self.min_budget = min_budget
        self._read_keys = read_keys
        self.decode_policy = decode_policy
        self.query_chunk = query_chunk
        self.budget: int | None = budget if isinstance(budget, int) else None
        self.policy: EvictionPolicy | None = policy_for(budget) if isinstance(budget, int) else None
        self.head_budgets = check_head_budgets(owner, head_budgets, policy_for, self.min_budget, decode_policy)
        self.recall = recall
        self._recall_counters = RecallCounters()
        self._page_tier: PageTier | None = None
        self.prefix = None if prefix is None else check_prefix(prefix, owner)
        if self.prefix is not None:
            check_prefix_geometry(self.prefix, windows, num_kv_heads, head_dim, owner)
        if not isinstance(namespace, str):
            raise TypeError(f"{owner}: namespace must be a str (a tenant salt); got {namespace!r}.")
        self.namespace = namespace
        self.shared: SharedPrefix | None = None  # the tree's blocks this request matched
        self.slot_layers: list[SlotLayer] = []
        self.pool: BlockPool | None = None
        if self.budget_of is not None:
            self._resolve_budget(self.budget_of)

    def attach(
        self,
        layers: Sequence[SlotLayer],
        pool: BlockPool | None,
        homes: Sequence[PooledSlotHome],
        page_tier: PageTier | None = None,
    ) -> None:
        """Take the layers (with their pool homes when the slots live in ``pool``) and, with recall, the tier its
        pages go to (`Recall.tier`), giving each layer its recall."""
        self.slot_layers = list(layers)
        self._page_tier = page_tier
        self.pool = pool
        if homes:
            for layer, home in zip(self.slot_layers, homes, strict=True):
                layer.home = home
        if self._page_tier is not None and self.recall is not None:
            indices = [layer.index for layer in self.slot_layers]
            recalls = layer_recalls(self._page_tier, indices, self.recall, self._recall_counters, pool)
            for layer, layer_recall in zip(self.slot_layers, recalls, strict=True):
                layer.recall = layer_recall

    # ------------------------------------------------------------------ one step

    def view(self, layer: SlotLayer, key_states: Tensor, value_states: Tensor, new_positions: Tensor) -> EvictionView:
        """What attention reads for ``[batch, kv_heads, q_len, head_dim]`` new K/V at ``new_positions``
        ``[batch, q_len]``: the kept slots and the new ones, with the facts the policy in charge needs and the
        commit that keeps its choice."""
        batch, _, q_len, _ = key_states.shape
        if layer.index == 0:
            self._check_basis(q_len)
            if self.shared is not None:
                self.shared.expand_to(batch, type(self).__name__)
        keys, values, positions, kept_valid = with_new_slots(layer, key_states, value_states, new_positions)
        policy, needs = self._step_policy(layer, q_len)
        wanted = needs.forecast
        forecast = None if wanted is None else forecast_hook(layer, wanted, self._frequencies.of(layer.index))
        reader = self._read_keys
        return EvictionView(
            keys=keys,
            values=values,
            positions=positions,
            kept_valid=kept_valid,
            scores=layer.scores,
            needs=needs,
            # Keys moved for attention sinks serve full-context layers; a window layer never reaches the sinks.
            read_keys=None if reader is None or layer.window is not None else functools.partial(reader, layer.index),
            commit=functools.partial(self._commit, layer, q_len, policy, needs.key_norm),
            chunk=self.query_chunk,
            window=layer.window,
            extra_slots=self._extra_slots_of(layer),
            forecast=forecast,
            observe=observer_hook(layer, self._frequencies.of(layer.index)) if self._observes(layer) else None,
        )

    def _observes(self, layer: SlotLayer) -> bool:
        """Whether this step's queries join the layer's running statistics: a policy that may still evict it
        forecasts from them."""
        return not self._appends_only(layer) and forecasts_running(
            (self._budgets.policies[layer.index], self.decode_policy)
        )

    def _extra_slots_of(self, layer: SlotLayer) -> Any:
        """The view's hook for slots attended beside the kept ones: the shared prefix, recalled pages; or None."""
        if self.shared is None and layer.recall is None:
            return None
        return functools.partial(self._extra_slots, layer)

    def _extra_slots(self, layer: SlotLayer, query: Tensor, first_query: Tensor) -> RecalledSlots | None:
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
        return QueryStatistics.row_bytes(self.num_query_heads, self.head_dim)

    @property
    def shared_prefix_tokens(self) -> list[int]:
        """Tokens each row reads from the prefix tree (empty before `match`)."""
        return [] if self.shared is None else self.shared.tokens

    @property
    def shared_prefix_blocks(self) -> list[int]:
        """Pool blocks of the tree each row reads, over every layer group (empty before `match`): with layer
        groups a sliding group's blocks are only those of its window, so the tokens do not say it."""
        return [] if self.shared is None else self.shared.blocks

    def _started(self, layer: SlotLayer) -> bool:
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
        name = type(self).__name__
        if self.prefix is None:
            raise ValueError(f"{name}.match needs a prefix cache: build it with prefix=prefix_tree(model).")
        if any(layer.seen for layer in self.slot_layers) or self.shared_prefix_tokens:
            raise ValueError(f"{name}.match needs an empty cache; call it before generate, or reset() first.")
        namespace = codes_namespace(self.prefix, self.namespace)
        self.shared, inputs = match_rows(self.prefix, input_ids, attention_mask, namespace, pad_token_id)
        for layer in self.slot_layers:
            layer.seen = self.shared.longest
        return inputs

    def _step_policy(self, layer: SlotLayer, q_len: int) -> tuple[EvictionPolicy, FactNeeds]:
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
        layer: SlotLayer,
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
        undo = None  # what puts recall back, when this step spills to it
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
                undo = layer.recall.undo_point()
                marked = torch.zeros_like(valid).scatter_(
                    -1, keep, torch.ones_like(keep, dtype=torch.bool) if kept is None else kept
                )
                layer.recall.spill(keys, values, positions, valid & ~marked)
            store = store.gather(keep)
            positions, valid = gather_kept(positions, keep), gather_kept(valid, keep)
            valid = valid if kept is None else valid & kept
            scores = None if scores is None else gather_kept(scores, keep)
        try:
            layer.hold(store, positions, valid, scores)
        except PoolExhausted:
            if undo is not None:  # the pages this step spilled go too: the pool's count stays what the cache holds
                undo()
            raise
        layer.seen += q_len
        self.committed(layer)

    def committed(self, layer: SlotLayer) -> None:
        """Called once a layer's step is stored (the cache clears its check that attention read the step)."""

    def _appends_only(self, layer: SlotLayer) -> bool:
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

    def mark_generate(self) -> None:
        """Generate's prompt is the basis of fractional budgets (generate marks a cache it is given)."""
        self._basis.mark_generate()

    # ------------------------------------------------------------------ lifetime

    def forget(self) -> None:
        """Forget every token (the layers are cleared by their owner); a fraction of generate's prompt is
        resolved again on the next prompt."""
        if self.shared is not None:
            self.shared.release()
            self.shared = None
        self._recall_counters.reset()
        self._budgets.reset()
        self._basis.reset()
        if not isinstance(self._budget_spec, int):
            self.budget, self.policy = None, None
        if self.budget_of is not None:
            self._resolve_budget(self.budget_of)

    def close_tier(self) -> None:
        """Delete the recall tier's spill file (a later step starts a new one)."""
        if self._page_tier is not None:
            self._page_tier.close()

    # ------------------------------------------------------------------ accounting

    def stats(self) -> EvictionStats:
        """Tokens seen, tokens kept per layer and KV head, bytes held (recall's included), codec, each layer's
        budget and, with recall, what it wrote and read."""
        layers = self.slot_layers
        caps, recall = self._layer_caps(), self.recall_stats()
        return layer_stats(layers, self.budget, self.num_kv_heads, self.codec_name, caps, recall)

    def recall_stats(self) -> RecallStats | None:
        """What the recall tier wrote, read and holds (None without recall)."""
        if self._page_tier is None or self.recall is None:
            return None
        tables = [layer.recall for layer in self.slot_layers if layer.recall is not None]
        return recall_stats(self._page_tier, self._recall_counters, self.recall.pages, tables)

    @property
    def page_tier(self) -> PageTier | None:
        """Recall's pages on disk (None without recall)."""
        return self._page_tier

    def _layer_caps(self) -> tuple[int | None, ...]:
        """The most slots each layer keeps between steps: its budget, capped at ``window - 1`` in window layers."""
        caps = []
        for layer, budget in zip(self.slot_layers, self._budgets.budgets, strict=True):
            if budget is not None and layer.window is not None:
                budget = min(budget, layer.window - 1)
            caps.append(budget)
        return tuple(caps)
