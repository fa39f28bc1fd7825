"""`kvgov eval longbench`: the handmade fixture (official jsonl format) end to end on the tiny model, and the
scores of known predictions worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_kvgov.cli.main import main
from hf_kvgov.evaluation.generation import Generated
from hf_kvgov.evaluation.longbench import run as longbench_run
from hf_kvgov.evaluation.longbench.run import LongBenchOptions, load_items, run_longbench
from tests.conftest import tiny_llama
from tests.evaluation.eval_tiny import (
    CHAT_WRAPPER_TOKENS,
    LONGBENCH_DIR,
    TINY_KV_BYTES_PER_TOKEN,
    save_tiny_model,
    tiny_tokenizer,
)

# The official templates, read straight from the vendored copy of THUDM's dataset2prompt.json (not through the
# code under test); test_eval_longbench_data pins that copy to the upstream file's sha256.
OFFICIAL_PROMPTS = json.loads(
    (Path(__file__).resolve().parents[2] / "hf_kvgov" / "data" / "longbench" / "dataset2prompt.json").read_text(
        encoding="utf-8"
    )
)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def fixture_records(task: str) -> list[dict]:
    lines = (LONGBENCH_DIR / f"{task}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_fixture_end_to_end_on_the_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny", chat=True)
    out, plots = tmp_path / "lb.json", tmp_path / "plots"
    argv = ["eval", "longbench", "--model", str(model_dir), "--data", str(LONGBENCH_DIR), "--caches", "dynamic,paged@8"]
    assert main([*argv, "--max-new-tokens", "6", "--json", str(out), "--plots", str(plots)]) == 0
    assert "| hotpotqa | 3 |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["command"] == "longbench" and report["processes"] == 1
    assert list(report["tasks"]) == ["hotpotqa", "trec", "samsum"]  # the official task order
    assert [c["name"] for c in report["caches"]] == ["dynamic", "paged@8"]
    samples = report["samples"]
    assert len(samples) == 7 * 2
    # The tiny model has 512 positions: the prompt keeps 512 minus the task's official answer length
    # (hotpotqa 32, trec 64, samsum 128), cut in the middle; the chat template wraps hotpotqa only.
    budgets = {"hotpotqa": 512 - 32, "trec": 512 - 64, "samsum": 512 - 128}
    chat = {"hotpotqa": CHAT_WRAPPER_TOKENS, "trec": 0, "samsum": 0}
    by_id = {s["id"]: s for s in samples if s["cache"] == "dynamic"}
    for task in ("hotpotqa", "trec", "samsum"):
        for record in fixture_records(task):
            raw = len(OFFICIAL_PROMPTS[task].format(**record))  # one token per character, no BOS
            got = by_id[record["_id"]]
            assert got["truncated"] == (raw > budgets[task])
            assert got["prompt_tokens"] == min(raw, budgets[task]) + chat[task]
            assert got["length"] == record["length"] and got["bucket"] == "0-4k"
            assert 1 <= got["new_tokens"] <= 6
            assert got["kv_bytes"] == (got["prompt_tokens"] + got["new_tokens"] - 1) * TINY_KV_BYTES_PER_TOKEN
    for sample in samples:
        if sample["task"] == "samsum":  # samsum stops at the first generated newline
            assert "\n" not in sample["prediction"][:-1]
    # PagedCache is lossless: the same greedy output as DynamicCache for every sample.
    paged = {s["id"]: s["prediction"] for s in samples if s["cache"] == "paged@8"}
    assert paged == {key: value["prediction"] for key, value in by_id.items()}
    for task, entry in report["tasks"].items():
        scores = [s["score"] for s in samples if s["task"] == task and s["cache"] == "dynamic"]
        assert entry["scores"]["dynamic"] == round(100 * sum(scores) / len(scores), 2)
        assert entry["buckets"]["dynamic"]["4-8k"] is None  # NaN in the official scorer, null in JSON
    assert (plots / "longbench_vs_kv_bytes.png").read_bytes()[:4] == b"\x89PNG"


# Known answers for the fixture, keyed by a word of each prompt; scores worked out by hand below.
CANNED = {
    "Marlow": "Dunmore",  # hotpotqa: exact, F1 1
    "Grey Ferry": "He was a schoolteacher",  # F1 vs "schoolteacher": precision 1/3, recall 1 -> 0.5
    "Ashby": "Ashby",  # wrong: 0
    "NASA": "Abbreviation\nQuestion: Who",  # trec: first line only, the right class alone -> 1
    "chapel": "Location",  # wrong class -> 0
    "Carl": "Carl's train is late, so Dora will wait at the station cafe for about twenty minutes.",  # rouge-L 1
    "printer": "",  # an empty prediction scores 0
}


def canned_generation(model, tokenizer, spec, prompt, max_new_tokens, **kwargs) -> Generated:  # type: ignore[no-untyped-def]
    text = next(answer for key, answer in CANNED.items() if key in prompt)
    return Generated(text, len(prompt), 3, {"dynamic": 1000, "h2o@0.5": 250}[spec.name])


def test_scores_of_known_predictions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(longbench_run, "generate_greedy", canned_generation)
    items = load_items(None, data_dir=LONGBENCH_DIR)
    options = LongBenchOptions(caches=("dynamic", "h2o@0.5"), max_length=4000)
    report = run_longbench(tiny_llama(), tiny_tokenizer(chat=True), items, options)
    # hotpotqa (1 + 0.5 + 0) / 3; trec (1 + 0) / 2; samsum (1 + 0) / 2.
    assert report.task_scores() == {
        "hotpotqa": {"dynamic": 50.0, "h2o@0.5": 50.0},
        "trec": {"dynamic": 50.0, "h2o@0.5": 50.0},
        "samsum": {"dynamic": 50.0, "h2o@0.5": 50.0},
    }
    data = report.to_dict()
    assert data["average"] == {"dynamic": 50.0, "h2o@0.5": 50.0}
    assert data["kv_bytes"] == {"dynamic": 1000.0, "h2o@0.5": 250.0}
    assert [s["score"] for s in data["samples"] if s["cache"] == "dynamic"][:3] == [1.0, 0.5, 0.0]
    assert "| hotpotqa | 3 | 50.00 | 50.00 |" in report.markdown()


def test_longbench_e_buckets_by_the_length_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(longbench_run, "generate_greedy", canned_generation)
    records = fixture_records("hotpotqa")
    for record, length in zip(records, (1200, 5000, 9000), strict=True):  # one sample per bucket
        record["length"] = length
    (tmp_path / "hotpotqa_e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    items = load_items(["hotpotqa"], data_dir=tmp_path, longbench_e=True)
    report = run_longbench(tiny_llama(), tiny_tokenizer(), items, LongBenchOptions(max_length=4000))
    assert report.bucket_scores() == {"hotpotqa": {"dynamic": {"0-4k": 100.0, "4-8k": 50.0, "8k+": 0.0}}}
    assert "| hotpotqa | 8k+ | 0.00 |" in report.markdown()


def test_sample_selection_and_errors(tmp_path: Path) -> None:
    assert [
        (i.index, i.task, i.sample.id) for i in load_items(["trec", "hotpotqa"], data_dir=LONGBENCH_DIR, limit=1)
    ] == [
        (0, "trec", "trec-001"),
        (1, "hotpotqa", "hotpotqa-001"),
    ]
    with pytest.raises(ValueError, match="Give exactly one of a data directory or a hub dataset id"):
        load_items(None)
    with pytest.raises(ValueError, match="Unknown LongBench task 'hotpot'"):
        load_items(["hotpot"], data_dir=LONGBENCH_DIR)
    with pytest.raises(ValueError, match=r"No LongBench task files \(<task>.jsonl\)"):
        load_items(None, data_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="No LongBench file for task 'qasper'"):
        load_items(["qasper"], data_dir=LONGBENCH_DIR)
    with pytest.raises(ValueError, match="max_length must be an integer of at least 2 or None; got 1"):
        LongBenchOptions(max_length=1)
