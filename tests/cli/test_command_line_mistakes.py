"""A command line argparse refuses (an unknown option, a missing value, an unknown subcommand) is one line on stderr
naming the subcommand it was meant for, and exit status 2: no usage block, which for an unknown option used to name
`kvgov` itself rather than the subcommand."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_kvgov.cli.main import main


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["demo", "--nope"], "kvgov demo: error: unrecognized arguments: --nope (`kvgov demo --help` lists what it"),
        (["plan", "--context", "8192"], "kvgov plan: error: unrecognized arguments: --context 8192"),
        (["bench", "speed", "--contexts"], "kvgov bench speed: error: argument --contexts: expected one argument"),
        (["eval", "synthetic", "--lengths", "1k"], "kvgov eval synthetic: error: argument --lengths: expected"),
        (["bench", "nope"], "kvgov bench: error: argument NAME: invalid choice: 'nope'"),
        (["nope"], "kvgov: error: argument COMMAND: invalid choice: 'nope'"),
        (["--nope"], "kvgov: error: unrecognized arguments: --nope"),
    ],
)
def test_a_refused_command_line_is_one_line_naming_the_subcommand(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1 and "usage:" not in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "ppl", "--text", "{missing}", "--caches", "dynamic"],
        ["eval", "synthetic", "--filler", "{missing}"],
        ["check-quant", "--text", "{missing}"],
    ],
    ids=["eval ppl", "eval synthetic", "check-quant"],
)
def test_an_input_file_that_cannot_be_read_is_named_in_one_line(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "novel.txt"
    assert main([arg.format(missing=missing) for arg in argv]) == 2
    command = "kvgov " + " ".join(argv[: 1 if argv[0] == "check-quant" else 2])
    assert capsys.readouterr().err == f"{command}: error: cannot read {missing}: No such file or directory\n"


def test_help_still_shows_the_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: kvgov demo")
