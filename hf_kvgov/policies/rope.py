"""Rotary position embedding helpers for moving cached keys to new positions (StreamingLLM).

transformers caches keys after RoPE, in the ``rotate_half`` convention (Llama, Qwen, Mistral, Gemma...)::

    rot(k, p) = (k * cos(p * inv_freq) + rotate_half(k) * sin(p * inv_freq)) * attention_scaling

Channel ``i`` pairs with ``i + head_dim/2`` and each pair turns by its angle, so rotations add up
(``rot(rot(k, p), q - p) == rot(k, q)``): a cache keeping a subset of tokens can move a key from ``p`` to ``q``
without the unrotated key, which it never sees. Partial rotary embeddings rotate only the first
``2 * len(inv_freq)`` channels, as these helpers do. `LayerRope` covers the other layouts a layer's keys come in:
interleaved pairs (Cohere, GLM), and layers without RoPE (zero frequencies: every turn is the identity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LayerRope:
    """How one layer's cached keys carry RoPE.

    Attributes:
        inv_freq: ``[rotary_dim / 2]`` frequencies; all zero for a layer without RoPE (SmolLM3's NoPE layers,
            Cohere2's full-attention layers), which every turn leaves as they are.
        interleaved: channel ``2i`` pairs with ``2i + 1`` (Cohere, GLM) instead of ``i`` with ``i + rotary_dim/2``.
    """

    inv_freq: Tensor
    interleaved: bool = False

    def split_half(self, x: Tensor) -> Tensor:
        """``x`` with its rotary channels reordered into the ``rotate_half`` pairing (``x`` itself when they are).
        Attention scores are the same on both sides of a reordering applied to queries and keys alike."""
        if not self.interleaved:
            return x
        rot = 2 * self.inv_freq.shape[0]
        return torch.cat((x[..., 0:rot:2], x[..., 1:rot:2], x[..., rot:]), dim=-1)

    def interleave(self, x: Tensor) -> Tensor:
        """The inverse of `split_half`."""
        if not self.interleaved:
            return x
        half = self.inv_freq.shape[0]
        pairs = torch.stack((x[..., :half], x[..., half : 2 * half]), dim=-1).flatten(-2)
        return torch.cat((pairs, x[..., 2 * half :]), dim=-1)

    def turn(self, keys: Tensor, delta: Tensor) -> Tensor:
        """`rerotate` in this layer's pairing."""
        return self.interleave(rerotate(self.split_half(keys), delta, self.inv_freq))


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
