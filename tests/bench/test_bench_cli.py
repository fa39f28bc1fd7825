"""`kvgov bench speed|capacity` through the main entry point, on the tiny model saved as a directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_kvgov.cli.main import build_parser, main
from tests.bench.conftest import BYTES_PER_BLOCK

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC


def test_speed_writes_json_table_and_plots(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plots = tmp_path / "speed.json", tmp_path / "plots"
    argv = ["bench", "speed", "--model", str(tiny_dir), "--caches", "paged", "--contexts", "16,24"]
    argv += ["--batches", "1", "--new-tokens", "2", "--rounds", "1", "--json", str(out), "--plots", str(plots)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| 1 | 24 | paged |" in printed and f"Wrote {out}" in printed
    report = json.loads(out.read_text())
    assert report["model"] == str(tiny_dir) and report["config"]["caches"] == ["dynamic", "paged"]
    rows = [(r["cache"], r["context"], r["batch"]) for r in report["rows"]]
    assert rows == [("dynamic", 16, 1), ("paged", 16, 1), ("dynamic", 24, 1), ("paged", 24, 1)]
    assert [r["kv_bytes"] for r in report["rows"] if r["cache"] == "paged"] == [2 * BYTES_PER_BLOCK] * 2  # 17, 25
    assert _is_png(plots / "memory_vs_context.png") and _is_png(plots / "tokens_per_s.png")


def test_capacity_writes_json_table_and_plot(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "capacity.json"
    budget = f"{12 * BYTES_PER_BLOCK + 100}B"
    argv = ["bench", "capacity", "--model", str(tiny_dir), "--caches", "paged", "--lengths", "40,7,7"]
    argv += ["--budget", budget, "--json", str(out), "--plots", str(tmp_path)]
    assert main(argv) == 0
    assert "| paged | pool refused | 6 | 7 |" in capsys.readouterr().out
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["sequences"], row["predicted_sequences"]) == (6, 7)
    assert _is_png(tmp_path / "capacity.png")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["speed", "--contexts", "0"], "--contexts takes a comma-separated list of positive integers"),
        (["speed", "--caches", "nope"], "Unknown cache 'nope'"),
        (["capacity", "--budget", "0GB"], "KV memory budget must be positive"),
        (["capacity", "--lengths", "many"], "Cannot read the sequence lengths 'many'"),
    ],
)
def test_bad_options_are_refused_before_loading_a_model(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")  # passes the name check, but no model loads from it
    assert main(["bench", *argv, "--model", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_prefix_keeps_its_options() -> None:
    args = build_parser().parse_args(["bench", "prefix", "--requests", "3", "--block-size", "8"])
    assert (args.name, args.requests, args.block_size, args.new_tokens, args.document_chars) == (
        "prefix",
        3,
        8,
        None,  # resolved to 8 new tokens by the prefix benchmark
        5000,
    )
