"""Every place where hf_kvgov depends on how a transformers version behaves, in one module.

Tested against transformers 5.24. Known changes ahead: models drop the old name `past_key_values` for
`cache` at 5.40 and generate at 6.0; hf_kvgov passes `cache=` everywhere (5.24 already takes it, and warns
on the old name); `get_layer_types_and_kwargs` is internal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from hf_kvgov.kv_layout import unsupported_kv_layout, unsupported_layer_type

__all__ = [
    "AttentionInterface",
    "AttentionMaskInterface",
    "Cache",
    "CacheLayerMixin",
    "GenerationOutput",
    "LayerKind",
    "RequestStatus",
    "attention_implementation",
    "decoder_config",
    "layer_kinds",
    "model_layer_devices",
    "sdpa_mask",
]

TRANSFORMERS_VERSION = transformers.__version__

# transformers' continuous batching hands results back as these (since 5.0; the module is internal, so the import
# is guarded: without them `hf_kvgov.serving.install` refuses with the version, and nothing else needs them).
try:
    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus
except ImportError:  # pragma: no cover - a transformers without continuous batching
    GenerationOutput = RequestStatus = None  # type: ignore[assignment,misc]


@dataclass(frozen=True)
class LayerKind:
    """What a decoder layer's attention needs from the cache."""

    sliding_window: int | None  # None: the layer attends to every previous token


def attention_implementation(config: Any) -> str:
    """The attention implementation a model's config names ("sdpa", "eager", a registered name).

    transformers keeps it in the config's `_attn_implementation`; this is the one place that reads it.
    """
    return str(getattr(config, "_attn_implementation", ""))


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
            raise ValueError(unsupported_layer_type(layer_type))
    return kinds


def cached_layer_count(config: PretrainedConfig) -> int:
    """The decoder layers that cache K/V of their own: all but the last ``num_kv_shared_layers`` (KV sharing,
    Gemma-3n: those read the K/V an earlier layer's `cache.update` returned and never call it themselves)."""
    total = int(config.num_hidden_layers)
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    return total - shared if 0 < shared < total else total


def kv_sources(config: PretrainedConfig) -> dict[int, int]:
    """Each KV-sharing layer (past `cached_layer_count`) -> the layer whose K/V it attends over: the last caching layer
    of its type (Gemma-3n's ``kv_shared_layer_index``); empty without KV sharing."""
    cached, types = cached_layer_count(config), getattr(config, "layer_types", None)
    total = int(config.num_hidden_layers)
    if cached == total:
        return {}
    types = list(types) if types is not None else ["full_attention"] * total
    return {layer: max(i for i in range(cached) if types[i] == types[layer]) for layer in range(cached, total)}


def kv_heads_and_head_dim(config: PretrainedConfig) -> tuple[int, int]:
    """(KV heads, head_dim) of a decoder config; `ValueError` for a model whose cache holds something else
    (`hf_kvgov.kv_layout`)."""
    reason = unsupported_kv_layout(lambda name: getattr(config, name, None), str(getattr(config, "model_type", "")))
    if reason is not None:
        raise ValueError(reason)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(kv_heads), int(head_dim)


def check_attention_view(model_or_config: Any, what: str) -> None:
    """Refuse a model `what` cannot serve by handing attention a view of its own storage (`AttentionView`).

    Two kinds: a model whose later layers reuse the K/V an earlier layer's `cache.update` returned (KV sharing:
    Gemma-3n, Gemma 4), which needs them whole; and, for a model (not a config), one whose attention does not pass
    its attention kwargs to `cache.update` (GPT-NeoX, Falcon, Bloom), which the view is staged from
    (`passes_update_kwargs`). A model whose attention never reads the view is refused at its first step, by name.
    """
    config = decoder_config(model_or_config)
    shared = getattr(config, "num_kv_shared_layers", None) or 0
    if shared > 0:
        raise ValueError(
            f"{getattr(config, 'model_type', 'This model')}'s last {shared} layers reuse the keys and values an "
            f"earlier layer's cache.update returned (KV sharing), and {what} returns only the new tokens, attending "
            "through a view of its own storage. PagedCache, QuantizedCache and DiskOffloadCache with their default "
            "attention, and the serving engine, serve it."
        )
    if isinstance(model_or_config, PreTrainedModel) and passes_update_kwargs(model_or_config) is False:
        raise ValueError(
            f"{type(model_or_config).__name__}'s attention does not pass its attention kwargs to cache.update, and "
            f"{what} attends through a view of its own storage staged from them. PagedCache, QuantizedCache and "
            "DiskOffloadCache with their default attention serve it."
        )


class _UpdateRecorder(DynamicCache):
    """transformers' own cache, noting whether each `update` was given the attention kwargs (``kwargs=``)."""

    calls = 0
    with_kwargs = 0

    def update(self, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.with_kwargs += kwargs.get("kwargs") is not None
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


# Whether a model class's attention passes its kwargs to `cache.update`: a fact of its code, probed once per class.
_PASSES_UPDATE_KWARGS: dict[type, bool] = {}


def passes_update_kwargs(model: PreTrainedModel) -> bool | None:
    """Whether every layer of `model` passes its attention kwargs to `cache.update` (transformers 5 decoders do:
    ``cache.update(k, v, layer_idx, kwargs=kwargs)``; GPT-NeoX, Falcon and Bloom do not). One token through the
    model finds out, once per model class; None when that forward fails or stores nothing (left to the first step)."""
    kind = type(model)
    if kind not in _PASSES_UPDATE_KWARGS:
        recorder = _UpdateRecorder(config=decoder_config(model))
        token = torch.zeros(1, 1, dtype=torch.long, device=next(model.parameters()).device)
        try:
            with torch.no_grad():
                model(input_ids=token, cache=recorder, use_cache=True)
        except Exception:  # a model this forward does not suit is checked at its first step instead
            return None
        if recorder.calls == 0:
            return None
        _PASSES_UPDATE_KWARGS[kind] = recorder.with_kwargs == recorder.calls
    return _PASSES_UPDATE_KWARGS.get(kind)


def model_dtype_and_device(model_or_config: Any) -> tuple[torch.dtype, torch.device] | None:
    if isinstance(model_or_config, PreTrainedModel):
        parameter = next(model_or_config.parameters())
        return parameter.dtype, parameter.device
    return None


def model_layer_devices(model_or_config: Any, num_layers: int) -> tuple[torch.device | None, ...]:
    """The device each decoder layer runs on, where its K/V arrive; None where only that first K/V will tell.

    In order: the model's `hf_device_map` (set by `from_pretrained(device_map=...)`; entries are accelerator
    ordinals, device names, "cpu" or "disk"), else each decoder layer's accelerate hook or parameters, else
    (a config, or a layer whose weights are not materialised) None.
    """
    if not isinstance(model_or_config, PreTrainedModel):
        return (None,) * num_layers
    names = decoder_layer_names(model_or_config, num_layers)
    if names is None:
        return (None,) * num_layers
    modules = dict(model_or_config.named_modules())
    device_map = getattr(model_or_config, "hf_device_map", None)
    if isinstance(device_map, Mapping) and device_map:
        return tuple(_mapped_device(device_map, modules, name) for name in names)
    return tuple(_module_device(modules[name]) for name in names)


def decoder_layer_names(model: PreTrainedModel, num_layers: int) -> list[str] | None:
    """Module names of the text decoder's first `num_layers` layers (e.g. "model.layers.3"; fewer than the model has
    when its last layers share K/V), or None if they cannot be found."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    found = [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and _holds_layers(module, layers, num_layers)
    ]
    if not found:
        return None
    return [f"{found[0]}.{i}" if found[0] else str(i) for i in range(num_layers)]


def _holds_layers(module: nn.ModuleList, layers: Any, num_layers: int) -> bool:
    """Whether `module` is the decoder's layer list (`layers`, when the model names it) holding at least `num_layers`
    layers; without a name, a list of exactly `num_layers`."""
    if layers is not None:
        return module is layers and len(module) >= num_layers
    return len(module) == num_layers


def _mapped_device(device_map: Mapping[str, Any], modules: Mapping[str, nn.Module], layer: str) -> torch.device | None:
    """Where accelerate runs module `layer`: the device_map entry covering it (or its attention's entry)."""
    covering = [key for key in device_map if key == "" or layer == key or layer.startswith(key + ".")]
    inside = [key for key in device_map if key.startswith(layer + ".")]
    if not covering and not inside:  # a hand-made map that leaves the layer out
        return _module_device(modules[layer])
    # Entries may split a layer into submodules; the K/V come from its attention, so its entry decides.
    key = max(covering, key=len) if covering else min(inside, key=lambda k: ("attn" not in k, k))
    entry = device_map[key]
    if entry in ("cpu", "disk"):
        # accelerate runs offloaded modules on its main device: the hook says which, else its default rule.
        return _hook_device(modules.get(key)) or _main_device(device_map)
    return _as_device(entry)


def _main_device(device_map: Mapping[str, Any]) -> torch.device:
    """accelerate's default execution device for offloaded modules: the first device that is not offloaded."""
    placed = [entry for entry in device_map.values() if entry not in ("cpu", "disk", "meta")]
    return _as_device(placed[0]) if placed else torch.device("cpu")


def _as_device(entry: int | str | torch.device) -> torch.device:
    if isinstance(entry, int):  # an ordinal of the machine's accelerator (CUDA unless torch reports another)
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type if accelerator is not None else "cuda", entry)
    return torch.device(entry)


def _hook_device(module: nn.Module | None) -> torch.device | None:
    """The execution device of an accelerate hook on `module` (a plain hook or a sequence of hooks)."""
    hook = getattr(module, "_hf_hook", None)
    for candidate in [hook, *getattr(hook, "hooks", ())]:
        device = getattr(candidate, "execution_device", None)
        if device is not None:
            return _as_device(device)
    return None


def _module_device(layer: nn.Module) -> torch.device | None:
    """The accelerate hook's execution device, else the device of the layer's first parameter (None on meta)."""
    hooked = _hook_device(layer)
    if hooked is not None:
        return hooked
    parameter = next(layer.parameters(), None)
    if parameter is None or parameter.device.type == "meta":
        return None
    return parameter.device
