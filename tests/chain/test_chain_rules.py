"""The chain's parts and rules, without a model: validation, normalisation, and every refusal."""

from __future__ import annotations

import itertools

import pytest

from hf_kvgov.chain import ChainParts, ChainRefused, Disk, Evict, HeavyHitter, Layer, Paging, Sink
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.engine.rules import LAYOUTS, REFUSED_PAIRS, layout_for
from hf_kvgov.policies import HeadAdaptive
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool, KVGeometry

LINKS = ("pool", "prefix", "codec", "policy", "spill")


def a_part(link: str, block_size: int = 16) -> dict[str, object]:
    """One link of a chain, as GovernedCache's keyword arguments."""
    if link == "pool":
        return {"pool": Paging(block_size=block_size)}
    if link == "prefix":
        return {"prefix": PrefixCache(BlockPool(KVGeometry(2, 2, 8), block_size=block_size))}
    if link == "codec":
        return {"codec": "int8"}
    if link == "policy":
        return {"policy": HeavyHitter(0.2)}
    return {"spill": Disk()}  # defaults: a block tier without a policy, a recall tier with one


def parts_of(*links: str) -> ChainParts:
    kwargs: dict[str, object] = {}
    for link in links:
        kwargs.update(a_part(link))
    return ChainParts.of(**kwargs)  # type: ignore[arg-type]


# Which storage layout serves each combination that works, written out by hand (not derived from the table):
# every chain without a policy is the block store (its codec and disk tier are links of that store); every
# chain with a policy keeps per-head slots: in the pool's blocks, a shared prefix read as computed, what it
# evicts spilled and recalled.
EXPECTED_LAYOUT = {
    **{
        tuple(link for link in LINKS if link in others): "blocks"
        for size in range(len(LINKS))
        for others in itertools.combinations(("pool", "prefix", "codec", "spill"), size)
    },
    **{
        tuple(link for link in LINKS if link in {"policy", *others}): "slots"
        for size in range(len(LINKS))
        for others in itertools.combinations(("pool", "prefix", "codec", "spill"), size)
    },
}


@pytest.mark.parametrize("size", range(len(LINKS) + 1))
def test_every_combination_is_built_or_refused_with_a_reason(size: int) -> None:
    for links in itertools.combinations(LINKS, size):
        parts = parts_of(*links)
        assert parts.present == frozenset(links)
        if links in EXPECTED_LAYOUT:
            assert layout_for(parts).name == EXPECTED_LAYOUT[links]
            continue
        with pytest.raises(ChainRefused, match="A chain cannot have both") as refused:
            layout_for(parts)
        named = [link for link in links if f"{link}=" in str(refused.value)]
        assert len(named) == 2, str(refused.value)  # the sentence names the two links that clash


def test_the_refusal_table_covers_exactly_the_combinations_no_layout_serves() -> None:
    for pair in itertools.combinations(LINKS, 2):
        served = any(set(pair) <= m.accepts for m in LAYOUTS)
        assert (frozenset(pair) in REFUSED_PAIRS) == (not served), pair


def test_codec_names_and_layer_overrides_normalise_to_one_quant_config() -> None:
    parts = ChainParts.of(codec="int4", layers={1: Layer(full_precision=True)})
    assert parts.codec == QuantConfig(bits=4, fmt="int", full_precision_layers=(1,))
    merged = ChainParts.of(codec=QuantConfig(full_precision_layers=(0,)), layers={2: Layer(full_precision=True)})
    assert merged.codec is not None and merged.codec.full_precision_layers == (0, 2)
    assert merged.overrides() == {0: Layer(full_precision=True), 2: Layer(full_precision=True)}
    assert ChainParts.of(codec="fp8").codec == QuantConfig(bits=8, fmt="fp8")
    assert ChainParts.of(codec="fp8_e5m2").codec == QuantConfig(bits=8, fmt="fp8_e5m2")


def test_kwargs_round_trip() -> None:
    parts = ChainParts.of(
        codec="int8", policy=HeavyHitter(64), layers={0: Layer(full_precision=True, budget=1.0)}, attention="contiguous"
    )
    assert ChainParts.of(**parts.kwargs()) == parts


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layers": {0: Layer(full_precision=True)}}, "no codec"),
        ({"layers": {0: Layer(budget=0.5)}}, "no eviction policy"),
        ({"spill": Disk(), "pool": Paging(max_tokens=1024)}, "max_resident_bytes"),
        ({"policy": Sink(4, 60), "attention": "paged"}, "always attends with the hf_kvgov attention"),
    ],
)
def test_overrides_and_knobs_that_cannot_apply_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ChainRefused, match=message):
        layout_for(ChainParts.of(**kwargs))  # type: ignore[arg-type]


def test_a_disk_tier_with_a_tree_draws_from_the_trees_pool() -> None:
    tree = PrefixCache(BlockPool(KVGeometry(2, 2, 8), block_size=16))
    assert layout_for(ChainParts.of(prefix=tree, pool=tree.pool, spill=Disk(hot_tokens=64))).name == "blocks"
    with pytest.raises(ChainRefused, match=r"Disk\(max_resident_bytes=65536\) cannot cap a disk tier with prefix="):
        layout_for(ChainParts.of(prefix=tree, spill=Disk(max_resident_bytes=65536)))
    with pytest.raises(ChainRefused, match="prefix= brings its own pool, whose cap applies"):
        layout_for(ChainParts.of(prefix=tree, pool=Paging(16, max_tokens=1024), spill=Disk()))
    other = BlockPool(KVGeometry(2, 2, 8), block_size=16)
    with pytest.raises(ChainRefused, match="pass that same pool as pool="):
        layout_for(ChainParts.of(prefix=tree, pool=other, spill=Disk()))


def test_a_disk_tier_of_codes_takes_a_tree_and_full_precision_layers() -> None:
    tree = PrefixCache(BlockPool(KVGeometry(2, 2, 8), block_size=16))
    assert layout_for(ChainParts.of(prefix=tree, codec="int8", spill=Disk())).name == "blocks"
    with pytest.raises(ChainRefused, match=r"Disk\(max_resident_bytes=65536\) cannot cap a disk tier with prefix="):
        layout_for(ChainParts.of(prefix=tree, codec="int8", spill=Disk(max_resident_bytes=65536)))
    with pytest.raises(ChainRefused, match="differs from the prefix tree's 16-token blocks"):
        layout_for(ChainParts.of(prefix=tree, pool=Paging(block_size=4), codec="int8", spill=Disk()))
    parts = ChainParts.of(codec="int4", spill=Disk(), layers={1: Layer(full_precision=True)})
    assert layout_for(parts).name == "blocks"


def test_layer_outside_the_model_is_refused() -> None:
    parts = ChainParts.of(codec="int8", layers={5: Layer(full_precision=True)})
    with pytest.raises(ChainRefused, match=r"layer 5, but the model has layers 0\.\.3"):
        layout_for(parts, num_layers=4)
    assert layout_for(parts, num_layers=6).name == "blocks"


def test_prefix_pool_must_be_the_trees_pool() -> None:
    tree = PrefixCache(BlockPool(KVGeometry(2, 2, 8), block_size=16))
    other = BlockPool(KVGeometry(2, 2, 8), block_size=16)
    with pytest.raises(ChainRefused, match="same pool"):
        layout_for(ChainParts.of(prefix=tree, pool=other))
    with pytest.raises(ChainRefused, match="same block size"):
        layout_for(ChainParts.of(prefix=tree, pool=Paging(block_size=32)))
    with pytest.raises(ChainRefused, match="its own pool, whose cap"):
        layout_for(ChainParts.of(prefix=tree, pool=Paging(max_bytes=4096)))
    assert layout_for(ChainParts.of(prefix=tree, pool=tree.pool)).name == "blocks"


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: ChainParts.of(codec="int7"), ValueError, "Unknown codec 'int7'; accepted: int8"),
        (lambda: ChainParts.of(policy="h2o"), TypeError, "policy must be a HeavyHitter or Sink or Evict"),  # type: ignore[arg-type]
        (lambda: ChainParts.of(spill="/tmp"), TypeError, "spill must be a Disk"),  # type: ignore[arg-type]
        (lambda: ChainParts.of(layers={-1: Layer()}), ValueError, "non-negative layer indices"),
        (lambda: ChainParts.of(layers={0: True}), TypeError, r"layers\[0\] must be a Layer"),  # type: ignore[dict-item]
        (lambda: ChainParts.of(attention="flash"), ValueError, "attention must be one of"),
        (lambda: Paging(block_size=0), ValueError, "Paging.block_size must be a positive int"),
        (lambda: Paging(max_tokens=64, max_bytes=64), ValueError, "not both"),
        (lambda: HeavyHitter(budget=1.5), ValueError, r"budget as a fraction must lie in \(0, 1\]"),
        (lambda: Sink(n_sink=-1), ValueError, "Sink.n_sink must be an int >= 0"),
        (lambda: Evict(policy=3), TypeError, "Evict.policy must be a policy object"),  # type: ignore[arg-type]
        (lambda: Evict("snapkv", compress="once"), ValueError, "Evict.compress must be one of"),
        (lambda: Evict("snapkv", budget=0), ValueError, "budget"),
        (lambda: Evict("snapkv", heads=0.2), TypeError, "Evict.heads must be a HeadAdaptive"),  # type: ignore[arg-type]
        (lambda: Layer(budget=0), ValueError, "at least 1"),
    ],
)
def test_bad_parts_are_named(build, error: type[Exception], message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(error, match=message):
        build()


def test_describe_follows_the_chain_order() -> None:
    tree = PrefixCache(BlockPool(KVGeometry(2, 2, 8), block_size=32))
    text = ChainParts.of(pool=Paging(32), prefix=tree, codec="int8").describe()
    assert text == "paged (32-token blocks) -> prefix sharing -> int8"
    evicting = ChainParts.of(policy=HeavyHitter(0.2), codec="int4", layers={0: Layer(budget=1.0)}).describe()
    assert evicting == "int4 -> H2O 20% -> budgets layer 0: 1.0"
    scored = ChainParts.of(policy=Evict("snapkv", 0.2, heads=HeadAdaptive()), codec="int8").describe()
    assert scored == "int8 -> evict by 'snapkv' 20% (head-adaptive budgets, floor 0.2)"
    recalling = ChainParts.of(policy=HeavyHitter(0.2), spill=Disk(recall_pages=4, recall_buffer="layer")).describe()
    assert recalling == "H2O 20% -> disk spill with recall (4 pages of 16 tokens per step, each layer's own buffer)"
    shared = ChainParts.of(policy=HeavyHitter(0.2), spill=Disk(page_tokens=8)).describe()
    assert shared == "H2O 20% -> disk spill with recall (8 pages of 8 tokens per step, one buffer the layers share)"
