"""Benchmark prompts of an exact token length, cut from the text shipped with the package.

Real text rather than random ids: attention mass, and so what an eviction cache keeps, depends on it.
The embedded text is a few thousand tokens; longer contexts repeat it. Each row of a batch starts at a
different place in the text, so rows are not copies of each other.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_kvgov.data_text import demo_text


def text_token_ids(tokenizer: Any) -> list[int]:
    """The embedded text as token ids, without special tokens (a prompt is cut from anywhere in it)."""
    ids = list(tokenizer(demo_text(), add_special_tokens=False)["input_ids"])
    if not ids:
        raise ValueError("The tokenizer turned the embedded text into no tokens; use a tokenizer for this language.")
    return ids


def prompt_ids(stream: list[int], batch: int, context: int) -> torch.Tensor:
    """Long `[batch, context]` prompts cut from `stream` (repeated as needed), row r from offset r * len / batch."""
    for name, value in (("batch", batch), ("context", context)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"A prompt's {name} must be a positive int; got {value!r}.")
    if not stream:
        raise ValueError("Cannot cut prompts from an empty token stream; give the token ids of some text.")
    offsets = [row * len(stream) // batch for row in range(batch)]
    needed = offsets[-1] + context
    tiled = torch.tensor(stream * -(-needed // len(stream)), dtype=torch.long)
    return torch.stack([tiled[start : start + context] for start in offsets])
