"""What the evaluation code needs from a tokenizer, as structural types.

A transformers tokenizer satisfies both protocols; so does any small object with the same
methods, which is how the tests run without a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class SupportsEncode(Protocol):
    """Anything with ``encode(text) -> token ids``; used to measure lengths in tokens."""

    def encode(self, text: str) -> Sequence[int]: ...


@runtime_checkable
class SupportsEncodeDecode(Protocol):
    """A tokenizer that encodes with or without special tokens and decodes, optionally skipping them."""

    def encode(self, text: str, add_special_tokens: bool = True) -> Sequence[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


def check_encoder(tokenizer: object, needs: type = SupportsEncode) -> None:
    """Raise ``TypeError`` naming what is missing when ``tokenizer`` lacks the methods of ``needs``."""
    if not isinstance(tokenizer, needs):
        raise TypeError(
            f"Expected a tokenizer-like object with {needs.__name__} methods (encode, and decode where "
            f"prompts are truncated); got {type(tokenizer).__name__}."
        )
