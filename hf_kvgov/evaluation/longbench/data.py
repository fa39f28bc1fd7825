"""LongBench samples: the official jsonl records, validated, from a local directory or the hub.

A record has the fields ``input`` (question, may be empty), ``context`` (the long text),
``answers`` (list of reference strings), ``length`` (word count of context + input, the LongBench-E
bucket key), ``all_classes`` (class names for trec/lsht, else null), ``dataset``, ``language``
and ``_id``. Local files are ``<directory>/<task>.jsonl``, one record per line, the layout of the
official ``data.zip``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_kvgov.evaluation._deps import INSTALL_HINT
from hf_kvgov.evaluation.longbench.config import check_task

HUB_DATASET = "THUDM/LongBench"


@dataclass(frozen=True)
class LongBenchSample:
    """One LongBench record (field names as in the jsonl, ``_id`` as ``id``)."""

    input: str
    context: str
    answers: tuple[str, ...]
    length: int
    all_classes: tuple[str, ...] | None
    dataset: str
    language: str
    id: str

    def __post_init__(self) -> None:
        if not self.answers:
            raise ValueError(f"LongBench sample {self.id!r} has no reference answers; it needs at least one.")
        if self.length < 0:
            raise ValueError(f"LongBench sample {self.id!r} has a negative length {self.length}.")

    def template_fields(self) -> dict[str, Any]:
        """The record as the official ``prompt_format.format(**json_obj)`` sees it."""
        return {
            "input": self.input,
            "context": self.context,
            "answers": list(self.answers),
            "length": self.length,
            "all_classes": None if self.all_classes is None else list(self.all_classes),
            "dataset": self.dataset,
            "language": self.language,
            "_id": self.id,
        }


def _is_str(value: object) -> bool:
    return isinstance(value, str)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_answers(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0 and _is_str_list(value)


def _is_classes(value: object) -> bool:
    return value is None or _is_str_list(value)


# Field -> (check, what the check accepts, in words for the error message).
_FIELDS: Mapping[str, tuple[Callable[[object], bool], str]] = {
    "input": (_is_str, "a string"),
    "context": (_is_str, "a string"),
    "answers": (_is_answers, "a non-empty list of strings"),
    "length": (_is_int, "an integer"),
    "all_classes": (_is_classes, "a list of strings or null"),
    "dataset": (_is_str, "a string"),
    "language": (_is_str, "a string"),
    "_id": (_is_str, "a string"),
}


def sample_from_record(record: object, where: str) -> LongBenchSample:
    """Validate one decoded record; ``where`` (e.g. "hotpotqa.jsonl, line 3") prefixes every error."""
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: a LongBench record must be a JSON object; got {type(record).__name__}.")
    for name, (check, accepted) in _FIELDS.items():
        if name not in record:
            raise ValueError(f"{where}: missing field {name!r}; a LongBench record needs the fields {list(_FIELDS)}.")
        if not check(record[name]):
            raise ValueError(f"{where}: field {name!r} must be {accepted}; got {record[name]!r:.80}.")
    classes = record["all_classes"]
    return LongBenchSample(
        input=record["input"],
        context=record["context"],
        answers=tuple(record["answers"]),
        length=record["length"],
        all_classes=None if classes is None else tuple(classes),
        dataset=record["dataset"],
        language=record["language"],
        id=record["_id"],
    )


def read_jsonl(path: str | Path) -> list[LongBenchSample]:
    """All records of one official jsonl file; blank lines are skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not JSON or not a valid record (the message names file, line and field).
    """
    path = Path(path)
    samples = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}).") from err
            samples.append(sample_from_record(record, where))
    return samples


def load_task(directory: str | Path, task: str, *, longbench_e: bool = False) -> list[LongBenchSample]:
    """The samples of ``task`` from ``<directory>/<task>.jsonl`` (``<task>_e.jsonl`` for LongBench-E)."""
    check_task(task)
    path = Path(directory) / f"{task}{'_e' if longbench_e else ''}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(
            f"No LongBench file for task {task!r} at {str(path)!r}; expected the official "
            "<task>.jsonl files (from LongBench's data.zip) in that directory."
        )
    return read_jsonl(path)


def load_from_hub(
    task: str,
    *,
    longbench_e: bool = False,
    repo_id: str = HUB_DATASET,
    split: str = "test",
    **load_kwargs: Any,
) -> list[LongBenchSample]:
    """The samples of ``task`` through ``datasets.load_dataset(repo_id, task[+"_e"], split=split)``.

    Needs the optional ``datasets`` package and network access (or its local cache). Recent
    ``datasets`` releases no longer run loading scripts; point ``repo_id`` at a mirror that ships
    plain data files, or use ``load_task`` on the unpacked official ``data.zip``.
    """
    check_task(task)
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError(
            "Loading LongBench from the hub needs the package 'datasets'; install it with "
            f"`pip install datasets` (the metrics themselves need `{INSTALL_HINT}`), or use "
            "load_task() on a local directory of <task>.jsonl files."
        ) from err
    config = f"{task}_e" if longbench_e else task
    rows: Iterable[object] = load_dataset(repo_id, config, split=split, **load_kwargs)
    return [sample_from_record(row, f"{repo_id}:{config}, row {index}") for index, row in enumerate(rows)]


def answers_of(samples: Sequence[LongBenchSample]) -> list[list[str]]:
    """The reference answers of ``samples``, in the shape ``scorer`` takes."""
    return [list(sample.answers) for sample in samples]
