"""The README's Python examples: what a newcomer pastes must run as shown, quietly, and write nothing outside a
temporary directory."""

from __future__ import annotations

import re
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)


def block_with(text: str) -> str:
    (block,) = [block for block in python_blocks() if text in block]
    return block


def test_no_example_uses_the_deprecated_argument_name_or_a_fixed_absolute_path() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        assert "past_key_values" not in block, "transformers 5.24 warns on past_key_values=; show cache="
        # A literal absolute path (e.g. "/nvme/kv") would be created on the machine of whoever pastes the block.
        assert not re.search(r"""["']/(?!tmp\b)\w""", block), f"a fixed absolute path in:\n{block}"


@pytest.mark.real_model
def test_usage_and_chain_examples_run_as_shown_without_warnings(
    smollm2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # gettempdir() in the chain example
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(block_with("PagedCache(model, block_size=16"), namespace)
        exec(block_with("with paged_attention(model):"), namespace)
        exec(block_with("PagedCache(model, pool=pool)"), namespace)
        exec(block_with("GovernedCache(model"), namespace)
        exec(block_with("ServingEngine(model"), namespace)
    noisy = [str(w.message) for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning)]
    assert not [message for message in noisy if "past_key_values" in message or "cache" in message], noisy
    assert namespace["out"].shape[1] > namespace["inputs"]["input_ids"].shape[1]  # generate produced tokens
    assert all(cache.pool is namespace["pool"] for cache in namespace["caches"])
    assert len(namespace["answers"]) == 2 and all(0 < len(a) <= 32 for a in namespace["answers"])
    assert 0 < len(namespace["stream"].tokens) <= 32 and namespace["stream"].finish_reason in ("stop", "length")
    assert Path(namespace["spill_dir"]).parent == tmp_path and Path(namespace["spill_dir"]).is_dir()
