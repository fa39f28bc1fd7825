"""Every place where hf_kvgov depends on how a transformers version behaves, in one module.

Tested against transformers 5.24. Known changes ahead: models rename `past_key_values` to `cache` at
5.40 and generate at 6.0 (both names are accepted here); `get_layer_types_and_kwargs` is internal.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

__all__ = [
    "AttentionInterface",
    "AttentionMaskInterface",
    "Cache",
    "CacheLayerMixin",
    "LayerKind",
    "decoder_config",
    "layer_kinds",
    "quiet_generate_warnings",
    "sdpa_mask",
]

TRANSFORMERS_VERSION = transformers.__version__


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer's attention needs from the cache."""

    sliding_window: int | None  # None: the layer attends to every previous token


def decoder_config(model_or_config: Any) -> PretrainedConfig:
    """The text-decoder config of a model, a config, or a multimodal config."""
    config = model_or_config.config if isinstance(model_or_config, PreTrainedModel) else model_or_config
    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"Expected a transformers PreTrainedModel or PretrainedConfig; got {type(model_or_config).__name__}."
        )
    return config.get_text_config(decoder=True)


def layer_kinds(config: PretrainedConfig) -> list[LayerKind]:
    """One `LayerKind` per decoder layer, from `layer_types` (or `sliding_window` on every layer)."""
    num_layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types is None:
        return [LayerKind(window)] * num_layers
    kinds = []
    for layer_type in types:
        if layer_type == "full_attention":
            kinds.append(LayerKind(None))
        elif layer_type == "sliding_attention":
            kinds.append(LayerKind(window))
        else:
            raise ValueError(
                f"Layer type {layer_type!r} is not supported by hf_kvgov caches; supported layer types are "
                "'full_attention' and 'sliding_attention' (attention-only decoders)."
            )
    return kinds


def kv_heads_and_head_dim(config: PretrainedConfig) -> tuple[int, int]:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(kv_heads), int(head_dim)


def model_dtype_and_device(model_or_config: Any) -> tuple[torch.dtype, torch.device] | None:
    if isinstance(model_or_config, PreTrainedModel):
        parameter = next(model_or_config.parameters())
        return parameter.dtype, parameter.device
    return None


@contextlib.contextmanager
def quiet_generate_warnings() -> Iterator[None]:
    """Silence transformers' renaming notice (`past_key_values` -> `cache`) for calls made by hf_kvgov."""
    logger = logging.getLogger("transformers")
    previous = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*past_key_values.*")
            yield
    finally:
        logger.setLevel(previous)
