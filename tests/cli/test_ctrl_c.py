"""Ctrl-C in `kvgov`: one line on stderr, exit status 130, and the rows finished so far kept (--json partial).

Ctrl-C is simulated deterministically by raising KeyboardInterrupt at the N-th forward of the tiny model,
in the middle of a row, as Python's SIGINT handler raises it; one test sends a real SIGINT to a process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_kvgov import models
from hf_kvgov.cli.main import main
from hf_kvgov.evaluation.distributed import Workers
from hf_kvgov.evaluation.ppl_run import PerplexityOptions, run_perplexity
from hf_kvgov.evaluation.texts import Document
from hf_kvgov.partial import Interrupted
from tests.conftest import tiny_llama
from tests.evaluation.eval_tiny import save_tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXT = "It is a truth universally acknowledged, that a single man of good fortune must want a wife. "
FILLER = (
    "The harbour lay quiet under a grey sky while fishermen mended their nets on the long stone pier. "
    "Nobody in the village remembered when the old lighthouse had last been painted. "
    "Children ran along the sea wall, shouting names into the wind and chasing gulls. "
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest's: the cores are shared with other test processes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-ctrl-c"))


def ctrl_c_at_forward(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Raise KeyboardInterrupt at the ``n``-th forward of any Llama from now on (1-based)."""
    real = LlamaForCausalLM.forward
    calls = 0

    def forward(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if calls == n:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", forward)


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:  # today's failure: the interrupt escapes `main` with a traceback
        pytest.fail("KeyboardInterrupt escaped kvgov's main")


def kvgov_lines(err: str) -> list[str]:
    """kvgov's own lines on stderr ("[kvgov] loading ..." aside); a line still holding an unclosed progress bar
    would start with it, not with "kvgov"."""
    return [line for line in err.split("\n") if line.startswith("kvgov")]


def stopped_output(capsys: pytest.CaptureFixture[str], *lines: str) -> str:
    """What a stopped command printed on stdout, after checking stderr: exactly `lines` of kvgov's, no traceback."""
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert kvgov_lines(err) == list(lines)
    return out


def ppl_argv(tiny_dir: Path, tmp_path: Path) -> list[str]:
    text = tmp_path / "text.txt"
    text.write_text(TEXT * 5, encoding="utf-8")
    # One document of 40 tokens, 13 per step: 3 forwards per cache, one cache per unit, no baseline.
    argv = ["eval", "ppl", "--model", str(tiny_dir), "--text", str(text), "--tokens", "40", "--chunk", "13"]
    return [*argv, "--rows", "1", "--caches", "dynamic,int8@8,int4@8", "--no-sliding-window"]


def test_eval_ppl_keeps_the_caches_scored_before_ctrl_c(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ppl_argv(tiny_dir, tmp_path)
    whole, partial = tmp_path / "whole.json", tmp_path / "partial.json"
    assert run_cli([*argv, "--json", str(whole)]) == 0
    capsys.readouterr()
    ctrl_c_at_forward(monkeypatch, 7)  # the first forward of the third cache
    assert run_cli([*argv, "--json", str(partial)]) == 130
    out = stopped_output(
        capsys, f"kvgov eval ppl: interrupted after 2 of 3 caches; partial results written to {partial}"
    )
    assert "**Partial**: interrupted after 2 of 3 caches" in out
    assert "| dynamic |" in out and "| int8@8 |" in out and "| int4@8 |" not in out
    data, reference = json.loads(partial.read_text()), json.loads(whole.read_text())
    assert data["partial"] is True and "partial" not in reference
    assert data["completed"] == {"done": 2, "total": 3, "unit": "caches", "main_process_only": False}
    assert data["results"] == reference["results"][:2]  # the finished rows, exactly as a whole run gives them
    assert {k: v for k, v in data.items() if k not in ("partial", "completed", "results")} == {
        k: v for k, v in reference.items() if k != "results"
    }


def test_eval_ppl_before_any_row_finished_writes_nothing(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out_path = tmp_path / "ppl.json"
    ctrl_c_at_forward(monkeypatch, 2)
    assert run_cli([*ppl_argv(tiny_dir, tmp_path), "--json", str(out_path)]) == 130
    out = stopped_output(capsys, "kvgov eval ppl: interrupted before any of 3 caches finished; nothing written")
    assert "|" not in out
    assert not out_path.exists()


def test_eval_synthetic_keeps_the_samples_generated_with_every_cache(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    filler = tmp_path / "filler.txt"
    filler.write_text(FILLER, encoding="utf-8")
    # Two samples x two caches, one new token each: one forward per (sample, cache).
    argv = ["eval", "synthetic", "--model", str(tiny_dir), "--tasks", "passkey", "--lengths", "320"]
    argv += ["--samples", "2", "--caches", "dynamic,int8@8", "--max-new-tokens", "1", "--filler", str(filler)]
    whole, partial = tmp_path / "whole.json", tmp_path / "partial.json"
    assert run_cli([*argv, "--json", str(whole)]) == 0
    capsys.readouterr()
    ctrl_c_at_forward(monkeypatch, 3)  # the second sample's first cache
    assert run_cli([*argv, "--json", str(partial)]) == 130
    out = stopped_output(
        capsys, f"kvgov eval synthetic: interrupted after 1 of 2 samples; partial results written to {partial}"
    )
    assert "Synthetic accuracy (%), 1 of 2 samples" in out
    data, reference = json.loads(partial.read_text()), json.loads(whole.read_text())
    assert data["partial"] is True
    assert data["completed"] == {"done": 1, "total": 2, "unit": "samples", "main_process_only": False}
    assert [(s["index"], s["cache"]) for s in data["samples"]] == [(0, "dynamic"), (0, "int8@8")]
    assert data["samples"] == reference["samples"][:2]


def test_bench_speed_keeps_the_points_measured(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["bench", "speed", "--model", str(tiny_dir), "--caches", "paged", "--contexts", "16,24"]
    argv += ["--batches", "1", "--new-tokens", "2", "--rounds", "1"]
    whole, partial = tmp_path / "whole.json", tmp_path / "partial.json"
    assert run_cli([*argv, "--json", str(whole)]) == 0
    capsys.readouterr()
    # 2 new tokens = 2 forwards a generate: the warm-up, then dynamic and paged at context 16, then 24.
    ctrl_c_at_forward(monkeypatch, 2 + 4 + 1)
    assert run_cli([*argv, "--json", str(partial), "--plots", str(tmp_path / "plots")]) == 130
    out = stopped_output(
        capsys,
        f"kvgov bench speed: interrupted after 1 of 2 (batch, context) points; partial results written to {partial}",
    )
    assert "| 1 | 16 | paged |" in out and "| 1 | 24 |" not in out
    data, reference = json.loads(partial.read_text()), json.loads(whole.read_text())
    assert data["partial"] is True
    assert data["completed"] == {"done": 1, "total": 2, "unit": "(batch, context) points", "main_process_only": False}

    def measured(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return [(r["cache"], r["context"], r["batch"], r["kv_bytes"]) for r in rows]

    assert measured(data["rows"]) == measured(reference["rows"])[:2]
    assert not (tmp_path / "plots").exists()  # no plots of a partial run


def test_bench_capacity_keeps_the_caches_measured(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out_path = tmp_path / "capacity.json"
    argv = ["bench", "capacity", "--model", str(tiny_dir), "--caches", "dynamic,int8", "--lengths", "40"]
    ctrl_c_at_forward(monkeypatch, 3)  # dynamic: one prefill and one decode step; int8 is stopped in its prefill
    assert run_cli([*argv, "--budget", "1MiB", "--json", str(out_path)]) == 130
    out = stopped_output(
        capsys, f"kvgov bench capacity: interrupted after 1 of 2 caches; partial results written to {out_path}"
    )
    data = json.loads(out_path.read_text())
    assert data["partial"] is True and data["completed"]["done"] == 1
    assert [row["cache"] for row in data["rows"]] == ["dynamic"]
    assert "| dynamic | measured bytes |" in out


def test_bench_prefix_keeps_the_mode_finished(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out_path = tmp_path / "prefix.json"
    argv = ["bench", "prefix", "--model", str(tiny_dir), "--requests", "2", "--document-chars", "200"]
    ctrl_c_at_forward(monkeypatch, 5)  # 2 requests x 2 new tokens without sharing, then the first with it
    assert run_cli([*argv, "--new-tokens", "2", "--json", str(out_path)]) == 130
    out = stopped_output(
        capsys, f"kvgov bench prefix: interrupted after 1 of 2 modes; partial results written to {out_path}"
    )
    data = json.loads(out_path.read_text())
    assert data["partial"] is True and data["completed"]["done"] == 1
    assert [row["mode"] for row in data["rows"]] == ["no sharing"] and data["rows"][0]["requests"] == 2
    assert "no sharing" in out and "prefix sharing" not in out


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["eval", "ppl"], "kvgov eval ppl: interrupted before any row finished; nothing written"),
        (["bench", "speed"], "kvgov bench speed: interrupted before any row finished; nothing written"),
        (["demo"], "kvgov demo: interrupted"),
        (["check-quant"], "kvgov check-quant: interrupted"),
    ],
)
def test_ctrl_c_while_loading_the_model_is_one_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_model(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "load_model", load_model)
    assert run_cli(argv) == 130
    stopped_output(capsys, line)


def test_ctrl_c_in_fetch_and_plan_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def stop(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "fetch", stop)
    monkeypatch.setattr("hf_kvgov.cli.plan.make_plan", stop)
    assert run_cli(["fetch", "smollm2"]) == 130
    assert run_cli(["plan", "--model", "Llama-3-8B"]) == 130
    stopped_output(capsys, "kvgov fetch: interrupted", "kvgov plan: interrupted")


def test_main_process_keeps_only_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first of two processes runs units 0 and 2 (dynamic, int4@8) and is stopped in its second: it
    reports dynamic, without gathering anything from the other process."""
    monkeypatch.setattr(Workers, "gather", lambda self, results: pytest.fail("gathered after Ctrl-C"))
    ctrl_c_at_forward(monkeypatch, 4)
    caches = ("dynamic", "int8@8", "int4@8")
    options = PerplexityOptions(caches=caches, chunk_tokens=13, max_tokens=40, rows=1, window=None)
    main_of_two = Workers(0, 2, torch.device("cpu"))
    try:
        run_perplexity(tiny_llama(), tiny_tokenizer(), [Document("text", TEXT)], options, main_of_two)
    except Interrupted as stopped:
        progress, report = stopped.progress, stopped.report
    except KeyboardInterrupt:
        pytest.fail("run_perplexity let KeyboardInterrupt through instead of raising Interrupted")
    else:
        pytest.fail("the run was not interrupted")
    assert (progress.done, progress.total, progress.processes) == (1, 3, 2)
    assert str(progress).startswith("1 of 3 caches on the main process (of 2;")
    assert [result.name for result in report.results] == ["dynamic"] and report.processes == 2


def _interrupt_after_the_first_cache(command: list[str]) -> tuple[subprocess.Popen[str], list[str], str]:
    """Run `command`, send SIGINT once its progress bar shows the first cache done; (process, stderr chars,
    stdout). The process may have finished before the line was read (a loaded machine): its exit code says."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stderr is not None
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(lambda: process.stderr.read(1), "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while "| 1/3 [" not in "".join(err) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    out = process.stdout.read() if process.stdout is not None else ""
    process.wait(timeout=60)
    reader.join(timeout=10)
    return process, err, out


def test_a_real_sigint_stops_a_running_process(tiny_dir: Path, tmp_path: Path) -> None:
    """SIGINT sent to `kvgov eval ppl` once its progress bar shows the first cache done."""
    argv = ppl_argv(tiny_dir, tmp_path)
    out_path = tmp_path / "ppl.json"
    argv[argv.index("--tokens") + 1], argv[argv.index("--chunk") + 1] = "400", "1"  # ~400 forwards a cache
    command = [sys.executable, "-m", "hf_kvgov.cli.main", *argv, "--json", str(out_path)]
    # On a loaded machine the whole run may end before its progress line is read (the signal then finds no
    # process and the exit code is 0); such a run tests nothing, so it is run again, up to three times in all.
    for _ in range(3):
        process, err, out = _interrupt_after_the_first_cache(command)
        if process.returncode != 0:
            break
    assert process.returncode == 130, "".join(err)[-2000:]
    text = "".join(err)
    assert "Traceback" not in text
    (line,) = kvgov_lines(text)
    data = json.loads(out_path.read_text())
    done = data["completed"]["done"]
    assert line == f"kvgov eval ppl: interrupted after {done} of 3 caches; partial results written to {out_path}"
    assert data["partial"] is True and 1 <= done < 3
    assert [r["name"] for r in data["results"]] == ["dynamic", "int8@8", "int4@8"][:done]
    assert "**Partial**" in out
