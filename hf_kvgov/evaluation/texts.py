"""Where evaluation text comes from: a file, a field of a jsonl file, a `datasets` id, or the built-in text.

A source yields documents; the perplexity run scores each document on its own (its own cache) and
pools the tokens. A `datasets` corpus is joined into one document with blank lines between its rows,
as the transformers perplexity guide does for wikitext.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hf_kvgov.data_text import demo_text

BUILTIN_NAME = "Pride and Prejudice, opening chapters (built in)"


@dataclass(frozen=True)
class Document:
    name: str
    text: str


@dataclass(frozen=True)
class TextSource:
    """One of: ``path`` (a UTF-8 text file, or a jsonl file with ``jsonl_field``), ``dataset`` (a hub id,
    with ``dataset_config``, ``split`` and ``dataset_field``), or nothing (the built-in text).

    ``max_documents`` keeps the first documents only; ``join`` concatenates a jsonl file's records into one
    document (for short records such as verses).
    """

    path: str | None = None
    jsonl_field: str | None = None
    dataset: str | None = None
    dataset_config: str | None = None
    split: str = "test"
    dataset_field: str = "text"
    max_documents: int | None = None
    join: bool = False

    def __post_init__(self) -> None:
        if self.path is not None and self.dataset is not None:
            raise ValueError(
                f"Give either a text file or a datasets id, not both; got path={self.path!r} and "
                f"dataset={self.dataset!r}."
            )
        if self.jsonl_field is not None and self.path is None:
            raise ValueError(f"jsonl_field={self.jsonl_field!r} names a field of a jsonl file, but no file was given.")
        if self.max_documents is not None and (isinstance(self.max_documents, bool) or self.max_documents < 1):
            raise ValueError(f"max_documents must be a positive integer or None; got {self.max_documents!r}.")

    def describe(self) -> str:
        if self.dataset is not None:
            return f"{self.dataset}{':' + self.dataset_config if self.dataset_config else ''} ({self.split})"
        if self.path is not None:
            return self.path + (f" [{self.jsonl_field}]" if self.jsonl_field else "")
        return BUILTIN_NAME


def load_documents(source: TextSource) -> list[Document]:
    """The documents of ``source``; ValueError when none has any text."""
    if source.dataset is not None:
        documents = [_dataset_document(source)]
    elif source.path is not None and source.jsonl_field is not None:
        documents = _jsonl_documents(Path(source.path), source.jsonl_field, source.join)
    elif source.path is not None:
        documents = [Document(Path(source.path).name, Path(source.path).read_text(encoding="utf-8"))]
    else:
        documents = [Document(BUILTIN_NAME, demo_text())]
    kept = [document for document in documents if document.text.strip()][: source.max_documents]
    if not kept:
        raise ValueError(f"The text source {source.describe()!r} holds no text to score.")
    return kept


def _jsonl_documents(path: Path, field: str, join: bool) -> list[Document]:
    documents = []
    with path.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg} at column {err.colno}).") from err
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                found = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ValueError(f"{where}: expected an object with a string field {field!r}; found {found}.")
            documents.append(Document(f"{path.name}:{line_number}", record[field]))
    if join and documents:
        return [Document(path.name, "\n\n".join(document.text for document in documents))]
    return documents


def _dataset_document(source: TextSource) -> Document:
    assert source.dataset is not None
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise ImportError(
            f"Reading the dataset {source.dataset!r} needs the package 'datasets' (`pip install datasets`) and "
            "network access or its local cache; or pass a text file (--text) or a jsonl file (--jsonl-field)."
        ) from err
    try:
        rows = load_dataset(source.dataset, source.dataset_config, split=source.split)
    except Exception as err:  # datasets raises many types (network, missing config, missing split)
        raise RuntimeError(
            f"Could not load the dataset {source.describe()!r}: {err}. It needs network access or a local "
            "datasets cache; or pass a text file (--text) or a jsonl file (--jsonl-field)."
        ) from err
    if source.dataset_field not in rows.column_names:
        raise ValueError(
            f"The dataset {source.describe()!r} has no column {source.dataset_field!r}; its columns are "
            f"{rows.column_names}."
        )
    return Document(source.describe(), "\n\n".join(rows[source.dataset_field]))
