"""Fixtures shared by the quality-check tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, austen_text: str) -> Path:
    """The tiny model and a character tokenizer saved as a local model directory, with a text beside them."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_llama().save_pretrained(directory)
    char_tokenizer().save_pretrained(directory)
    (directory / "text.txt").write_text(austen_text[40_000:40_600], encoding="utf-8")
    return directory
