"""The model's RoPE frequencies, for caches that turn keys (sink re-rotation) or queries (expected attention).

Most models hold one ``inv_freq`` buffer on their rotary embedding; models with per-layer-type RoPE
(Gemma-3: a local base for sliding layers, a global one for full layers) hold ``<layer type>_inv_freq``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hf_kvgov.hf.compat import decoder_config

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
    """Each decoder layer's RoPE frequencies, or why the model has none a cache can use.

    Looked up once on construction; a model without usable RoPE is refused only by what asks for them
    (`of`), so caches whose policies never turn queries still serve it.
    """

    def __init__(self, model: Any, owner: str, purpose: str) -> None:
        self._freqs: list[Tensor] = []
        self.refusal: str | None = None
        try:
            self._freqs = layer_inv_freqs(model, owner, purpose)
        except ValueError as error:
            self.refusal = str(error)

    def of(self, layer: int) -> Tensor:
        """Layer ``layer``'s ``inv_freq``; raises the refusal's ValueError for a model without usable RoPE."""
        if self.refusal is not None:
            raise ValueError(self.refusal)
        return self._freqs[layer]
