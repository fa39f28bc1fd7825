"""The model's RoPE frequencies, for caches that turn keys (sink re-rotation) or queries (expected attention).

Most models hold one ``inv_freq`` buffer on their rotary embedding; models with per-layer-type RoPE
(Gemma-3: a local base for sliding layers, a global one for full layers) hold ``<layer type>_inv_freq``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from hf_kvgov.hf.compat import decoder_config
from hf_kvgov.policies.rope import LayerRope

# RoPE variants whose frequencies change with the sequence length: a key rotated earlier could not be
# moved with today's frequencies.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def rotary_inv_freq(model: Any, owner: str, purpose: str) -> Tensor:
    """The RoPE ``inv_freq`` ``[rotary_dim / 2]`` of the model's full-attention layers.

    Refuses, naming ``owner`` and what it ``purpose``-s with the frequencies, a model without RoPE, one
    whose frequencies depend on the length, and one whose full-attention layers use different RoPEs.
    """
    config = decoder_config(model)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]  # per-layer-type RoPE (Gemma-3)
    rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ValueError(
            f"{owner} {purpose}, which needs RoPE frequencies that do not depend on the length; this model uses "
            f"rope_type={rope_type!r}. Supported: default, linear, llama3, yarn and other static types."
        )
    found = [freq for module in model.modules() if (freq := _inv_freq_of(module, "full_attention")) is not None]
    if not found:
        raise ValueError(
            f"{owner} {purpose} with the model's rotary embedding, but {type(model).__name__} has none "
            "(no module with an inv_freq buffer); it needs a RoPE model."
        )
    if any(freq.shape != found[0].shape or not torch.equal(freq, found[0]) for freq in found[1:]):
        raise ValueError(
            f"{owner} found several different rotary embeddings in {type(model).__name__}; it supports models "
            "whose full-attention layers share one RoPE."
        )
    return found[0].detach().clone()


def layer_inv_freqs(model: Any, owner: str, purpose: str) -> list[Tensor]:
    """Each decoder layer's RoPE ``inv_freq``: its layer type's buffer where the model has one per type."""
    full = rotary_inv_freq(model, owner, purpose)
    config = decoder_config(model)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * int(config.num_hidden_layers))
    by_type: dict[str, Tensor] = {}
    for layer_type in set(types):
        found = [freq for module in model.modules() if (freq := _inv_freq_of(module, layer_type)) is not None]
        by_type[layer_type] = found[0].detach().clone() if found else full
    return [by_type[layer_type] for layer_type in types]


def _inv_freq_of(module: Any, layer_type: str) -> Tensor | None:
    """The RoPE frequencies a module applies on layers of ``layer_type``, if it is a rotary embedding."""
    for name in ("inv_freq", f"{layer_type}_inv_freq"):
        freq = getattr(module, name, None)
        if isinstance(freq, Tensor):
            return freq
    return None


class LayerFrequencies:
    """Each decoder layer's RoPE, or why the model has none a cache can use.

    The frequencies are looked up on construction; a model without usable RoPE is refused only by what asks for
    them (`of`), so caches whose policies never turn queries still serve it. A cache that turns keys or queries
    calls `check_keys` on construction: the layouts then come from the model's own keys (`keys_rope`).
    """

    def __init__(self, model: Any, owner: str, purpose: str) -> None:
        self._ropes: list[LayerRope] = []
        self.refusal: str | None = None
        self._owner, self._purpose = owner, purpose
        try:
            self._ropes = [LayerRope(freq) for freq in layer_inv_freqs(model, owner, purpose)]
        except ValueError as error:
            self.refusal = str(error)

    def check_keys(self, model: Any) -> None:
        """Raise the refusal, or take each layer's layout from the keys the model caches (`keys_rope`)."""
        if self.refusal is not None:
            raise ValueError(self.refusal)
        self._ropes = keys_rope(model, [rope.inv_freq for rope in self._ropes], self._owner, self._purpose)

    def of(self, layer: int) -> LayerRope:
        """Layer ``layer``'s RoPE; raises the refusal's ValueError for a model without usable RoPE."""
        return self.ropes()[layer]

    def ropes(self) -> tuple[LayerRope, ...]:
        """Every layer's RoPE; raises the refusal's ValueError for a model without usable RoPE."""
        if self.refusal is not None:
            raise ValueError(self.refusal)
        return tuple(self._ropes)


def keys_rope(model: Any, freqs: Sequence[Tensor], owner: str, purpose: str) -> list[LayerRope]:
    """Each layer's RoPE as the model's cached keys show it, for layers whose frequencies are ``freqs``.

    One token's key before RoPE does not depend on its position (attention over that token alone returns its
    value), so the model is run on two tokens alone, at position 0 and at `_PROBE_SHIFT`, and each layer's second
    keys are compared with its first turned by the shift: as stored (a layer without RoPE), in the ``rotate_half``
    pairing, or in interleaved pairs. A layer none of them fits is refused, naming ``owner`` and its ``purpose``.
    """
    config = decoder_config(model)
    tokens = [t for t in range(min(int(config.vocab_size), 8)) if t != getattr(config, "pad_token_id", None)][:2]
    before, after = (_cached_keys(model, tokens, position) for position in (0, _PROBE_SHIFT))
    ropes = []
    for layer, (first, moved, freq) in enumerate(zip(before, after, freqs, strict=False)):
        candidates = (LayerRope(torch.zeros_like(freq)), LayerRope(freq), LayerRope(freq, interleaved=True))
        fitting = [rope for rope in candidates if _close(rope.turn(first, torch.tensor([_PROBE_SHIFT])), moved)]
        if not fitting:
            raise ValueError(
                f"{owner} {purpose}, but layer {layer}'s cached keys move between positions in a way it cannot "
                "reproduce: they are not rotated by the model's RoPE frequencies in the rotate_half pairing, nor in "
                "interleaved pairs, nor left as they are. Supported: RoPE models in either pairing, and layers without "
                "RoPE."
            )
        ropes.append(fitting[0])
    return ropes


_PROBE_SHIFT = 5


def _cached_keys(model: Any, tokens: list[int], position: int) -> list[Tensor]:
    """Float64 keys ``[len(tokens), kv_heads, 1, head_dim]`` each layer caches for ``tokens``, each alone at
    ``position``."""
    device = model.get_input_embeddings().weight.device
    ids = torch.tensor(tokens, device=device)[:, None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.full_like(ids, position), cache=cache, use_cache=True)
    keys = [getattr(layer, "keys", None) for layer in cache.layers]
    return [stored.to(torch.float64) for stored in keys if isinstance(stored, Tensor)]


def _close(turned: Tensor, cached: Tensor) -> bool:
    """Whether ``turned`` keys are the ``cached`` ones, up to the rounding of the model's dtype (a wrong turn is
    off by the keys' own size)."""
    scale = cached.norm()
    return bool(scale == 0 or (turned - cached).norm() <= 0.05 * scale)
