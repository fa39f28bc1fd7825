"""Shared fixtures: a tiny random-weight Llama for fast matrices, the embedded real models for checks
that need trained weights. Real models must have been fetched before the tests run (`kvgov fetch`, part
of the README's test command): tests never download, and a missing model is an error, not a skip."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)


def tiny_llama(num_kv_heads: int = 2, num_heads: int = 4, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer random Llama: big enough to exercise GQA/MHA, small enough for a test matrix."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


# The geometry of the tiny hybrid models: 2 KV heads of dim 16 (4 query heads), float32.
_TINY_HYBRID = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SLIDING, FULL = "sliding_attention", "full_attention"


def tiny_gemma3(layer_types: tuple[str, ...] = (SLIDING, FULL, SLIDING), window: int = 8) -> Gemma3ForCausalLM:
    """Gemma-3's hybrid layout in miniature: sliding-window layers of `window` tokens beside full-attention ones."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        num_hidden_layers=len(layer_types), layer_types=list(layer_types), sliding_window=window, **_TINY_HYBRID
    )
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def tiny_gpt_oss(window: int = 8) -> GptOssForCausalLM:
    """GPT-OSS in miniature: sliding and full layers alternating, and a learned sink logit per query head (transformers'
    ``s_aux``), set from -1 to 3 so that every softmax gives the sink a visible share."""
    torch.manual_seed(0)
    config = GptOssConfig(
        num_hidden_layers=2, sliding_window=window, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_TINY_HYBRID,
    )  # fmt: skip
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, config.num_attention_heads))
    model.generation_config.pad_token_id = 0
    return model


def tiny_mistral(window: int = 8, num_layers: int = 2) -> MistralForCausalLM:
    """A Mistral-style model: every layer slides over `window` tokens."""
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(num_hidden_layers=num_layers, sliding_window=window, **_TINY_HYBRID))
    model.generation_config.pad_token_id = 0
    return model.eval()


def _real_model(name: str):  # type: ignore[no-untyped-def]
    from hf_kvgov import models

    if not models.is_fetched(name):
        pytest.fail(
            f"The embedded model {name!r} is not fetched; run `kvgov fetch` before the tests (no downloads in tests)."
        )
    return models.load_model(name)


@pytest.fixture(scope="session")
def smollm2():  # type: ignore[no-untyped-def]
    return _real_model("smollm2")


@pytest.fixture(scope="session")
def gemma3():  # type: ignore[no-untyped-def]
    return _real_model("gemma3-270m")


@pytest.fixture(scope="session")
def austen_text() -> str:
    """Pride and Prejudice, complete: the package ships it (hf_kvgov/data/text), so a bare clone has it."""
    from hf_kvgov.data_text import pride_and_prejudice

    return pride_and_prejudice()


@pytest.fixture
def one_thread():  # type: ignore[no-untyped-def]
    """Torch on one thread (results are the same): two intra-op threads on a shared 2-core machine stall each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
