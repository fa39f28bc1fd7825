"""What an eviction cache hands to the hf_kvgov attention for one layer and one step.

transformers calls ``cache.update(k, v, layer_idx, kwargs=kwargs)`` and then splats that same ``kwargs`` dict into
the attention call. The cache's ``update`` stages the step (kept + new slots) in an `EvictionView` under
`hf_kvgov.engine.attention_view.VIEW_KEY`; the attention reads it, attends, and calls the view's ``commit`` with
the new tokens' validity and the attention facts the policy needs, which is when the cache stores the step and
evicts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hf_kvgov.engine.slots.slot_attention import DEFAULT_QUERY_CHUNK, attend_slots, new_tokens_valid
from hf_kvgov.policies import FactNeeds

if TYPE_CHECKING:
    from hf_kvgov.engine.slots.recall import RecalledSlots

# commit(keys, values, positions, valid, mass, recent_attention, expected_attention): store the attended
# slots and evict down to the budget; the attention facts are None unless ``needs`` asked for them.
Commit = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None], None]
# forecast(query, query_positions, query_valid, keys, values, valid, scale) -> the expected attention of
# the queries to come to each slot (`hf_kvgov.policies.expected_attention` with the layer's RoPE bound).
Forecast = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, float], Tensor]
# observe(query, query_positions, query_valid): add the step's queries to the layer's running statistics
# (`hf_kvgov.policies.query_forecast.observe_queries`), before the forecast reads them.
QueryObserver = Callable[[Tensor, Tensor, Tensor], None]
# read_keys(keys, positions, valid) -> the keys attention reads (a sink cache re-rotates its sinks there).
KeyReader = Callable[[Tensor, Tensor, Tensor], Tensor]
# The same for any layer, given the layer's index first (what a cache hands its store).
LayerKeyReader = Callable[[int, Tensor, Tensor, Tensor], Tensor]
# extra_slots(query, first_query_positions) -> slots attended beside the kept ones this step (a shared
# prefix, a recall tier's pending and recalled pages), or None.
ExtraSlots = Callable[[Tensor, Tensor], "RecalledSlots | None"]


@dataclass
class EvictionView:
    """One layer's slots for one step.

    ``keys``/``values`` ``[batch, kv_heads, kept + q_len, head_dim]`` (as stored: rotated at each token's
    own position); ``positions`` long ``[batch, kv_heads, kept + q_len]`` (RoPE positions); ``kept_valid``
    bool ``[batch, kv_heads, kept]``; ``scores`` the kept slots' mass or None; ``needs`` the attention
    facts to compute (the mass, and the attention of the last ``recent_queries`` queries); ``read_keys`` an
    optional hook giving the keys attention reads, once the new tokens' validity is known; ``window`` the
    layer's sliding window (None: the layer reads every kept slot); ``extra_slots`` gives slots attended
    before the kept ones and never committed: a shared prefix, recalled pages (None: none); ``forecast``
    estimates the attention of the queries to come when ``needs.forecast`` asks for it (None otherwise);
    ``observe`` adds every step's queries to the layer's running statistics when a policy forecasts from them.
    """

    keys: Tensor
    values: Tensor
    positions: Tensor
    kept_valid: Tensor
    scores: Tensor | None
    needs: FactNeeds
    read_keys: KeyReader | None
    commit: Commit
    chunk: int = DEFAULT_QUERY_CHUNK
    window: int | None = None  # a sliding-window layer's window: kept slots older than it are not read
    extra_slots: ExtraSlots | None = None
    forecast: Forecast | None = None
    observe: QueryObserver | None = None
    consumed: bool = False

    def attend(
        self, query: Tensor, mask: Tensor | None, scale: float, softcap: float | None, sinks: Tensor | None = None
    ) -> Tensor:
        """Attention of ``query`` ``[batch, q_heads, q_len, head_dim]``; returns ``[batch, q_len, q_heads, head_dim]``.

        ``mask`` is the mask transformers built for the new tokens only, bool ``[batch, 1, q_len, q_len]``
        (the cache reports ``get_mask_sizes(q) = (q, tokens seen)``), or None when it is plainly causal.
        """
        if self.consumed:
            raise RuntimeError("An eviction cache's attention view was read twice; each step is attended once.")
        self.consumed = True
        batch, _, q_len, _ = query.shape
        new_mask = _new_token_mask(mask, batch, q_len)
        new_valid = new_tokens_valid(new_mask, batch, q_len, query.device)
        kv_heads = self.kept_valid.shape[1]
        valid = torch.cat((self.kept_valid, new_valid[:, None, :].expand(batch, kv_heads, q_len)), dim=-1)
        keys = self.keys if self.read_keys is None else self.read_keys(self.keys, self.positions, valid)
        values, positions, kept_valid, scores = self.values, self.positions, self.kept_valid, self.scores
        query_positions = self.positions[:, 0, -q_len:]
        if self.observe is not None:
            self.observe(query, query_positions, new_valid)
        expected = None
        if self.forecast is not None:  # of the kept and new slots, before any extra slot joins them
            expected = self.forecast(query, query_positions, new_valid, keys, values, valid, scale)
        first_query = query_positions.amin(dim=-1)
        extra = None if self.extra_slots is None else self.extra_slots(query, first_query)
        if extra is not None:  # extra slots go first, so the new ones stay last as attend_slots expects
            keys, values = torch.cat((extra.keys, keys), dim=2), torch.cat((extra.values, values), dim=2)
            positions = torch.cat((extra.positions, positions), dim=2)
            kept_valid = torch.cat((extra.valid, kept_valid), dim=2)
            scores = None if scores is None else torch.cat((scores.new_zeros(extra.valid.shape), scores), dim=2)
        out, scores, recent = attend_slots(
            query,
            keys,
            values,
            kept_valid,
            new_mask,
            scale,
            softcap=softcap,
            sinks=sinks,
            scores=scores,
            want_scores=self.needs.mass,
            recent_queries=self.needs.recent_queries,
            chunk=self.chunk,
            window=None if self.window is None else (self.window, positions),
        )
        if extra is not None:  # extra slots are attended, not kept: their facts go
            scores = None if scores is None else scores[..., extra.count :]
            recent = None if recent is None else recent[..., extra.count :]
        self.commit(self.keys, self.values, self.positions, valid, scores, recent, expected)
        return out


def _new_token_mask(mask: Tensor | None, batch: int, q_len: int) -> Tensor | None:
    """transformers' ``[batch, 1, q_len, q_len]`` mask (bool or additive float) as bool ``[batch, q_len, q_len]``."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[-2:] != (q_len, q_len) or mask.shape[1] != 1:
        raise ValueError(
            "An eviction cache builds its own attention mask from a 2-D attention_mask; it got a mask of shape "
            f"{tuple(mask.shape)} where [batch, 1, {q_len}, {q_len}] was expected. Pass a 2-D attention_mask "
            "[batch, tokens seen + new tokens] (or none), not a prepared 4-D mask."
        )
    allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    return allowed[:, 0].expand(batch, q_len, q_len)
