"""Random needle keys and values: 7-digit numbers, 5-8 digit codes, UUIDs, or hyphenated word pairs from the filler."""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

Draw = Callable[[random.Random, Sequence[str]], str]


def random_number(rng: random.Random, vocab: Sequence[str]) -> str:
    """A 7-digit decimal number, as in RULER."""
    return str(rng.randint(10**6, 10**7 - 1))


def random_code(rng: random.Random, vocab: Sequence[str]) -> str:
    """A decimal code of 5 to 8 digits (its length drawn too), so no setting is fitted to one length."""
    digits = rng.randint(5, 8)
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random, vocab: Sequence[str]) -> str:
    """A version-4 UUID string drawn from ``rng`` (not from the OS), so it is reproducible."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_word_pair(rng: random.Random, vocab: Sequence[str]) -> str:
    """Two filler words joined by a hyphen ("quiet-harbour"), RULER's adjective-noun keys."""
    if len(vocab) < 2:
        raise ValueError(
            "Word keys are pairs of distinct filler words of 3+ letters; the filler has "
            f"{len(vocab)} such words. Pass a longer filler or use numbers or uuids."
        )
    first, second = rng.sample(list(vocab), 2)
    return f"{first}-{second}"


@dataclass(frozen=True)
class ItemKind:
    """How to draw one kind of key or value, and what to call it in the prompt."""

    plural: str
    singular: str
    draw: Draw


ITEM_KINDS: Mapping[str, ItemKind] = MappingProxyType(
    {
        "numbers": ItemKind("numbers", "number", random_number),
        "codes": ItemKind("codes", "code", random_code),
        "uuids": ItemKind("uuids", "uuid", random_uuid),
        "words": ItemKind("words", "word", random_word_pair),
    }
)


def item_kind(name: str) -> ItemKind:
    """The registered kind ``name``; ``ValueError`` listing the accepted kinds otherwise."""
    kind = ITEM_KINDS.get(name)
    if kind is None:
        raise ValueError(f"Unknown key/value kind {name!r}; the accepted kinds are {', '.join(ITEM_KINDS)}.")
    return kind


def draw_distinct(
    rng: random.Random, draw: Draw, vocab: Sequence[str], count: int, avoid: str, taken: Sequence[str] = ()
) -> list[str]:
    """``count`` fresh items: none occurs in ``avoid`` (the filler) and none contains another.

    The containment rule keeps substring scoring honest: an answer inside a distractor would
    otherwise be "found" in a response that only names the distractor.
    """
    chosen: list[str] = list(taken)
    attempts = 0
    while len(chosen) < len(taken) + count:
        attempts += 1
        if attempts > 1000 + 100 * count:
            raise ValueError(
                f"Could not draw {count} distinct items that do not occur in the filler; "
                "use a more varied filler or a different kind of key/value."
            )
        item = draw(rng, vocab)
        if item in avoid or any(item in other or other in item for other in chosen):
            continue
        chosen.append(item)
    return chosen[len(taken) :]
