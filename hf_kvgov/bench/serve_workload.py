"""The serving benchmark's trace: who asks what, when, and for how many tokens (vLLM's `benchmark_serving` shape).

A prefix-repetition workload: `documents` passages of Pride and Prejudice (shipped with the package), each request
one passage, chosen by Zipf popularity (passage k with weight 1 / k^zipf), followed by one question and "Answer:".
Arrivals are a gamma process of `rate` requests/s (shape `burstiness`: 1 is Poisson, below 1 burstier); an infinite
rate is a burst (everything at t = 0). Each request asks for a number of tokens drawn uniformly in [min, max]. One
seed fixes the whole trace, so every configuration of a run serves the same requests.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from hf_kvgov.bench.prefix_qa import questions
from hf_kvgov.data_text import pride_and_prejudice

PASSAGE_STRIDE = 41_000  # characters between passages: far enough apart that they share no text
CHARS_PER_TOKEN = 8  # characters read for each passage token (generous: English runs at about 4 per token)


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 32
    rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0
    documents: int = 4
    zipf: float = 1.2
    document_tokens: int = 256
    min_new_tokens: int = 16
    max_new_tokens: int = 48
    seed: int = 0

    def __post_init__(self) -> None:
        positive = {"requests": self.requests, "documents": self.documents, "document_tokens": self.document_tokens}
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1; got {value}.")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 requests/s (inf for a burst); got {self.rate}.")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0 (1 is Poisson); got {self.burstiness}.")
        if not 1 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"new tokens must satisfy 1 <= min <= max; got min {self.min_new_tokens}, max {self.max_new_tokens}."
            )
        if len(pride_and_prejudice()) < self.documents * PASSAGE_STRIDE:
            raise ValueError(f"documents must be at most {len(pride_and_prejudice()) // PASSAGE_STRIDE}.")
        if self.document_tokens * CHARS_PER_TOKEN > PASSAGE_STRIDE:
            raise ValueError(
                f"document_tokens must be at most {PASSAGE_STRIDE // CHARS_PER_TOKEN} (passages start "
                f"{PASSAGE_STRIDE:,} characters apart, so longer ones would share text); got {self.document_tokens}."
            )


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival: float  # seconds after the trace starts
    prompt: list[int]
    new_tokens: int
    document: int


def build_trace(tokenizer: Any, config: TraceConfig) -> list[TraceRequest]:
    """The requests in arrival order."""
    rng = random.Random(config.seed)
    text = pride_and_prejudice()
    passages = []
    for k in range(config.documents):
        start = k * PASSAGE_STRIDE + 5_000
        ids = tokenizer(text[start : start + CHARS_PER_TOKEN * config.document_tokens])
        passages.append(tokenizer.decode(ids["input_ids"][: config.document_tokens]))
    weights = [1 / (k + 1) ** config.zipf for k in range(config.documents)]
    asks = questions(max(config.requests, 1))
    rng.shuffle(asks)
    trace, now = [], 0.0
    for i in range(config.requests):
        if i and math.isfinite(config.rate):
            now += rng.gammavariate(config.burstiness, 1 / (config.rate * config.burstiness))
        document = rng.choices(range(config.documents), weights)[0]
        prompt = tokenizer(f"{passages[document]}\n\n{asks[i]}\nAnswer:")["input_ids"]
        new = rng.randint(config.min_new_tokens, config.max_new_tokens)
        trace.append(TraceRequest(i, now if math.isfinite(config.rate) else 0.0, prompt, new, document))
    return trace
