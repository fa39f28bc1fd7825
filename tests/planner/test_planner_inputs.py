"""Sizes, dtypes, memory budgets, length distributions and chains as users give them, good and bad."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_kvgov.planner import (
    CacheSetup,
    ChainOptions,
    MemoryBudget,
    budget_for_model,
    lognormal,
    parse_chain,
    parse_lengths,
    parse_memory,
    resolve_model,
    weight_dtype_bytes,
)
from hf_kvgov.planner.units import format_bytes, parse_count


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GB", 80 * 10**9),
        ("80 GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("80", 80 * 2**30),
        (24, 24 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("512MiB", 512 * 2**20),
    ],
)
def test_parse_memory(text: str | int, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize("text", ["-80GB", "0GB", "0", -5])
def test_negative_or_zero_memory_is_refused(text: str | int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        parse_memory(text)


def test_unknown_memory_unit_lists_accepted_units() -> None:
    with pytest.raises(ValueError, match=r"Unknown unit 'XB'.*accepted units are b, kb, mb, gb"):
        parse_memory("80XB")
    with pytest.raises(ValueError, match="give a number and a unit"):
        parse_memory("eighty")


def test_parse_count_and_format_bytes() -> None:
    assert parse_count("13B") == 13_000_000_000
    assert parse_count("135M") == 135_000_000
    assert parse_count(7) == 7
    assert format_bytes(819_200) == "0.819 MB"
    assert format_bytes(1_677_721_600) == "1.68 GB"
    assert format_bytes(5.1e6) == "5.1 MB"
    assert format_bytes(300) == "300 B"


def test_unknown_dtype_lists_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"Unknown weight dtype 'fp12'; accepted: fp32, fp16, bf16, int8, int4\."):
        weight_dtype_bytes("fp12")
    with pytest.raises(ValueError, match=r"Unknown KV cache dtype 'int8'; accepted: fp32, fp16, bf16\."):
        CacheSetup(kv_dtype="int8")


def test_weight_bytes_per_dtype() -> None:
    assert weight_dtype_bytes("bf16") == 2.0
    # int4 codes are half a byte, plus one fp16 scale per 128 weights.
    assert weight_dtype_bytes("int4") == 0.5 + 2 / 128


def test_weights_larger_than_memory_are_refused() -> None:
    geometry = resolve_model("LLaMA-13B")
    with pytest.raises(ValueError, match=r"The weights .* do not fit: 16 GB of accelerator memory"):
        budget_for_model(geometry, parse_memory("16GB"))
    # int4 weights (~6.7 GB) do fit in 16 GB.
    assert budget_for_model(geometry, parse_memory("16GB"), "int4").kv_bytes > 0


def test_memory_budget_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        MemoryBudget(accelerator_bytes=-1, weight_bytes=0)
    with pytest.raises(ValueError, match=r"reserve is a fraction of accelerator memory in \[0, 1\)"):
        MemoryBudget(accelerator_bytes=100, weight_bytes=0, reserve_fraction=1.5)


def test_setup_and_options_check_knobs() -> None:
    with pytest.raises(ValueError, match=r"shared_fraction .* must lie in \[0, 1\)"):
        ChainOptions(max_len=16, shared_fraction=1.0)
    with pytest.raises(ValueError, match=r"h2o_budget is the fraction of tokens H2O keeps, in \(0, 1\]"):
        ChainOptions(max_len=16, h2o_budget=0.0)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        ChainOptions(max_len=16, block_size=0)
    with pytest.raises(ValueError, match="Unknown KV codec 'int3'"):
        CacheSetup(codec="int3")
    with pytest.raises(ValueError, match=r"static .* takes none of them"):
        CacheSetup(paged=False, max_len=16, codec="int8")


def test_parse_chain_orders_and_names() -> None:
    assert parse_chain("static, paged,int8") == ("static", "paged", "int8")
    with pytest.raises(ValueError, match=r"Unknown chain step\(s\) \['int9'\].*static, paged, prefix, int8"):
        parse_chain("paged,int9")
    with pytest.raises(ValueError, match="'paged' must come before them"):
        parse_chain("static,int8,paged")
    with pytest.raises(ValueError, match="can only be the first step"):
        parse_chain("paged,static")
    with pytest.raises(ValueError, match="more than one codec"):
        parse_chain("paged,int8,int4")
    with pytest.raises(ValueError, match="names a step twice"):
        parse_chain("paged,h2o,h2o")


def test_lengths_fixed_and_lists() -> None:
    assert parse_lengths("2048").lengths == (2048,)
    assert parse_lengths("fixed:512").lengths == (512,)
    assert parse_lengths("300,1200,4000").lengths == (300, 1200, 4000)
    assert parse_lengths("list:5,6").lengths == (5, 6)
    with pytest.raises(ValueError, match="must be positive integers"):
        parse_lengths("100,-5")
    with pytest.raises(ValueError, match="Cannot read the sequence lengths 'long'"):
        parse_lengths("long")


def test_lengths_from_csv_and_json(tmp_path: Path) -> None:
    (tmp_path / "with_header.csv").write_text("id,tokens\na,100\nb,300\n")
    (tmp_path / "bare.csv").write_text("7\n9\n")
    (tmp_path / "list.json").write_text(json.dumps([10, 20, 30]))
    (tmp_path / "object.json").write_text(json.dumps({"lengths": [40]}))
    assert parse_lengths(str(tmp_path / "with_header.csv")).lengths == (100, 300)
    assert parse_lengths(str(tmp_path / "bare.csv")).lengths == (7, 9)
    assert parse_lengths(str(tmp_path / "list.json")).lengths == (10, 20, 30)
    assert parse_lengths(str(tmp_path / "object.json")).lengths == (40,)
    (tmp_path / "bad.json").write_text(json.dumps({"n": 3}))
    with pytest.raises(ValueError, match="must hold a JSON list of integer lengths"):
        parse_lengths(str(tmp_path / "bad.json"))


def test_lognormal_is_seeded_bounded_and_centred_on_the_median() -> None:
    a = parse_lengths("lognormal:median=600,max=8192,seed=3,n=4000")
    assert a.lengths == lognormal(600, 8192, seed=3, n=4000).lengths
    assert a.lengths != lognormal(600, 8192, seed=4, n=4000).lengths
    assert min(a.lengths) >= 1 and a.max <= 8192
    assert 540 <= a.quantile(0.5) <= 660
    # A long tail: the mean sits well above the median (exp(sigma^2 / 2) = 1.65 for sigma 1, less the cut).
    assert a.mean > 1.3 * a.quantile(0.5)
    with pytest.raises(ValueError, match="needs median= and max="):
        parse_lengths("lognormal:median=600")
    with pytest.raises(ValueError, match=r"1 <= median <= max"):
        parse_lengths("lognormal:median=600,max=100")
