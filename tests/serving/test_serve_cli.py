"""`kvgov serve`'s mistakes: one line naming what was wrong and a non-zero exit, before any model loads."""

from __future__ import annotations

import pytest

from hf_kvgov.cli.main import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--codec", "int3"], "Unknown codec 'int3'"),
        (["--kv-budget", "lots"], "KV byte cap"),
        (["--model", "/nowhere/model.gguf"], "No GGUF file at '/nowhere/model.gguf'"),
        (["--swap-dir", __file__], "path must be a directory for the spill file"),
        (["--h2o", "1.5"], "--h2o takes the share of each prompt a request keeps, in (0, 1]; got 1.5"),
        (["--redis", "localhost:6379"], "--redis takes a redis://, rediss:// or unix:// URL; got 'localhost:6379'"),
        (["--redis", "redis://127.0.0.1:1/0", "--no-prefix-sharing"], "cannot go with --no-prefix-sharing"),
    ],
)
def test_bad_options_get_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
