"""Text shipped with the package, so demos and benchmarks run with no data set-up."""

from __future__ import annotations

from importlib import resources


def demo_text(max_chars: int | None = None) -> str:
    """The opening chapters of Pride and Prejudice (public domain), cut at a paragraph boundary."""
    text = resources.files("hf_kvgov").joinpath("data/demo_text.txt").read_text(encoding="utf-8")
    if max_chars is None or len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    return cut[: cut.rfind("\n\n")] if "\n\n" in cut else cut
