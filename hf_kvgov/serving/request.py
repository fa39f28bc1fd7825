"""A request's life in the serving engine: what it asks for (`SamplingParams`), where it stands (`Request`), and
what the engine hands back for it each step (`TokenEvent`)."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import torch

from hf_kvgov.serving.swap import Swapped
from hf_kvgov.storage.block_table import SequenceTables


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    Args:
        max_new_tokens: tokens to generate at most.
        temperature: 0 is greedy (argmax); above 0 samples from softmax(logits / temperature).
        top_p: with sampling, keep the smallest set of tokens whose probability reaches `top_p` (1.0 keeps all).
        top_k: with sampling, keep the `top_k` most likely tokens (0 keeps all; 1 is greedy).
        stop_token_ids: tokens that end the request (kept in its output); None: the model's end-of-sequence tokens.
        ignore_eos: generate exactly `max_new_tokens`, whatever is sampled.
        min_new_tokens: the stop tokens cannot be chosen before this many tokens were generated (their logits are
            masked, as transformers' ``min_new_tokens`` does).
        repetition_penalty: CTRL's penalty on every token already in the prompt or the output (transformers'
            ``repetition_penalty``: a positive logit divided by it, a negative one multiplied); 1.0 is none.
        seed: seeds this request's sampling alone, so its tokens do not depend on what else runs.
        prompt_logprobs: also score the prompt: the log-probability of each prompt token after the first, given the
            ones before it as the engine holds them (with an eviction policy, the evicted cache in the loop). Such a
            request matches no prefix, so every token is computed and scored.
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    prompt_logprobs: bool = False
    min_new_tokens: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy); got {self.temperature!r}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p!r}.")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 keeps every token); got {self.top_k!r}.")
        if (
            isinstance(self.min_new_tokens, bool)
            or not isinstance(self.min_new_tokens, int)
            or not 0 <= self.min_new_tokens <= self.max_new_tokens
        ):
            raise ValueError(
                f"min_new_tokens must be an int from 0 to max_new_tokens={self.max_new_tokens}; got "
                f"{self.min_new_tokens!r}."
            )
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1.0 is none); got {self.repetition_penalty!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again; holds no blocks
    RUNNING = "running"  # holds a block table; its prompt may still be in prefill
    FINISHED = "finished"  # stopped by length or a stop token
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class TokenEvent:
    """One token of one request, as a step produced it; `finish_reason` is set on its last event."""

    request_id: int
    token: int | None  # None: the request ended without a new token (cancelled)
    finish_reason: str | None = None  # "length", "stop" or "cancelled"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """One request inside the engine. `tokens` is the prompt and what it generated; `computed` of them have
    their K/V in the pool (a preempted request loses them and computes them again, unless they were swapped out),
    `stored` of those in its tables (fewer once an eviction policy dropped blocks)."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    namespace: str = ""
    stop_ids: tuple[int, ...] = ()  # the tokens that end it: its own `stop_token_ids`, else the model's EOS
    state: RequestState = RequestState.WAITING
    output: list[int] = field(default_factory=list)
    computed: int = 0
    tables: SequenceTables | None = None  # its block tables, one per layer group of the pool
    locks: list[int] = field(default_factory=list)  # prefix-tree blocks to unlock when it leaves the pool
    published: int = 0  # tokens offered to the prefix tree so far
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.perf_counter)
    admitted_at: float | None = None  # when it first entered the pool (the end of its queue time)
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    swapped: Swapped | None = None  # where its blocks wait on disk while it is preempted (an engine with spill=)
    prompt_logprobs: list[float] = field(default_factory=list)  # with `SamplingParams.prompt_logprobs`
    evicted_tokens: int = 0  # tokens of the blocks a policy evicted from its full-attention tables (whole blocks)
    block_mass: torch.Tensor | None = None  # per column of its table, the attention it collected (with a policy)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def stored(self) -> int:
        """Tokens its full-attention tables hold: the computed ones the policy kept. Its next token goes at this
        index there (at its position in a sliding group's)."""
        return self.computed - self.evicted_tokens

    @property
    def pending(self) -> int:
        """Tokens whose K/V the next steps must compute before it can sample."""
        return self.num_tokens - self.computed

    def stop_reason(self) -> str | None:
        """Why it must stop after its latest token, or None."""
        if self.output and not self.params.ignore_eos and self.output[-1] in self.stop_ids:
            return "stop"
        if len(self.output) >= self.params.max_new_tokens:
            return "length"
        return None
