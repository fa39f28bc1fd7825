"""Task-level LongBench scoring: dataset -> metric map, first-line rule, max over answers, x100 and
rounding, LongBench-E buckets, prediction files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hf_kvgov.evaluation.longbench import metrics
from hf_kvgov.evaluation.longbench.config import LONGBENCH_TASKS
from hf_kvgov.evaluation.longbench.scoring import (
    DATASET_TO_METRIC,
    bucket_of,
    score_prediction_dir,
    score_prediction_file,
    score_sample,
    scorer,
    scorer_e,
)

# Transcribed from the official eval.py ``dataset2metric``.
OFFICIAL_METRIC_NAMES = {
    "narrativeqa": "qa_f1_score",
    "qasper": "qa_f1_score",
    "multifieldqa_en": "qa_f1_score",
    "multifieldqa_zh": "qa_f1_zh_score",
    "hotpotqa": "qa_f1_score",
    "2wikimqa": "qa_f1_score",
    "musique": "qa_f1_score",
    "dureader": "rouge_zh_score",
    "gov_report": "rouge_score",
    "qmsum": "rouge_score",
    "multi_news": "rouge_score",
    "vcsum": "rouge_zh_score",
    "trec": "classification_score",
    "triviaqa": "qa_f1_score",
    "samsum": "rouge_score",
    "lsht": "classification_score",
    "passage_retrieval_en": "retrieval_score",
    "passage_count": "count_score",
    "passage_retrieval_zh": "retrieval_zh_score",
    "lcc": "code_sim_score",
    "repobench-p": "code_sim_score",
}


def test_dataset_to_metric_is_the_official_mapping() -> None:
    assert set(DATASET_TO_METRIC) == set(OFFICIAL_METRIC_NAMES) == set(LONGBENCH_TASKS)
    for dataset, name in OFFICIAL_METRIC_NAMES.items():
        assert DATASET_TO_METRIC[dataset] is getattr(metrics, name), dataset


def test_first_line_rule_applies_to_triviaqa_but_not_hotpotqa() -> None:
    prediction = "\n\nParis\nLondon is wrong"
    assert scorer("triviaqa", [prediction], [["Paris"]]) == 100.0
    # hotpotqa scores all of it: tokens paris, london, is, wrong -> P = 1/4, R = 1, F1 = 0.4.
    assert scorer("hotpotqa", [prediction], [["Paris"]]) == 40.0


def test_first_line_rule_for_trec_and_lsht() -> None:
    # Both classes on separate lines: only "Human" is scored for trec -> 1/1.
    assert scorer("trec", ["Human\nLocation"], [["Human"]], ["Human", "Location"]) == 100.0
    assert scorer("lsht", ["\n体育\n娱乐"], [["体育"]], ["体育", "娱乐"]) == 100.0


def test_first_line_rule_for_samsum() -> None:
    # The second line would halve precision; only "a b c" is scored: ROUGE-L F = 2/(2 + 1e-8).
    assert scorer("samsum", ["a b c\nx y z w v u"], [["a b c"]]) == 100.0
    assert score_sample("gov_report", "a b c\nx y z", ["a b c"]) < 0.7


def test_best_answer_counts() -> None:
    assert score_sample("triviaqa", "Paris", ["London", "paris"]) == 1.0
    assert scorer("passage_count", ["3"], [["2", "3"]]) == 100.0


@pytest.mark.parametrize(
    ("predictions", "answers", "expected"),
    [
        # 2 of 3 right: 100 * 2/3 = 66.666... -> 66.67.
        (["1", "2", "3"], [["1"], ["1"], ["3"]], 66.67),
        # 1 of 3: 33.333... -> 33.33.
        (["1", "9", "9"], [["1"], ["1"], ["1"]], 33.33),
        # Half credit (numbers 1 and 2, one right) on one of two samples: 100 * 0.5 / 2 = 25.0.
        (["1 2", "7"], [["1"], ["1"]], 25.0),
        # 1 of 8: 12.5 exactly.
        (["1"] + ["0"] * 7, [["1"]] * 8, 12.5),
    ],
)
def test_scorer_is_100_times_mean_rounded_to_2_decimals(
    predictions: list[str], answers: list[list[str]], expected: float
) -> None:
    assert scorer("passage_count", predictions, answers) == expected


@pytest.mark.parametrize(
    ("length", "bucket"), [(0, "0-4k"), (3999, "0-4k"), (4000, "4-8k"), (7999, "4-8k"), (8000, "8k+")]
)
def test_longbench_e_bucket_boundaries(length: int, bucket: str) -> None:
    assert bucket_of(length) == bucket


def test_scorer_e_scores_each_bucket() -> None:
    predictions = ["1", "1", "1", "2", "0"]
    answers = [["1"], ["1"], ["1"], ["1"], ["1"]]
    lengths = [3999, 4000, 7999, 8000, 100]
    # 0-4k: samples 1 (right) and 5 (wrong) -> 50; 4-8k: both right -> 100; 8k+: wrong -> 0.
    assert scorer_e("passage_count", predictions, answers, lengths) == {
        "0-4k": 50.0,
        "4-8k": 100.0,
        "8k+": 0.0,
    }


def test_scorer_e_empty_bucket_is_nan_like_numpy_mean() -> None:
    result = scorer_e("passage_count", ["1"], [["1"]], [10])
    assert result["0-4k"] == 100.0
    assert math.isnan(result["4-8k"]) and math.isnan(result["8k+"])


def test_scorer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="No LongBench metric"):
        scorer("not_a_task", ["x"], [["x"]])
    with pytest.raises(ValueError, match="align"):
        scorer("hotpotqa", ["x", "y"], [["x"]])
    with pytest.raises(ValueError, match="empty"):
        scorer("hotpotqa", [], [])
    with pytest.raises(ValueError, match="align"):
        scorer_e("hotpotqa", ["x"], [["x"]], [1, 2])


def _write_predictions(path: Path, records: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_prediction_files_are_scored_like_eval_py(tmp_path: Path) -> None:
    _write_predictions(
        tmp_path / "passage_count.jsonl",
        [
            {"pred": "1", "answers": ["1"], "all_classes": None, "length": 100},
            {"pred": "2", "answers": ["1"], "all_classes": None, "length": 5000},
        ],
    )
    _write_predictions(
        tmp_path / "trec.jsonl",
        [
            {
                "pred": "Human\nLocation",
                "answers": ["Human"],
                "all_classes": ["Human", "Location"],
                "length": 1,
            }
        ],
    )
    assert score_prediction_file(tmp_path / "passage_count.jsonl") == 50.0
    e_scores = score_prediction_file(tmp_path / "passage_count.jsonl", longbench_e=True)
    assert isinstance(e_scores, dict) and e_scores["0-4k"] == 100.0 and e_scores["4-8k"] == 0.0
    assert score_prediction_dir(tmp_path) == {"passage_count": 50.0, "trec": 100.0}


def test_prediction_file_errors_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "hotpotqa.jsonl"
    _write_predictions(path, [{"pred": "x", "answers": ["x"], "all_classes": None}, {"pred": "y"}])
    with pytest.raises(ValueError, match=r"hotpotqa\.jsonl, line 2.*missing \['answers', 'all_classes'\]"):
        score_prediction_file(path)
    with pytest.raises(ValueError, match=r"No \*\.jsonl"):
        score_prediction_dir(tmp_path / "empty_dir_that_does_not_exist")
