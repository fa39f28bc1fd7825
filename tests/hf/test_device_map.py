"""Caches on a model placed with a device map: each layer's blocks live on the device that runs the layer.

On this CPU machine the real dispatch puts every module on "cpu" (or offloads a layer to "disk", which
accelerate then runs on the CPU); layers on `torch.device("meta")` check placement where no data flows.
Two CUDA tests split the model for real and are skipped without the devices.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import dispatch_model
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_kvgov import HeavyHitterCache, PagedCache, SinkCache, eviction_attention, eviction_pool, paged_attention
from hf_kvgov.engine.attention_view import VIEW_KEY
from hf_kvgov.hf.compat import model_layer_devices
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.storage.pool import BlockPool, KVGeometry
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.tiers import DiskTier, LayerPrefetcher, TierLayout
from tests.conftest import tiny_llama

CPU, META = torch.device("cpu"), torch.device("meta")
ACCELERATOR = (torch.accelerator.current_accelerator() or torch.device("cuda")).type  # what device_map ints name
TOP = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
ALL_CPU = {**TOP, "model.layers.0": "cpu", "model.layers.1": "cpu"}


def prompts(batch: int = 2, length: int = 15) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(batch * 100 + length))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def generate(model: Any, cache: Any, inputs: dict[str, torch.Tensor], new_tokens: int = 10) -> torch.Tensor:
    device = model.get_input_embeddings().weight.device
    inputs = {k: v.to(device if device.type != "meta" else CPU) for k, v in inputs.items()}
    return model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False)


def mapped(device_map: dict[str, Any]) -> LlamaForCausalLM:
    """A tiny model carrying `device_map` as its `hf_device_map` (not dispatched: weights stay on the CPU)."""
    model = tiny_llama()
    model.hf_device_map = device_map
    return model


# ---------------------------------------------------------------- where each layer runs


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama().save_pretrained(path)
    return path


def load(how: str, saved: Path, offload: Path) -> LlamaForCausalLM:
    if how == "from_pretrained":  # one device: transformers places the weights, sets no hf_device_map
        return LlamaForCausalLM.from_pretrained(saved, device_map=ALL_CPU).eval()
    if how == "dispatch":  # accelerate's hooks on every mapped module, and model.hf_device_map
        return dispatch_model(tiny_llama(), ALL_CPU, force_hooks=True)
    # Layer 1 offloaded to disk: its weights become meta, and accelerate runs it on the main device (CPU).
    return dispatch_model(tiny_llama(), {**ALL_CPU, "model.layers.1": "disk"}, offload_dir=str(offload))


CACHES: dict[str, Callable[[Any, Path], Any]] = {
    "paged": lambda model, path: PagedCache(model, block_size=4),
    "paged_view": lambda model, path: PagedCache(model, block_size=4, attention="paged"),
    "quantized_int8": lambda model, path: QuantizedCache(model, bits=8, block_size=4),
    "disk": lambda model, path: DiskOffloadCache(model, path, hot_tokens=6, block_size=4),
}


@pytest.mark.parametrize("how", ["from_pretrained", "dispatch", "disk_offload"])
@pytest.mark.parametrize("kind", sorted(CACHES))
def test_dispatched_model_generates_as_dynamic_cache_with_blocks_on_each_layers_device(
    how: str, kind: str, saved: Path, tmp_path: Path
) -> None:
    model = load(how, saved, tmp_path / "offload")
    inputs = prompts()
    expected = generate(model, DynamicCache(), inputs)
    cache = CACHES[kind](model, tmp_path / "spill")
    assert cache.pool is not None  # every layer's device was known from the model: the pool exists up front
    with paged_attention(model) if cache.attention == "paged" else contextlib.nullcontext():
        got = generate(model, cache, inputs)
    assert torch.equal(got, expected)
    assert cache.pool.geometry.layer_devices == (CPU, CPU)
    assert [t.device for t in cache.pool.keys + cache.pool.values] == [CPU] * 4
    if kind == "quantized_int8":
        assert cache.stats().sealed_blocks > 0
        assert {t.device for pieces in cache.pool.sealed.pieces for t in pieces.values()} == {CPU}
    if kind == "disk":
        stats = cache.stats()
        assert stats.spills > 0 and stats.prefetched > 0
        cache.release()


@pytest.mark.parametrize(
    ("device_map", "expected"),
    [
        ({**TOP, "model.layers.0": 0, "model.layers.1": 1}, [(ACCELERATOR, 0), (ACCELERATOR, 1)]),
        ({"model": 1, "lm_head": 0}, [(ACCELERATOR, 1), (ACCELERATOR, 1)]),
        ({"": "cpu"}, [("cpu", None), ("cpu", None)]),
        # Offloaded layers run on accelerate's main device: the first entry that is not offloaded.
        ({**TOP, "model.layers.0": "cuda:1", "model.layers.1": "cpu"}, [("cuda", 1), ("cuda", 1)]),
        ({**TOP, "model.layers.0": "disk", "model.layers.1": 0}, [(ACCELERATOR, 0), (ACCELERATOR, 0)]),
        # A layer split between devices: its attention (where K/V come from) decides.
        (
            {**TOP, "model.layers.0": 0, "model.layers.1.mlp": 0, "model.layers.1.self_attn": "cuda:1"},
            [(ACCELERATOR, 0), ("cuda", 1)],
        ),
    ],
)
def test_layer_devices_follow_hf_device_map(device_map: dict[str, Any], expected: list[tuple[str, Any]]) -> None:
    devices = model_layer_devices(mapped(device_map), 2)
    assert [(d.type, d.index) for d in devices if d is not None] == expected


def test_device_map_prefixes_match_whole_module_names() -> None:
    with torch.device("meta"):  # 11 layers cost nothing on meta; only the module names matter
        model = LlamaForCausalLM(
            LlamaConfig(num_hidden_layers=11, hidden_size=8, num_attention_heads=2, intermediate_size=8, vocab_size=8)
        )
    model.hf_device_map = {"model.layers.1": "cuda:1", "model.layers.10": "cuda:2", "model": "cuda:0"}
    devices = model_layer_devices(model, 11)
    assert [d.index if d is not None else None for d in devices] == [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2]


def test_without_a_device_map_parameters_decide_and_a_config_defers_to_the_kv() -> None:
    model = tiny_llama()
    assert model_layer_devices(model, 2) == (CPU, CPU)
    model.model.layers[1].to(META)  # weights not materialised: the first K/V will tell
    assert model_layer_devices(model, 2) == (CPU, None)
    assert model_layer_devices(model.config, 2) == (None, None)


# ---------------------------------------------------------------- placement and the mismatch error

SPLIT = {**TOP, "model.layers.0": "cpu", "model.layers.1": "meta"}


@pytest.mark.parametrize("kind", ["paged", "quantized", "disk"])
def test_cache_allocates_each_layer_on_its_mapped_device(kind: str, tmp_path: Path) -> None:
    model = mapped(SPLIT)
    if kind == "paged":
        cache: PagedCache = PagedCache(model, block_size=4)
    elif kind == "quantized":
        cache = QuantizedCache(model, bits=8, block_size=4)
    else:
        cache = DiskOffloadCache(model, tmp_path, block_size=4)
    assert cache.pool is not None and cache.pool.geometry.layer_devices == (CPU, META)
    cache.pool.allocate(5)
    assert [t.device for t in cache.pool.keys + cache.pool.values] == [CPU, META] * 2
    assert tuple(cache.pool.keys[1].shape) == (cache.pool.capacity, 4, 2, 16)
    if isinstance(cache.pool, QuantizedBlockPool):
        assert [next(iter(p.values())).device for p in cache.pool.sealed.pieces] == [CPU, META]


@pytest.mark.parametrize("attention", ["contiguous", "paged"])
def test_kv_arriving_on_another_device_than_the_layers_blocks_is_refused(attention: str) -> None:
    model = mapped(SPLIT)  # the map says meta, but the weights (so the K/V) are on the CPU
    cache = PagedCache(model, block_size=4, attention=attention)  # type: ignore[arg-type]
    with (
        paged_attention(model) if attention == "paged" else contextlib.nullcontext(),
        pytest.raises(ValueError, match=r"Layer 1 stored K/V on cpu, but this cache keeps layer 1's blocks on meta"),
    ):
        generate(model, cache, prompts(batch=1))
    assert cache.pool is not None and cache.pool.layer_device(1) == META  # nothing was moved


def kv(device: torch.device, q_len: int, start: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.arange(2 * q_len * 16, dtype=torch.float32).view(1, 2, q_len, 16) + start
    return keys.to(device), (-keys).to(device)


def test_a_config_only_cache_places_each_layer_where_its_first_kv_arrive() -> None:
    cache = PagedCache(tiny_llama().config, block_size=4)
    assert cache.pool is None
    keys0, values0 = cache.update(*kv(CPU, 5), 0, kwargs={})
    keys1, _ = cache.update(*kv(META, 5), 1, kwargs={})
    assert cache.pool is not None and cache.pool.geometry.layer_devices == (CPU, META)
    assert torch.equal(keys0, kv(CPU, 5)[0]) and torch.equal(values0, kv(CPU, 5)[1])
    assert (keys1.device, tuple(keys1.shape)) == (META, (1, 2, 5, 16))
    keys0, _ = cache.update(*kv(CPU, 1, 1000.0), 0, kwargs={})
    assert torch.equal(keys0, torch.cat([kv(CPU, 5)[0], kv(CPU, 1, 1000.0)[0]], dim=2))
    with pytest.raises(ValueError, match="Layer 1 stored K/V on cpu, but this cache keeps layer 1's blocks on meta"):
        cache.update(*kv(CPU, 1), 1, kwargs={})


def test_an_adopted_pool_must_match_where_the_model_runs_each_layer() -> None:
    pool = BlockPool(KVGeometry(num_layers=2, num_kv_heads=2, head_dim=16, layer_devices=(CPU, META)), block_size=4)
    with pytest.raises(ValueError, match="layer 1: blocks on meta, layer runs on cpu"):
        PagedCache(tiny_llama(), pool=pool)
    cache = PagedCache(tiny_llama().config, pool=pool)  # devices unknown: accepted, and never re-placed
    cache.update(*kv(CPU, 3), 0, kwargs={})
    with pytest.raises(ValueError, match="Layer 1 stored K/V on cpu"):
        cache.update(*kv(CPU, 3), 1, kwargs={})
    assert pool.layer_device(1) == META


# ---------------------------------------------------------------- disk tier read-ahead


def segment(block: int, layer: int) -> bytes:
    """Eight distinct bytes per (block, layer)."""
    return bytes((16 * block + layer + i) % 256 for i in range(8))


def test_read_ahead_rows_are_split_between_the_layers_devices(tmp_path: Path) -> None:
    tier = DiskTier(TierLayout(layers=2, part_bytes=(4, 4)), tmp_path)
    blocks = [1, 2, 3]
    handles = tier.put(
        3,
        [1, 1, 1],
        lambda layer: [[memoryview(segment(b, layer))[:4], memoryview(segment(b, layer))[4:]] for b in blocks],
    )
    reader = LayerPrefetcher(tier, buffer_bytes=4 * 8, device=lambda layer: (CPU, META)[layer])
    reader.request(1, handles)  # two rows per device: layer 1 cannot take layer 0's share
    reader.request(0, handles)
    assert reader.buffer_bytes == 32
    on_cpu = [torch.zeros((3, 4), dtype=torch.uint8) for _ in range(2)]
    reader.take(0, handles, on_cpu)
    assert [bytes(k.numpy()) + bytes(v.numpy()) for k, v in zip(*on_cpu, strict=True)] == [
        segment(b, 0) for b in blocks
    ]
    assert (reader.prefetched, reader.on_demand) == (2, 1)
    on_meta = [torch.empty((3, 4), dtype=torch.uint8, device=META) for _ in range(2)]
    reader.take(1, handles, on_meta)  # read into the meta layer's rows, then "copied" to its device
    assert (reader.prefetched, reader.on_demand) == (4, 2)
    reader.close()
    tier.close()


# ---------------------------------------------------------------- eviction caches


@pytest.mark.parametrize("kind", ["h2o", "h2o_pooled", "sink"])
def test_eviction_caches_on_a_dispatched_model_equal_dynamic_cache(kind: str) -> None:
    model = dispatch_model(tiny_llama(), ALL_CPU, force_hooks=True)
    inputs = prompts(batch=1, length=13)
    expected = generate(model, DynamicCache(), inputs, new_tokens=8)
    pool = eviction_pool(model) if kind == "h2o_pooled" else None
    cache = (
        SinkCache(model, n_sink=4, window=60)
        if kind == "sink"
        else HeavyHitterCache(model, budget=64, recent=8, pool=pool)
    )
    with eviction_attention(model):
        got = generate(model, cache, inputs, new_tokens=8)
    assert torch.equal(got, expected)
    assert {t.device for layer in cache.layers for t in (layer.keys, layer.values, layer.positions, layer.valid)} == {
        CPU
    }


def test_heavy_hitter_cache_keeps_each_layers_slots_where_its_kv_arrive() -> None:
    model = tiny_llama()
    cache = HeavyHitterCache(model, budget=6, recent=2)
    with eviction_attention(model):
        for step, q_len in enumerate((5, 1, 1, 1)):
            first = 0 if step == 0 else 4 + step
            for layer, device in ((0, CPU), (1, META)):
                attn_kwargs: dict[str, Any] = {"position_ids": torch.arange(first, first + q_len)[None].to(device)}
                cache.update(*kv(device, q_len), layer, kwargs=attn_kwargs)
                attn_kwargs[VIEW_KEY].attend(torch.ones(1, 4, q_len, 16, device=device), None, 0.25, None)
    for layer, device in zip(cache.layers, (CPU, META), strict=True):
        kept = (layer.keys, layer.values, layer.positions, layer.valid, layer.scores)
        assert [t.device for t in kept] == [device] * 5
        assert tuple(layer.keys.shape) == (1, 2, 6, 16)


# ---------------------------------------------------------------- real splits (CUDA)

CUDA_CACHES = {k: CACHES[k] for k in ("paged", "paged_view", "quantized_int8", "disk")}


def assert_blocks_follow(cache: Any, devices: list[torch.device]) -> None:
    assert [t.device for t in cache.pool.keys] == devices and [t.device for t in cache.pool.values] == devices
    if isinstance(cache.pool, QuantizedBlockPool):
        assert [next(iter(p.values())).device for p in cache.pool.sealed.pieces] == devices


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("kind", sorted(CUDA_CACHES))
def test_model_split_over_two_gpus_keeps_each_layers_blocks_on_its_gpu(kind: str, saved: Path, tmp_path: Path) -> None:
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    model = LlamaForCausalLM.from_pretrained(saved, device_map=device_map).eval()
    inputs = prompts()
    expected = generate(model, DynamicCache(), inputs)
    cache = CUDA_CACHES[kind](model, tmp_path)
    with paged_attention(model) if cache.attention == "paged" else contextlib.nullcontext():
        got = generate(model, cache, inputs)
    assert torch.equal(got, expected)
    assert_blocks_follow(cache, [torch.device("cuda", 0), torch.device("cuda", 1)])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(CUDA_CACHES))
def test_model_split_between_gpu_and_cpu_keeps_each_layers_blocks_on_its_device(kind: str, tmp_path: Path) -> None:
    # main_device="cpu": accelerate runs the "cpu" modules on the CPU instead of offloading them to the GPU.
    device_map = {**ALL_CPU, "model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0}
    model = dispatch_model(tiny_llama(), device_map, main_device="cpu")
    inputs = prompts()
    expected = generate(model, DynamicCache(), inputs)
    cache = CUDA_CACHES[kind](model, tmp_path)
    with paged_attention(model) if cache.attention == "paged" else contextlib.nullcontext():
        got = generate(model, cache, inputs)
    assert torch.equal(got, expected)
    assert_blocks_follow(cache, [torch.device("cuda", 0), CPU])


def test_an_eviction_pool_for_a_model_on_several_devices_says_its_slots_cross_them() -> None:
    """The pool keeps every layer's slots in one tensor, on the first parameter's device: a model whose layers run
    elsewhere is told that its slots are copied there and back each step (its tokens stay right, as tested above)."""
    with pytest.warns(UserWarning, match=r"layers run on .*cuda:1 too, and the pool keeps every layer's slots on cpu"):
        eviction_pool(mapped({**TOP, "model.layers.0": 0, "model.layers.1": "cuda:1"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eviction_pool(mapped({"": "cpu"}))  # one device: nothing to say
