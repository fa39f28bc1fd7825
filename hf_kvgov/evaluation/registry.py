"""Task names to generators and scorers, so callers pick a task by string without branching on it.

Synthetic tasks map to a ``SyntheticTask`` (generator + per-sample scorer); LongBench tasks map to
the official per-sample metric through ``DATASET_TO_METRIC``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from hf_kvgov.evaluation.longbench.metrics import Metric
from hf_kvgov.evaluation.longbench.scoring import metric_for
from hf_kvgov.evaluation.synthetic.common_words import generate_common_words
from hf_kvgov.evaluation.synthetic.niah import PASSKEY_WORDING, NiahConfig, generate_niah, generate_varied_needle
from hf_kvgov.evaluation.synthetic.sample import SyntheticSample, check_seed, string_match_all
from hf_kvgov.evaluation.synthetic.variable_tracking import VariableTrackingConfig, generate_variable_tracking
from hf_kvgov.evaluation.tokenizer import SupportsEncode

# generate(filler, tokenizer, target_length, seed, task=name) -> sample
Generator = Callable[..., SyntheticSample]
SampleScorer = Callable[[str, Sequence[str]], float]


@dataclass(frozen=True)
class SyntheticTask:
    """A registered synthetic task: how to generate a sample and how to score a response to it."""

    name: str
    generate: Generator
    score: SampleScorer
    description: str

    def make(self, filler: str, tokenizer: SupportsEncode, target_length: int, seed: int) -> SyntheticSample:
        """One sample of this task (see the generator for the meaning of the arguments)."""
        return self.generate(filler, tokenizer, target_length, seed, task=self.name)


def _niah(**config: Any) -> Generator:
    return functools.partial(generate_niah, config=NiahConfig(**config))


_SYNTHETIC: dict[str, SyntheticTask] = {}


def register_synthetic_task(task: SyntheticTask, *, replace: bool = False) -> None:
    """Add ``task`` under ``task.name``; ``ValueError`` if the name is taken, unless ``replace``."""
    if task.name in _SYNTHETIC and not replace:
        raise ValueError(f"A synthetic task named {task.name!r} is already registered; pass replace=True.")
    _SYNTHETIC[task.name] = task


for _task in (
    SyntheticTask("passkey", _niah(wording=PASSKEY_WORDING), string_match_all, "one pass key in filler"),
    SyntheticTask("niah_single", _niah(), string_match_all, "one word key, one 7-digit number"),
    SyntheticTask(
        "needles", generate_varied_needle, string_match_all, "one 5-8 digit code, wording and depth varied per sample"
    ),
    SyntheticTask("niah_single_uuid", _niah(value_kind="uuids"), string_match_all, "one key, one UUID"),
    SyntheticTask("niah_multikey", _niah(num_keys=4), string_match_all, "four keys, one asked"),
    SyntheticTask(
        "niah_multikey_uuid",
        _niah(num_keys=4, key_kind="uuids", value_kind="uuids"),
        string_match_all,
        "four UUID keys with UUID values, one asked",
    ),
    SyntheticTask("niah_multivalue", _niah(num_values=4), string_match_all, "one key, four values"),
    SyntheticTask("niah_multiquery", _niah(num_keys=4, num_queries=4), string_match_all, "four keys, all asked"),
    SyntheticTask(
        "variable_tracking",
        functools.partial(generate_variable_tracking, config=VariableTrackingConfig()),
        string_match_all,
        "one chain of four hops, find every variable holding its value",
    ),
    SyntheticTask("common_words", generate_common_words, string_match_all, "top-10 most frequent words"),
):
    register_synthetic_task(_task)


def synthetic_tasks() -> Mapping[str, SyntheticTask]:
    """All registered synthetic tasks by name (read-only view)."""
    return MappingProxyType(_SYNTHETIC)


def get_synthetic_task(name: str) -> SyntheticTask:
    """The synthetic task ``name``; ``ValueError`` listing the registered names otherwise."""
    task = _SYNTHETIC.get(name)
    if task is None:
        raise ValueError(f"Unknown synthetic task {name!r}; the registered tasks are {', '.join(sorted(_SYNTHETIC))}.")
    return task


def longbench_metric(task: str) -> Metric:
    """The official per-sample metric of LongBench task ``task``."""
    return metric_for(task)


def generate_synthetic(
    name: str, filler: str, tokenizer: SupportsEncode, target_length: int, num_samples: int, seed: int
) -> list[SyntheticSample]:
    """``num_samples`` samples of task ``name``, their seeds derived from ``seed`` (reproducible)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer; got {num_samples!r}.")
    check_seed(seed)
    task = get_synthetic_task(name)
    seeds = random.Random(seed)
    return [task.make(filler, tokenizer, target_length, seeds.getrandbits(63)) for _ in range(num_samples)]


def score_synthetic(name: str, predictions: Sequence[str], samples: Sequence[SyntheticSample]) -> float:
    """100 x the mean per-sample score of ``predictions`` against ``samples``, rounded to 2 decimals."""
    if not predictions or len(predictions) != len(samples):
        raise ValueError(
            f"Need one prediction per sample and at least one of each; got {len(predictions)} predictions "
            f"for {len(samples)} samples."
        )
    score = get_synthetic_task(name).score
    total = sum(score(prediction, sample.answers) for prediction, sample in zip(predictions, samples, strict=True))
    return round(100 * total / len(samples), 2)
