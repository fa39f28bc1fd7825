"""Tokenizer stand-ins and filler text for the evaluation tests (no model, no download)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

FILLER = (
    "The harbour lay quiet under a grey sky while fishermen mended their nets on the long stone pier. "
    "Nobody in the village remembered when the old lighthouse had last been painted. "
    "Children ran along the sea wall, shouting names into the wind and chasing gulls. "
    "A baker opened his shutters at dawn, and the smell of warm bread drifted down the lane. "
    "In winter the ferry stopped running, so letters waited for weeks at the post office. "
    "The schoolteacher kept a barometer by the window and wrote the pressure in a ledger. "
    "Every spring the meadow behind the church turned yellow with wild mustard flowers. "
    "Travellers rarely stayed longer than a night, because the inn had only three rooms. "
    "On clear evenings you could see the islands, blue and flat, along the horizon. "
    "The blacksmith's daughter repaired bicycles, clocks and, once, a church organ. "
)


class WhitespaceTokenizer:
    """One token per whitespace-separated word."""

    def encode(self, text: str) -> list[int]:
        return [len(word) for word in text.split()]


class CharTokenizer:
    """One token per character (id = code point + 10), with a BOS token of id 1 added by default."""

    BOS = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(ch) + 10 for ch in text]
        return [self.BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(
            "<s>" if i == self.BOS else chr(i - 10) for i in ids if not (skip_special_tokens and i == self.BOS)
        )


class ChatCharTokenizer(CharTokenizer):
    """A CharTokenizer with a chat template that wraps the user turn in <user>...<reply>."""

    chat_template = "<user>{content}<reply>"

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool) -> str:
        assert not tokenize and add_generation_prompt and len(messages) == 1
        return f"<user>{messages[0]['content']}<reply>"


@pytest.fixture
def whitespace_tokenizer() -> WhitespaceTokenizer:
    return WhitespaceTokenizer()


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()


@pytest.fixture
def chat_tokenizer() -> ChatCharTokenizer:
    return ChatCharTokenizer()


@pytest.fixture
def filler() -> str:
    return FILLER
