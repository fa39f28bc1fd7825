"""Greedy generation of one prompt with one registered cache, as every generation benchmark needs it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.registry import CacheSpec, kv_bytes


@dataclass(frozen=True)
class Generated:
    """What one greedy run produced and what the cache held at its end."""

    text: str  # the new tokens decoded, special tokens skipped
    prompt_tokens: int
    new_tokens: int
    kv_bytes: int  # KV bytes the cache held after the last step


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
) -> Generated:
    """Generate greedily from `prompt` with a fresh cache of `spec`, under the attention the cache needs."""
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"].to(model.device)
    eos = eos_token_ids(model, extra_eos_token_ids)
    pad = model.generation_config.pad_token_id
    cache = spec.build(model)
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


def release(cache: Any) -> None:
    """Give back what a cache holds beyond its tensors (pool blocks, a spill file) as soon as it is done."""
    free = getattr(cache, "release", None)
    if callable(free):
        free()
