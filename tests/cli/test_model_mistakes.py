"""A model name no load could succeed with is answered, in every command that loads one, by one line on stderr and
exit 2 before anything loads: no traceback, no retries against an unreachable hub. `kvgov --help` loads no torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import huggingface_hub
import pytest

from hf_kvgov.cli.main import main

COMMANDS = [
    ["demo"],
    ["check-quant"],
    ["bench", "speed"],
    ["bench", "serve"],
    ["eval", "ppl"],
    ["eval", "synthetic"],
    ["eval", "longbench", "--hub"],
    ["serve"],
]
MISTAKES = [
    ("nosuch/model", "'nosuch/model' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"),
    ("/tmp/doesnotexist.gguf", "No GGUF file at '/tmp/doesnotexist.gguf'"),
    ("./no/such/dir", "No model at './no/such/dir'"),
    ("bad name!", "'bad name!' is not a valid model name"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize(("name", "message"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_an_impossible_model_gets_one_line(
    command: list[str], name: str, message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main([*command, "--model", name]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert "embedded model (gemma3-270m, smollm2)" in err or "GGUF" in err


def test_a_directory_that_is_no_model_is_named(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--model", str(tmp_path)]) == 2
    assert "is a directory without a config.json" in capsys.readouterr().err


def test_unknown_names_and_values_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [
        (["fetch", "nosuch"], "Unknown embedded model 'nosuch'"),
        (["demo", "--caches", "bogus"], "Unknown cache 'bogus'; names: dynamic, paged"),
        (["demo", "--max-new-tokens", "1"], "--max-new-tokens must be at least 2"),
        (["bench", "prefix", "--requests", "0"], "--requests must be at least 1; got 0."),
        (["plan", "--model", "nosuch"], "Unknown model 'nosuch'. Built-in models:"),
        (["plan", "--model", "llama-7b", "--block-size", "0"], "--block-size must be at least 1; got 0."),
        (["plan", "--model", "llama-7b", "--residual", "-3"], "--residual must be at least 0; got -3."),
        (["bench", "serve", "--block-size", "0"], "block_size must be at least 1; got 0."),
        (["bench", "serve", "--max-batched-tokens", "0"], "max_batched_tokens must be at least 1; got 0."),
        (["bench", "serve", "--slo-ttft", "-1"], "slo_ttft_s must be a positive number of seconds; got -1.0."),
        (["bench", "speed", "--threads", "0"], "--threads must be at least 1; got 0."),
        (["bench", "capacity", "--threads", "-1"], "--threads must be at least 1; got -1."),
        (["eval", "ppl", "--window", "0"], "The sliding-window window must be a positive number of tokens; got 0."),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and len(err) < 600, err


def test_a_real_process_with_no_hub_answers_at_once() -> None:
    """The hub unreachable (offline): the whole process, interpreter start included, in well under 10 s."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "hf_kvgov.cli.main", "demo", "--model", "nosuch/model"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - start < 10
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_help_loads_neither_torch_nor_transformers() -> None:
    code = (
        "import sys; from hf_kvgov.cli.main import build_parser; build_parser().format_help(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


def test_nested_progress_bars_stay_off_a_log_file() -> None:
    """Off a terminal (here: pytest captures stderr) a nested bar is not drawn, so no cursor-up codes reach a log."""
    from hf_kvgov.progress import nested_bar

    assert not sys.stderr.isatty()
    with nested_bar(range(3), desc="inner") as bar:
        assert bar.disable and list(bar) == [0, 1, 2]
