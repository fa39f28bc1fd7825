"""The steps of an eviction cache's update that need no cache state: checks and the staged slot tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hf_kvgov.engine.attention_view import ATTENTION_NAME
from hf_kvgov.policies import SlotFacts, select_by_priority

if TYPE_CHECKING:
    from hf_kvgov.engine.slots.slot_layer import SlotLayer


def check_attention(
    name: str, current: str, awaiting: int | None, attn_kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    """``attn_kwargs`` once the model attends with the hf_kvgov attention and read the last staged layer."""
    if current != ATTENTION_NAME:
        raise RuntimeError(
            f"{name} keeps different tokens in each KV head, so the model must attend with the hf_kvgov "
            f"attention ({ATTENTION_NAME!r}), but the model it was built for uses {current!r}. Wrap generation in "
            "`with hf_kvgov.eviction_attention(model):`, with that model (a cache serves the model it was built for)."
        )
    if awaiting is not None:
        raise RuntimeError(
            f"{name} handed layer {awaiting}'s slots to attention, but attention did not read "
            "them (it saw only the newest tokens). The model must call the attention registered as "
            f"{ATTENTION_NAME!r} for every layer; models routing attention elsewhere cannot use an eviction cache."
        )
    if attn_kwargs is None:
        raise RuntimeError(
            f"{name} needs the model to pass its attention kwargs to cache.update (transformers >= 5 "
            "decoder models do); this model does not, so it cannot use an eviction cache."
        )
    return attn_kwargs


def check_shapes(name: str, layer: SlotLayer, key_states: Tensor, kv_heads: int, expected_dim: int) -> None:
    """Refuse new K/V ``[batch, heads, q_len, head_dim]`` of another geometry or batch than the layer's."""
    batch, heads, _, head_dim = key_states.shape
    if (heads, head_dim) != (kv_heads, expected_dim):
        raise ValueError(
            f"Layer {layer.index} stored K/V with {heads} heads of dim {head_dim}; this cache was built for "
            f"{kv_heads} KV heads of dim {expected_dim}."
        )
    if layer.batch and layer.batch != batch:
        raise ValueError(
            f"{name} holds a batch of {layer.batch} sequences but got a batch of {batch}; "
            "call reset() before starting another batch."
        )


def with_new_slots(
    layer: SlotLayer, key_states: Tensor, value_states: Tensor, new_positions: Tensor
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


def newest(facts: SlotFacts, positions: Tensor, valid: Tensor, budget: int) -> Tensor:
    """The ``budget`` newest valid slots ``[batch, kv_heads, budget]``, with a policy's ``select`` signature."""
    return select_by_priority(positions.to(torch.float64), positions, valid, budget)


def visible_to_next_queries(positions: Tensor, valid: Tensor, q_len: int, window: int) -> Tensor:
    """``valid`` ``[batch, kv_heads, slots]`` minus the slots that no later query of a window layer can read.

    The next query sits one past this step's newest position ``p``; it reads keys at positions
    ``> p + 1 - window``, and later queries read even fewer of the old ones.
    """
    newest = positions[..., -q_len:].amax(dim=-1, keepdim=True)
    return valid & (positions > newest + 1 - window)
