"""`EvictionCache`: the transformers `Cache` that H2O, StreamingLLM and every eviction policy share.

The slots, budgets and each step's commit are the engine's `EvictionStore` (`hf_kvgov.engine.slots.eviction_store`);
this class reads the model (its geometry, RoPE, dtype) and puts transformers' `Cache` interface on the store: it
stages each layer's step for the hf_kvgov attention (`slot_attention`) from the model's attention kwargs.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from torch import Tensor

from hf_kvgov.engine.attention_view import VIEW_KEY
from hf_kvgov.engine.slots.eviction_store import EvictionStore, PolicyFactory
from hf_kvgov.engine.slots.layer_budgets import LayerBudgetSpec
from hf_kvgov.engine.slots.pooled_slots import PooledSlotHome
from hf_kvgov.engine.slots.recall import Recall, page_tier_for
from hf_kvgov.engine.slots.slot_attention import DEFAULT_QUERY_CHUNK
from hf_kvgov.engine.slots.slot_codecs import CodecSpec
from hf_kvgov.engine.slots.slot_layer import SlotLayer
from hf_kvgov.engine.slots.slot_steps import check_attention, check_shapes
from hf_kvgov.engine.slots.view import LayerKeyReader
from hf_kvgov.hf.compat import attention_implementation, check_attention_view, kv_heads_and_head_dim
from hf_kvgov.hf.eviction.layer import EvictionLayer
from hf_kvgov.hf.eviction.model_inputs import checked_decoder_config, layer_windows, new_token_positions
from hf_kvgov.hf.eviction.pooled_slots import eviction_pool, pooled_homes
from hf_kvgov.hf.eviction.rotary import LayerFrequencies
from hf_kvgov.hf.governed import GovernedCacheBase
from hf_kvgov.policies import EvictionPolicy, HeadAdaptive
from hf_kvgov.policies.budget import BudgetSpec
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool

__all__ = ["EvictionCache", "PolicyFactory"]


class EvictionCache(GovernedCacheBase, EvictionStore):
    """A fixed budget of slots per (sequence, KV head), kept by an eviction policy.

    Use a subclass (`HeavyHitterCache`, `SinkCache`) under ``with hf_kvgov.eviction_attention(model):``.

    Each layer (`EvictionLayer`) holds per-slot tensors; a slot is one kept token of one (sequence, KV head)::

        K/V            [batch, kv_heads, slots, head_dim]   as cached (after RoPE); dense, or codes + scales
                                                            (``codec=``)
        positions      long  [batch, kv_heads, slots]         the RoPE position each key was rotated at
        valid          bool  [batch, kv_heads, slots]         False: left padding or an empty filler slot
        scores         float [batch, kv_heads, slots]         accumulated attention mass (policies that rank by it)

    Heads keep different tokens, so ``update`` stages a step for the hf_kvgov attention (`slot_attention`), whose
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
        read_keys: optional hook turning a layer's stored keys into the keys attention reads (given the layer's index).
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
        read_keys: LayerKeyReader | None = None,
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
        config = checked_decoder_config(model, name)
        num_kv_heads, head_dim = kv_heads_and_head_dim(config)
        check_attention_view(model, f"an eviction cache ({name})")
        windows = layer_windows(config)
        self._config = config
        # A policy that forecasts queries turns them with the layers' RoPE; a model without it is refused by
        # the cache that takes such a policy (`PolicyCache`), on construction.
        self._rotary = LayerFrequencies(model, name, "turns queries to the positions to come")
        EvictionStore.__init__(
            self, windows, num_kv_heads, head_dim, int(config.num_attention_heads), self._rotary, budget, policy_for,
            min_budget, read_keys, query_chunk, codec=codec, layer_budgets=layer_budgets, head_budgets=head_budgets,
            decode_policy=decode_policy, budget_of=budget_of, compress=compress, recall=recall, prefix=prefix,
            namespace=namespace,
        )  # fmt: skip
        self._awaiting_attention: int | None = None  # the layer whose staged step attention has not read
        self._user_defined = False
        pairs = enumerate(zip(windows, self.formats, strict=True))
        layers = [EvictionLayer(self, i, window, fmt) for i, (window, fmt) in pairs]
        GovernedCacheBase.__init__(self, layers=list(layers))  # a list of the base type (lists are invariant)
        if head_budgets is not None and pool is None:  # ragged heads are stored compactly only in pool blocks
            pool = eviction_pool(model, codec=codec)
        homes = [] if pool is None else pooled_homes(pool, model, windows, self.formats, num_kv_heads, head_dim, name)
        # Last, once every argument is checked: the tier checks (and creates) its spill directory.
        tier = None if recall is None else page_tier_for(recall, model, head_dim, read_keys, name)
        self.attach(layers, pool, homes, tier)  # with a pool, every layer's slots live in its blocks between steps

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A copy by value of the kept slots and the running state, for transformers' prompt reuse (a context
        compressed once, each continuation from ``copy.deepcopy(cache)``). Slots kept in a pool's blocks are copied
        into blocks of the same pool; a prefix tree's matched blocks are held once more. Refused by name with
        recall, whose pages live in the cache's own spill file."""
        if self.recall is not None:
            raise TypeError(
                f"{type(self).__name__} cannot be copied: recall keeps its pages in the cache's own spill file. To "
                "reuse a prompt's K/V across requests, share it through a prefix tree (prefix=prefix_tree(model, "
                "...)): a fresh cache for each request, cache.match(input_ids) before generate, publish after."
            )
        homes = [layer.home for layer in self.slot_layers if isinstance(layer.home, PooledSlotHome)]
        copies: list[PooledSlotHome] = []
        try:
            for home in homes:
                copies.append(home.copy())
        except BaseException:
            for made in copies:
                made.release()
            raise
        memo.update({id(home): made for home, made in zip(homes, copies, strict=True)})
        # The copy draws from the same pool and tree, and reads the model's own config (its attention is switched
        # there) and RoPE frequencies.
        for shared in (self.pool, self.prefix, self._config, self._rotary):
            if shared is not None:
                memo[id(shared)] = shared
        if self.shared is not None:
            memo[id(self.shared)] = self.shared.copy()
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in self.__dict__.items():
            setattr(copied, name, copy.deepcopy(value, memo))
        return copied

    # generate sets this on a cache the caller passes in, before its prefill: the mark `BudgetBasis` reads.
    @property
    def _is_user_defined(self) -> bool:
        return self._user_defined

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self._user_defined = value
        if value:
            self.mark_generate()

    def stage(
        self, layer: EvictionLayer, key_states: Tensor, value_states: Tensor, attn_kwargs: dict[str, Any] | None
    ) -> tuple[Tensor, Tensor]:
        """Hand attention the kept + new slots of ``[batch, kv_heads, q_len, head_dim]`` new K/V."""
        name = type(self).__name__
        check_shapes(name, layer, key_states, self.num_kv_heads, self.head_dim)  # another model's K/V, named first
        attn_kwargs = check_attention(
            name, attention_implementation(self._config), self._awaiting_attention, attn_kwargs
        )
        batch, _, q_len, _ = key_states.shape
        position_ids = attn_kwargs.get("position_ids")
        new_positions = new_token_positions(position_ids, batch, q_len, layer.seen, key_states.device)
        attn_kwargs[VIEW_KEY] = self.view(layer, key_states, value_states, new_positions)
        self._awaiting_attention = layer.index
        return key_states, value_states

    def committed(self, layer: SlotLayer) -> None:
        self._awaiting_attention = None  # attention read the staged step

    # ------------------------------------------------------------------ generate's bookkeeping

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            if isinstance(layer, EvictionLayer):
                layer.crop(tokens_to_remove)

    def reset(self) -> None:
        """Forget every token; a fraction of generate's prompt is resolved again on the next prompt."""
        super().reset()
        self._awaiting_attention = None
        self.forget()

    def release(self) -> None:
        """Forget every token and delete the recall tier's spill file (a later step starts a new one)."""
        self.reset()
        self.close_tier()

    def __del__(self) -> None:
        # A cache dropped without `release` gives a shared pool its blocks back (and the tree its locks).
        with contextlib.suppress(Exception):
            self.release()
