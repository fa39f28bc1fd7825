"""An output path no result could be written to is refused in one line before anything runs, in every command that
writes one (`--json`, `--plot`, `--plots`, `--recommend`); a missing directory is not a mistake (it is made)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_kvgov.cli.main import main

COMMANDS = [
    (["bench", "capacity", "--budget", "1GiB"], ("--json", "--plots")),
    (["bench", "speed"], ("--json", "--plots")),
    (["bench", "serve"], ("--json", "--plots")),
    (["bench", "prefix"], ("--json",)),
    (["eval", "ppl"], ("--json", "--plots")),
    (["eval", "synthetic"], ("--json", "--plots")),
    (["check-quant"], ("--json", "--recommend")),
    (["plan", "--model", "llama-7b"], ("--json", "--plot")),
]
CASES = [(command, option) for command, options in COMMANDS for option in options]


@pytest.mark.parametrize(("command", "option"), CASES, ids=[f"{' '.join(c[:2])} {o}" for c, o in CASES])
def test_a_path_under_a_file_is_refused_in_one_line(
    command: list[str], option: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory\n")
    target = blocker / "out" / ("plots" if option == "--plots" else "result.json")
    assert main([*command, option, str(target)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {target} cannot be written: {blocker} is a file, not a directory." in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


WITH_JSON = [command for command, options in COMMANDS if "--json" in options]


@pytest.mark.parametrize("command", WITH_JSON, ids=lambda command: " ".join(command[:2]))
def test_a_directory_given_as_the_json_file_is_refused(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--json {tmp_path} is a directory; give a file path such as {tmp_path / 'results.json'}." in err, err


def test_plots_given_a_file_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    existing = tmp_path / "chart.png"
    existing.write_bytes(b"")
    assert main(["eval", "ppl", "--plots", str(existing)]) == 2
    assert f"--plots {existing} is a file; give a directory" in capsys.readouterr().err


def test_a_missing_directory_is_made_by_the_writer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "new" / "deeper" / "plan.json"
    assert main(["plan", "--model", "llama-7b", "--json", str(target)]) == 0
    assert target.is_file() and target.read_text().startswith("{")
    assert not list(tmp_path.rglob(".kvgov-probe-*"))  # the check leaves nothing behind
