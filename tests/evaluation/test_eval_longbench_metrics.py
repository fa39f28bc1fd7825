"""Official LongBench metrics on hand-made examples; expected values worked out by hand from the
definitions in THUDM/LongBench metrics.py (noted next to each case)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from hf_kvgov.evaluation import _deps
from hf_kvgov.evaluation.longbench.metrics import (
    classification_score,
    code_sim_score,
    count_score,
    first_code_line,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)


def rouge_f(precision: float, recall: float) -> float:
    """The F formula of package rouge 1.0.1 (with its 1e-8 in the denominator)."""
    return 2.0 * ((precision * recall) / (precision + recall + 1e-8))


# --- English QA F1 ---------------------------------------------------------------------------


def test_normalize_answer_lowers_strips_punctuation_articles_and_spaces() -> None:
    assert normalize_answer("The  Quick,  brown FOX!") == "quick brown fox"
    # Punctuation goes before articles, so "the-end" becomes one word "theend" and survives.
    assert normalize_answer("the-end") == "theend"
    assert normalize_answer("An apple a day") == "apple day"


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        # "cat sat" vs "cat sat on": 2 common, P = 2/2, R = 2/3, F1 = 2PR/(P+R) = 0.8.
        ("the cat sat", "cat sat on", 0.8),
        ("The Cat, sat!", "cat sat", 1.0),
        # Overlap counts multiplicity: common = min(2, 1) = 1, P = 1/2, R = 1, F1 = 2/3.
        ("cat cat", "cat", 2 / 3),
        ("dog", "cat", 0.0),
        # Only articles and punctuation: no tokens, no overlap.
        ("the a an ...", "cat", 0.0),
    ],
)
def test_qa_f1_score(prediction: str, truth: str, expected: float) -> None:
    assert qa_f1_score(prediction, truth) == pytest.approx(expected, abs=1e-12)


# --- Chinese QA F1 (jieba) ----------------------------------------------------------------------


def test_normalize_zh_answer_removes_chinese_and_ascii_punctuation_and_spaces() -> None:
    assert normalize_zh_answer("北京， 是 首都。!") == "北京是首都"


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        # jieba: 我/爱/北京 vs 北京 -> 1 common, P = 1/3, R = 1, F1 = 0.5.
        ("我爱北京", "北京", 0.5),
        # Same words in another order, "。" normalizes to "" and is dropped: F1 = 1.
        ("北京是中国的首都。", "中国的首都是北京", 1.0),
        # Punctuation only: no tokens left.
        ("。！", "北京", 0.0),
    ],
)
def test_qa_f1_zh_score(prediction: str, truth: str, expected: float) -> None:
    assert qa_f1_zh_score(prediction, truth) == pytest.approx(expected, abs=1e-12)


# --- ROUGE-L ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prediction", ["", "   ", "...", "\n"])
def test_rouge_score_is_zero_when_rouge_raises_on_an_empty_prediction(prediction: str) -> None:
    assert rouge_score(prediction, "the reference summary") == 0.0


def test_rouge_score_is_rouge_l_f_of_package_rouge() -> None:
    # LCS("a b c", "a b d") = "a b": P = R = 2/3.
    assert rouge_score("a b c", "a b d") == pytest.approx(rouge_f(2 / 3, 2 / 3), abs=1e-15)
    # LCS = "cat": P = 1/2, R = 1.
    assert rouge_score("the cat", "cat") == pytest.approx(rouge_f(0.5, 1.0), abs=1e-15)


def test_rouge_zh_score_segments_with_jieba_before_rouge() -> None:
    # "我 爱 北京" vs "北京": LCS 1, P = 1/3, R = 1.
    assert rouge_zh_score("我爱北京", "北京") == pytest.approx(rouge_f(1 / 3, 1.0), abs=1e-15)
    assert rouge_zh_score("今天天气很好", "今天天气很好") == pytest.approx(rouge_f(1.0, 1.0), abs=1e-15)
    assert rouge_zh_score("", "北京") == 0.0


# --- passage_count / retrieval ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        ("5", "5", 1.0),
        # Numbers found: 5 and 7; one of two equals the truth.
        ("There are 5 unique paragraphs, not 7.", "5", 0.5),
        ("I cannot tell.", "5", 0.0),
        # "15" is not "5": whole numbers are compared, not digits.
        ("15", "5", 0.0),
    ],
)
def test_count_score(prediction: str, truth: str, expected: float) -> None:
    assert count_score(prediction, truth) == expected


@pytest.mark.parametrize(
    ("prediction", "expected"),
    [
        ("Paragraph 3", 1.0),
        ("The answer is Paragraph 3.", 1.0),
        # Numbers 3 and 13: half of them are right.
        ("Paragraph 3 or Paragraph 13", 0.5),
        ("Paragraph 30", 0.0),
        ("no idea", 0.0),
    ],
)
def test_retrieval_score(prediction: str, expected: float) -> None:
    assert retrieval_score(prediction, "Paragraph 3") == expected


def test_retrieval_zh_score() -> None:
    assert retrieval_zh_score("答案是段落3", "段落3") == 1.0
    assert retrieval_zh_score("段落3和段落13", "段落3") == 0.5


def test_retrieval_ground_truth_without_paragraph_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="Paragraph"):
        retrieval_score("Paragraph 3", "3")


# --- classification (trec, lsht) ----------------------------------------------------------------


def test_classification_exact_class() -> None:
    classes = ["Location", "Other location", "Human"]
    assert classification_score("Location", "Location", all_classes=classes) == 1.0


def test_classification_two_classes_named_scores_half() -> None:
    # Found: Location, Human; the truth is one of the two -> 1/2.
    classes = ["Location", "Human"]
    assert classification_score("Human or Location", "Human", all_classes=classes) == 0.5


def test_classification_drops_classes_inside_the_ground_truth() -> None:
    # Found: state, city state; "state" is a strict substring of the truth and is dropped -> 1/1.
    classes = ["state", "country", "city state"]
    assert classification_score("city state", "city state", all_classes=classes) == 1.0


def test_classification_keeps_the_official_skip_after_removal_quirk() -> None:
    # Found: big, red, big red ball. The loop removes "big" and then looks at index 1, which is now
    # "big red ball", so "red" is never examined and stays: 2 found -> 1/2 (not 1/1).
    classes = ["big", "red", "big red ball"]
    assert classification_score("big red ball", "big red ball", all_classes=classes) == 0.5


def test_classification_without_any_class_named_is_zero() -> None:
    # The official similarity fallback is unreachable (`list != 0` is always true).
    assert classification_score("Locatoin", "Location", all_classes=["Location", "Human"]) == 0.0


def test_classification_needs_all_classes() -> None:
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("Human", "Human")


# --- code similarity ------------------------------------------------------------------------------


def test_first_code_line_skips_fences_and_comments() -> None:
    assert first_code_line("\n\n```python\n# set up\n// js style\nx = foo(1)\ny = 2") == "x = foo(1)"
    assert first_code_line("```\n# only comments\n```") == ""


@pytest.mark.parametrize(
    ("prediction", "truth", "expected"),
    [
        ("```python\n# comment\nx = foo(1)\n```", "x = foo(1)", 1.0),
        # difflib ratio 2*3/8 = 0.75 -> fuzz.ratio 75.
        ("\n\nabce", "abcd", 0.75),
        # 2*2/6 = 0.666... -> fuzz.ratio rounds to 67.
        ("abc", "abd", 0.67),
        # Every line has a comment marker: the empty string is compared, fuzz.ratio("", "x") = 0.
        ("// note\nprint(x)  # inline", "print(x)", 0.0),
    ],
)
def test_code_sim_score(prediction: str, truth: str, expected: float) -> None:
    assert code_sim_score(prediction, truth) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    ("module", "loader", "metric"),
    [
        ("rouge", _deps.rouge_scorer, rouge_score),
        ("jieba", _deps.jieba_cut, qa_f1_zh_score),
        ("fuzzywuzzy", _deps.fuzz_ratio, code_sim_score),
    ],
)
def test_missing_optional_package_raises_naming_the_eval_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, loader: Any, metric: Any
) -> None:
    # A metric must not turn a missing package into a score of 0.0.
    monkeypatch.setitem(sys.modules, module, None)
    loader.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"pip install hf-kvgov\[eval\]"):
            metric("a b", "a b")
    finally:
        monkeypatch.undo()
        loader.cache_clear()
