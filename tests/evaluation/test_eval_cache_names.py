"""Parameterized cache names (`h2o@0.2`, `sink@4+252`, `int4@64`, `disk@128`...): parsing, errors, what they build."""

from __future__ import annotations

import pytest
import torch

from hf_kvgov import DiskOffloadCache, HeavyHitterCache, PagedCache, PolicyCache, QuantizedCache, SinkCache
from hf_kvgov.policies import TOVA, ExpectedAttention, HeadAdaptive, KeyNorm, MeanMass, SnapKV
from hf_kvgov.registry import CACHES, FAMILIES, get_cache_spec
from tests.conftest import tiny_llama

MODEL = tiny_llama()


def test_fixed_names_still_resolve_to_their_registered_specs() -> None:
    for name in ("dynamic", "paged", "paged-attn", "int8", "int4", "int2", "fp8", "h2o", "sink", "disk"):
        assert get_cache_spec(name) is CACHES[name]
    eviction = {"h2o", "sink", "snapkv", "tova", "key_norm", "mean_mass", "expected_attention"}
    eviction |= {"expected_attention_running"}
    assert set(FAMILIES) == eviction | {"kvzip", "int8", "int4", "int2", "fp8", "quant", "paged", "disk"}


def test_int2_runs_as_kivi_does() -> None:
    cache = get_cache_spec("int2@32").build(MODEL)  # head_dim 16: one value group per head
    assert (cache.quant.bits, cache.quant.residual, cache.quant.group_size, cache.quant.scale_bytes) == (2, 32, None, 2)
    assert cache.parts.pool is not None and cache.parts.pool.block_size == 32
    preset = get_cache_spec("int2").build(MODEL)  # the setting within +10% under 0.2x of float16 (RESULTS.md)
    assert preset.parts.pool is not None and preset.parts.pool.block_size == 16 and preset.quant.scale_bytes == 2
    smollm2_like = tiny_llama()
    smollm2_like.config.head_dim = 64  # only the geometry is read: value groups of 32 channels
    assert get_cache_spec("int2").build(smollm2_like).quant.group_size == 32


@pytest.mark.parametrize(
    ("name", "cls", "lossless", "own_attention"),
    [
        ("h2o@0.2", HeavyHitterCache, False, True),
        ("h2o@256", HeavyHitterCache, False, True),
        ("sink@4+252", SinkCache, False, True),
        ("snapkv@0.2", PolicyCache, False, True),
        ("tova@64:int8", PolicyCache, False, True),
        ("int8@64", QuantizedCache, False, False),
        ("int4@32", QuantizedCache, False, False),
        ("fp8@64", QuantizedCache, False, False),
        ("paged@8", PagedCache, True, False),
        ("disk@128", DiskOffloadCache, True, False),
    ],
)
def test_family_names_build_the_right_cache(name: str, cls: type, lossless: bool, own_attention: bool) -> None:
    spec = get_cache_spec(name)
    assert spec.name == name and spec.lossless is lossless and spec.needs_attention_context is own_attention
    cache = spec.build(MODEL)
    assert isinstance(cache, cls)
    if hasattr(cache, "release"):
        cache.release()


def test_arguments_reach_the_caches() -> None:
    assert get_cache_spec("h2o@256").build(MODEL).budget == 256
    assert get_cache_spec("h2o@0.2").build(MODEL).budget is None  # a fraction resolves on the prompt
    sink = get_cache_spec("sink@4+252").build(MODEL)
    assert (sink.n_sink, sink.window) == (4, 252)
    int4 = get_cache_spec("int4@32").build(MODEL)
    fp8 = get_cache_spec("fp8@64").build(MODEL)
    assert (int4.quant.bits, int4.quant.fmt, fp8.quant.bits, fp8.quant.fmt) == (4, "int", 8, "fp8")
    disk = get_cache_spec("disk@128").build(MODEL)
    assert disk.disk.hot_tokens == 128
    disk.release()


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("snapkv@0.2", SnapKV()),
        ("tova@0.2", TOVA()),
        ("key_norm@0.2", KeyNorm()),
        ("mean_mass@0.2", MeanMass()),
        ("expected_attention@0.2", ExpectedAttention()),
    ],
)
def test_policy_names_build_a_policy_cache_with_that_policy(name: str, policy: object) -> None:
    spec = get_cache_spec(name)
    cache = spec.build(MODEL)
    assert cache.budget is None and cache.policy is None  # the fraction resolves on the prompt
    # Sized on a known context: 20% of 1000 tokens; SnapKV never keeps fewer than its 32-slot window.
    sized = spec.build_for(MODEL, 1000)
    assert isinstance(sized, PolicyCache) and sized.budget == 200 and sized.policy == policy
    assert get_cache_spec("snapkv@0.01").build_for(MODEL, 1000).budget == 32


def test_policy_names_take_a_codec_and_recall() -> None:
    cache = get_cache_spec("snapkv@128:int8+recall").build(MODEL)
    assert cache.budget == 128 and cache.codec_name == "int8" and cache.recall is not None
    assert get_cache_spec("tova@128").build(MODEL).recall is None
    accepted = "the suffixes after '\\+' are 'recall', 'spans', 'pyramid', 'ada', each at most once"
    examples = "snapkv@0.2\\+recall, snapkv@0.2\\+recall\\+spans, snapkv@0.2\\+pyramid, snapkv@0.2\\+ada"
    with pytest.raises(ValueError, match=f"{accepted} \\({examples}\\); got 'x'"):
        get_cache_spec("snapkv@0.2+x")
    with pytest.raises(ValueError, match=f"{accepted} .*; got 'pyramid'"):
        get_cache_spec("h2o@0.2+pyramid+pyramid")


def test_the_pyramid_suffix_splits_the_budget_over_the_layers() -> None:
    # 20% of 1000 = 200 slots over 2 layers (SnapKV's 32-slot window fixed): 168 to share, low 8.4,
    # high 327.6 -> 359.6 and 40.4 -> 360 and 40; H2O (1 fixed slot): 199 to share, low 9.95, high 388.05 ->
    # 389.05 and 10.95 -> 389 and 11.
    snapkv = get_cache_spec("snapkv@0.2+pyramid").build_for(MODEL, 1000)
    h2o = get_cache_spec("h2o@0.2:int8+pyramid").build_for(MODEL, 1000)
    assert snapkv.stats().layer_budgets == (360, 40) and h2o.stats().layer_budgets == (389, 11)
    assert h2o.codec_name == "int8" and get_cache_spec("h2o@0.2").build_for(MODEL, 1000).stats().layer_budgets == (
        200,
        200,
    )


def test_the_ada_suffix_shares_each_layers_budget_among_its_heads() -> None:
    cache = get_cache_spec("snapkv@0.2:int8+pyramid+ada").build_for(MODEL, 1000)
    assert isinstance(cache, PolicyCache) and cache.head_budgets == HeadAdaptive()
    assert cache.stats().layer_budgets == (360, 40) and cache.codec_name == "int8" and cache.pool is not None
    assert "KV heads by score" in get_cache_spec("h2o@0.2+ada").description
    assert get_cache_spec("h2o@0.2").build_for(MODEL, 1000).head_budgets is None


@pytest.mark.parametrize(("name", "block_size"), [("paged@8", 8), ("int8@32", 32), ("int4@64", 64)])
def test_block_size_argument_sets_the_pool_block_size(name: str, block_size: int) -> None:
    cache = get_cache_spec(name).build(MODEL)
    with torch.inference_mode():
        MODEL(input_ids=torch.arange(3, 40)[None], cache=cache, use_cache=True)
    assert cache.pool.block_size == block_size
    cache.release()


def test_fractions_resolve_on_a_context_known_in_advance() -> None:
    # 20% of 1000 tokens is 200 slots; 0.25 of 1000 is 250; tokens given as an int stay as they are.
    assert get_cache_spec("h2o@0.2").build_for(MODEL, 1000).budget == 200
    assert get_cache_spec("h2o@0.25").build_for(MODEL, 1000).budget == 250
    assert get_cache_spec("h2o@64").build_for(MODEL, 1000).budget == 64
    # The fixed presets too: h2o is 20% of the context; sink is 20% but never below 4 + 60 slots.
    assert get_cache_spec("h2o").build_for(MODEL, 500).budget == 100
    assert get_cache_spec("sink").build_for(MODEL, 1000).budget == 200
    assert get_cache_spec("sink").build_for(MODEL, 100).budget == 64
    # Caches without a fractional budget ignore the context.
    assert isinstance(get_cache_spec("int8@16").build_for(MODEL, 1000), QuantizedCache)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("h2o@0", "'h2o@0': a budget in tokens must be an integer of at least 1; got '0'"),
        ("h2o@1.5", "a fraction in (0, 1] with a decimal point (0.2) or a number of tokens (256); got '1.5'"),
        ("h2o@abc", "got 'abc'"),
        ("h2o@1e-1", "got '1e-1'"),
        ("sink@4", "'sink@4': the argument must be <sinks>+<window> in tokens, as in sink@4+252; got '4'"),
        ("sink@4+0", "'sink@4+0': the window must be an integer of at least 1; got '0'"),
        ("sink@-1+8", "the number of sinks must be an integer of at least 0; got '-1'"),
        ("int4@", "'int4@': the block size in tokens must be an integer of at least 1; got ''"),
        ("disk@x", "the hot window in tokens must be an integer of at least 0; got 'x'"),
    ],
)
def test_bad_arguments_are_refused_with_a_sentence(name: str, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        get_cache_spec(name)
    assert message in str(raised.value)
    assert str(raised.value).startswith(f"Cannot read the cache name {name!r}")


@pytest.mark.parametrize("name", ["nope", "nope@3", "dynamic@2", "h2o0.2"])
def test_unknown_names_list_the_fixed_names_and_the_families(name: str) -> None:
    with pytest.raises(ValueError) as raised:
        get_cache_spec(name)
    text = str(raised.value)
    assert text.startswith(f"Unknown cache {name!r}; names: dynamic, paged, paged-attn,")
    assert "h2o@..." in text and "sink@..." in text and "disk@..." in text and "kvgov demo --list-caches" in text
    assert len(text) < 600  # one readable line: each family's forms are in `kvgov demo --list-caches`


def test_a_layer_map_file_names_a_cache_with_its_formats(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from hf_kvgov import QuantConfig

    path = tmp_path / "map.json"
    path.write_text('{"quant_config": {"bits": 8, "layer_formats": {"1": "int4"}}}', encoding="utf-8")
    spec = get_cache_spec(f"quant@{path}")
    cache = spec.build(tiny_llama())
    assert isinstance(cache, QuantizedCache) and not spec.lossless
    assert cache.quant == QuantConfig(bits=8, layer_formats={1: "int4"})
    assert "int4" in spec.description
    with pytest.raises(ValueError, match=r"Cannot read a QuantConfig from .*missing\.json"):
        get_cache_spec(f"quant@{tmp_path / 'missing.json'}")
