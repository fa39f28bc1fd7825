"""Text shipped with the package, so demos, tests and benchmarks run with no data set-up."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

# The whole novel (public domain, see data/text/NOTICE): the tests cut passages from it at fixed character
# offsets and the streaming benchmark needs more tokens than the opening chapters hold.
_NOVEL = "data/text/prideprejudice.txt"


def demo_text(max_chars: int | None = None) -> str:
    """The opening chapters of Pride and Prejudice (public domain), cut at a paragraph boundary."""
    text = resources.files("hf_kvgov").joinpath("data/demo_text.txt").read_text(encoding="utf-8")
    if max_chars is None or len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    return cut[: cut.rfind("\n\n")] if "\n\n" in cut else cut


def pride_and_prejudice_path() -> Path:
    """Where the package's copy of the complete Pride and Prejudice (684,767 characters) lies on disk."""
    return Path(str(resources.files("hf_kvgov").joinpath(_NOVEL)))


def pride_and_prejudice() -> str:
    """The complete text of Pride and Prejudice, as the Austen corpora distribute it."""
    return pride_and_prejudice_path().read_text(encoding="utf-8")
