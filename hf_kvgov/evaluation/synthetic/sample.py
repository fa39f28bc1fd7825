"""The record every synthetic task produces, and RULER's string-match scorers."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# RULER's insertion depths: 40 evenly spaced points from 0% to 100% of the haystack.
DEPTH_GRID: tuple[float, ...] = tuple(step / 39 for step in range(40))


@dataclass(frozen=True)
class SyntheticSample:
    """One generated long-context sample.

    Attributes:
        task: the registered task name (e.g. "niah_single").
        prompt: context and question, ready for a chat template or to be fed raw.
        answers: the strings a correct response contains.
        answer_prefix: RULER's answer prefix ("The special magic number for ... is"); append it after
            the chat template to steer base models, or ignore it.
        target_length: the requested prompt length in tokens.
        length: the prompt's length in tokens as the generating tokenizer counts it; never above
            ``target_length`` and normally short of it by less than one filler unit.
        max_new_tokens: RULER's generation budget for the task.
        seed: the seed the sample was generated from; the same seed gives the same sample.
        depths: where each inserted fact sits, as a fraction of the haystack (0.0 = start,
            1.0 = end), in insertion order; empty for tasks without inserted facts.
        question: what the template puts after the context, which ``prompt`` ends with: a cache that
            compresses the context before it sees the question is fed the prompt up to it first.
    """

    task: str
    prompt: str
    answers: tuple[str, ...]
    answer_prefix: str
    target_length: int
    length: int
    max_new_tokens: int
    seed: int
    depths: tuple[float, ...] = ()
    question: str = ""

    def __post_init__(self) -> None:
        if not self.prompt.endswith(self.question):
            raise ValueError(f"A synthetic {self.task!r} sample's prompt must end with its question {self.question!r}.")
        if not self.answers:
            raise ValueError(f"A synthetic {self.task!r} sample needs at least one expected answer.")
        if self.length > self.target_length:
            raise ValueError(
                f"A synthetic {self.task!r} sample has {self.length} tokens, more than its target "
                f"of {self.target_length}."
            )


def question_of(wrap: Callable[[str], str]) -> str:
    """What ``wrap`` (a task's template) puts after the context it is given: the question and what follows it."""
    return wrap(_CONTEXT).rpartition(_CONTEXT)[2]


_CONTEXT = "\x00"  # stands for the context: no filler or template holds it


def string_match_all(prediction: str, answers: Sequence[str]) -> float:
    """RULER's recall: the fraction of ``answers`` found in ``prediction`` (case-insensitive substring)."""
    if not answers:
        raise ValueError("string_match_all needs at least one expected answer; got none.")
    lowered = prediction.lower()
    return sum(answer.lower() in lowered for answer in answers) / len(answers)


def string_match_part(prediction: str, answers: Sequence[str]) -> float:
    """RULER's QA match: 1.0 if any of ``answers`` is found in ``prediction`` (case-insensitive), else 0.0."""
    if not answers:
        raise ValueError("string_match_part needs at least one expected answer; got none.")
    lowered = prediction.lower()
    return float(any(answer.lower() in lowered for answer in answers))


def random_depths(rng: random.Random, count: int) -> tuple[float, ...]:
    """``count`` distinct depths from RULER's grid in increasing order (uniform ones past 40)."""
    if count <= len(DEPTH_GRID):
        return tuple(sorted(rng.sample(DEPTH_GRID, count)))
    return tuple(sorted(rng.random() for _ in range(count)))


def check_seed(seed: int) -> None:
    """Seeds are plain ints, so a sample is reproducible from what its record states."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int; got {type(seed).__name__} {seed!r}.")
