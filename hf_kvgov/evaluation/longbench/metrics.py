"""The official LongBench per-sample metrics, reproduced to give the same number on every sample.

Each metric has the official signature ``metric(prediction, ground_truth, **kwargs) -> float`` with
a score in [0, 1]; only ``classification_score`` reads a keyword (``all_classes``). Where the
official code has a quirk that changes scores, the quirk is kept on purpose and commented: a
result called "LongBench" must match the published harness, not an idealised version of it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any, Protocol

from hf_kvgov.evaluation._deps import fuzz_ratio, jieba_cut, rouge_scorer

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_DIGITS = re.compile(r"\d+")
_EN_PUNCTUATION = frozenset(string.punctuation)
# Copied character for character from the official metrics.py (it lists "》" but not "《").
_CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［"
    "＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔"
    "〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…"
    "‧﹏."
)
_ZH_PUNCTUATION = frozenset(string.punctuation + _CN_PUNCTUATION)


class Metric(Protocol):
    """A per-sample LongBench metric: prediction and one reference answer in, a score in [0, 1] out."""

    def __call__(self, prediction: str, ground_truth: str, **kwargs: Any) -> float: ...


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation, drop the articles a/an/the, collapse whitespace (SQuAD style)."""
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in _EN_PUNCTUATION)
    no_articles = _ARTICLES.sub(" ", no_punct)
    return " ".join(no_articles.split())


def normalize_zh_answer(text: str) -> str:
    """Lower-case, drop ASCII and Chinese punctuation, remove all whitespace."""
    lowered = text.lower()
    no_punct = "".join(ch for ch in lowered if ch not in _ZH_PUNCTUATION)
    return "".join(no_punct.split())


def f1_score(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1: overlap counted with multiplicity; 0.0 when nothing overlaps."""
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """English QA F1 over whitespace tokens after ``normalize_answer``."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def _zh_tokens(text: str) -> list[str]:
    cut = jieba_cut()
    normalized = (normalize_zh_answer(token) for token in cut(text, cut_all=False))
    return [token for token in normalized if token]


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Chinese QA F1 over jieba words, each normalized, empty ones (punctuation) dropped."""
    return f1_score(_zh_tokens(prediction), _zh_tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F of package ``rouge`` 1.0.1; 0.0 when it raises.

    ``rouge`` raises on an empty or punctuation-only text ("Hypothesis is empty.") and can hit the
    recursion limit on very long ones; the official harness scores every such case 0.0.
    """
    scorer = rouge_scorer()  # Outside the try: a missing package must raise, not score 0.0.
    try:
        scores = scorer.get_scores([prediction], [ground_truth], avg=True)
    except Exception:
        return 0.0
    return float(scores["rouge-l"]["f"])


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """ROUGE-L F on jieba words joined by spaces (no normalization, as in the official code)."""
    cut = jieba_cut()
    return rouge_score(" ".join(cut(prediction, cut_all=False)), " ".join(cut(ground_truth, cut_all=False)))


def _share_of_numbers_equal_to(prediction: str, target: str) -> float:
    numbers = _DIGITS.findall(prediction)
    if not numbers:
        return 0.0
    return sum(number == target for number in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Share of the numbers in the prediction that equal the ground truth (passage_count)."""
    return _share_of_numbers_equal_to(prediction, str(ground_truth))


def _paragraph_id(ground_truth: str, pattern: re.Pattern[str]) -> str:
    found = pattern.findall(ground_truth)
    if not found:
        raise ValueError(
            f"A retrieval ground truth must name a paragraph matching {pattern.pattern!r}; got {ground_truth!r}."
        )
    return str(found[0])


_PARAGRAPH_EN = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ZH = re.compile(r"段落(\d+)")


def retrieval_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Share of the numbers in the prediction equal to N of the ground truth's "Paragraph N"."""
    return _share_of_numbers_equal_to(prediction, _paragraph_id(ground_truth, _PARAGRAPH_EN))


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """Share of the numbers in the prediction equal to N of the ground truth's "段落N"."""
    return _share_of_numbers_equal_to(prediction, _paragraph_id(ground_truth, _PARAGRAPH_ZH))


def first_code_line(prediction: str) -> str:
    """The first line with no backtick, ``#`` or ``//`` (fences and comments skipped), else ""."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """``fuzz.ratio(first_code_line(prediction), ground_truth) / 100`` (lcc, repobench-p).

    ``fuzz.ratio`` rounds to an int first, so scores move in steps of 0.01. fuzzywuzzy must run
    without python-Levenshtein (difflib backend), as it did for the official numbers.
    """
    return fuzz_ratio()(first_code_line(prediction), ground_truth) / 100


def _drop_classes_inside_ground_truth(matches: list[str], ground_truth: str) -> None:
    # The official code removes items from the list while a for-loop walks it, so the item right
    # after each removed one is never examined. A list iterator is an index that grows by one per
    # step and stops at the current length; this loop is that iterator, so scores stay official.
    index = 0
    while index < len(matches):
        term = matches[index]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        index += 1


def classification_score(prediction: str, ground_truth: str, **kwargs: Any) -> float:
    """1/k when the ground truth is among the k class names found in the prediction, else 0.0.

    Class names that are strict substrings of the ground truth are dropped from the found ones
    first (with the official skip-after-removal quirk). The official fallback to the most similar
    class never runs (its guard compares a list with 0), so a prediction naming no class scores 0.0.

    Raises:
        ValueError: ``all_classes`` is missing or None.
    """
    all_classes = kwargs.get("all_classes")
    if all_classes is None:
        raise ValueError("classification_score needs all_classes=<the task's class names>; got None.")
    matches = [name for name in all_classes if name in prediction]
    _drop_classes_inside_ground_truth(matches, ground_truth)
    return 1.0 / len(matches) if ground_truth in matches else 0.0
