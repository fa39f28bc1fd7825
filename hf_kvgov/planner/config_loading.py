"""A ModelGeometry from a built-in name, a local ``config.json``, or a hub id already in the local cache.

Nothing here downloads: a hub id is read with ``local_files_only=True``, and transformers is imported
only for that case.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hf_kvgov.kv_layout import unsupported_kv_layout, unsupported_layer_type
from hf_kvgov.planner.catalog import find_builtin, known_model_names
from hf_kvgov.planner.geometry import ModelGeometry

_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")
_MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal checkpoints (Gemma 3 4B+, LLaVA...) keep the decoder's fields under text_config.
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) and "num_hidden_layers" in nested else config


def _require_int(config: Mapping[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"The model config from {source} needs a positive integer {key!r}; got {value!r}.")
    return value


def _head_dim(config: Mapping[str, Any], num_heads: int, source: str) -> int:
    head_dim = config.get("head_dim")
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden = _require_int(config, "hidden_size", source)
    if hidden % num_heads:
        raise ValueError(
            f"The model config from {source} has no head_dim and hidden_size {hidden} is not a multiple of "
            f"num_attention_heads {num_heads}; add head_dim to the config."
        )
    return hidden // num_heads


def _context(config: Mapping[str, Any], source: str) -> int:
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"The model config from {source} has none of {list(_CONTEXT_KEYS)}; add the context length.")


def _sliding_layers(config: Mapping[str, Any], num_layers: int, source: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) from layer_types, or the older per-family conventions."""
    window = config.get("sliding_window")
    window = window if isinstance(window, int) and window > 0 else None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        refusal = next((r for t in layer_types if (r := unsupported_layer_type(t)) is not None), None)
        if refusal is not None:
            raise ValueError(f"The model config from {source}: {refusal}")
        if len(layer_types) != num_layers:
            raise ValueError(
                f"The model config from {source} has {len(layer_types)} layer_types for {num_layers} layers; "
                "it needs one entry per layer."
            )
        sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif window is None or config.get("use_sliding_window") is False:
        sliding = ()
    elif isinstance(config.get("sliding_window_pattern"), int):
        # Gemma 3 before layer_types: every pattern-th layer attends fully.
        pattern = config["sliding_window_pattern"]
        sliding = tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)
    elif isinstance(config.get("max_window_layers"), int):
        # Qwen2 with use_sliding_window: the first max_window_layers layers attend fully.
        sliding = tuple(range(config["max_window_layers"], num_layers))
    else:
        sliding = tuple(range(num_layers))  # Mistral: every layer slides.
    if sliding and window is None:
        raise ValueError(f"The model config from {source} marks sliding-window layers but gives no sliding_window.")
    return (window, sliding) if sliding else (None, ())


def estimate_params(config: Mapping[str, Any]) -> int | None:
    """Parameters of a dense LLaMA-style decoder from its config, or None when the config is not one.

    Counts embeddings (once if tied), q/k/v/o projections (+ q/k/v biases for Qwen2), a gated MLP of
    three matrices, RMSNorm weights (Gemma 3: four per layer plus q/k norms) and the final norm. Exact for
    the LLaMA, Mistral, Qwen2, SmolLM2 and Gemma 3 families; mixture-of-experts configs return None.
    """
    config = _text_config(config)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if any(not isinstance(config.get(k), int) for k in keys) or any(k in config for k in _MOE_KEYS):
        return None
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    model_type = str(config.get("model_type", ""))
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = 2 * hidden * q + 2 * hidden * kv
    if model_type.startswith("qwen2") or config.get("attention_bias") is True:
        attention += q + 2 * kv + (hidden if config.get("attention_bias") is True else 0)
    norms = 4 * hidden + 2 * head_dim if model_type.startswith("gemma3") else 2 * hidden
    layer = attention + 3 * hidden * config["intermediate_size"] + norms
    tied = config.get("tie_word_embeddings", model_type.startswith("gemma"))
    embeddings = config["vocab_size"] * hidden * (1 if tied else 2)
    return int(embeddings + config["num_hidden_layers"] * layer + hidden)


def geometry_from_config(config: Mapping[str, Any], name: str, source: str | None = None) -> ModelGeometry:
    """A ModelGeometry from the fields of a transformers config (a parsed ``config.json``)."""
    source = source or name
    text = _text_config(config)
    reason = unsupported_kv_layout(text.get, str(text.get("model_type", "")))
    if reason is not None:
        raise ValueError(f"The model config from {source}: {reason}")
    num_layers = _require_int(text, "num_hidden_layers", source)
    num_heads = _require_int(text, "num_attention_heads", source)
    num_kv_heads = text.get("num_key_value_heads") or num_heads
    window, sliding = _sliding_layers(text, num_layers, source)
    # KV sharing (Gemma-3n, Gemma 4): the last layers read the K/V of earlier ones and cache none of their own.
    shared = text.get("num_kv_shared_layers") or 0
    if not (isinstance(shared, int) and 0 < shared < num_layers):
        shared = 0
    num_layers -= shared
    sliding = tuple(i for i in sliding if i < num_layers)
    window = window if sliding else None
    return ModelGeometry(
        name=name,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=_head_dim(text, num_heads, source),
        max_position_embeddings=_context(text, source),
        sliding_window=window,
        sliding_layers=sliding,
        num_params=estimate_params(config),
        shared_kv_layers=shared,
    )


def load_config_file(path: str | Path) -> ModelGeometry:
    """Geometry from a ``config.json`` file, or from a directory holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"No config.json at {str(path)!r}: give the file or the model directory holding it.")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{str(file)!r} is not valid JSON ({err}); give a transformers config.json.") from err
    if not isinstance(config, dict):
        raise ValueError(f"{str(file)!r} holds a JSON {type(config).__name__}, not the object of a config.json.")
    name = file.parent.name if file.name == "config.json" else file.stem
    return geometry_from_config(_with_derived_layer_types(config, file), name=name or str(file), source=str(file))


def _with_derived_layer_types(config: dict[str, Any], file: Path) -> dict[str, Any]:
    """`config` with the decoder's ``layer_types`` as transformers derives them where the file leaves them out: a
    Gemma-2 file alternates sliding and full layers, a Llama 4 file has chunked layers, a Jamba or Bamba file names its
    Mamba layers by index. The file as it is when transformers is not importable or does not know its model type."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return config
    try:
        parsed = AutoConfig.from_pretrained(str(file), local_files_only=True)
    except Exception:  # a model type transformers does not know (or another version's fields): the file's own
        return config
    return _with_layer_types(config, parsed)


def _with_layer_types(config: dict[str, Any], parsed: Any) -> dict[str, Any]:
    """`config` (a parsed config.json) with the ``layer_types`` of `parsed`, its transformers config object (where
    hybrid models derive them in a property that ``to_dict`` leaves out)."""
    types = getattr(parsed.get_text_config(decoder=True), "layer_types", None)
    if types is None:
        return config
    nested = config.get("text_config")
    if nested is not _text_config(config):
        return {**config, "layer_types": list(types)}
    return {**config, "text_config": {**nested, "layer_types": list(types)}}


def load_hub_config(model_id: str) -> ModelGeometry:
    """Geometry of a hub id whose config is already in the local Hugging Face cache (never downloads)."""
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise ValueError(
            f"Reading {model_id!r} from the Hugging Face cache needs transformers, which is not "
            f"importable ({err}); pass a config.json path or one of the built-in models: "
            f"{', '.join(known_model_names())}."
        ) from err
    try:
        config = AutoConfig.from_pretrained(model_id, local_files_only=True)
    except Exception as err:  # transformers raises OSError, ValueError or HF-hub errors here
        raise ValueError(
            f"Unknown model {model_id!r}: it is not a built-in model ({', '.join(known_model_names())}), "
            "not a local config.json path, and not in the local Hugging Face cache (the planner never "
            f"downloads). Pass the path of its config.json instead. ({type(err).__name__}: {err})"
        ) from err
    fields = _with_layer_types(config.to_dict(), config)
    return geometry_from_config(fields, name=model_id, source=f"the cached config of {model_id}")


def resolve_model(spec: str) -> ModelGeometry:
    """A geometry from a local path, else a built-in name or alias, else a cached hub id ('org/name')."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"Give a model as a built-in name, a config.json path or a hub id; got {spec!r}.")
    if Path(spec).exists():
        return load_config_file(spec)
    builtin = find_builtin(spec)
    if builtin is not None:
        return builtin
    if "/" in spec and not spec.endswith(".json"):
        return load_hub_config(spec)
    raise ValueError(
        f"Unknown model {spec!r}. Built-in models: {', '.join(known_model_names())}; or pass the path of a "
        "config.json, or a hub id ('org/name') whose config is in the local Hugging Face cache."
    )
