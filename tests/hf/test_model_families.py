"""Which model families each path serves, and the refusals, by name and when a cache, the engine or a plan is made.

Models whose K/V the caches cannot hold are refused everywhere.

Multi-head latent attention (DeepSeek-V3 and its family) caches one shared latent and rotary key per token; MiMo-V2-
Flash's value heads are narrower than its key heads. Both used to fail at the first `update`, in the middle of
`generate`: with a message blaming the K/V's head count, or an `IndexError` from `index_copy_`. An encoder-decoder
model (T5) took a block cache for its cross-attention K/V as well, and generated other tokens than with its own
cache. Gemma 4's layers differ in head_dim: transformers' own error when the geometry was read, now hf_kvgov's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from transformers import DynamicCache

from hf_kvgov import (
    DiskOffloadCache,
    GovernedCache,
    HeavyHitter,
    HeavyHitterCache,
    PagedCache,
    Paging,
    PolicyCache,
    QuantizedCache,
    SinkCache,
    kvzip_cache,
    prefix_tree,
)
from hf_kvgov.bench.plan_setups import planner_geometry
from hf_kvgov.cli.main import main
from hf_kvgov.planner import CacheSetup
from hf_kvgov.planner.accounting import sequence_bytes
from hf_kvgov.planner.config_loading import geometry_from_config
from hf_kvgov.registry import get_cache_spec
from hf_kvgov.serving import SamplingParams, ServingEngine
from tests.char_tokenizer import char_tokenizer

SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=256,
)  # fmt: skip
LATENT = "uses multi-head latent attention: transformers caches one shared latent of 32 values and a rotary key of 8"
NARROW_VALUES = "has value heads of dim 8 and key heads of dim 16"


def deepseek_v3() -> transformers.PretrainedConfig:
    return transformers.DeepseekV3Config(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        first_k_dense_replace=2, **SMALL,
    )  # fmt: skip


def mimo_v2_flash() -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model("mimo_v2_flash", num_key_value_heads=2, head_dim=16, v_head_dim=8, **SMALL)


def t5() -> transformers.PretrainedConfig:
    return transformers.T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0
    )


def gemma4() -> transformers.PretrainedConfig:
    """Gemma 4's layout in miniature: its full-attention layer has twice the sliding layer's head_dim."""
    return transformers.AutoConfig.for_model(
        "gemma4_text", vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        layer_types=["sliding_attention", "full_attention"], sliding_window=16, max_position_embeddings=256,
        per_layer_config={"1": {"head_dim": 32}},
    )  # fmt: skip


MODELS = [
    (deepseek_v3, LATENT),
    (mimo_v2_flash, NARROW_VALUES),
    (t5, "t5 is an encoder-decoder model"),
    (gemma4, r"gemma4_text gives its layers different attention geometry \(layer 1 has head_dim 32\)"),
]
MODEL_IDS = ["deepseek_v3", "mimo_v2_flash", "t5", "gemma4"]


@pytest.fixture(scope="module", params=MODELS, ids=MODEL_IDS)
def refused(request: pytest.FixtureRequest) -> tuple[Any, str]:
    make_config, message = request.param
    torch.manual_seed(0)
    config = make_config()
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    return auto.from_config(config).eval(), message


def test_transformers_itself_generates_with_these_models(refused: tuple[Any, str]) -> None:
    model, _ = refused  # the refusal below is hf_kvgov's, not a model that cannot run
    out = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] >= 3


BUILDERS: dict[str, Callable[[Any, Path], Any]] = {
    "PagedCache": lambda model, _: PagedCache(model),
    "QuantizedCache": lambda model, _: QuantizedCache(model, bits=8),
    "HeavyHitterCache": lambda model, _: HeavyHitterCache(model),
    "SinkCache": lambda model, _: SinkCache(model),
    "PolicyCache": lambda model, _: PolicyCache(model, "snapkv"),
    "DiskOffloadCache": lambda model, path: DiskOffloadCache(model, path=path),
    "GovernedCache": lambda model, _: GovernedCache(model, pool=Paging(16), codec="int8", policy=HeavyHitter(0.2)),
    "cache name h2o@0.2:int8": lambda model, _: get_cache_spec("h2o@0.2:int8").build(model),
    "kvzip_cache": lambda model, _: kvzip_cache(model, char_tokenizer(), torch.tensor([[5, 6, 7, 8, 9, 10]]), budget=4),
    "ServingEngine": lambda model, _: ServingEngine(model),
}


@pytest.mark.parametrize("builder", list(BUILDERS), ids=list(BUILDERS))
def test_every_cache_and_the_engine_refuse_at_construction(
    refused: tuple[Any, str], builder: str, tmp_path: Path
) -> None:
    model, message = refused
    if builder == "SinkCache" and model.config.is_encoder_decoder:
        message = "SinkCache re-rotates sink keys with the model's rotary embedding, but T5ForConditionalGeneration"
    with pytest.raises(ValueError, match=message):
        BUILDERS[builder](model, tmp_path)
    assert model.config._attn_implementation != "kvgov_ragged"  # the engine changed nothing before refusing


@pytest.mark.parametrize(("make_config", "message"), MODELS, ids=MODEL_IDS)
def test_the_planner_refuses_their_configs(
    make_config: Callable[[], Any], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config()
    with pytest.raises(ValueError, match=message):
        geometry_from_config(config.to_dict(), name="tiny")
    config.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path / "config.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


# ---------------------------------------------------------------- attention the engine's step does not reach


def bloom() -> Any:
    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4, initializer_range=0.5)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def stablelm() -> Any:
    torch.manual_seed(0)
    config = transformers.StableLmConfig(num_key_value_heads=2, **SMALL)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    ("make_model", "message"),
    [
        (bloom, r"BloomForCausalLM cannot be served by the engine: layers \[0, 1\] attended without its step"),
        (stablelm, r"StableLmForCausalLM cannot be served by the engine: one token through its step failed"),
    ],
    ids=["bloom", "stablelm"],
)
def test_the_engine_refuses_a_model_whose_layers_attend_without_its_step(
    make_model: Callable[[], Any], message: str
) -> None:
    """Bloom computes attention in its own code (the engine used to answer every request without its context after
    the first token); StableLM's layers do not pass the model's keyword arguments down to attention (it failed at the
    first step). One token through the engine's step at construction finds both."""
    model = make_model()
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=message):
        ServingEngine(model)
    assert model.config._attn_implementation == before  # the model has its own attention back


def gpt_neox() -> Any:
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(**SMALL)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


VIEWS: dict[str, Callable[[Any], Any]] = {
    "PagedCache(attention='paged')": lambda m: PagedCache(m, attention="paged"),
    "HeavyHitterCache": lambda m: HeavyHitterCache(m, budget=8),
    "PolicyCache": lambda m: PolicyCache(m, "snapkv", budget=40),
}


@pytest.mark.parametrize("make_model", [gpt_neox, bloom], ids=["gpt_neox", "bloom"])
@pytest.mark.parametrize("build", list(VIEWS.values()), ids=list(VIEWS))
def test_views_refuse_a_model_that_keeps_its_attention_kwargs_from_cache_update(
    make_model: Callable[[], Any], build: Callable[[Any], Any]
) -> None:
    """GPT-NeoX and Bloom call ``cache.update(k, v, layer_idx)`` without the attention kwargs a view is staged from:
    these caches used to be built, then raise in the middle of `generate`. The block caches' default attention still
    serves them, and a config (no model to run) is left to the first step."""
    model = make_model()
    with pytest.raises(ValueError, match=f"{type(model).__name__}'s attention does not pass its attention kwargs"):
        build(model)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = model.generate(ids, max_new_tokens=4, do_sample=False, cache=DynamicCache(config=model.config))
    got = model.generate(ids, max_new_tokens=4, do_sample=False, cache=PagedCache(model, block_size=4))
    assert torch.equal(got, expected)
    PagedCache(model.config, attention="paged")  # built: nothing to probe


# ---------------------------------------------------------------- KV sharing (Gemma-3n, Gemma 4)


@pytest.fixture(scope="module")
def gemma3n() -> Any:
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=[128] * 4, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
        layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=16, max_position_embeddings=256,
    )  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize(
    "build",
    [lambda m: PagedCache(m, attention="paged"), lambda m: HeavyHitterCache(m), lambda m: PolicyCache(m, "snapkv")],
    ids=["PagedCache(attention='paged')", "HeavyHitterCache", "PolicyCache"],
)
def test_views_refuse_kv_sharing_at_construction(gemma3n: Any, build: Callable[[Any], Any]) -> None:
    """Gemma-3n's last layers reuse the K/V `cache.update` returned to an earlier layer: a view of the new tokens
    crashed attention='paged' and made an eviction cache's tokens differ from the full cache's, silently."""
    with pytest.raises(ValueError, match="gemma3n_text's last 2 layers reuse the keys and values an earlier layer"):
        build(gemma3n)


def test_block_caches_and_the_engine_serve_kv_sharing(gemma3n: Any, tmp_path: Path) -> None:
    """The block caches hold blocks for the two layers that cache K/V (the pool used to give the two sharing layers
    blocks they never wrote: twice the bytes here), as the planner counts them; answers as the full cache's."""
    prompt = torch.randint(3, 120, (2, 30), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0
    kw = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0, "eos_token_id": None}
    expected = gemma3n.generate(prompt, cache=DynamicCache(config=gemma3n.config), **kw)
    paged = PagedCache(gemma3n, block_size=4)
    assert torch.equal(gemma3n.generate(prompt, cache=paged, **kw), expected)
    assert len(paged.layers) == 2 and paged.pool.geometry.num_layers == 2
    geometry = planner_geometry(gemma3n)
    assert geometry is not None and geometry.num_layers == 2
    one_row = sequence_bytes(geometry, CacheSetup(block_size=4, kv_dtype="fp32"), 37).device
    assert paged.stats().bytes_used == 2 * one_row  # two rows of 37 stored tokens (the padding row's too)
    disk = DiskOffloadCache(gemma3n, path=tmp_path, hot_tokens=8, block_size=4)
    assert torch.equal(gemma3n.generate(prompt, cache=disk, **kw), expected)
    tree = prefix_tree(gemma3n)
    for _ in range(2):  # the second turn hits what the first published
        cache = PagedCache(gemma3n, prefix=tree)
        inputs = cache.match(prompt[:1])
        out = gemma3n.generate(**inputs, cache=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert out[0, -8:].tolist() == expected[0, 30:].tolist()
        cache.publish(out)
        cache.release()
    assert tree.stats().hit_tokens > 0
    rows = [prompt[0].tolist(), prompt[1, 4:].tolist()]  # the second without its padding
    with ServingEngine(gemma3n, block_size=4, max_batched_tokens=7) as engine:  # prompts chunked beside decode
        got = engine.generate(rows, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert engine.pool.geometry.num_layers == 2  # sharing layers attend over the blocks of the layers they share
    assert got == [expected[0, 30:].tolist(), expected[1, 30:].tolist()]
    # The engine's H2O, which `kvgov plan` names for such a model, with nothing to evict: the same tokens.
    with ServingEngine(gemma3n, block_size=4, policy=HeavyHitter(4096)) as engine:
        kept = engine.generate(rows, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert kept == got
