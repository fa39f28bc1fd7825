"""Rotary position embedding helpers for moving cached keys to new positions (StreamingLLM).

transformers caches keys after RoPE, in the ``rotate_half`` convention (Llama, Qwen, Mistral, Gemma...)::

    rot(k, p) = (k * cos(p * inv_freq) + rotate_half(k) * sin(p * inv_freq)) * attention_scaling

Channel ``i`` pairs with ``i + head_dim/2`` and each pair turns by its angle, so rotations add up
(``rot(rot(k, p), q - p) == rot(k, q)``): a cache keeping a subset of tokens can move a key from ``p`` to ``q``
without the unrotated key, which it never sees. Partial rotary embeddings rotate only the first
``2 * len(inv_freq)`` channels, as these helpers do; interleaved pairs (GPT-J's ``rotate_every_two``) are not handled.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rotate_half(x: Tensor) -> Tensor:
    """``[..., d]`` -> ``[..., d]``: ``(x1, x2) -> (-x2, x1)`` on the two halves of the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, attention_scaling: float = 1.0) -> Tensor:
    """Rotate unrotated ``x`` to absolute ``positions``, as the model's attention does.

    Args:
        x: ``[batch, heads, seq, head_dim]`` queries or keys before RoPE.
        positions: absolute positions, ``[batch, heads, seq]`` or ``[seq]`` (anything broadcastable to
            ``[batch, heads, seq]``).
        inv_freq: ``[rotary_dim / 2]``, the model's ``rotary_emb.inv_freq``.
        attention_scaling: the model's ``rotary_emb.attention_scaling`` (1.0 except for YaRN/LongRoPE).

    Returns:
        ``[batch, heads, seq, head_dim]`` in the dtype of ``x``.
    """
    return _turn(x, positions, inv_freq, attention_scaling)


def rerotate(keys: Tensor, delta: Tensor, inv_freq: Tensor) -> Tensor:
    """Move keys already rotated at some position ``p`` to position ``p + delta``.

    Args:
        keys: ``[batch, kv_heads, slots, head_dim]`` as cached, i.e. after RoPE.
        delta: ``new_pos - old_pos``, ``[batch, kv_heads, slots]`` or ``[slots]`` (anything broadcastable
            to ``[batch, kv_heads, slots]``); integer or float, negative to move keys back.
        inv_freq: ``[rotary_dim / 2]``, the model's ``rotary_emb.inv_freq``.

    Returns:
        ``[batch, kv_heads, slots, head_dim]`` in the dtype of ``keys``, equal to ``apply_rope`` of the
        unrotated keys at ``p + delta`` up to float rounding.

    There is deliberately no ``attention_scaling`` argument: cached keys already carry the model's
    scaling from their first rotation, and a pure rotation keeps it. Re-rotating with the model's own
    ``cos``/``sin`` (which transformers pre-multiplies by ``attention_scaling``) would apply it twice.
    """
    return _turn(keys, delta, inv_freq, 1.0)


def _turn(x: Tensor, amount: Tensor, inv_freq: Tensor, factor: float) -> Tensor:
    """Rotate the first ``2 * len(inv_freq)`` channels of ``x`` by ``amount * inv_freq``, times ``factor``."""
    _check_shapes(x, amount, inv_freq)
    rot_dim = 2 * inv_freq.shape[0]
    dtype = torch.promote_types(x.dtype, torch.float32)
    # Angles in float64: positions past 2**24 (StreamingLLM runs that long) lose whole radians in float32.
    half = amount.to(torch.float64)[..., None] * inv_freq.to(device=x.device, dtype=torch.float64)
    angle = torch.cat((half, half), dim=-1)
    cos = (angle.cos() * factor).to(dtype)
    sin = (angle.sin() * factor).to(dtype)
    rot, rest = x[..., :rot_dim].to(dtype), x[..., rot_dim:]
    turned = (rot * cos + rotate_half(rot) * sin).to(x.dtype)
    return torch.cat((turned, rest), dim=-1) if rest.shape[-1] else turned


def _check_shapes(x: Tensor, amount: Tensor, inv_freq: Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(f"Expected a [batch, heads, seq, head_dim] tensor; got shape {tuple(x.shape)}.")
    if inv_freq.dim() != 1 or not 0 < 2 * inv_freq.shape[0] <= x.shape[-1]:
        raise ValueError(
            f"inv_freq must be 1-D with between 1 and head_dim/2 = {x.shape[-1] // 2} entries; "
            f"got shape {tuple(inv_freq.shape)}."
        )
    target = x.shape[:3]  # `amount` broadcasts to it exactly: each of its trailing dims is 1 or the target's
    if amount.dim() > 3 or any(a not in (1, t) for a, t in zip(reversed(amount.shape), reversed(target), strict=False)):
        raise ValueError(
            f"Positions/deltas of shape {tuple(amount.shape)} do not broadcast to [batch, heads, seq] = "
            f"{tuple(x.shape[:3])}; pass [batch, heads, seq] or [seq]."
        )
