"""What a cache name stands for: `CacheSpec` builds the chain a name parses into (`hf_kvgov.registry`) through
`hf_kvgov.chain`, fresh for each run, and says which attention it needs around `generate`; `ContextSpec` is a cache
that compresses a context before its question is known (KVzip), built only with that context.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache

from hf_kvgov.chain.build import GovernedCache
from hf_kvgov.engine.parts import ChainParts, Evict, HeavyHitter, Sink
from hf_kvgov.hf.eviction.kvzip import kvzip_cache
from hf_kvgov.policies import make_policy

AttentionContext = Callable[[Any], AbstractContextManager[Any]]
ChainOf = Callable[[Any], ChainParts]  # model -> the chain a name stands for (a few depend on its geometry)


def plain_attention(model: Any) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass(frozen=True)
class CacheSpec:
    """A cache name's chain: `build` checks and builds it through `hf_kvgov.chain` (None: `DynamicCache`).

    A name parses into the chain it stands for (`ChainParts`), which `hf_kvgov.chain` checks and builds as it
    does for ``GovernedCache`` and a chain written by hand: one validator, one builder. A spec builds a fresh
    cache for a model and says which attention context it needs around `generate`, so orchestration code never
    branches on cache types.
    """

    name: str
    description: str
    chain: ChainOf | None
    lossless: bool
    attention_context: AttentionContext = plain_attention  # what generate must run under

    def parts(self, model: Any) -> ChainParts | None:
        """The chain this name builds for `model` (None for transformers' `DynamicCache`)."""
        return None if self.chain is None else self.chain(model)

    def build(self, model: Any) -> Any:
        """A fresh cache for `model`; a fractional eviction budget resolves on generate's prompt."""
        parts = self.parts(model)
        if parts is None:
            return DynamicCache(config=model.config)
        return GovernedCache(model, **parts.kwargs())

    def build_for(self, model: Any, context_tokens: int) -> Any:
        """A fresh cache for a context of `context_tokens` tokens known in advance (fractions resolve on it).

        generate resolves a fraction on the prompt; a perplexity run feeds the text a token at a time, so it knows
        the length up front and resolves the fraction itself.
        """
        return self._built_for(model, self.parts(model), context_tokens)

    def _built_for(self, model: Any, parts: ChainParts | None, context_tokens: int) -> Any:
        if parts is None or parts.policy is None or not isinstance(parts.policy.budget, float):
            return DynamicCache(config=model.config) if parts is None else GovernedCache(model, **parts.kwargs())
        tokens = _tokens_of(parts.policy.budget, context_tokens, _least_budget(parts.policy))
        return GovernedCache(model, **replace(parts, policy=replace(parts.policy, budget=tokens)).kwargs())

    def context_cache(self, model: Any, tokenizer: Any, context_ids: Tensor) -> Any:
        """A fresh cache holding the context ``context_ids`` ``[1, n]``, compressed before any question is seen,
        for generate to continue with the question (kvpress's protocol).

        A fraction resolves on the context; a policy (`Evict`) compresses the context once and the question and
        answer are appended, as kvpress's presses do; H2O and sinks go on evicting at every step, as they
        always do. A lossless cache holds what generate on the whole prompt would.
        """
        parts = self.parts(model)
        if parts is not None and isinstance(parts.policy, Evict):
            parts = replace(parts, policy=replace(parts.policy, compress="prefill"))
        cache = self._built_for(model, parts, int(context_ids.shape[1]))
        with self.attention(model), torch.inference_mode():
            model(input_ids=context_ids, attention_mask=torch.ones_like(context_ids), cache=cache, use_cache=True)
        return cache

    @property
    def needs_context(self) -> bool:
        """Whether the cache compresses a context before its question (built only by `context_cache`)."""
        return False

    def attention(self, model: Any) -> AbstractContextManager[Any]:
        """The attention context the cache needs around `generate` (nothing for most caches)."""
        return self.attention_context(model)

    @property
    def needs_attention_context(self) -> bool:
        """Whether the cache only works under its own attention (so it cannot share a batch with others)."""
        return self.attention_context is not plain_attention


@dataclass(frozen=True)
class ContextSpec(CacheSpec):
    """KVzip: a context compressed before any question is known, by how much the model needs each token to repeat
    it. Only `context_cache` builds it: a prompt whose context and question are one is refused (`get_cache_spec`)."""

    budget: int | float = 0.2
    codec: str | None = None

    def build(self, model: Any) -> Any:
        raise ValueError(context_refusal(self.name))

    def build_for(self, model: Any, context_tokens: int) -> Any:
        raise ValueError(context_refusal(self.name))

    def context_cache(self, model: Any, tokenizer: Any, context_ids: Tensor) -> Any:
        return kvzip_cache(model, tokenizer, context_ids, budget=self.budget, codec=self.codec)

    @property
    def needs_context(self) -> bool:
        return True


def context_refusal(name: str) -> str:
    return (
        f"The cache {name!r} compresses a context before its question is known (KVzip), so it runs only where a "
        "prompt's context comes apart from its question: `kvgov eval synthetic` or `kvgov eval longbench` with "
        "`--compress context`, or `kvzip_cache` in Python."
    )


def _least_budget(policy: HeavyHitter | Sink | Evict) -> int:
    """The fewest slots a policy's fractional budget resolves to."""
    if isinstance(policy, Sink):
        return policy.n_sink + policy.window
    if isinstance(policy, Evict):
        return int(make_policy(policy.policy).min_budget)
    return 1


def _tokens_of(budget: int | float, context_tokens: int, minimum: int = 1) -> int:
    """A budget in tokens: an int as given, a fraction of `context_tokens` (at least `minimum`)."""
    if isinstance(budget, int):
        return budget
    return max(minimum, math.floor(budget * context_tokens + 1e-9))
