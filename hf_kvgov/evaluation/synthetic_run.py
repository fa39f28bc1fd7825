"""`kvgov eval synthetic`: RULER-style tasks at chosen lengths, generated with each cache, exact-match scored.

For each task x length x sample, the prompt is wrapped in the model's chat template (when it has one
and it is wanted) and followed by the task's answer prefix, as RULER does; the answer is generated
greedily and scored by the task's scorer (the fraction of expected strings found in it). Accuracy per
(task, length, cache) is 100 x the mean score.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hf_kvgov.evaluation import plots
from hf_kvgov.evaluation.distributed import Workers, single_process
from hf_kvgov.evaluation.generation import cache_specs, generate_greedy
from hf_kvgov.evaluation.longbench.prompts import apply_chat_template
from hf_kvgov.evaluation.registry import generate_synthetic, get_synthetic_task
from hf_kvgov.evaluation.report import markdown_table
from hf_kvgov.evaluation.summary import cache_rows, mean_by_cache
from hf_kvgov.evaluation.synthetic.sample import SyntheticSample
from hf_kvgov.registry import CacheSpec


@dataclass(frozen=True)
class SyntheticOptions:
    """What to run: ``samples`` per (task, length), drawn from ``seed``; ``max_new_tokens`` caps the tasks'
    own budgets (None: RULER's); ``chat_template`` wraps prompts in the tokenizer's template when it has one;
    ``compress``: what a compressing cache has seen when it compresses (`COMPRESS_INPUTS`): the whole prompt, or the
    context before its question (kvpress's protocol)."""

    caches: tuple[str, ...] = ("dynamic",)
    tasks: tuple[str, ...] = ("passkey",)
    lengths: tuple[int, ...] = (1024,)
    samples: int = 4
    seed: int = 0
    chat_template: bool = True
    max_new_tokens: int | None = None
    compress: str = "prompt"

    def __post_init__(self) -> None:
        for field, values in (("caches", self.caches), ("tasks", self.tasks), ("lengths", self.lengths)):
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{field} must list at least one entry, each once; got {list(values)}.")
        cache_specs(self.caches, self.compress)
        for task in self.tasks:
            get_synthetic_task(task)
        for name, value in (("samples", self.samples), *(("lengths", length) for length in self.lengths)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must hold positive integers; got {value!r}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer or None; got {self.max_new_tokens!r}.")


@dataclass(frozen=True)
class SyntheticItem:
    index: int
    sample: SyntheticSample


@dataclass(frozen=True)
class SyntheticResult:
    index: int
    task: str
    length: int  # the target length in tokens
    prompt_tokens: int  # as fed, chat template and answer prefix included
    cache: str
    prediction: str
    answers: tuple[str, ...]
    score: float  # in [0, 1]
    new_tokens: int
    kv_bytes: int
    depths: tuple[float, ...]


def build_items(tokenizer: Any, filler: str, options: SyntheticOptions) -> list[SyntheticItem]:
    """Every sample of the run, in (task, length, sample) order; the same options give the same samples."""
    samples = [
        sample
        for task in options.tasks
        for length in options.lengths
        for sample in generate_synthetic(task, filler, tokenizer, length, options.samples, options.seed)
    ]
    return [SyntheticItem(index, sample) for index, sample in enumerate(samples)]


def prompt_text(sample: SyntheticSample, tokenizer: Any, chat_template: bool) -> tuple[str, bool]:
    """The prompt as RULER feeds it (chat-wrapped when wanted and possible, then the answer prefix), and
    whether it is wrapped: a chat template already holds the model's leading special tokens."""
    wrapped = apply_chat_template(sample.prompt, tokenizer) if chat_template else None
    return (sample.prompt if wrapped is None else wrapped) + sample.answer_prefix, wrapped is not None


def run_synthetic(
    model: Any,
    tokenizer: Any,
    items: Sequence[SyntheticItem],
    options: SyntheticOptions,
    workers: Workers | None = None,
    model_name: str = "",
) -> SyntheticReport:
    """Generate every item with every cache (this process's share of the items) and score them.

    On Ctrl-C raises `hf_kvgov.partial.Interrupted` with the report of the samples finished with every cache.
    """
    if not items:
        raise ValueError("There are no synthetic samples to run.")
    workers = workers or single_process()
    specs = cache_specs(options.caches, options.compress)
    unsplit = sorted({item.sample.task for item in items if not item.sample.question})
    if options.compress == "context" and unsplit:
        raise ValueError(
            f"The samples of {', '.join(map(repr, unsplit))} name no question after their context, so the context "
            "cannot be compressed apart from it: give the task's samples a `question`, or compress='prompt'."
        )

    def run(item: SyntheticItem) -> list[SyntheticResult]:
        return [_generate(model, tokenizer, item, spec, options) for spec in specs]

    def report(results: list[SyntheticResult]) -> SyntheticReport:
        order = {name: position for position, name in enumerate(options.caches)}
        ordered = sorted(results, key=lambda r: (r.index, order[r.cache]))
        return SyntheticReport(model_name, options, tuple(ordered), workers.count)

    return report(workers.map(items, run, "synthetic", partial=report))


def _generate(
    model: Any, tokenizer: Any, item: SyntheticItem, spec: CacheSpec, options: SyntheticOptions
) -> SyntheticResult:
    sample = item.sample
    text, wrapped = prompt_text(sample, tokenizer, options.chat_template)
    budget = min(sample.max_new_tokens, options.max_new_tokens or sample.max_new_tokens)
    context = text.rfind(sample.question) if options.compress == "context" else None
    out = generate_greedy(model, tokenizer, spec, text, budget, add_special_tokens=not wrapped, context_chars=context)
    score = get_synthetic_task(sample.task).score(out.text, sample.answers)
    return SyntheticResult(
        item.index, sample.task, sample.target_length, out.prompt_tokens, spec.name, out.text, sample.answers,
        score, out.new_tokens, out.kv_bytes, sample.depths,
    )  # fmt: skip


@dataclass(frozen=True)
class SyntheticReport:
    model: str
    options: SyntheticOptions
    results: tuple[SyntheticResult, ...]
    processes: int

    def accuracy(self) -> dict[str, dict[int, dict[str, float]]]:
        """task -> length -> cache -> 100 x mean score, 2 decimals; only the (task, length) pairs with results
        (all of them, unless Ctrl-C stopped the run)."""
        measured = {(r.task, r.length) for r in self.results}
        return {
            task: {
                length: {cache: self._accuracy(task, length, cache) for cache in self.options.caches}
                for length in self.options.lengths
                if (task, length) in measured
            }
            for task in self.options.tasks
            if any((task, length) in measured for length in self.options.lengths)
        }

    def _accuracy(self, task: str | None, length: int | None, cache: str) -> float:
        scores = [
            r.score for r in self.results if r.cache == cache and task in (None, r.task) and length in (None, r.length)
        ]
        return round(100 * sum(scores) / len(scores), 2) if scores else float("nan")

    def averages(self) -> dict[str, float]:
        return {cache: self._accuracy(None, None, cache) for cache in self.options.caches}

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "synthetic",
            "model": self.model,
            "processes": self.processes,
            "options": asdict(self.options),
            "caches": cache_rows(self.options.caches),
            "accuracy": self.accuracy(),
            "accuracy_by_length": {
                length: {cache: self._accuracy(None, length, cache) for cache in self.options.caches}
                for length in self.options.lengths
            },
            "average": self.averages(),
            "kv_bytes": mean_by_cache(self.results, self.options.caches),
            "samples": [asdict(result) for result in self.results],
        }

    def markdown(self) -> str:
        caches = list(self.options.caches)
        rows: list[list[Any]] = [
            [task, length, *per_cache.values()]
            for task, per_length in self.accuracy().items()
            for length, per_cache in per_length.items()
        ]
        rows.append(["average", None, *self.averages().values()])
        kv = mean_by_cache(self.results, caches)
        rows.append(["KV bytes (mean)", None, *(round(kv[c]) for c in caches)])
        title = f"### Synthetic accuracy (%), {self._samples()}"
        return title + "\n\n" + markdown_table(["task", "length", *caches], rows, align_left=1, decimals=2)

    def _samples(self) -> str:
        planned = self.options.samples * len(self.options.tasks) * len(self.options.lengths)
        done = len({r.index for r in self.results})
        if done == planned:
            return f"{self.options.samples} sample(s) per task and length"
        return f"{done} of {planned} samples"

    def plots(self, directory: Path) -> list[Path]:
        kv, average = mean_by_cache(self.results, self.options.caches), self.averages()
        points = [(cache, kv[cache], average[cache]) for cache in self.options.caches]
        name = self.model or "model"
        scatter = plots.quality_vs_bytes(
            points, directory / "synthetic_vs_kv_bytes.png", "accuracy (%)", f"{name}: synthetic accuracy vs KV held"
        )
        series = {
            cache: [(float(length), self._accuracy(None, length, cache)) for length in self.options.lengths]
            for cache in self.options.caches
        }
        curve = plots.curves(
            series, directory / "synthetic_accuracy_vs_length.png", "prompt length (tokens)", "accuracy (%)",
            f"{name}: accuracy vs length", log_x=True,
        )  # fmt: skip
        return [scatter, curve]
