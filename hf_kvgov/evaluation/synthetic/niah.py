"""Needle in a haystack (RULER's NIAH family) and the passkey test.

Needles "One of the special magic numbers for <key> is: <value>." are placed in the filler at
chosen depths; the question asks for the values of some of the keys. Variants: several keys of
which only some are asked (multi-key, the others are distractors), several values per key
(multi-value), several keys asked (multi-query); values as numbers or UUIDs.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from hf_kvgov.evaluation.synthetic.haystack import filler_words, fit_haystack, sentence_starts, vocabulary
from hf_kvgov.evaluation.synthetic.keys import draw_distinct, item_kind
from hf_kvgov.evaluation.synthetic.sample import SyntheticSample, check_seed, question_of, random_depths
from hf_kvgov.evaluation.tokenizer import SupportsEncode


@dataclass(frozen=True)
class NiahWording:
    """Prompt texts: ``{kind}`` names the value kind, ``{query}`` the keys asked, ``{context}`` the haystack.

    ``*_one`` are used when exactly one value is asked for (singular grammar), ``*_many`` otherwise.
    """

    needle: str
    template_one: str
    template_many: str
    prefix_one: str
    prefix_many: str


# RULER's constants.py texts, with its singular rewrite ("Some ... are" -> "A ... is") spelled out.
RULER_WORDING = NiahWording(
    needle="One of the special magic {kinds} for {key} is: {value}.",
    template_one=(
        "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {kind} afterwards.\n{context}\n"
        "What is the special magic {kind} for {query} mentioned in the provided text?"
    ),
    template_many=(
        "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {kind} afterwards.\n{context}\n"
        "What are all the special magic {kind} for {query} mentioned in the provided text?"
    ),
    prefix_one=" The special magic {kind} for {query} mentioned in the provided text is",
    prefix_many=" The special magic {kind} for {query} mentioned in the provided text are",
)

# The passkey retrieval test (Mohtashami & Jaggi, 2023): one number, no key.
PASSKEY_WORDING = NiahWording(
    needle="The pass key is {value}. Remember it. {value} is the pass key.",
    template_one=(
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n{context}\nWhat is the pass key?"
    ),
    template_many=(
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n{context}\nWhat are the pass keys?"
    ),
    prefix_one=" The pass key is",
    prefix_many=" The pass keys are",
)


# Other ways to plant and ask for one value, none of them the wording a setting was tuned on: the `needles`
# task draws one per sample (with the value's digits and the depth), so a score is not one template's.
VARIED_WORDINGS: tuple[NiahWording, ...] = (
    PASSKEY_WORDING,
    NiahWording(
        needle="The access code for the {key} vault is {value}.",
        template_one="Read the following notes carefully.\n{context}\nWhat is the access code for the {query} vault?",
        template_many="Read the following notes carefully.\n{context}\nWhat are the access codes for {query}?",
        prefix_one=" The access code for the {query} vault is",
        prefix_many=" The access codes for {query} are",
    ),
    NiahWording(
        needle="Please remember that {value} is the number {key} wrote on the back of the letter.",
        template_one="{context}\nAnswer from the text above: which number did {query} write on the letter?",
        template_many="{context}\nAnswer from the text above: which numbers did {query} write on the letter?",
        prefix_one=" The number {query} wrote on the back of the letter was",
        prefix_many=" The numbers {query} wrote on the back of the letter were",
    ),
    NiahWording(
        needle="(Note for later: the locker of {key} opens with the combination {value}.)",
        template_one="Somewhere in this story is a note about a locker.\n{context}\nWhich combination opens the "
        "locker of {query}?",
        template_many="Somewhere in this story are notes about lockers.\n{context}\nWhich combinations open the "
        "lockers of {query}?",
        prefix_one=" The locker of {query} opens with the combination",
        prefix_many=" The lockers of {query} open with the combinations",
    ),
    RULER_WORDING,
)


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}.")


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH variant.

    Attributes:
        num_keys: needles with distinct keys; those not asked are distractors.
        num_values: values (needles) per key.
        num_queries: keys asked about, at most ``num_keys``.
        key_kind / value_kind: "numbers", "uuids" or "words" (pairs of filler words).
        depths: one depth in [0, 1] per needle, in the order key 1 value 1, key 1 value 2, ...;
            None draws them from RULER's 40-point grid and shuffles the needles.
        wording: the prompt texts.
        max_new_tokens: the generation budget (RULER: 128).
    """

    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1
    key_kind: str = "words"
    value_kind: str = "numbers"
    depths: tuple[float, ...] | None = None
    wording: NiahWording = RULER_WORDING
    max_new_tokens: int = 128

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "num_queries", "max_new_tokens"):
            _check_count(name, getattr(self, name))
        if self.num_queries > self.num_keys:
            raise ValueError(f"num_queries ({self.num_queries}) cannot exceed num_keys ({self.num_keys}).")
        item_kind(self.key_kind)
        item_kind(self.value_kind)
        if self.depths is not None:
            self._check_depths(self.depths)

    def _check_depths(self, depths: tuple[float, ...]) -> None:
        if len(depths) != self.num_needles:
            raise ValueError(f"depths needs one entry per needle ({self.num_needles}); got {len(depths)}.")
        if any(not 0.0 <= depth <= 1.0 for depth in depths):
            raise ValueError(f"Every depth must lie in [0, 1] (0 = start of the haystack); got {depths}.")

    @property
    def num_needles(self) -> int:
        """Needles inserted: one per (key, value) pair."""
        return self.num_keys * self.num_values


def _join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


@dataclass(frozen=True)
class _Question:
    answers: tuple[str, ...]
    template: str
    prefix: str
    labels: dict[str, str]


def _draw_needles(rng: random.Random, config: NiahConfig, filler: str) -> tuple[list[str], list[str], list[str]]:
    """Keys, values (key-major: key 1's values first) and the needle sentences in the same order."""
    vocab = vocabulary(filler)
    keys = draw_distinct(rng, item_kind(config.key_kind).draw, vocab, config.num_keys, filler)
    values = draw_distinct(rng, item_kind(config.value_kind).draw, vocab, config.num_needles, filler, keys)
    plural = item_kind(config.value_kind).plural
    needle_keys = [key for key in keys for _ in range(config.num_values)]
    needles = [
        config.wording.needle.format(kinds=plural, key=k, value=v) for k, v in zip(needle_keys, values, strict=True)
    ]
    return keys, values, needles


def _place(rng: random.Random, config: NiahConfig, needles: list[str]) -> tuple[list[str], tuple[float, ...]]:
    if config.depths is not None:
        return needles, config.depths
    shuffled = list(needles)
    rng.shuffle(shuffled)
    return shuffled, random_depths(rng, len(shuffled))


def _ask(rng: random.Random, config: NiahConfig, keys: list[str], values: list[str]) -> _Question:
    asked = sorted(rng.sample(range(config.num_keys), config.num_queries))
    answers = tuple(values[k * config.num_values + v] for k in asked for v in range(config.num_values))
    one = len(answers) == 1
    kind = item_kind(config.value_kind)
    return _Question(
        answers=answers,
        template=config.wording.template_one if one else config.wording.template_many,
        prefix=config.wording.prefix_one if one else config.wording.prefix_many,
        labels={
            "kind": kind.singular if one else kind.plural,
            "query": _join_query([keys[k] for k in asked]),
        },
    )


def generate_niah(
    filler: str,
    tokenizer: SupportsEncode,
    target_length: int,
    seed: int,
    config: NiahConfig | None = None,
    task: str = "niah",
) -> SyntheticSample:
    """One NIAH sample (``config`` defaults to RULER's niah_single) of at most ``target_length`` tokens.

    ``filler`` is any text, repeated as often as needed; the haystack is the longest one whose
    prompt fits ``target_length`` tokens of ``tokenizer``. The same seed gives the same sample.
    """
    check_seed(seed)
    config = NiahConfig() if config is None else config
    rng = random.Random(seed)
    words = filler_words(filler)
    keys, values, needles = _draw_needles(rng, config, filler)
    needles, depths = _place(rng, config, needles)
    question = _ask(rng, config, keys, values)
    offset = rng.choice(sentence_starts(words))  # The haystack opens on a whole sentence.

    def wrap(context: str) -> str:
        return question.template.format(context=context, **question.labels)

    prompt, length = fit_haystack(words, offset, needles, depths, wrap, tokenizer, target_length)
    return SyntheticSample(
        task=task,
        prompt=prompt,
        answers=question.answers,
        answer_prefix=question.prefix.format(**question.labels),
        target_length=target_length,
        length=length,
        max_new_tokens=config.max_new_tokens,
        seed=seed,
        depths=tuple(depths),
        question=question_of(wrap),
    )


def generate_varied_needle(
    filler: str, tokenizer: SupportsEncode, target_length: int, seed: int, task: str = "needles"
) -> SyntheticSample:
    """One needle whose wording (`VARIED_WORDINGS`), code length (5-8 digits), key and depth (uniform in
    [0.02, 0.98], not RULER's grid) the seed draws; otherwise as `generate_niah`."""
    check_seed(seed)
    rng = random.Random(seed)
    wording = rng.choice(VARIED_WORDINGS)
    config = NiahConfig(value_kind="codes", depths=(round(rng.uniform(0.02, 0.98), 3),), wording=wording)
    sample = generate_niah(filler, tokenizer, target_length, rng.randrange(2**31), config, task)
    return dataclasses.replace(sample, seed=seed)  # the seed that reproduces it is this task's
