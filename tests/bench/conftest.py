"""The tiny random Llama with a character tokenizer: both benchmarks run end to end in seconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.char_tokenizer import char_tokenizer
from tests.conftest import tiny_llama

# Geometry of tiny_llama(): 2 layers, 2 KV heads, head_dim 64 / 4 = 16, float32.
LAYERS, KV_HEADS, HEAD_DIM, FP32 = 2, 2, 16, 4
BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * FP32  # keys and values: 512
BLOCK = 16  # the registry's `paged` block size
BYTES_PER_BLOCK = BLOCK * BYTES_PER_TOKEN  # 8,192


@pytest.fixture(scope="package")
def tiny() -> tuple[Any, Any]:
    return tiny_llama(), char_tokenizer()


@pytest.fixture(scope="package")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tiny: tuple[Any, Any]) -> Path:
    """The tiny model and tokenizer saved as a local directory, loadable by `--model PATH`."""
    directory = tmp_path_factory.mktemp("tiny-bench-model")
    model, tokenizer = tiny
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
