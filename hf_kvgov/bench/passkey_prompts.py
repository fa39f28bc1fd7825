"""The passkey prompts of SnapKV's retrieval check: RULER's question over Pride and Prejudice, the key stated early.

Each prompt (~1,000 tokens of SmolLM2's chat template) states a 5-digit pass key at 10% depth of a passage and ends
with the question and the answer's start ("What is the pass key?", then "The pass key is"). One draw of ten
(key, passage start) pairs; the full cache misses two of them on SmolLM2-135M, which the callers leave out.
`tests/eviction/test_eviction_passkey.py` holds SnapKV and H2O to thresholds on them, and
`eval/bench_snapkv_passkey.py` compares SnapKV's settings on the same prompts.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from hf_kvgov.data_text import pride_and_prejudice

FILLER_TOKENS = 900
DEPTH = 0.1
SMOLLM2_FULL_CACHE_MISSES = frozenset({2, 7})  # the draws SmolLM2-135M answers wrong with the full cache


def passkey_prompt(tokenizer: Any, text: str, key: int, start: int) -> dict[str, torch.Tensor]:
    """The chat prompt hiding `key` at `DEPTH` of `FILLER_TOKENS` tokens of `text` from character `start`."""
    filler = tokenizer(text[start : start + 8000])["input_ids"][:FILLER_TOKENS]
    cut = int(len(filler) * DEPTH)
    needle = f" The pass key is {key}. Remember it. {key} is the pass key. "
    body = (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the important information there.\n"
        + tokenizer.decode(filler[:cut]) + needle + tokenizer.decode(filler[cut:]) + "\nWhat is the pass key?"
    )  # fmt: skip
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": body}], tokenize=False, add_generation_prompt=True
    )
    return dict(tokenizer(chat + "The pass key is", return_tensors="pt"))


def passkey_prompts(tokenizer: Any, skip: frozenset[int] = SMOLLM2_FULL_CACHE_MISSES) -> list[tuple[int, Any]]:
    """(key, prompt) for the ten draws of seed 0 over Pride and Prejudice, but those in `skip`."""
    rng = random.Random(0)
    draws = [(rng.randrange(10000, 99999), rng.randrange(10000, 600000)) for _ in range(10)]
    text = pride_and_prejudice()
    return [(key, passkey_prompt(tokenizer, text, key, start)) for i, (key, start) in enumerate(draws) if i not in skip]
