"""`kvgov plan`'s ``recall`` step: the chain models what hf_kvgov builds for a policy with ``spill=Disk(path)``.

That cache (`GovernedCache(pool=Paging(16), codec="int8", policy=HeavyHitter(0.2), spill=Disk(path))`) keeps H2O's
slots in pool blocks and writes what it evicts to disk pages it recalls from; the chain's step must count the
same bytes as the planner's model of that very cache object (`planner_setup`, which the chain bench checks
against the cache's own bytes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_kvgov import GovernedCache
from hf_kvgov.bench.plan_setups import planner_geometry, planner_setup
from hf_kvgov.chain import Disk, HeavyHitter, Paging
from hf_kvgov.planner.accounting import SequenceBytes, sequence_bytes
from hf_kvgov.planner.chain import (
    DEFAULT_RECALL_PAGE_TOKENS,
    DEFAULT_RECALL_PAGES,
    ChainOptions,
    build_chain,
    parse_chain,
)
from hf_kvgov.planner.geometry import ModelGeometry
from hf_kvgov.planner.setup import DEFAULT_RECALL_SUMMARY
from hf_kvgov.tiers.recall_pages import DEFAULT_PAGE_TOKENS, DEFAULT_SUMMARY, Recall
from hf_kvgov.tiers.recall_pages import DEFAULT_RECALL_PAGES as TIER_RECALL_PAGES
from tests.conftest import tiny_llama
from tests.planner.test_planner_cli import _run


def test_the_planner_defaults_are_the_recall_tier_defaults() -> None:
    assert (DEFAULT_RECALL_PAGES, DEFAULT_RECALL_PAGE_TOKENS) == (TIER_RECALL_PAGES, DEFAULT_PAGE_TOKENS)
    assert DEFAULT_RECALL_SUMMARY == DEFAULT_SUMMARY == Recall().summary == "centroid"


def test_recall_needs_h2o_before_it_and_excludes_block_spill() -> None:
    assert parse_chain("static,paged,int8,h2o,recall")[-1] == "recall"
    with pytest.raises(ValueError, match="'h2o' must come before it"):
        parse_chain("paged,int8,recall")
    with pytest.raises(ValueError, match="'h2o' must come before it"):
        parse_chain("paged,recall,h2o")
    with pytest.raises(ValueError, match="list one"):
        parse_chain("paged,h2o,spill,recall")
    with pytest.raises(ValueError, match="recall_pages must be an int >= 0"):
        ChainOptions(max_len=4096, recall_pages=-1)


@pytest.mark.parametrize("length", [40, 333, 1000])
def test_the_recall_step_counts_what_the_built_cache_holds(tmp_path: Path, length: int) -> None:
    model = tiny_llama()
    cache = GovernedCache(model, pool=Paging(16), codec="int8", policy=HeavyHitter(0.2), spill=Disk(path=str(tmp_path)))
    built = planner_setup(cache, "fp32")
    geometry = planner_geometry(model)
    assert built is not None and geometry is not None and built.recall_pages == DEFAULT_RECALL_PAGES
    options = ChainOptions(max_len=4096, kv_dtype="fp32", h2o_recent=built.h2o_recent)
    steps = {name: setup for name, _, setup in build_chain(parse_chain("paged,int8,h2o,recall"), options)}
    planned = sequence_bytes(geometry, steps["recall"], length)
    assert planned == sequence_bytes(geometry, built, length)
    # Past the first page of evicted tokens the recall tier holds bytes on disk and on the accelerator.
    if length >= 333:
        assert planned.disk > 0 and planned.device > sequence_bytes(geometry, steps["h2o"], length).device / 2


def test_kvgov_plan_prints_the_recall_step(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "SmolLM2-135M", "--chain", "static,paged,int8,h2o,recall", "--recall-pages", "4"]
    assert _run([*argv, "--lengths", "2048"]) == 0
    out = capsys.readouterr().out
    assert "+ evicted tokens to disk, 4 pages of 16 recalled per step" in out


def test_kvgov_plan_refuses_recall_without_h2o_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "SmolLM2-135M", "--chain", "paged,recall"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'h2o' must come before it" in err


def _planned_as_built(
    tmp_path: Path, field: str, values: tuple[str, ...]
) -> tuple[ModelGeometry, dict[str, SequenceBytes]]:
    """(geometry, {value: planned bytes of 1,000 tokens}) for an int8 H2O 20% recall chain with the recall field
    `field` ("summary" or "buffer") at each value; checks the planner's step equals the built cache's setup."""
    model = tiny_llama()
    geometry = planner_geometry(model)
    assert geometry is not None
    planned: dict[str, SequenceBytes] = {}
    for value in values:
        spill = Disk(path=str(tmp_path / value), **{f"recall_{field}": value})
        cache = GovernedCache(model, pool=Paging(16), codec="int8", policy=HeavyHitter(0.2), spill=spill)
        built = planner_setup(cache, "fp32")
        assert built is not None and getattr(built, f"recall_{field}") == value
        options = ChainOptions(max_len=4096, kv_dtype="fp32", h2o_recent=built.h2o_recent, **{f"recall_{field}": value})
        steps = {name: setup for name, _, setup in build_chain(parse_chain("paged,int8,h2o,recall"), options)}
        planned[value] = sequence_bytes(geometry, steps["recall"], 1000)
        assert planned[value] == sequence_bytes(geometry, built, 1000)
    return geometry, planned


def test_the_recall_summary_follows_the_built_cache_and_a_centroid_is_one_key_row_per_page(tmp_path: Path) -> None:
    geometry, planned = _planned_as_built(tmp_path, "summary", ("centroid", "bounds"))
    # H2O keeps 200 of 1,000 tokens, so 800 are evicted: 50 pages written per layer and KV head, plus 16 spare
    # table entries. Bounds keep a second key row (head_dim fp32 values) for each.
    layers, kv_heads, head_dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    extra = layers * kv_heads * (50 + 16) * head_dim * 4
    assert planned["bounds"].device - planned["centroid"].device == extra
    assert planned["bounds"].disk == planned["centroid"].disk


def test_kvgov_plan_takes_the_recall_summary_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "SmolLM2-135M", "--chain", "paged,int8,h2o,recall", "--lengths", "2048"]
    assert _run([*argv, "--recall-summary", "bounds"]) == 0
    assert "key range (min and max)" in capsys.readouterr().out
    assert _run(argv) == 0
    assert "whose mean key stays resident" in capsys.readouterr().out
    assert _run([*argv, "--recall-summary", "mean"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "recall_summary must be one of bounds, centroid; got 'mean'" in err


def test_a_shared_recall_buffer_is_counted_once_per_sequence_as_the_built_cache_holds_it(tmp_path: Path) -> None:
    geometry, planned = _planned_as_built(tmp_path, "buffer", ("layer", "shared"))
    # 800 evicted tokens write 50 pages per layer and KV head, so each buffer holds 8 pages of 16 tokens (K, V in
    # fp32 and an int64 position each); shared, one layer's buffers are held instead of every layer's.
    layers, kv_heads, head_dim = geometry.num_layers, geometry.num_kv_heads, geometry.head_dim
    one_layer = kv_heads * DEFAULT_RECALL_PAGES * 16 * (2 * head_dim * 4 + 8)
    assert planned["layer"].device - planned["shared"].device == (layers - 1) * one_layer
    assert planned["layer"].disk == planned["shared"].disk


def test_kvgov_plan_takes_the_recall_buffer_and_refuses_an_unknown_one(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "SmolLM2-135M", "--chain", "paged,int8,h2o,recall", "--lengths", "2048"]
    assert _run([*argv, "--recall-buffer", "shared"]) == 0
    assert "one buffer the layers share (one layer's pages)" in capsys.readouterr().out
    assert _run([*argv, "--recall-buffer", "global"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "recall_buffer must be one of layer, shared; got 'global'" in err
