"""Model geometries: the built-in table, config.json files, hub ids, and the errors for unknown ones."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hf_kvgov.planner import (
    BUILTIN_MODELS,
    ModelGeometry,
    estimate_params,
    geometry_from_config,
    load_config_file,
    resolve_model,
)

SMOLLM2_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


def _gemma3_text_config() -> dict[str, Any]:
    kinds = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "model_type": "gemma3_text",
        "hidden_size": 640,
        "intermediate_size": 2048,
        "num_hidden_layers": 18,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "layer_types": kinds * 3,
        "max_position_embeddings": 32768,
        "vocab_size": 262144,
    }


def test_builtin_table_has_the_documented_geometries() -> None:
    llama13 = BUILTIN_MODELS["llama-13b"]
    assert (llama13.num_layers, llama13.num_kv_heads, llama13.head_dim) == (40, 40, 128)
    assert BUILTIN_MODELS["llama-2-70b"].num_kv_heads == 8
    assert BUILTIN_MODELS["mistral-7b"].sliding_window == 4096
    assert BUILTIN_MODELS["mistral-7b"].num_sliding_layers == 32
    smol = BUILTIN_MODELS["smollm2-135m"]
    assert (smol.num_layers, smol.num_kv_heads, smol.head_dim) == (30, 3, 64)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") is smol


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"Unknown model 'gpt-7'\. Built-in models: LLaMA-7B, LLaMA-13B, .*Gemma-3-270M"
    ):
        resolve_model("gpt-7")


def test_config_json_from_tmp_path(tmp_path: Path) -> None:
    model_dir = tmp_path / "smollm2"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    geometry = resolve_model(str(model_dir))
    assert geometry == load_config_file(model_dir / "config.json")
    assert (geometry.name, geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (
        "smollm2",
        30,
        3,
        64,
    )
    assert geometry.sliding_window is None
    assert geometry.kv_bytes_per_token("fp16") == 23_040


def test_config_params_estimate_by_hand() -> None:
    # SmolLM2-135M: tied embeddings 49152 x 576 = 28,311,552; per layer q/o 2 x 576 x 576, k/v 2 x 576 x 192,
    # MLP 3 x 576 x 1536, two norms 2 x 576 -> 3,540,096 x 30 = 106,202,880; final norm 576.
    assert estimate_params(SMOLLM2_CONFIG) == 28_311_552 + 106_202_880 + 576 == 134_515_008
    assert estimate_params(SMOLLM2_CONFIG) == BUILTIN_MODELS["smollm2-135m"].num_params
    assert estimate_params({**SMOLLM2_CONFIG, "num_local_experts": 8}) is None


def test_gemma3_layer_types_and_nested_text_config(tmp_path: Path) -> None:
    path = tmp_path / "gemma.json"
    path.write_text(json.dumps({"model_type": "gemma3", "text_config": _gemma3_text_config()}))
    geometry = load_config_file(path)
    builtin = BUILTIN_MODELS["gemma-3-270m"]
    assert (geometry.sliding_window, geometry.sliding_layers) == (
        builtin.sliding_window,
        builtin.sliding_layers,
    )
    assert geometry.num_params == builtin.num_params


def test_sliding_window_conventions_without_layer_types() -> None:
    base = {
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "hidden_size": 64,
        "max_position_embeddings": 128,
    }
    mistral = geometry_from_config({**base, "sliding_window": 32}, "m")
    assert mistral.sliding_layers == (0, 1, 2, 3)
    qwen_off = geometry_from_config({**base, "sliding_window": 32, "use_sliding_window": False}, "q")
    assert (qwen_off.sliding_window, qwen_off.sliding_layers) == (None, ())
    qwen_on = geometry_from_config({**base, "sliding_window": 32, "max_window_layers": 3}, "q")
    assert qwen_on.sliding_layers == (3,)
    assert mistral.head_dim == 16  # hidden_size / heads


def _write(tmp_path: Path, name: str, config: dict[str, Any]) -> Path:
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path / name


def test_layer_types_a_file_leaves_to_transformers(tmp_path: Path) -> None:
    """A config.json without `layer_types` is read as transformers reads it: Gemma-2's published files (transformers
    4.42) give only `sliding_window`, and transformers alternates sliding and full layers, where the per-family
    fallback took every layer as sliding (a third of the KV missing at 8k tokens on gemma-2-9b)."""
    gemma2 = {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "sliding_window": 32,
        "max_position_embeddings": 256,
        "vocab_size": 128,
    }
    geometry = load_config_file(_write(tmp_path, "gemma2", gemma2))
    assert (geometry.sliding_window, geometry.sliding_layers) == (32, (0, 2))
    # Without a model type transformers knows, the file's own fields and the per-family fallback.
    assert load_config_file(_write(tmp_path, "custom", {**gemma2, "model_type": "kvgov-custom"})).sliding_layers == (
        0,
        1,
        2,
        3,
    )


def test_layers_that_are_not_attention_are_refused_as_the_caches_refuse_them(tmp_path: Path) -> None:
    """Hybrid Mamba models name their attention layers by index or period (no `layer_types` in the file) and Llama 4
    files leave out its chunked layers: the planner used to count every layer as attention and plan them."""
    transformers = pytest.importorskip("transformers")
    small = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4}
    configs = {
        "linear_attention": transformers.JambaConfig(
            num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, num_key_value_heads=2, **small
        ),
        "hybrid": transformers.FalconH1Config(
            num_hidden_layers=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, **small
        ),
        "chunked_attention": transformers.Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8, **small),
    }
    for layer_type, config in configs.items():
        config.save_pretrained(tmp_path / layer_type)
        file = tmp_path / layer_type / "config.json"
        fields = json.loads(file.read_text())
        fields.pop("layer_types", None)  # as files written before transformers added the key
        file.write_text(json.dumps(fields))
        with pytest.raises(ValueError, match=f"Layer type '{layer_type}' is not supported by hf_kvgov caches"):
            resolve_model(str(tmp_path / layer_type))


def test_bad_configs_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs a positive integer 'num_hidden_layers'"):
        geometry_from_config({"num_attention_heads": 4}, "x")
    with pytest.raises(ValueError, match="has none of"):
        geometry_from_config({"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8}, "x")
    bad = tmp_path / "broken.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_config_file(bad)
    with pytest.raises(ValueError, match=r"No config\.json at"):
        load_config_file(tmp_path / "missing")


def test_hub_id_not_in_the_local_cache_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        resolve_model("no-such-org/no-such-model-kvgov")


def test_geometry_validation() -> None:
    with pytest.raises(ValueError, match=r"ModelGeometry\.num_layers must be a positive int"):
        ModelGeometry("x", 0, 1, 8, 16)
    with pytest.raises(ValueError, match="but no sliding_window"):
        ModelGeometry("x", 2, 1, 8, 16, sliding_layers=(0,))
    with pytest.raises(ValueError, match=r"distinct indices in \[0, 2\)"):
        ModelGeometry("x", 2, 1, 8, 16, sliding_window=4, sliding_layers=(2,))
