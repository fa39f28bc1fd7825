"""Greedy generation of one prompt with one registered cache, as every generation benchmark needs it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.registry import CacheSpec, get_cache_spec, kv_bytes

# What a compressing cache has seen when it compresses: the whole prompt, its question included, or only the context,
# the question following (kvpress's protocol, where a question-agnostic method such as KVzip belongs).
COMPRESS_INPUTS = ("prompt", "context")


@dataclass(frozen=True)
class Generated:
    """What one greedy run produced and what the cache held at its end."""

    text: str  # the new tokens decoded, special tokens skipped
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int  # KV bytes the cache held after the last step


def cache_specs(names: Sequence[str], compress: str) -> list[CacheSpec]:
    """The spec of each cache name for a run whose caches compress `compress` (one of `COMPRESS_INPUTS`); a cache
    that compresses only a context (`kvzip@0.2`) needs ``compress="context"``."""
    if compress not in COMPRESS_INPUTS:
        raise ValueError(f"compress must be one of {', '.join(COMPRESS_INPUTS)}; got {compress!r}.")
    return [get_cache_spec(name, context=compress == "context") for name in names]


def eos_token_ids(model: Any, extra: Sequence[int] = ()) -> list[int]:
    """The model's end-of-sequence ids (generation config, else config) followed by `extra`, without repeats."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    own = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return list(dict.fromkeys([*own, *extra]))


def generate_greedy(
    model: Any,
    tokenizer: Any,
    spec: CacheSpec,
    prompt: str,
    max_new_tokens: int,
    *,
    add_special_tokens: bool = True,
    extra_eos_token_ids: Sequence[int] = (),
    min_new_tokens: int = 0,
    context_chars: int | None = None,
) -> Generated:
    """Generate greedily from `prompt` with a fresh cache of `spec`, under the attention the cache needs.

    `context_chars`: the prompt's first characters that are its context. The cache then holds the context,
    compressed before the question is seen (`CacheSpec.context_cache`), and generate goes on from there
    (kvpress's protocol). None: generate's prompt is the whole prompt.
    """
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"].to(model.device)
    eos = eos_token_ids(model, extra_eos_token_ids)
    pad = model.generation_config.pad_token_id
    if context_chars is None:
        cache = spec.build(model)
    else:
        context = _context_tokens(tokenizer, prompt, context_chars, ids[0].tolist(), add_special_tokens)
        cache = spec.context_cache(model, tokenizer, ids[:, :context])
    try:
        with spec.attention(model), torch.inference_mode():
            output = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                cache=cache,
                max_new_tokens=max_new_tokens,
                min_new_tokens=min_new_tokens,
                do_sample=False,
                num_beams=1,
                eos_token_id=eos or None,
                pad_token_id=pad if pad is not None else (eos[0] if eos else None),
            )
        held = kv_bytes(cache)
    finally:
        release(cache)
    new = output[0, ids.shape[1] :]
    return Generated(tokenizer.decode(new, skip_special_tokens=True), int(ids.shape[1]), int(new.shape[0]), held)


def _context_tokens(tokenizer: Any, prompt: str, chars: int, ids: list[int], add_special_tokens: bool) -> int:
    """How many of the prompt's tokens `ids` its first `chars` characters give: the tokens the context and the whole
    prompt share (a token across the boundary goes with the question)."""
    if not 0 < chars < len(prompt):
        raise ValueError(f"The context must be a part of the prompt ({len(prompt)} characters); got {chars}.")
    head = tokenizer(prompt[:chars], add_special_tokens=add_special_tokens)["input_ids"]
    shared = next((i for i, (a, b) in enumerate(zip(head, ids, strict=False)) if a != b), min(len(head), len(ids)))
    if not 0 < shared < len(ids):
        raise ValueError(
            f"The context gives {shared} of the prompt's {len(ids)} tokens; it needs at least one, and one after it."
        )
    return shared


def release(cache: Any) -> None:
    """Give back what a cache holds beyond its tensors (pool blocks, a spill file) as soon as it is done."""
    free = getattr(cache, "release", None)
    if callable(free):
        free()
