"""Built-in geometries of popular models, so that planning needs neither a download nor transformers.

Figures are those of each model's published ``config.json``; parameter counts are exact counts of the
released checkpoints (embeddings included, tied embeddings counted once).
"""

from __future__ import annotations

from hf_kvgov.planner.geometry import ModelGeometry


def _gemma3_sliding_layers(num_layers: int, pattern: int = 6) -> tuple[int, ...]:
    # Gemma 3: five sliding-window layers, then one full-attention layer, repeated.
    return tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)


def _alternating_sliding_layers(num_layers: int) -> tuple[int, ...]:
    # gpt-oss: layer_types alternate "sliding_attention", "full_attention", starting with a sliding layer.
    return tuple(range(0, num_layers, 2))


BUILTIN_MODELS: dict[str, ModelGeometry] = {
    geometry.name.lower(): geometry
    for geometry in (
        ModelGeometry("LLaMA-7B", 32, 32, 128, 2048, num_params=6_738_415_616),
        ModelGeometry("LLaMA-13B", 40, 40, 128, 2048, num_params=13_015_864_320),
        ModelGeometry("Llama-2-70B", 80, 8, 128, 4096, num_params=68_976_648_192),
        ModelGeometry("Llama-3-8B", 32, 8, 128, 8192, num_params=8_030_261_248),
        # Mistral-7B v0.1: sliding_window 4096 on every layer (v0.2 and later set it to null: full attention).
        ModelGeometry(
            "Mistral-7B",
            32,
            8,
            128,
            32768,
            sliding_window=4096,
            sliding_layers=tuple(range(32)),
            num_params=7_241_732_096,
        ),
        ModelGeometry("Qwen2.5-0.5B", 24, 2, 64, 32768, num_params=494_032_768),
        ModelGeometry("Qwen2.5-7B", 28, 4, 128, 131072, num_params=7_615_616_512),
        ModelGeometry("SmolLM2-135M", 30, 3, 64, 8192, num_params=134_515_008),
        ModelGeometry(
            "Gemma-3-270M",
            18,
            1,
            256,
            32768,
            sliding_window=512,
            sliding_layers=_gemma3_sliding_layers(18),
            num_params=268_098_176,
        ),
        # openai/gpt-oss-20b and -120b config.json: 24 and 36 layers, 8 KV heads, head_dim 64, context 131072,
        # sliding_window 128 on every other layer. Parameters counted from the configs (embeddings untied, 32 and
        # 128 experts with biases, attention sinks): 20.91B and 116.83B, the totals of the gpt-oss model card.
        # The experts ship in MXFP4 (about 4.25 bits): --weight-dtype int4 comes close.
        ModelGeometry(
            "gpt-oss-20b",
            24,
            8,
            64,
            131072,
            sliding_window=128,
            sliding_layers=_alternating_sliding_layers(24),
            num_params=20_914_757_184,
        ),
        ModelGeometry(
            "gpt-oss-120b",
            36,
            8,
            64,
            131072,
            sliding_window=128,
            sliding_layers=_alternating_sliding_layers(36),
            num_params=116_829_156_672,
        ),
    )
}

# Hub ids and common spellings of the same checkpoints.
ALIASES: dict[str, str] = {
    "huggyllama/llama-7b": "llama-7b",
    "meta-llama/llama-2-7b-hf": "llama-7b",
    "llama-2-7b": "llama-7b",
    "huggyllama/llama-13b": "llama-13b",
    "meta-llama/llama-2-13b-hf": "llama-13b",
    "llama-2-13b": "llama-13b",
    "meta-llama/llama-2-70b-hf": "llama-2-70b",
    "meta-llama/meta-llama-3-8b": "llama-3-8b",
    "meta-llama/meta-llama-3-8b-instruct": "llama-3-8b",
    "mistralai/mistral-7b-v0.1": "mistral-7b",
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b",
    "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "qwen/qwen2.5-7b": "qwen2.5-7b",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
    "google/gemma-3-270m": "gemma-3-270m",
    "google/gemma-3-270m-it": "gemma-3-270m",
    "openai/gpt-oss-20b": "gpt-oss-20b",
    "openai/gpt-oss-120b": "gpt-oss-120b",
}


def known_model_names() -> list[str]:
    """Display names of the built-in models, in table order."""
    return [geometry.name for geometry in BUILTIN_MODELS.values()]


def find_builtin(name: str) -> ModelGeometry | None:
    """The built-in geometry for ``name`` or one of its aliases (case-insensitive), else None."""
    key = name.strip().lower()
    return BUILTIN_MODELS.get(ALIASES.get(key, key))
