"""RULER's variable tracking: follow chains of assignments hidden in filler text.

A chain is "VAR QXKZB = 52817." then "VAR HJWTE = VAR QXKZB." and so on for ``num_hops`` hops. The
statements of all chains are spread through the haystack, each chain in order; the question asks
for every variable that holds the first chain's value.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from hf_kvgov.evaluation.synthetic.haystack import filler_words, fit_haystack, sentence_starts
from hf_kvgov.evaluation.synthetic.sample import SyntheticSample, check_seed, question_of, random_depths
from hf_kvgov.evaluation.tokenizer import SupportsEncode

TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
)
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assigned the value {query}, they are: "
)


@dataclass(frozen=True)
class VariableTrackingConfig:
    """Attributes: ``num_chains`` (1 asked, the rest distractors), ``num_hops`` per chain,
    ``name_length`` (letters per variable name) and ``max_new_tokens`` (RULER: 30)."""

    num_chains: int = 1
    num_hops: int = 4
    name_length: int = 5
    max_new_tokens: int = 30

    def __post_init__(self) -> None:
        for name in ("num_chains", "num_hops", "name_length", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}.")
        if self.name_length < 3:
            raise ValueError(f"name_length must be at least 3 letters to keep names distinct; got {self.name_length}.")


def _variable_names(rng: random.Random, count: int, length: int, avoid: set[str]) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choices(string.ascii_uppercase, k=length))
        # Equal-length distinct names never contain each other, so substring scoring stays exact.
        if name not in names and name not in avoid:
            names.append(name)
    return names


def _chains(
    rng: random.Random, config: VariableTrackingConfig, avoid: set[str]
) -> tuple[list[list[str]], list[list[str]], list[str]]:
    width = config.num_hops + 1
    names = _variable_names(rng, config.num_chains * width, config.name_length, avoid)
    values = [str(value) for value in rng.sample(range(10000, 99999), config.num_chains)]
    chain_names = [names[index * width : (index + 1) * width] for index in range(config.num_chains)]
    statements = [
        [f"VAR {chain[0]} = {value}."] + [f"VAR {chain[hop + 1]} = VAR {chain[hop]}." for hop in range(config.num_hops)]
        for chain, value in zip(chain_names, values, strict=True)
    ]
    return chain_names, statements, values


def _interleave(rng: random.Random, statements: list[list[str]]) -> list[str]:
    # A random merge that keeps each chain's statements in order (assignment before use).
    owners = [chain for chain, items in enumerate(statements) for _ in items]
    rng.shuffle(owners)
    cursors = [0] * len(statements)
    merged = []
    for chain in owners:
        merged.append(statements[chain][cursors[chain]])
        cursors[chain] += 1
    return merged


def generate_variable_tracking(
    filler: str,
    tokenizer: SupportsEncode,
    target_length: int,
    seed: int,
    config: VariableTrackingConfig | None = None,
    task: str = "variable_tracking",
) -> SyntheticSample:
    """One variable-tracking sample of at most ``target_length`` tokens; answers: the first chain's names."""
    check_seed(seed)
    config = VariableTrackingConfig() if config is None else config
    rng = random.Random(seed)
    words = filler_words(filler)
    chain_names, statements, values = _chains(rng, config, set(words))
    facts = _interleave(rng, statements)
    depths = random_depths(rng, len(facts))
    offset = rng.choice(sentence_starts(words))  # The haystack opens on a whole sentence.
    labels = {"query": values[0], "num_v": config.num_hops + 1}

    def wrap(context: str) -> str:
        return TEMPLATE.format(context=context, **labels)

    prompt, length = fit_haystack(words, offset, facts, depths, wrap, tokenizer, target_length)
    return SyntheticSample(
        task=task,
        prompt=prompt,
        answers=tuple(chain_names[0]),
        answer_prefix=ANSWER_PREFIX.format(**labels),
        target_length=target_length,
        length=length,
        max_new_tokens=config.max_new_tokens,
        seed=seed,
        depths=depths,
        question=question_of(wrap),
    )
