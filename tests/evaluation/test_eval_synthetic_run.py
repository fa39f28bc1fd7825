"""`kvgov eval synthetic`: accuracy of known answers worked out by hand, and the CLI on the tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from hf_kvgov.cli.main import main
from hf_kvgov.evaluation import synthetic_run
from hf_kvgov.evaluation.generation import Generated
from hf_kvgov.evaluation.registry import generate_synthetic
from hf_kvgov.evaluation.synthetic_run import SyntheticOptions, build_items, run_synthetic
from tests.evaluation.eval_tiny import TINY_KV_BYTES_PER_TOKEN, save_tiny_model, tiny_tokenizer

FILLER = (
    "The harbour lay quiet under a grey sky while fishermen mended their nets on the long stone pier. "
    "Nobody in the village remembered when the old lighthouse had last been painted. "
    "Children ran along the sea wall, shouting names into the wind and chasing gulls. "
)
# What a perfect reader of each needle would answer: the values written in the prompt.
NEEDLE_VALUE = re.compile(r"(?:The pass key is|special magic numbers for [\w-]+ is:) (\d+)")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def reader(fed: list[str]):  # type: ignore[no-untyped-def]
    """A stand-in for generation: reads the needles back, except that "h2o@0.5" forgets a multi-value key's
    last two values and everything of niah_single."""

    def generate(model, tokenizer, spec, prompt, max_new_tokens, **kwargs) -> Generated:  # type: ignore[no-untyped-def]
        fed.append(prompt)
        values = list(dict.fromkeys(NEEDLE_VALUE.findall(prompt)))
        if spec.name == "h2o@0.5":
            values = [] if "special magic number for" in prompt else values[:2]
        return Generated(" ".join(values), len(prompt), 7, {"dynamic": 4096, "h2o@0.5": 1024}[spec.name])

    return generate


def test_accuracy_of_known_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    fed: list[str] = []
    monkeypatch.setattr(synthetic_run, "generate_greedy", reader(fed))
    tasks = ("passkey", "niah_single", "niah_multivalue")
    options = SyntheticOptions(caches=("dynamic", "h2o@0.5"), tasks=tasks, lengths=(700, 900), samples=2)
    tokenizer = tiny_tokenizer(chat=True)
    items = build_items(tokenizer, FILLER, options)
    assert [(i.sample.task, i.sample.target_length) for i in items[::2]] == [
        (task, length) for task in tasks for length in (700, 900)
    ]
    report = run_synthetic(None, tokenizer, items, options)
    # dynamic reads every needle: 100. h2o: passkey 100, niah_single 0, 2 of 4 values of niah_multivalue: 50.
    expected_h2o = {"passkey": 100.0, "niah_single": 0.0, "niah_multivalue": 50.0}
    assert report.accuracy() == {
        task: {length: {"dynamic": 100.0, "h2o@0.5": expected_h2o[task]} for length in (700, 900)} for task in tasks
    }
    assert report.averages() == {"dynamic": 100.0, "h2o@0.5": 50.0}
    data = json.loads(json.dumps(report.to_dict()))
    assert data["accuracy_by_length"]["700"] == {"dynamic": 100.0, "h2o@0.5": 50.0}
    assert data["kv_bytes"] == {"dynamic": 4096.0, "h2o@0.5": 1024.0}
    # The prompt as RULER feeds it: the chat template around the task prompt, then the answer prefix.
    for prompt, item in zip(fed[::2], items, strict=True):
        assert prompt == f"<user>{item.sample.prompt}<reply>{item.sample.answer_prefix}"
    assert "| niah_multivalue | 900 | 100.00 | 50.00 |" in report.markdown()


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="Unknown synthetic task 'passkeys'"):
        SyntheticOptions(tasks=("passkeys",))
    with pytest.raises(ValueError, match=r"lengths must list at least one entry, each once; got \[\]"):
        SyntheticOptions(lengths=())
    with pytest.raises(ValueError, match="samples must hold positive integers; got 0"):
        SyntheticOptions(samples=0)


def test_cli_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny")
    filler = tmp_path / "filler.txt"
    filler.write_text(FILLER, encoding="utf-8")
    out, plots = tmp_path / "syn.json", tmp_path / "plots"
    argv = ["eval", "synthetic", "--model", str(model_dir), "--tasks", "passkey", "--lengths", "320,400"]
    argv += ["--samples", "2", "--caches", "dynamic,sink@4+60", "--max-new-tokens", "4", "--filler", str(filler)]
    assert main([*argv, "--json", str(out), "--plots", str(plots)]) == 0
    assert "| passkey | 320 |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["command"] == "synthetic" and report["options"]["lengths"] == [320, 400]
    assert set(report["accuracy"]["passkey"]) == {"320", "400"}
    tokenizer = tiny_tokenizer()
    expected = [
        sample for length in (320, 400) for sample in generate_synthetic("passkey", FILLER, tokenizer, length, 2, 0)
    ]
    dynamic = [s for s in report["samples"] if s["cache"] == "dynamic"]
    for got, sample in zip(dynamic, expected, strict=True):
        assert got["answers"] == list(sample.answers) and got["length"] == sample.target_length
        assert got["prompt_tokens"] == len(sample.prompt) + len(sample.answer_prefix)  # no chat template here
        assert got["kv_bytes"] == (got["prompt_tokens"] + got["new_tokens"] - 1) * TINY_KV_BYTES_PER_TOKEN
        assert got["score"] in (0.0, 1.0)
    sink = [s for s in report["samples"] if s["cache"] == "sink@4+60"]
    assert all(s["kv_bytes"] < d["kv_bytes"] for s, d in zip(sink, dynamic, strict=True))
    for name in ("synthetic_vs_kv_bytes.png", "synthetic_accuracy_vs_length.png"):
        assert (plots / name).read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_lengths_too_short_for_the_task(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny")
    assert main(["eval", "synthetic", "--model", str(model_dir), "--lengths", "64", "--caches", "dynamic"]) == 2
    assert "kvgov eval synthetic: error: target_length=64 tokens is shorter than the task's fixed text alone" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):  # argparse refuses it
        main(["eval", "synthetic", "--lengths", "1k"])
    assert "expected comma-separated token counts such as 1024,4096; got '1k'" in capsys.readouterr().err
