"""`kvgov check-quant` end to end: the tiny model saved as a local directory, and the deployment gate (on by
default)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_kvgov.cli import check_quant
from hf_kvgov.cli.main import main


def kvgov(argv: list[str]) -> int:
    """Run `kvgov check-quant ...` as the command does (its checks of the model name and output paths included)."""
    return main(["check-quant", *argv])


def test_end_to_end_on_the_tiny_model(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_path = tmp_path / "report.json"
    argv = ["--model", str(tiny_dir), "--text", str(tiny_dir / "text.txt"), "--tokens", "200", "--block-size", "8"]
    argv += ["--scan-tokens", "48", "--max-ppl-increase", "1000", "--json", str(report_path)]
    assert kvgov(argv) == 0
    assert json.loads(report_path.read_text())["sensitivity"] is None  # every format passed: no scan by default
    assert kvgov([*argv, "--full"]) == 0
    printed = capsys.readouterr().out
    assert "verdict:" in printed and "recommended: QuantizedCache(model," in printed
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["threshold_pct"] == 1000.0 and report["gate_failures"] == []
    assert [f["name"] for f in report["formats"]] == ["int8", "fp8", "int4"]
    assert report["tokens"] == 200 and report["block_size"] == 8 and report["chunk_tokens"] == 8
    assert len(report["key_outlier_ratios"]) == 2
    assert [layer["name"] for layer in report["sensitivity"]["layers"]] == ["layer 0", "layer 1"]
    # The smallest format within the (1000%) tolerance whose top token agrees at 98% of positions at least.
    keeping = [f for f in report["formats"] if f["top1_agreement"] >= 0.98]
    best = min(keeping, key=lambda f: (f["bytes_per_token"], f["ppl_increase_pct"]))
    assert report["recommendation"]["name"] == best["name"]


def test_json_to_stdout_and_bad_options(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(tiny_dir), "--tokens", "40", "--block-size", "8", "--formats", "int8", "--no-scan"]
    assert kvgov([*argv, "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)  # nothing but the JSON on stdout
    assert report["sensitivity"] is None and report["threshold_pct"] == 0.5  # the default gate
    assert report["tokens"] == 40  # the built-in text, cut at --tokens
    assert kvgov([*argv, "--formats", "int3"]) == 2
    assert "Unknown or no formats ['int3']" in capsys.readouterr().err


@pytest.mark.real_model
def test_the_default_gate_fails_when_a_format_exceeds_it(
    smollm2, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    # On the built-in text, 512 tokens, blocks of 16, SmolLM2 measured int8 +0.00% and int2 +11.08% (four
    # levels per group): the default 0.5% gate passes the first and fails the second, by margins far above
    # the run-to-run noise of float32 arithmetic. (fp8 e5m2, which failed it at +1.09% with symmetric key
    # scales, measures +0.18% since keys are centred.)
    monkeypatch.setattr(check_quant.models, "load_model", lambda name: smollm2)  # already loaded by the fixture
    report_path = tmp_path / "gate.json"
    argv = ["--formats", "int8,int2", "--tokens", "512", "--no-scan"]
    assert kvgov([*argv, "--json", str(report_path)]) == 1
    report = json.loads(report_path.read_text())
    assert report["passed"] is False and report["gate_failures"] == ["int2"] and report["threshold_pct"] == 0.5
    increases = {f["name"]: f["ppl_increase_pct"] for f in report["formats"]}
    assert increases["int8"] < 0.5 < increases["int2"]
    assert "gate (every listed format within +0.5%): FAIL: int2" in capsys.readouterr().out
