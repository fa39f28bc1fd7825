"""Task-level LongBench scores, as the official ``eval.py`` computes them.

Per sample: cut the prediction to its first line for trec/triviaqa/samsum/lsht, score it against
every reference answer with the task's metric and keep the best. Per task: 100 x the mean,
rounded to 2 decimals. LongBench-E reports the same per length bucket of the ``length`` field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import numpy as np

from hf_kvgov.evaluation.longbench.config import FIRST_LINE_TASKS
from hf_kvgov.evaluation.longbench.metrics import (
    Metric,
    classification_score,
    code_sim_score,
    count_score,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)

# The official eval.py ``dataset2metric``, entry for entry.
DATASET_TO_METRIC: Mapping[str, Metric] = MappingProxyType(
    {
        "narrativeqa": qa_f1_score,
        "qasper": qa_f1_score,
        "multifieldqa_en": qa_f1_score,
        "multifieldqa_zh": qa_f1_zh_score,
        "hotpotqa": qa_f1_score,
        "2wikimqa": qa_f1_score,
        "musique": qa_f1_score,
        "dureader": rouge_zh_score,
        "gov_report": rouge_score,
        "qmsum": rouge_score,
        "multi_news": rouge_score,
        "vcsum": rouge_zh_score,
        "trec": classification_score,
        "triviaqa": qa_f1_score,
        "samsum": rouge_score,
        "lsht": classification_score,
        "passage_retrieval_en": retrieval_score,
        "passage_count": count_score,
        "passage_retrieval_zh": retrieval_zh_score,
        "lcc": code_sim_score,
        "repobench-p": code_sim_score,
    }
)

LENGTH_BUCKETS: tuple[str, ...] = ("0-4k", "4-8k", "8k+")


def metric_for(dataset: str) -> Metric:
    """The official metric of ``dataset``; ``ValueError`` naming the accepted tasks otherwise."""
    metric = DATASET_TO_METRIC.get(dataset)
    if metric is None:
        accepted = ", ".join(DATASET_TO_METRIC)
        raise ValueError(f"No LongBench metric for dataset {dataset!r}; the accepted datasets are {accepted}.")
    return metric


def score_sample(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """The score in [0, 1] of one prediction: the best over ``answers`` after the first-line rule."""
    metric = metric_for(dataset)
    if dataset in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    best = 0.0
    for answer in answers:
        best = max(best, metric(prediction, answer, all_classes=all_classes))
    return best


def _check_aligned(predictions: Sequence[str], *others: Sequence[object]) -> None:
    if not predictions:
        raise ValueError("Cannot score an empty list of predictions; give at least one.")
    lengths = {len(predictions), *(len(other) for other in others)}
    if len(lengths) != 1:
        raise ValueError(
            f"predictions and their answers (and lengths) must align one to one; got sizes "
            f"{[len(predictions), *(len(other) for other in others)]}."
        )


def scorer(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """100 x the mean sample score over the task, rounded to 2 decimals (official ``scorer``)."""
    _check_aligned(predictions, answers)
    total = 0.0
    # A running sum in order, exactly as eval.py adds, so the rounding boundary cases agree.
    for prediction, references in zip(predictions, answers, strict=True):
        total += score_sample(dataset, prediction, references, all_classes)
    return round(100 * total / len(predictions), 2)


def bucket_of(length: int) -> str:
    """The LongBench-E bucket of a sample with ``length`` (the dataset's word count): <4000, <8000, else."""
    if length < 4000:
        return "0-4k"
    return "4-8k" if length < 8000 else "8k+"


def scorer_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | None = None,
) -> dict[str, float]:
    """Official LongBench-E scores: {"0-4k", "4-8k", "8k+"} -> 100 x mean, rounded to 2 decimals.

    A bucket without samples is NaN, as numpy's mean of an empty list makes it in eval.py.
    """
    _check_aligned(predictions, answers, lengths)
    buckets: dict[str, list[float]] = {name: [] for name in LENGTH_BUCKETS}
    for prediction, references, length in zip(predictions, answers, lengths, strict=True):
        buckets[bucket_of(length)].append(score_sample(dataset, prediction, references, all_classes))
    # numpy's pairwise mean, as in eval.py, so the last bits (and thus the rounding) agree.
    return {name: _mean_percent(scores) for name, scores in buckets.items()}


def _mean_percent(scores: list[float]) -> float:
    if not scores:
        return math.nan
    return round(100 * float(np.mean(np.asarray(scores, dtype=np.float64))), 2)


def score_prediction_file(path: str | Path, *, longbench_e: bool = False) -> float | dict[str, float]:
    """Score an official prediction file (``pred/<model>/<task>.jsonl`` with pred/answers/all_classes/length).

    The task is the file name up to its first dot, as in eval.py.
    """
    path = Path(path)
    dataset = path.name.split(".")[0]
    predictions: list[str] = []
    answers: list[list[str]] = []
    lengths: list[int] = []
    all_classes: Sequence[str] | None = None
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = _prediction_record(path, line_number, line, needs_length=longbench_e)
            predictions.append(record["pred"])
            answers.append(record["answers"])
            lengths.append(record.get("length", 0))
            # eval.py keeps the last record's all_classes for the whole file; they are per task anyway.
            all_classes = record["all_classes"]
    if longbench_e:
        return scorer_e(dataset, predictions, answers, lengths, all_classes)
    return scorer(dataset, predictions, answers, all_classes)


def _prediction_record(path: Path, line_number: int, line: str, *, needs_length: bool) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}, line {line_number}: not valid JSON ({err.msg}).") from err
    required = ("pred", "answers", "all_classes", *(("length",) if needs_length else ()))
    missing = [name for name in required if not isinstance(record, dict) or name not in record]
    if missing:
        raise ValueError(
            f"{path}, line {line_number}: a prediction record needs the fields {list(required)}; missing {missing}."
        )
    return dict(record)


def score_prediction_dir(directory: str | Path, *, longbench_e: bool = False) -> dict[str, object]:
    """Score every ``*.jsonl`` in ``directory`` like eval.py: {task: score} (LongBench-E: bucket dicts)."""
    files = sorted(Path(directory).glob("*.jsonl"))
    if not files:
        raise ValueError(f"No *.jsonl prediction files in {str(directory)!r}.")
    return {path.name.split(".")[0]: score_prediction_file(path, longbench_e=longbench_e) for path in files}
