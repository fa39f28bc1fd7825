"""Bytes per kind of layer (the library's layer groups) in the planner and in `kvgov plan`'s output."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hf_kvgov.cli import plan as plan_cli
from hf_kvgov.planner import CacheSetup, ChainOptions, MemoryBudget, PlanInputs, fixed, make_plan, resolve_model
from hf_kvgov.planner.groups import group_bytes
from hf_kvgov.planner.lengths import parse_lengths
from hf_kvgov.planner.report import group_lengths

PAGED = CacheSetup()  # 16-token blocks, fp16


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgov")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    return args.func(args)


def _per_kind(model: str, length: int, setup: CacheSetup = PAGED) -> dict[int | None, tuple[int, int, int, int]]:
    """window -> (layers, groups, tokens per layer, bytes per sequence)."""
    groups = group_bytes(resolve_model(model), setup, length)
    return {k.window: (k.layers, k.groups, k.tokens, k.bytes_per_sequence) for k in groups.kinds}


@pytest.mark.parametrize("length", [1024, 4096, 8192])
def test_gemma3_270m_by_hand(length: int) -> None:
    # One token of one Gemma-3-270M layer: K and V x 1 KV head x head_dim 256 x 2 B (fp16) = 1,024 B.
    # Layer groups: 15 sliding layers and 3 full ones (5, 11, 17), gcd 3: five sliding groups, one full.
    # A full layer holds all L tokens (L is a whole number of 16-token blocks): 3 x L x 1,024 B.
    # A sliding layer: the newest query, at L - 1, sees from L - 512 on, which starts a block, so the layer
    # keeps exactly the last 512 tokens at each of these lengths: 15 x 512 x 1,024 = 7,864,320 B.
    kinds = _per_kind("Gemma-3-270M", length)
    assert kinds == {512: (15, 5, 512, 7_864_320), None: (3, 1, length, 3 * length * 1024)}
    groups = group_bytes(resolve_model("Gemma-3-270M"), PAGED, length)
    assert groups.group_size == 3
    assert groups.bytes_per_sequence == 7_864_320 + 3 * length * 1024
    sliding = groups.kinds[0]
    assert sliding.bytes_per_token == 7_864_320 / length
    assert sliding.share == 7_864_320 / groups.bytes_per_sequence


def test_a_length_between_blocks_keeps_the_block_holding_the_window_start() -> None:
    # L = 1,000: a full layer holds ceil(1000 / 16) = 63 blocks, 1,008 slots. The query at 999 sees from
    # 488 on, inside block 30 (480..495), so a sliding layer keeps blocks 30..62: 1,008 - 480 = 528 slots.
    kinds = _per_kind("Gemma-3-270M", 1000)
    assert kinds == {512: (15, 5, 528, 15 * 528 * 1024), None: (3, 1, 1008, 3 * 1008 * 1024)}


def test_gpt_oss_and_mistral_by_hand() -> None:
    # gpt-oss: 8 KV heads x head_dim 64: 2 x 8 x 64 x 2 B = 2,048 B per token and layer; sliding and full
    # layers alternate (12 + 12 in the 20b, one group each). At 4,096 the query at 4,095 sees from 3,968 on
    # (a block start), so a sliding layer keeps 128 tokens.
    assert _per_kind("gpt-oss-20b", 4096) == {128: (12, 1, 128, 12 * 128 * 2048), None: (12, 1, 4096, 12 * 4096 * 2048)}
    assert _per_kind("openai/gpt-oss-120b", 4096) == {
        128: (18, 1, 128, 18 * 128 * 2048),
        None: (18, 1, 4096, 18 * 4096 * 2048),
    }
    # Mistral-7B v0.1: 32 layers, all sliding over 4,096: 2 x 8 x 128 x 2 B = 4,096 B per token and layer.
    # At 8,192 a layer keeps the last 4,096 tokens; at 2,048 (shorter than the window) all of them.
    assert _per_kind("Mistral-7B", 8192) == {4096: (32, 1, 4096, 32 * 4096 * 4096)}
    assert _per_kind("Mistral-7B", 2048) == {4096: (32, 1, 2048, 32 * 2048 * 4096)}


def test_gpt_oss_catalog_entries() -> None:
    small, large = resolve_model("openai/gpt-oss-20b"), resolve_model("gpt-oss-120b")
    assert small.layer_windows() == (128, None) * 12 and large.layer_windows() == (128, None) * 18
    assert (small.num_params, large.num_params) == (20_914_757_184, 116_829_156_672)
    assert (small.num_kv_heads, small.head_dim, small.max_position_embeddings) == (8, 64, 131072)


def test_static_buffers_hold_max_len_and_the_window() -> None:
    static = CacheSetup(paged=False, max_len=2048)
    assert _per_kind("Gemma-3-270M", 100, static) == {
        512: (15, 5, 512, 15 * 512 * 1024),
        None: (3, 1, 2048, 3 * 2048 * 1024),
    }


@pytest.mark.parametrize("model", ["Gemma-3-270M", "gpt-oss-20b", "gpt-oss-120b", "Mistral-7B", "Llama-3-8B"])
@pytest.mark.parametrize("length", [1, 1000, 4096, 8192, 20_000])
def test_kinds_add_up_to_the_static_and_paged_steps(model: str, length: int) -> None:
    geometry = resolve_model(model)
    options = ChainOptions(max_len=32_768)
    plan = make_plan(PlanInputs(geometry, MemoryBudget(10**12, 0), fixed(length)), ("static", "paged"), options)
    paged = CacheSetup(max_len=32_768)
    static = CacheSetup(paged=False, max_len=32_768)
    assert group_bytes(geometry, paged, length).bytes_per_sequence == plan.step("paged").bytes_per_sequence
    assert group_bytes(geometry, static, length).bytes_per_sequence == plan.step("static").bytes_per_sequence


def test_only_plain_setups_and_positive_lengths() -> None:
    geometry = resolve_model("Gemma-3-270M")
    with pytest.raises(ValueError, match="plain paged or static cache"):
        group_bytes(geometry, CacheSetup(codec="int8"), 100)
    with pytest.raises(ValueError, match="positive int"):
        group_bytes(geometry, PAGED, 0)
    with pytest.raises(ValueError, match="does not fit a static buffer"):
        group_bytes(geometry, CacheSetup(paged=False, max_len=64), 65)


def test_which_lengths_get_a_table() -> None:
    assert group_lengths(parse_lengths("8192")) == [(8192, "the length of every sequence")]
    assert [n for n, _ in group_lengths(parse_lengths("300,1200,300"))] == [300, 1200]
    assert group_lengths(parse_lengths("100,200,300,401")) == [(250, "the mean length")]


def _layer_types(pattern: list[str], num_layers: int) -> list[str]:
    return (pattern * num_layers)[:num_layers]


def _gpt_oss_config() -> dict[str, Any]:
    return {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "sliding_window": 128,
        "layer_types": _layer_types(["sliding_attention", "full_attention"], 24),
        "max_position_embeddings": 131072,
    }


def _mistral_config() -> dict[str, Any]:
    return {
        "model_type": "mistral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "max_position_embeddings": 32768,
        "vocab_size": 32000,
    }


@pytest.mark.parametrize(("config", "builtin"), [(_gpt_oss_config(), "gpt-oss-20b"), (_mistral_config(), "Mistral-7B")])
def test_a_config_json_gives_the_builtin_groups(tmp_path: Path, config: dict[str, Any], builtin: str) -> None:
    path = tmp_path / "model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    loaded, known = resolve_model(str(path)), resolve_model(builtin)
    assert loaded.layer_windows() == known.layer_windows()
    assert group_bytes(loaded, PAGED, 5000) == group_bytes(known, PAGED, 5000)


def test_cli_prints_the_table_and_writes_the_json_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpt-oss" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(_gpt_oss_config()))
    target = tmp_path / "plan.json"
    argv = ["--model", str(path), "--params", "20.9B", "--lengths", "4096", "--chain", "static,paged"]
    assert _run([*argv, "--json", str(target)]) == 0
    out = capsys.readouterr().out
    assert "Layer groups at 4,096 tokens (the length of every sequence): groups of 12 layers" in out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    assert rows["sliding window"][2:6] == ["128", "12", "1", "128"]
    assert rows["full attention"][-1] == "97%"
    data = json.loads(target.read_text())
    (groups,) = data["layer_groups"]
    assert (groups["at"], groups["length"], groups["group_size"]) == ("the length of every sequence", 4096, 12)
    assert [(k["window"], k["layers"], k["bytes_per_sequence"]) for k in groups["kinds"]] == [
        (128, 12, 12 * 128 * 2048),
        (None, 12, 12 * 4096 * 2048),
    ]
    assert groups["bytes_per_sequence"] == data["steps"][1]["bytes_per_sequence"]


def test_a_model_without_windows_prints_no_group_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.json"
    assert _run(["--model", "Llama-3-8B", "--lengths", "4096", "--json", str(target)]) == 0
    assert "Layer groups" not in capsys.readouterr().out
    assert json.loads(target.read_text())["layer_groups"] == []


def test_the_planner_still_loads_without_torch() -> None:
    # The planner takes the window formula from hf_kvgov.storage.layer_groups, which must stay torch-free.
    code = "import sys, hf_kvgov.planner; assert 'torch' not in sys.modules, 'the planner imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_kv_sharing_config_counts_the_layers_that_cache(tmp_path: Path) -> None:
    """Gemma-3n's last `num_kv_shared_layers` layers reuse earlier layers' K/V and store none: the plan counts the
    others (as the block caches now hold them; `tests/hf/test_model_families.py` checks a built cache against it)
    and names the rest."""
    config = {
        "model_type": "gemma3n_text", "num_hidden_layers": 35, "num_kv_shared_layers": 15, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 256, "sliding_window": 512, "max_position_embeddings": 32768,
        "layer_types": _layer_types(["sliding_attention"] * 4 + ["full_attention"], 35),
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    geometry = resolve_model(str(path))
    assert (geometry.num_layers, geometry.shared_kv_layers) == (20, 15)
    assert geometry.layer_windows() == tuple(None if i % 5 == 4 else 512 for i in range(20))
    assert geometry.kv_bytes_per_token("fp16") == 2 * 20 * 2 * 256 * 2
    assert (
        "20 layers" in geometry.describe()
        and "and 15 more layers that reuse earlier layers' K/V" in geometry.describe()
    )
    # The eviction caches refuse such a model (tests/hf/test_model_families.py): the H2O row says so.
    out = subprocess.run(
        [sys.executable, "-m", "hf_kvgov.cli.main", "plan", "--model", str(path), "--memory", "24GiB", "--params",
         "4e9", "--chain", "paged,int8,h2o"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "eviction caches (HeavyHitterCache, PolicyCache, SinkCache) refuse it" in out
