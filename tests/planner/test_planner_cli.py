"""`kvgov plan` end to end through add_parser, the article's scenario, JSON, plot and error paths."""

from __future__ import annotations

import argparse
import builtins
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hf_kvgov import QuantizedCache
from hf_kvgov.cli import plan as plan_cli
from hf_kvgov.planner.chain import codec_settings
from tests.conftest import tiny_llama


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvgov")
    plan_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["plan", *argv])
    assert args.func is plan_cli.run
    return args.func(args)


def test_brief_scenario_flags_the_article_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--scenario", "brief"]) == 0
    out = capsys.readouterr().out
    assert "819,200 B" in out and "1,677,721,600 B" in out
    claim_rows = {line.split("  ")[0]: line for line in out.splitlines() if "does NOT hold" in line}
    assert "5.1 MB" in claim_rows["KV bytes per token"]
    assert "10.4 GB" in claim_rows["KV bytes per 2,048-token user"]
    assert "6.2x too high: 2 x 40 x 40 x 128 x 2 B = 819,200 B" in out
    # The article's user counts, each next to the computed one.
    for claimed in ("64", "256 (x4.0)", "1,024 (x4.0)", "1,536 (x1.5)"):
        assert claimed in out
    assert "users, paged" in claim_rows and "64 users fit only if each holds at most" in out
    assert "Assumptions:" in out and "depends entirely on that fraction" in out


def test_brief_scenario_json_has_claims_and_steps(tmp_path: Path) -> None:
    target = tmp_path / "out" / "plan.json"
    assert _run(["--scenario", "brief", "--json", str(target)]) == 0
    data = json.loads(target.read_text())
    assert data["kv_bytes_per_token"] == 819_200
    assert [s["name"] for s in data["steps"]] == ["static", "paged", "prefix", "h2o", "int8", "spill"]
    assert data["steps"][0]["concurrent"] == data["steps"][1]["concurrent"] == 30
    per_token = data["claims"][0]
    assert (per_token["claimed"], per_token["holds"], per_token["verdict"]) == (
        "5.1 MB",
        False,
        "does NOT hold",
    )
    assert data["steps"][1]["bytes_per_sequence"] == 1_677_721_600


def test_cli_end_to_end_with_a_distribution(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plan.json"
    argv = ["--model", "SmolLM2-135M", "--memory", "24GiB", "--kv-dtype", "fp32", "--weight-dtype", "fp32"]
    argv += ["--lengths", "lognormal:median=500,max=8192,n=2000", "--json", str(target)]
    assert _run(argv) == 0
    out = capsys.readouterr().out
    assert "step" in out and "sequences" in out and "+ disk spill (hot 512 tokens)" in out
    assert "46,080 B" in out  # fp32 KV per token on the CPU runtime
    data = json.loads(target.read_text())
    steps = data["steps"]
    assert [s["name"] for s in steps] == ["static", "paged", "prefix", "int8", "h2o", "spill"]
    counts = [s["concurrent"] for s in steps]
    assert counts == sorted(counts) and counts[0] > 0
    assert steps[1]["vs_previous"] == pytest.approx(counts[1] / counts[0])
    assert data["lengths"]["count"] == 2000 and data["lengths"]["max"] <= 8192


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "plan.png"
    assert _run(["--scenario", "brief", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_gives_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert _run(["--model", "llama-7b", "--plot", str(tmp_path / "p.png")]) == 1
    assert "pip install hf-kvgov[eval]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-13b", "--memory=-80GB"], "must be positive"),
        (["--model", "llama-13b", "--memory", "16GB"], "do not fit: 16 GB of accelerator memory"),
        (["--model", "llama-13b", "--weight-dtype", "fp12"], "accepted: fp32, fp16, bf16, int8, int4"),
        (["--model", "gpt-7"], "Built-in models: LLaMA-7B, LLaMA-13B"),
        ([], "Give --model"),
        (["--model", "llama-13b", "--lengths", "4096"], "longer than the static buffer of max_len 2,048"),
        (["--scenario", "brief", "--chain", "static,paged"], "uses the article's chain"),
        (["--model", "llama-13b", "--shared-fraction", "1.2"], "must lie in [0, 1)"),
        (["--model", "llama-13b", "--scale-bytes", "3"], "fp32 (4) or one byte (1: a logarithmic scale"),
        (["--model", "llama-13b", "--residual", "-1"], "residual must be"),
        (["--model", "llama-13b", "--step-tokens", "-1"], "--step-tokens must be at least 0; got -1"),
        (["--model", "llama-13b", "--chain", "paged,int8,h2o,recall", "--scale-bytes", "1"], "keep fp16 statistics"),
    ],
)
def test_bad_input_is_a_sentence_and_exit_code_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgov plan: error: ") and message in err


def test_planner_imports_without_torch() -> None:
    # Load hf_kvgov.planner and the CLI module without running hf_kvgov/__init__ and with torch blocked.
    package_dir = Path(plan_cli.__file__).resolve().parents[1]
    code = f"""
import sys, types
sys.modules["torch"] = None
sys.modules["transformers"] = None
root = types.ModuleType("hf_kvgov"); root.__path__ = [{str(package_dir)!r}]
sys.modules["hf_kvgov"] = root
import hf_kvgov.planner, hf_kvgov.cli.plan
print(hf_kvgov.planner.resolve_model("LLaMA-13B").kv_bytes_per_token())
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "819200"


def test_params_flag_sizes_weights_of_a_config_the_planner_cannot_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = {
        "model_type": "mixtral",
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "intermediate_size": 1024,
        "vocab_size": 1000,
        "num_local_experts": 8,
        "max_position_embeddings": 4096,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert _run(["--model", str(path), "--memory", "1GB"]) == 2
    assert "pass it, e.g. --params" in capsys.readouterr().err
    assert _run(["--model", str(path), "--memory", "1GB", "--params", "50M", "--weight-dtype", "int8"]) == 0
    # 50M weights x (1 + 2/128) B in int8.
    assert f"{50_000_000 * (1 + 2 / 128) / 1e6:.3g} MB weights" in capsys.readouterr().out


def test_help_lists_the_subcommand_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        _run(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--scenario" in out and "--shared-fraction" in out and "[0.5]" in out


def test_one_byte_statistics_and_the_residual_window_are_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model", "SmolLM2-135M", "--chain", "paged,int2", "--lengths", "2048"]
    assert _run([*argv, "--scale-bytes", "1", "--residual", "32", "--json", str(tmp_path / "one.json")]) == 0
    out = capsys.readouterr().out
    assert "a one-byte logarithmic scale and an e4m3 zero point" in out and "its newest 32 tokens" in out
    bare = ["--residual", "0", "--group-size", "64", "--scale-bytes", "2"]
    assert _run([*argv, *bare, "--json", str(tmp_path / "two.json")]) == 0
    assert _run([*argv, "--json", str(tmp_path / "measured.json")]) == 0
    one, two, measured = (
        json.loads((tmp_path / f"{n}.json").read_text())["steps"][-1] for n in ("one", "two", "measured")
    )
    # 2,048 tokens in 16-token blocks, per layer and KV head (head_dim 64), 30 x 3 of them. fp16 statistics,
    # one value group per token: 127 sealed blocks of 2 x 16 x 16 codes + 64 x 4 key + 16 x 4 value bytes, the
    # sink in fp16 (4,096 B). One byte, newest 32 in fp16, value groups of 32 (int2's, not given): 125 sealed
    # blocks of 512 + 64 x 2 key + 16 x 2 x 2 value bytes, three fp16 blocks.
    assert two["bytes_per_sequence"] == 90 * (4096 + 127 * (512 + 256 + 64))
    assert one["bytes_per_sequence"] == 90 * (3 * 4096 + 125 * (512 + 128 + 64))
    # No setting given: what QuantizedCache(model, bits=2) builds (KIVI's 32-token window, value groups of 32,
    # fp16 statistics): 125 sealed blocks with two value groups per token, three fp16 blocks.
    assert measured["bytes_per_sequence"] == 90 * (3 * 4096 + 125 * (512 + 256 + 128))


def test_int2_defaults_in_the_plan_are_the_built_cache_s() -> None:
    model = tiny_llama(num_kv_heads=1, num_heads=1)  # head_dim 64: value groups of 32 apply
    config = QuantizedCache(model, bits=2).quant
    settings = codec_settings(("paged", "int2"), 64)
    assert settings == {"residual": config.residual, "group_size": config.group_size, "scale_bytes": 2}
    # An eviction cache's slot codes are the bare format; a setting given is kept.
    assert codec_settings(("paged", "int2", "h2o", "recall"), 64)["residual"] == 0
    assert codec_settings(("paged", "int2"), 64, residual=5, scale_bytes=1)["residual"] == 5


def test_json_to_stdout_and_an_unwritable_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", "SmolLM2-135M", "--chain", "paged,int8", "--lengths", "2048"]
    assert _run([*argv, "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"][-1]["name"] == "int8"  # only the JSON
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert _run([*argv, "--json", str(blocker / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgov plan: error: cannot write the JSON to ") and err.count("\n") == 1


def test_spill_under_a_tree_says_sliding_layers_keep_their_window(capsys: pytest.CaptureFixture[str]) -> None:
    said = "sliding-window layers spill nothing: their prompt blocks join the prefix tree"
    for model, hybrid in (("gemma-3-270m", True), ("SmolLM2-135M", False)):
        assert _run(["--model", model, "--chain", "paged,prefix,spill", "--lengths", "4096"]) == 0
        assert (said in capsys.readouterr().out) is hybrid
    # Without prefix sharing a sliding layer spills what is older than the hot window, and nothing is said.
    assert _run(["--model", "gemma-3-270m", "--chain", "paged,spill", "--lengths", "4096"]) == 0
    assert said not in capsys.readouterr().out
