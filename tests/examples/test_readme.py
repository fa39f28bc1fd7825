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


def test_no_example_uses_the_deprecated_argument_name_or_a_fixed_absolute_path() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 5
    for block in blocks:
        assert "past_key_values" not in block, "transformers 5.24 warns on past_key_values=; show cache="
        # A literal absolute path (e.g. "/nvme/kv") would be created on the machine of whoever pastes the block.
        assert not re.search(r"""["']/(?!tmp\b)\w""", block), f"a fixed absolute path in:\n{block}"


@pytest.mark.real_model
def test_every_python_block_runs_in_order_without_warnings(
    smollm2: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks in the order the README gives them, each after the ones before it, as a reader pastes them."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # gettempdir() in the chain example
    namespace: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for block in python_blocks():
            exec(block, namespace)
    noisy = [str(w.message) for w in caught if issubclass(w.category, FutureWarning | DeprecationWarning)]
    assert not [message for message in noisy if "past_key_values" in message or "cache" in message], noisy
    assert all(cache.pool is namespace["pool"] for cache in namespace["caches"])
    assert namespace["out"].shape[0] == 2  # the prefix-sharing block's batch of two questions
    assert namespace["prefix"].stats().hit_tokens == 0  # a first request: nothing cached before it...
    assert len(namespace["prefix"].tree) > 0  # ...but its blocks are published for the next
    assert Path(namespace["spill_dir"]).parent == tmp_path and Path(namespace["spill_dir"]).is_dir()
    assert len(namespace["answers"]) == 2 and all(0 < len(a) <= 32 for a in namespace["answers"])
    assert 0 < len(namespace["stream"].tokens) <= 32 and namespace["stream"].finish_reason in ("stop", "length")
