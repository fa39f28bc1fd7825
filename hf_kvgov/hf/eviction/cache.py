"""`EvictionCache`: the transformers `Cache` that H2O and StreamingLLM share.

Each layer (`EvictionLayer`) holds per-slot tensors; a slot is one kept token of one (sequence, KV head)::

    K/V            [batch, kv_heads, slots, head_dim]   as the model cached them (after RoPE), in a slot store:
                                                        dense, or codes + per-slot scales (``codec=``)
    positions      long  [batch, kv_heads, slots]         the RoPE position each key was rotated at
    valid          bool  [batch, kv_heads, slots]         False: left padding or an empty filler slot
    scores         float [batch, kv_heads, slots]         accumulated attention mass (policies that rank by it)

Heads keep different tokens, so the layer's attention is the hf_kvgov eviction attention, which applies
this validity itself (see `slot_attention`). A step goes: ``update`` stages kept + new slots in an
`EvictionView` -> the attention reads the view, attends and records the attention facts the policy
``needs`` -> the view commits, and the cache keeps ``policy.select(facts, ...)`` of the slots once they
exceed the budget (key norms, when needed, are taken from the keys then). The first chunk (the prompt,
under generate) is evicted by the cache's policy and every later step by ``decode_policy`` when one is
given: SnapKV at prefill, then H2O during decode, is configuration, not a class. Memory therefore never
exceeds ``budget + q_len`` slots per (sequence, head) during a step and ``budget`` between steps. With a
codec, the step's new tokens are attended in full precision and encoded once at commit; eviction then
gathers codes and scales, never decoding and re-encoding the slots that stay. Each layer may have its own
budget (``layer_budgets``).

transformers' bookkeeping: ``get_seq_length()`` is the absolute number of tokens processed (generate slices
prompts and derives positions from it); ``update`` returns only the new K/V and ``get_mask_sizes(q)`` says
so, ``(q, tokens seen)``, which makes transformers' mask exactly the causal + padding mask of the new tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from hf_kvgov.hf.compat import kv_heads_and_head_dim
from hf_kvgov.hf.eviction.layer import EvictionLayer
from hf_kvgov.hf.eviction.layer_budgets import LayerBudgets, check_layer_budgets
from hf_kvgov.hf.eviction.model_inputs import checked_decoder_config, layer_windows, new_token_positions
from hf_kvgov.hf.eviction.slot_attention import DEFAULT_QUERY_CHUNK
from hf_kvgov.hf.eviction.slot_codecs import CodecSpec, slot_formats
from hf_kvgov.hf.eviction.stats import EvictionStats, layer_stats
from hf_kvgov.hf.eviction.view import ATTENTION_NAME, VIEW_KEY, EvictionView, KeyReader
from hf_kvgov.hf.governed import GovernedCache
from hf_kvgov.policies import EvictionPolicy, FactNeeds, SlotFacts, gather_kept, select_by_priority
from hf_kvgov.policies.budget import BudgetSpec, resolve_budget

PolicyFactory = Callable[[int], EvictionPolicy]


class EvictionCache(GovernedCache):
    """A fixed budget of slots per (sequence, KV head), kept by an eviction policy.

    Use a subclass (`HeavyHitterCache`, `SinkCache`) under ``with hf_kvgov.eviction_attention(model):``.

    Args:
        model: the transformers model the cache serves (an attention-only decoder). Sliding-window layers
            keep at most ``min(budget, window - 1)`` slots, all inside their window: the policy chooses among
            the tokens the next query can still see, so with a budget of at least the window such a layer
            holds exactly what `DynamicCache` holds.
        budget: slots per (sequence, KV head), or a float fraction of the first chunk seen (the prompt).
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
            of the first chunk, like ``budget``. Sliding-window layers still cap theirs at ``window - 1``.
        decode_policy: the policy for every step after the first chunk (None: the same policy throughout).
            Its budget is the layer's; the attention mass is accumulated from the prompt on if it needs it.
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
        layer_budgets: Mapping[int, BudgetSpec] | None = None,
        decode_policy: EvictionPolicy | None = None,
    ) -> None:
        name = type(self).__name__
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
        self._budgets = LayerBudgets(name, budget, self.layer_budgets, len(windows), policy_for, min_budget)
        self._config = config
        self._budget_spec = budget
        self._policy_for = policy_for
        self._min_budget = min_budget
        self._read_keys = read_keys
        self.decode_policy = decode_policy
        self.query_chunk = query_chunk
        self.budget: int | None = budget if isinstance(budget, int) else None
        self.policy: EvictionPolicy | None = policy_for(budget) if isinstance(budget, int) else None
        self._awaiting_attention: int | None = None  # the layer whose staged step attention has not read
        pairs = enumerate(zip(windows, formats, strict=True))
        super().__init__(layers=[EvictionLayer(self, i, window, fmt) for i, (window, fmt) in pairs])

    # ------------------------------------------------------------------ one step

    def _stage(
        self, layer: EvictionLayer, key_states: Tensor, value_states: Tensor, attn_kwargs: dict[str, Any] | None
    ) -> tuple[Tensor, Tensor]:
        """Hand attention the kept + new slots of ``[batch, kv_heads, q_len, head_dim]`` new K/V."""
        attn_kwargs = self._check_attention(attn_kwargs)
        self._check_shapes(layer, key_states)
        if not self._budgets.resolved:
            self._resolve_budget(key_states.shape[2])
        batch, _, q_len, _ = key_states.shape
        new_positions = new_token_positions(
            attn_kwargs.get("position_ids"), batch, q_len, layer.seen, key_states.device
        )
        keys, values, positions, kept_valid = _with_new_slots(layer, key_states, value_states, new_positions)
        policy, needs = self._step_policy(layer, q_len)
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
        )
        attn_kwargs[VIEW_KEY] = view
        self._awaiting_attention = layer.index
        return key_states, value_states

    def _step_policy(self, layer: EvictionLayer, q_len: int) -> tuple[EvictionPolicy, FactNeeds]:
        """The policy that evicts after this step, and the facts to compute for it.

        The mass is kept whenever either policy ranks by it (a decode-time H2O needs the prompt's mass);
        the other facts are computed only for the policy in charge, and only when this step will evict.
        """
        policy, budget = self._budgets.policies[layer.index], self._budgets.budgets[layer.index]
        assert policy is not None and budget is not None
        mass = policy.needs.mass or (self.decode_policy is not None and self.decode_policy.needs.mass)
        if layer.seen and self.decode_policy is not None:
            policy = self.decode_policy
        if layer.slots + q_len <= budget:
            return policy, FactNeeds(mass=mass)
        return policy, FactNeeds(mass, policy.needs.recent_queries, policy.needs.key_norm)

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
    ) -> None:
        """Store the attended slots, then keep the policy's choice once they exceed the layer's budget."""
        budget = self._budgets.budgets[layer.index]
        assert budget is not None
        select = policy.select
        store = layer.slot_format.store(layer.store, keys, values, q_len)
        if layer.window is not None:
            valid = _visible_to_next_queries(positions, valid, q_len, layer.window)
            if budget >= layer.window - 1:  # all the next query can read fits: nothing to choose
                budget, select = layer.window - 1, _newest
        if store.count > budget:
            norms = keys.to(torch.promote_types(keys.dtype, torch.float32)).norm(dim=-1) if key_norm else None
            keep = select(SlotFacts(mass=scores, recent_attention=recent, key_norm=norms), positions, valid, budget)
            store = store.gather(keep)
            positions, valid = gather_kept(positions, keep), gather_kept(valid, keep)
            scores = None if scores is None else gather_kept(scores, keep)
        layer.store, layer.positions, layer.valid, layer.scores = store, positions, valid, scores
        layer.seen += q_len
        self._awaiting_attention = None

    def _resolve_budget(self, first_length: int) -> None:
        if self.policy is None:
            self.budget = resolve_budget(self._budget_spec, first_length, self._min_budget)
            self.policy = self._policy_for(self.budget)
        self._budgets.resolve(first_length)

    # ------------------------------------------------------------------ checks

    def _check_attention(self, attn_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        name = type(self).__name__
        current = self._config._attn_implementation
        if current != ATTENTION_NAME:
            raise RuntimeError(
                f"{name} keeps different tokens in each KV head, so the model must attend with the hf_kvgov "
                f"eviction attention ({ATTENTION_NAME!r}), but it uses {current!r}. Wrap generation in "
                "`with hf_kvgov.eviction_attention(model):`."
            )
        if self._awaiting_attention is not None:
            raise RuntimeError(
                f"{name} handed layer {self._awaiting_attention}'s slots to attention, but attention did not read "
                "them (it saw only the newest tokens). The model must call the attention registered as "
                f"{ATTENTION_NAME!r} for every layer; models routing attention elsewhere cannot use an eviction cache."
            )
        if attn_kwargs is None:
            raise RuntimeError(
                f"{name} needs the model to pass its attention kwargs to cache.update (transformers >= 5 "
                "decoder models do); this model does not, so it cannot use an eviction cache."
            )
        return attn_kwargs

    def _check_shapes(self, layer: EvictionLayer, key_states: Tensor) -> None:
        batch, heads, _, head_dim = key_states.shape
        if (heads, head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"Layer {layer.index} stored K/V with {heads} heads of dim {head_dim}; this cache was built for "
                f"{self.num_kv_heads} KV heads of dim {self.head_dim}."
            )
        if layer.store is not None and layer.store.batch != batch:
            raise ValueError(
                f"{type(self).__name__} holds a batch of {layer.store.batch} sequences but got a batch of {batch}; "
                "call reset() before starting another batch."
            )

    # ------------------------------------------------------------------ generate's bookkeeping

    def crop(self, tokens_to_remove: int) -> None:
        for layer in self.layers:
            if isinstance(layer, EvictionLayer):
                layer.crop(tokens_to_remove)

    def reset(self) -> None:
        """Forget every token; a fractional budget is resolved again on the next first chunk."""
        super().reset()
        self._awaiting_attention = None
        self._budgets.reset()
        if not isinstance(self._budget_spec, int):
            self.budget, self.policy = None, None

    # ------------------------------------------------------------------ accounting

    def stats(self) -> EvictionStats:
        """Tokens seen, tokens kept per layer and KV head, bytes held, codec and each layer's budget."""
        layers = [layer for layer in self.layers if isinstance(layer, EvictionLayer)]
        return layer_stats(layers, self.budget, self.num_kv_heads, self.codec_name, self._layer_caps(layers))

    def _layer_caps(self, layers: list[EvictionLayer]) -> tuple[int | None, ...]:
        """The most slots each layer keeps between steps: its budget, capped at ``window - 1`` in window layers."""
        caps = []
        for layer, budget in zip(layers, self._budgets.budgets, strict=True):
            if budget is not None and layer.window is not None:
                budget = min(budget, layer.window - 1)
            caps.append(budget)
        return tuple(caps)


def _with_new_slots(
    layer: EvictionLayer, key_states: Tensor, value_states: Tensor, new_positions: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Kept slots followed by the new ones: keys, values, positions ``[b, h, kept + q, ...]``, kept validity."""
    batch, heads, q_len, _ = key_states.shape
    positions = new_positions[:, None].expand(batch, heads, q_len)
    if layer.store is None:
        kept_valid = torch.zeros(batch, heads, 0, dtype=torch.bool, device=key_states.device)
        return key_states, value_states, positions, kept_valid
    assert layer.positions is not None and layer.valid is not None
    kept_keys, kept_values = layer.store.read()
    keys = torch.cat((kept_keys, key_states), dim=2)
    values = torch.cat((kept_values, value_states), dim=2)
    return keys, values, torch.cat((layer.positions, positions), dim=2), layer.valid


def _newest(facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
    """The ``budget`` newest valid slots ``[batch, kv_heads, budget]``, with a policy's ``select`` signature."""
    return select_by_priority(positions.to(torch.float64), positions, valid, budget)


def _visible_to_next_queries(positions: Tensor, valid: Tensor, q_len: int, window: int) -> Tensor:
    """``valid`` ``[batch, kv_heads, slots]`` minus the slots that no later query of a window layer can read.

    The next query sits one past this step's newest position ``p``; it reads keys at positions
    ``> p + 1 - window``, and later queries read even fewer of the old ones.
    """
    newest = positions[..., -q_len:].amax(dim=-1, keepdim=True)
    return valid & (positions > newest + 1 - window)
