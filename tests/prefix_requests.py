"""Requests served through a prefix tree, for the tests that compare two caches on the same requests:
deterministic token lists, left-padded batches, match -> generate -> publish -> release, exact equality."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from hf_kvgov import PagedCache, paged_attention


def tokens(length: int, seed: int) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def left_padded(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return {"input_ids": ids, "attention_mask": mask}


def serve(model: Any, new_tokens: int, cache: PagedCache, rows: list[list[int]], **kwargs: Any) -> dict[str, Any]:
    """match -> generate -> publish -> release, noting what the cache held before publishing."""
    padded = left_padded(rows)
    inputs = cache.match(padded["input_ids"], padded["attention_mask"])
    reused = cache.get_seq_length()
    context = paged_attention(model) if cache.attention == "paged" else contextlib.nullcontext()
    with context:
        out = model.generate(
            **inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **kwargs,
        )  # fmt: skip
    held = [list(row.block_ids) for row in cache.tables.rows]  # type: ignore[union-attr]
    stats = cache.stats()
    if "num_beams" not in kwargs:  # generate returns only the best beams: nothing to publish per row
        cache.publish(out.sequences)
    cache.release()
    return {"out": out, "reused": reused, "held": held, "stats": stats}


def assert_identical(got: Any, expected: Any) -> None:
    """The same tokens and bit-identical logits at every step."""
    assert torch.equal(got.sequences, expected.sequences)
    for got_step, expected_step in zip(got.logits, expected.logits, strict=True):
        assert torch.equal(got_step, expected_step)
