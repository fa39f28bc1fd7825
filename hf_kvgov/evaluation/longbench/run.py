"""`kvgov eval longbench`: LongBench as the official pred.py + eval.py run it, once per cache.

Per sample: the official template, the middle cut to ``max_length`` tokens, the chat template except
for the few-shot and code tasks, greedy generation of the official length (samsum also stops at a
newline), the official metric (max over answers). Per task and cache: 100 x the mean, and the
LongBench-E buckets by the sample's ``length`` (0-4k, 4-8k, 8k+ words).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hf_kvgov.evaluation import plots
from hf_kvgov.evaluation.distributed import Workers, single_process
from hf_kvgov.evaluation.generation import cache_specs, generate_greedy
from hf_kvgov.evaluation.longbench.config import LONGBENCH_E_TASKS, LONGBENCH_TASKS, check_task, max_new_tokens
from hf_kvgov.evaluation.longbench.data import LongBenchSample, load_from_hub, load_task
from hf_kvgov.evaluation.longbench.prompts import prepare_prompt
from hf_kvgov.evaluation.longbench.scoring import LENGTH_BUCKETS, bucket_of, score_sample, scorer, scorer_e
from hf_kvgov.evaluation.report import markdown_table
from hf_kvgov.evaluation.summary import cache_rows, mean_by_cache
from hf_kvgov.hf.compat import decoder_config
from hf_kvgov.registry import CacheSpec


@dataclass(frozen=True)
class LongBenchOptions:
    """What to run.

    Attributes:
        caches: registered cache names.
        max_length: prompt tokens kept by the middle cut; None: the model's context minus the task's
            generation budget, so prompt and answer fit.
        max_new_tokens: a cap on the official generation budgets, for quick runs (scores are then not
            the official protocol's); None: the official budgets.
        compress: what a compressing cache has seen when it compresses (`COMPRESS_INPUTS`): the whole prompt,
            or the context before its question (kvpress's protocol).
    """

    caches: tuple[str, ...] = ("dynamic",)
    max_length: int | None = None
    max_new_tokens: int | None = None
    compress: str = "prompt"

    def __post_init__(self) -> None:
        if not self.caches or len(set(self.caches)) != len(self.caches):
            raise ValueError(f"caches must name at least one cache, each once; got {list(self.caches)}.")
        cache_specs(self.caches, self.compress)
        for name in ("max_length", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 2):
                raise ValueError(f"{name} must be an integer of at least 2 or None; got {value!r}.")


@dataclass(frozen=True)
class LongBenchItem:
    index: int  # order in the run: results are reported in it whatever process ran them
    task: str
    sample: LongBenchSample


@dataclass(frozen=True)
class LongBenchResult:
    """One sample generated with one cache."""

    index: int
    task: str
    id: str
    cache: str
    prediction: str
    score: float  # in [0, 1], the official per-sample score
    length: int  # the dataset's length field (words), the LongBench-E bucket key
    bucket: str
    prompt_tokens: int
    new_tokens: int
    truncated: bool
    kv_bytes: int


def load_items(
    tasks: Sequence[str] | None,
    *,
    data_dir: str | Path | None = None,
    hub: str | None = None,
    longbench_e: bool = False,
    limit: int | None = None,
) -> list[LongBenchItem]:
    """The samples to run, from ``<data_dir>/<task>.jsonl`` or the hub dataset ``hub``, ``limit`` per task.

    Without ``tasks``: every task with a file in ``data_dir``, or every task of LongBench(-E) from the hub.
    """
    if (data_dir is None) == (hub is None):
        raise ValueError(f"Give exactly one of a data directory or a hub dataset id; got {data_dir!r} and {hub!r}.")
    if limit is not None and (isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive number of samples per task or None; got {limit!r}.")
    names = [check_task(task) for task in tasks] if tasks else _default_tasks(data_dir, longbench_e)
    if not names:
        raise ValueError(f"No LongBench task files (<task>{'_e' if longbench_e else ''}.jsonl) in {str(data_dir)!r}.")
    items: list[LongBenchItem] = []
    for task in names:
        if data_dir is not None:
            samples = load_task(data_dir, task, longbench_e=longbench_e)
        else:
            assert hub is not None
            samples = load_from_hub(task, longbench_e=longbench_e, repo_id=hub)
        items += [LongBenchItem(len(items) + offset, task, sample) for offset, sample in enumerate(samples[:limit])]
    return items


def _default_tasks(data_dir: str | Path | None, longbench_e: bool) -> list[str]:
    candidates = LONGBENCH_E_TASKS if longbench_e else LONGBENCH_TASKS
    if data_dir is None:
        return list(candidates)
    suffix = "_e" if longbench_e else ""
    return [task for task in candidates if (Path(data_dir) / f"{task}{suffix}.jsonl").is_file()]


def run_longbench(
    model: Any,
    tokenizer: Any,
    items: Sequence[LongBenchItem],
    options: LongBenchOptions,
    workers: Workers | None = None,
    model_name: str = "",
) -> LongBenchReport:
    """Generate every item with every cache (this process's share) and score them the official way.

    On Ctrl-C raises `hf_kvgov.partial.Interrupted` with the report of the samples finished with every cache.
    """
    if not items:
        raise ValueError("There are no LongBench samples to run; check the data directory, tasks and limit.")
    workers = workers or single_process()
    specs = cache_specs(options.caches, options.compress)
    context = int(getattr(decoder_config(model), "max_position_embeddings", 0) or 0)
    if options.compress == "context":  # every sample's split is checked before hours of generation, not at its turn
        unsplit = [
            f"{item.task} {item.sample.id!r}"
            for item in items
            if prepare_prompt(item.task, item.sample, tokenizer, _max_length(item.task, options, context)).context_chars
            is None
        ]
        if unsplit:
            raise ValueError(
                f"{len(unsplit)} LongBench sample(s) have no context before their question, or the middle cut took "
                f"part of it ({', '.join(unsplit[:5])}{', ...' if len(unsplit) > 5 else ''}), so their context cannot "
                "be compressed apart from it; raise max_length, leave them out, or run with compress='prompt'."
            )

    def run(item: LongBenchItem) -> list[LongBenchResult]:
        return [_generate(model, tokenizer, item, spec, options, context) for spec in specs]

    def report(results: list[LongBenchResult]) -> LongBenchReport:
        """The report of ``results``, scored over the items they cover (every item, unless Ctrl-C stopped the run)."""
        order = {name: position for position, name in enumerate(options.caches)}
        ordered = sorted(results, key=lambda r: (r.index, order[r.cache]))
        covered = {r.index for r in results}
        done = tuple(item for item in items if item.index in covered)
        return LongBenchReport(model_name, options, tuple(ordered), done, workers.count)

    return report(workers.map(items, run, "longbench", partial=report))


def _generate(
    model: Any, tokenizer: Any, item: LongBenchItem, spec: CacheSpec, options: LongBenchOptions, context: int
) -> LongBenchResult:
    prompt = prepare_prompt(item.task, item.sample, tokenizer, _max_length(item.task, options, context))
    budget = min(prompt.max_new_tokens, options.max_new_tokens or prompt.max_new_tokens)
    context_chars = prompt.context_chars if options.compress == "context" else None  # checked by run_longbench
    out = generate_greedy(
        model,
        tokenizer,
        spec,
        prompt.text,
        budget,
        add_special_tokens=prompt.add_special_tokens,
        extra_eos_token_ids=prompt.extra_eos_token_ids,
        min_new_tokens=prompt.min_new_tokens,
        context_chars=context_chars,
    )
    sample = item.sample
    score = score_sample(item.task, out.text, sample.answers, sample.all_classes)
    return LongBenchResult(
        item.index, item.task, sample.id, spec.name, out.text, score, sample.length, bucket_of(sample.length),
        out.prompt_tokens, out.new_tokens, prompt.truncated, out.kv_bytes,
    )  # fmt: skip


def _max_length(task: str, options: LongBenchOptions, context: int) -> int:
    if options.max_length is not None:
        return options.max_length
    room = context - max_new_tokens(task)
    if room < 2:
        raise ValueError(
            f"Cannot derive a prompt length for {task!r}: the model's context ({context} tokens) leaves no room "
            f"after the task's {max_new_tokens(task)} generated tokens; pass max_length explicitly."
        )
    return room


@dataclass(frozen=True)
class LongBenchReport:
    model: str
    options: LongBenchOptions
    results: tuple[LongBenchResult, ...]
    items: tuple[LongBenchItem, ...]
    processes: int

    @property
    def tasks(self) -> list[str]:
        return list(dict.fromkeys(item.task for item in self.items))

    def _of(self, task: str, cache: str) -> list[LongBenchResult]:
        return [r for r in self.results if r.task == task and r.cache == cache]

    def task_scores(self) -> dict[str, dict[str, float]]:
        """task -> cache -> the official task score (100 x mean of the per-sample best, 2 decimals)."""
        return {task: {cache: self._score(task, cache) for cache in self.options.caches} for task in self.tasks}

    def _score(self, task: str, cache: str) -> float:
        predictions = [r.prediction for r in self._of(task, cache)]
        return scorer(task, predictions, self._answers(task), self._classes(task))

    def bucket_scores(self) -> dict[str, dict[str, dict[str, float]]]:
        """task -> cache -> LongBench-E bucket -> score (NaN for a bucket without samples)."""
        return {
            task: {
                cache: scorer_e(
                    task,
                    [r.prediction for r in self._of(task, cache)],
                    self._answers(task),
                    [r.length for r in self._of(task, cache)],
                    self._classes(task),
                )
                for cache in self.options.caches
            }
            for task in self.tasks
        }

    def _answers(self, task: str) -> list[list[str]]:
        return [list(item.sample.answers) for item in self.items if item.task == task]

    def _classes(self, task: str) -> list[str] | None:
        # eval.py scores a whole file with the all_classes of its last record; they are per task anyway.
        last = [item.sample.all_classes for item in self.items if item.task == task][-1]
        return None if last is None else list(last)

    def averages(self) -> dict[str, float]:
        scores = self.task_scores()
        return {cache: round(sum(s[cache] for s in scores.values()) / len(scores), 2) for cache in self.options.caches}

    def to_dict(self) -> dict[str, Any]:
        scores, buckets = self.task_scores(), self.bucket_scores()
        return {
            "command": "longbench",
            "model": self.model,
            "processes": self.processes,
            "options": asdict(self.options),
            "caches": cache_rows(self.options.caches),
            "tasks": {
                task: {"samples": len(self._answers(task)), "scores": scores[task], "buckets": buckets[task]}
                for task in self.tasks
            },
            "average": self.averages(),
            "kv_bytes": mean_by_cache(self.results, self.options.caches),
            "samples": [asdict(result) for result in self.results],
        }

    def markdown(self) -> str:
        caches, scores = list(self.options.caches), self.task_scores()
        rows: list[list[Any]] = [[task, len(self._answers(task)), *scores[task].values()] for task in self.tasks]
        rows.append(["average", len(self.items), *self.averages().values()])
        kv = mean_by_cache(self.results, caches)
        rows.append(["KV bytes (mean)", None, *(round(kv[c]) for c in caches)])
        text = "### LongBench (score x100)\n\n" + markdown_table(["task", "samples", *caches], rows, 1, decimals=2)
        # Only the buckets that hold samples (a bucket without any is NaN for every cache).
        bucket_rows = [
            [task, bucket, *(per_cache[c][bucket] for c in caches)]
            for task, per_cache in self.bucket_scores().items()
            for bucket in LENGTH_BUCKETS
            if any(r.task == task and r.bucket == bucket for r in self.results)
        ]
        table = markdown_table(["task", "bucket", *caches], bucket_rows, 2, decimals=2)
        return text + "\n\n### LongBench-E length buckets (words)\n\n" + table

    def plots(self, directory: Path) -> list[Path]:
        kv, average = mean_by_cache(self.results, self.options.caches), self.averages()
        points = [(cache, kv[cache], average[cache]) for cache in self.options.caches]
        title = f"{self.model or 'model'}: LongBench vs KV held"
        return [plots.quality_vs_bytes(points, directory / "longbench_vs_kv_bytes.png", "average score", title)]
