"""RULER's common-word extraction: name the most frequent words of a long numbered list.

The words come from the filler's vocabulary. ``num_common`` of them appear ``freq_common`` times
each, the rest ``freq_uncommon`` times; the list is shuffled and numbered "1. harbour 2. quiet ...".
The list grows with more rare words until the prompt reaches the target length. When the filler's
vocabulary runs out, pairs of its rare words ("quiet-harbour") serve as further rare words.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvgov.evaluation.synthetic.haystack import check_target_length, fit_to_length, vocabulary
from hf_kvgov.evaluation.synthetic.sample import SyntheticSample, check_seed, question_of
from hf_kvgov.evaluation.tokenizer import SupportsEncode

TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the {num_common} most common words in the above list?"
)
ANSWER_PREFIX = " Answer: The top {num_common} words that appear most often in the list are:"

# RULER repeats words less often in prompts under 4096 tokens, where 30 repeats would not fit.
LONG_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class CommonWordsConfig:
    """Attributes: ``num_common`` words to find; ``freq_common`` / ``freq_uncommon`` repeats per
    common / rare word (None: RULER's 30 / 3 from 4096 target tokens on, 6 / 1 below);
    ``max_new_tokens`` (RULER: 120)."""

    num_common: int = 10
    freq_common: int | None = None
    freq_uncommon: int | None = None
    max_new_tokens: int = 120

    def __post_init__(self) -> None:
        for name in ("num_common", "freq_common", "freq_uncommon", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (or None where allowed); got {value!r}.")

    def frequencies(self, target_length: int) -> tuple[int, int]:
        """(common, rare) repeats for a prompt of ``target_length`` tokens."""
        long = target_length >= LONG_PROMPT_TOKENS
        common = self.freq_common if self.freq_common is not None else (30 if long else 6)
        rare = self.freq_uncommon if self.freq_uncommon is not None else (3 if long else 1)
        if common <= rare:
            raise ValueError(f"Common words must repeat more often than rare ones; got {common} <= {rare}.")
        return common, rare


def _pick_common(shuffled: Sequence[str], count: int) -> list[str]:
    # No chosen word inside another, so naming one common word never "finds" a second one.
    chosen: list[str] = []
    for word in shuffled:
        if not any(word in other or other in word for other in chosen):
            chosen.append(word)
            if len(chosen) == count:
                return chosen
    raise ValueError(
        f"The filler has too few distinct words (3+ letters) to pick {count} common words that do not "
        "contain one another; pass a longer filler."
    )


def _rare_pool(shuffled: Sequence[str], common: Sequence[str], size: int) -> list[str]:
    # A rare word containing a common one would let a wrong answer match a right one.
    singles = [word for word in shuffled if not any(c in word for c in common)]
    pairs = (f"{a}-{b}" for a, b in itertools.permutations(singles, 2))
    return list(itertools.islice(itertools.chain(singles, pairs), size))


def _numbered(words: Sequence[str]) -> str:
    return " ".join(f"{index + 1}. {word}" for index, word in enumerate(words))


def generate_common_words(
    filler: str,
    tokenizer: SupportsEncode,
    target_length: int,
    seed: int,
    config: CommonWordsConfig | None = None,
    task: str = "common_words",
) -> SyntheticSample:
    """One common-words sample of at most ``target_length`` tokens; answers are the common words."""
    check_seed(seed)
    check_target_length(target_length)
    config = CommonWordsConfig() if config is None else config
    freq_common, freq_rare = config.frequencies(target_length)
    rng = random.Random(seed)
    shuffled = vocabulary(filler)
    rng.shuffle(shuffled)
    common = _pick_common(shuffled, config.num_common)
    # Every rare word adds at least one token, so target_length of them is always enough.
    pool = _rare_pool(shuffled, common, target_length)
    shuffle_seed = rng.getrandbits(64)
    labels = {"num_common": config.num_common}

    def wrap(context: str) -> str:
        return TEMPLATE.format(context=context, **labels)

    def render(size: int) -> str:
        listing = common * freq_common + pool[:size] * freq_rare
        random.Random(shuffle_seed).shuffle(listing)
        return wrap(_numbered(listing))

    too_small = (
        f"The filler yields only {len(pool)} usable rare words, too few for a {target_length}-token "
        "common-words prompt; pass a filler with a larger vocabulary."
    )
    prompt, length = fit_to_length(render, tokenizer, target_length, len(pool), too_small)
    return SyntheticSample(
        task=task,
        prompt=prompt,
        answers=tuple(common),
        answer_prefix=ANSWER_PREFIX.format(**labels),
        target_length=target_length,
        length=length,
        max_new_tokens=config.max_new_tokens,
        seed=seed,
        question=question_of(wrap),
    )
