"""The official LongBench task lists, prompt templates and generation lengths.

``dataset2prompt.json`` and ``dataset2maxlen.json`` are vendored unchanged from THUDM/LongBench
(MIT License, see ``hf_kvgov/data/longbench/LICENSE``) and read as package data, so nothing here
needs the network or a checkout of the official repository.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import resources
from types import MappingProxyType
from typing import Any

# The 21 tasks of LongBench (v1), in the official order of pred.py.
LONGBENCH_TASKS: tuple[str, ...] = (
    "narrativeqa",
    "qasper",
    "multifieldqa_en",
    "multifieldqa_zh",
    "hotpotqa",
    "2wikimqa",
    "musique",
    "dureader",
    "gov_report",
    "qmsum",
    "multi_news",
    "vcsum",
    "trec",
    "triviaqa",
    "samsum",
    "lsht",
    "passage_count",
    "passage_retrieval_en",
    "passage_retrieval_zh",
    "lcc",
    "repobench-p",
)

# The 13 tasks of LongBench-E (uniform length buckets); their hub configs are "<task>_e".
LONGBENCH_E_TASKS: tuple[str, ...] = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)

# Few-shot and code-completion tasks: the prompt already has the shape of the expected output,
# so pred.py feeds them raw, without the chat template.
NO_CHAT_TEMPLATE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

# Tasks whose prediction is cut to its first line before scoring: their few-shot prompts invite
# the model to continue with further made-up examples after the answer.
FIRST_LINE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})

# samsum also stops generation at a newline (pred.py adds the newline token to eos_token_id).
NEWLINE_STOP_TASKS: frozenset[str] = frozenset({"samsum"})

_DATA_PACKAGE = "hf_kvgov"
_DATA_DIR = ("data", "longbench")


def _read_vendored_json(name: str) -> dict[str, Any]:
    path = resources.files(_DATA_PACKAGE).joinpath(*_DATA_DIR, name)
    loaded: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


@functools.cache
def dataset_prompts() -> Mapping[str, str]:
    """Task name -> official prompt template (with ``{context}`` and, for most tasks, ``{input}``)."""
    return MappingProxyType(_read_vendored_json("dataset2prompt.json"))


@functools.cache
def dataset_max_new_tokens() -> Mapping[str, int]:
    """Task name -> official maximum number of generated tokens."""
    return MappingProxyType(_read_vendored_json("dataset2maxlen.json"))


def check_task(task: str) -> str:
    """Return ``task`` if it is a LongBench task name, else raise ``ValueError`` listing the names."""
    if task not in LONGBENCH_TASKS:
        accepted = ", ".join(LONGBENCH_TASKS)
        raise ValueError(f"Unknown LongBench task {task!r}; the accepted tasks are {accepted}.")
    return task


def prompt_template(task: str) -> str:
    """The official prompt template of ``task``."""
    return dataset_prompts()[check_task(task)]


def max_new_tokens(task: str) -> int:
    """The official generation budget of ``task`` in tokens (e.g. 32 for hotpotqa, 512 for gov_report)."""
    return int(dataset_max_new_tokens()[check_task(task)])


def uses_chat_template(task: str) -> bool:
    """Whether pred.py wraps the prompt of ``task`` in the model's chat template."""
    return check_task(task) not in NO_CHAT_TEMPLATE_TASKS


def scores_first_line_only(task: str) -> bool:
    """Whether only the first line of a prediction for ``task`` is scored."""
    return check_task(task) in FIRST_LINE_TASKS


def stops_at_newline(task: str) -> bool:
    """Whether generation for ``task`` also stops at the first generated newline."""
    return check_task(task) in NEWLINE_STOP_TASKS
