"""StackedCache over caches that keep different history in sliding-window layers: DynamicCache exactly the
window, a cache with layer groups from a block boundary, a cache without groups everything. Each row of the
batch must give the logits that cache gives alone, chunk by chunk, past the window."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from hf_kvgov import PagedCache, QuantizedCache
from hf_kvgov.quality import StackedCache
from tests.conftest import FULL, SLIDING, tiny_gemma3

MODEL = tiny_gemma3((SLIDING, SLIDING, FULL), window=24)
BUILDERS: list[Callable[[], Any]] = [
    lambda: DynamicCache(config=MODEL.config),
    lambda: PagedCache(MODEL, block_size=8),  # layer groups: the window from a block boundary
    lambda: PagedCache(MODEL, block_size=8, max_tokens=4096),
    lambda: QuantizedCache(MODEL, bits=8, block_size=8),
    lambda: type("OneGroup", (PagedCache,), {"groups_layers": False})(MODEL, block_size=8),  # keeps everything
]
CHUNK, TOKENS = 8, 72


def chunked_logits(cache: Any, rows: int = 1) -> torch.Tensor:
    ids = torch.arange(TOKENS).remainder(90).add(3)[None].expand(rows, -1)
    with torch.inference_mode():
        return torch.cat([MODEL(ids[:, s : s + CHUNK], cache=cache).logits for s in range(0, TOKENS, CHUNK)], dim=1)


@pytest.mark.parametrize("first", range(len(BUILDERS)), ids=["dynamic", "paged", "paged-capped", "int8", "one-group"])
def test_each_row_gives_what_its_cache_gives_alone(first: int) -> None:
    builders = [BUILDERS[first], *(b for i, b in enumerate(BUILDERS) if i != first)]  # each kind leads once
    alone = [chunked_logits(build()) for build in builders]
    together = chunked_logits(StackedCache([build() for build in builders], 3), rows=len(builders))
    for row, expected in enumerate(alone):
        torch.testing.assert_close(together[row], expected[0], atol=1e-5, rtol=1e-5)
