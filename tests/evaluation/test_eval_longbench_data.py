"""LongBench jsonl loading, vendored config, prompt building, middle truncation, chat decision."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from hf_kvgov.evaluation.longbench.config import (
    LONGBENCH_E_TASKS,
    LONGBENCH_TASKS,
    dataset_max_new_tokens,
    dataset_prompts,
    max_new_tokens,
    prompt_template,
    uses_chat_template,
)
from hf_kvgov.evaluation.longbench.data import LongBenchSample, load_from_hub, load_task, read_jsonl
from hf_kvgov.evaluation.longbench.prompts import (
    build_prompt,
    middle_halves,
    prepare_prompt,
    truncate_middle,
)


def record(**overrides: object) -> dict[str, object]:
    base: dict[str, object] = {
        "input": "Who painted the lighthouse?",
        "context": "Passage 1: nobody remembers.",
        "answers": ["nobody"],
        "length": 5,
        "all_classes": None,
        "dataset": "hotpotqa",
        "language": "en",
        "_id": "abc123",
    }
    base.update(overrides)
    return base


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def sample(**overrides: object) -> LongBenchSample:
    fields = record(**overrides)
    return LongBenchSample(
        input=str(fields["input"]),
        context=str(fields["context"]),
        answers=tuple(fields["answers"]),  # type: ignore[arg-type]
        length=int(fields["length"]),  # type: ignore[call-overload]
        all_classes=None,
        dataset=str(fields["dataset"]),
        language="en",
        id="abc123",
    )


# --- loading ---------------------------------------------------------------------------------------


def test_load_task_reads_every_field(tmp_path: Path) -> None:
    classes = ["Human", "Location"]
    write_jsonl(
        tmp_path / "trec.jsonl",
        [
            json.dumps(record()),
            "",  # blank lines are skipped
            json.dumps(record(answers=["Human", "Person"], all_classes=classes, _id="x2", length=9000)),
        ],
    )
    samples = load_task(tmp_path, "trec")
    assert len(samples) == 2
    first, second = samples
    assert first == LongBenchSample(
        input="Who painted the lighthouse?",
        context="Passage 1: nobody remembers.",
        answers=("nobody",),
        length=5,
        all_classes=None,
        dataset="hotpotqa",
        language="en",
        id="abc123",
    )
    assert second.answers == ("Human", "Person")
    assert second.all_classes == ("Human", "Location")
    assert second.length == 9000 and second.id == "x2"


def test_load_task_longbench_e_file_name(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "qasper_e.jsonl", [json.dumps(record())])
    assert len(load_task(tmp_path, "qasper", longbench_e=True)) == 1
    with pytest.raises(FileNotFoundError, match=r"qasper\.jsonl"):
        load_task(tmp_path, "qasper")
    with pytest.raises(ValueError, match="Unknown LongBench task 'qasperr'"):
        load_task(tmp_path, "qasperr")


def test_missing_field_names_file_line_and_field(tmp_path: Path) -> None:
    bad = record()
    del bad["answers"]
    path = write_jsonl(tmp_path / "hotpotqa.jsonl", [json.dumps(record()), json.dumps(bad)])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl, line 2: missing field 'answers'"):
        read_jsonl(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"input": "x", ', r"line 1: not valid JSON"),
        ("[1, 2]", r"line 1: a LongBench record must be a JSON object; got list"),
        (json.dumps(record(length="12")), r"line 1: field 'length' must be an integer"),
        (json.dumps(record(length=True)), r"line 1: field 'length' must be an integer"),
        (json.dumps(record(answers=[])), r"line 1: field 'answers' must be a non-empty list of strings"),
        (json.dumps(record(answers="nobody")), r"line 1: field 'answers' must be a non-empty list"),
        (
            json.dumps(record(all_classes="Human")),
            r"line 1: field 'all_classes' must be a list of strings or null",
        ),
    ],
)
def test_malformed_records_are_clear_errors(tmp_path: Path, line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "trec.jsonl", [line])
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)


def test_hub_loading_without_datasets_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="pip install datasets"):
        load_from_hub("hotpotqa")


# --- vendored configuration ------------------------------------------------------------------------


def test_vendored_config_covers_every_task_with_official_values() -> None:
    assert set(dataset_prompts()) == set(LONGBENCH_TASKS) == set(dataset_max_new_tokens())
    assert set(LONGBENCH_E_TASKS) <= set(LONGBENCH_TASKS) and len(LONGBENCH_E_TASKS) == 13
    assert max_new_tokens("hotpotqa") == 32
    assert max_new_tokens("gov_report") == 512
    assert max_new_tokens("trec") == 64
    assert prompt_template("trec") == (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    )
    assert prompt_template("lcc") == "Please complete the code given below. \n{context}Next line of code:\n"


# sha256 of THUDM/LongBench's LongBench/config/*.json as published: the vendored copies must be byte for byte
# the official ones (their typos included), since the published LongBench numbers were produced with them.
UPSTREAM_SHA256 = {
    "dataset2prompt.json": "56d22ad4f382169c2b8a11ff4c982a4a1bea096c8152b0f0b85b64686b157c30",
    "dataset2maxlen.json": "72966b3c0933e214591637fb085798c5e687ebff4ddaab5d99bbc31120532022",
}


@pytest.mark.parametrize("name", sorted(UPSTREAM_SHA256))
def test_vendored_config_is_the_upstream_file(name: str) -> None:
    import hashlib
    from importlib import resources

    data = resources.files("hf_kvgov").joinpath("data", "longbench", name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == UPSTREAM_SHA256[name]


def test_vendored_license_ships_with_the_data() -> None:
    from importlib import resources

    licence = resources.files("hf_kvgov").joinpath("data", "longbench", "LICENSE").read_text(encoding="utf-8")
    assert "MIT License" in licence and "THU-KEG & Zhipu AI" in licence


def test_chat_template_decision() -> None:
    raw = {"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"}
    for task in LONGBENCH_TASKS:
        assert uses_chat_template(task) is (task not in raw), task


# --- prompts and truncation ------------------------------------------------------------------------


def test_build_prompt_fills_context_and_input() -> None:
    s = sample(context="Q: where? A: here {not a field}", input="Q: when?")
    assert build_prompt("trec", s) == (
        "Please determine the type of the question below. Here are some examples of questions.\n\n"
        "Q: where? A: here {not a field}\nQ: when?"
    )


def test_middle_halves_exact_ids() -> None:
    ids = list(range(10))
    assert middle_halves(ids, 4) == ([0, 1], [8, 9])
    # Odd limits keep 2 * (max_length // 2) = max_length - 1 ids, as pred.py does.
    assert middle_halves(ids, 5) == ([0, 1], [8, 9])
    assert middle_halves(ids, 10) is None
    with pytest.raises(ValueError, match="at least 2"):
        middle_halves(ids, 1)


def test_truncate_middle_counts_and_skips_special_tokens(char_tokenizer: object) -> None:
    # "abcdefghij" -> [BOS, a..j] = 11 ids. max_length 6: [BOS, a, b] + [h, i, j] -> "ab" + "hij".
    assert truncate_middle("abcdefghij", char_tokenizer, 6) == "abhij"  # type: ignore[arg-type]
    assert truncate_middle("abcdefghij", char_tokenizer, 7) == "abhij"  # type: ignore[arg-type]
    # max_length 10: [BOS, a, b, c, d] + [f, g, h, i, j].
    assert truncate_middle("abcdefghij", char_tokenizer, 10) == "abcdfghij"  # type: ignore[arg-type]
    # 11 ids fit in 11: unchanged.
    assert truncate_middle("abcdefghij", char_tokenizer, 11) == "abcdefghij"  # type: ignore[arg-type]


def test_truncate_middle_rejects_an_object_without_decode() -> None:
    class EncodeOnly:
        def encode(self, text: str) -> list[int]:
            return [1]

    with pytest.raises(TypeError, match="tokenizer-like"):
        truncate_middle("abc", EncodeOnly(), 4)  # type: ignore[arg-type]


def test_prepare_prompt_wraps_chat_tasks_only(chat_tokenizer: object) -> None:
    s = sample(context="ctx", input="q")
    chat = prepare_prompt("hotpotqa", s, chat_tokenizer, 10_000)  # type: ignore[arg-type]
    assert chat.text == "<user>" + build_prompt("hotpotqa", s) + "<reply>"
    assert chat.chat_template_applied and not chat.add_special_tokens and not chat.truncated
    assert chat.max_new_tokens == 32 and chat.extra_eos_token_ids == () and chat.min_new_tokens == 0
    raw = prepare_prompt("lcc", s, chat_tokenizer, 10_000)  # type: ignore[arg-type]
    assert raw.text == "Please complete the code given below. \nctxNext line of code:\n"
    assert not raw.chat_template_applied and raw.add_special_tokens


def test_prepare_prompt_without_a_chat_template_keeps_the_raw_prompt(char_tokenizer: object) -> None:
    s = sample(context="ctx", input="q")
    prepared = prepare_prompt("hotpotqa", s, char_tokenizer, 10_000)  # type: ignore[arg-type]
    assert prepared.text == build_prompt("hotpotqa", s) and not prepared.chat_template_applied


def test_prepare_prompt_samsum_stops_at_newline_and_truncates(char_tokenizer: object) -> None:
    s = sample(context="x" * 500, input="Dialogue: hi")
    prepared = prepare_prompt("samsum", s, char_tokenizer, 100)  # type: ignore[arg-type]
    # The newline's id in CharTokenizer is ord("\n") + 10 = 20.
    assert prepared.extra_eos_token_ids == (20,) and prepared.min_new_tokens == 1
    assert prepared.truncated and len(prepared.text) == 99  # 50 + 50 ids, minus the skipped BOS
    full = build_prompt("samsum", s)
    assert prepared.text == full[:49] + full[-50:]
    assert prepared.max_new_tokens == 128
