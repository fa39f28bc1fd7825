"""Filler text into haystacks of a given size, fact insertion by depth, and length fitting in tokens."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from hf_kvgov.evaluation.tokenizer import SupportsEncode, check_encoder

# A sentence longer than this is cut into pieces, so that a depth lands within a few dozen words
# of where it was asked even in filler without punctuation.
MAX_UNIT_WORDS = 40
_SENTENCE_END = ".!?"
_CLOSING = "\"')]”’"
_VOCAB_WORD = re.compile(r"[a-z]{3,}")


def filler_words(filler: str) -> list[str]:
    """The whitespace-separated words of ``filler``; ``ValueError`` if it has none."""
    if not isinstance(filler, str):
        raise TypeError(f"filler must be a string of text; got {type(filler).__name__}.")
    words = filler.split()
    if not words:
        raise ValueError("filler must contain at least one word of text; got an empty or blank string.")
    return words


def vocabulary(filler: str) -> list[str]:
    """The distinct lower-case alphabetic words of at least 3 letters in ``filler``, sorted."""
    return sorted(set(_VOCAB_WORD.findall(filler.lower())))


def cyclic_words(words: Sequence[str], offset: int, count: int) -> list[str]:
    """``count`` words read from ``words`` starting at ``offset``, wrapping around as often as needed."""
    return [words[(offset + index) % len(words)] for index in range(count)]


def _ends_sentence(word: str) -> bool:
    stripped = word.rstrip(_CLOSING)
    return bool(stripped) and stripped[-1] in _SENTENCE_END


def sentence_starts(words: Sequence[str]) -> list[int]:
    """Indices of the words that begin a sentence (the first word, and each one after . ! or ?)."""
    return [0] + [index + 1 for index, word in enumerate(words[:-1]) if _ends_sentence(word)]


def split_units(words: Sequence[str], max_words: int = MAX_UNIT_WORDS) -> list[str]:
    """Group ``words`` into sentences (ending in . ! or ?), none longer than ``max_words`` words."""
    units: list[str] = []
    current: list[str] = []
    for word in words:
        current.append(word)
        if _ends_sentence(word) or len(current) == max_words:
            units.append(" ".join(current))
            current = []
    if current:
        units.append(" ".join(current))
    return units


def insert_at_depths(units: Sequence[str], facts: Sequence[str], depths: Sequence[float]) -> str:
    """Join ``units`` with each fact placed before unit ``int(len(units) * depth)`` (RULER's rule).

    Facts at the same position keep their order in ``facts``.
    """
    assert len(facts) == len(depths), "one depth per fact"
    positions = [int(len(units) * depth) for depth in depths]
    pieces: list[str] = []
    start = 0
    for index in sorted(range(len(facts)), key=positions.__getitem__):
        pieces.extend(units[start : positions[index]])
        pieces.append(facts[index])
        start = positions[index]
    pieces.extend(units[start:])
    return " ".join(pieces)


def check_target_length(target_length: int) -> None:
    """``target_length`` must be a positive int (a number of tokens)."""
    if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"target_length must be a positive number of tokens; got {target_length!r}.")


def _interpolate(base: int, size: int, tokens: int, target_length: int) -> int:
    """Where the line through (0, base) and (size, tokens) reaches ``target_length`` tokens."""
    if tokens <= base:
        return 2 * size
    return int(size * (target_length - base) / (tokens - base))


def fit_to_length(
    render: Callable[[int], str],
    tokenizer: SupportsEncode,
    target_length: int,
    max_size: int,
    too_small: str,
) -> tuple[str, int]:
    """The text ``render(n)`` for the largest ``n <= max_size`` that has at most ``target_length`` tokens.

    ``render(n)`` must grow with ``n`` (the size of the haystack) and be deterministic. Returns the
    text and its token count. Raises ``ValueError`` when even ``render(0)`` is too long, or, with
    ``too_small`` as the message, when ``render(max_size)`` still falls short (filler exhausted).
    """
    check_encoder(tokenizer)
    check_target_length(target_length)
    measured: dict[int, tuple[str, int]] = {}

    def count(size: int) -> int:
        if size not in measured:
            text = render(size)
            measured[size] = (text, len(tokenizer.encode(text)))
        return measured[size][1]

    base = count(0)
    if base > target_length:
        raise ValueError(
            f"target_length={target_length} tokens is shorter than the task's fixed text alone "
            f"({base} tokens); ask for a longer prompt."
        )
    # Tokens grow almost linearly with the haystack, so interpolation lands within a few probes
    # (each a full encode of a long prompt); bisection takes over whenever it fails to halve the gap.
    low, high = 0, None  # render(low) fits; render(high) is too long once one is found.
    probe = max(1, target_length // 4)
    while high is None or high - low > 1:
        if high is None and low >= max_size:
            raise ValueError(too_small)
        width = None if high is None else high - low
        probe = min(max(probe, low + 1), max_size if high is None else high - 1)
        low, high = (probe, high) if count(probe) <= target_length else (low, probe)
        probe = _interpolate(base, probe, count(probe), target_length)
        if width is not None and high is not None and 2 * (high - low) > width:
            probe = (low + high) // 2
    return measured[low]


_NOT_GROWING = (
    "The prompt never reached the target length although the haystack grew far past it; the "
    "tokenizer's encode() does not seem to count the filler's tokens."
)


def fit_haystack(
    words: Sequence[str],
    offset: int,
    facts: Sequence[str],
    depths: Sequence[float],
    wrap: Callable[[str], str],
    tokenizer: SupportsEncode,
    target_length: int,
) -> tuple[str, int]:
    """The longest ``wrap(haystack with facts)`` of at most ``target_length`` tokens, and its length.

    The haystack is filler ``words`` read cyclically from ``offset``, cut into sentences, with
    ``facts[i]`` inserted at ``depths[i]``; ``wrap`` puts it into the task's template.
    """

    def render(size: int) -> str:
        return wrap(insert_at_depths(split_units(cyclic_words(words, offset, size)), facts, depths))

    # Each filler word adds at least one token, so a haystack of this many words is always enough.
    return fit_to_length(render, tokenizer, target_length, 64 * target_length + 1024, _NOT_GROWING)
