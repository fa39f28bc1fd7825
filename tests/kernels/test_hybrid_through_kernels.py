"""PagedCache's and QuantizedCache's sliding layer groups through the Triton decode kernels (the interpreter on
the CPU).

A sliding group hands attention its table from the first block it still holds and the kv length from that
block on; the first kept block still holds tokens outside the window, which only the mask hides. A kernel
that read the table from block 0, or ignored the sliding mask, would still pass the hybrid tests that run
the torch reference; here a tiny Gemma-3 layout decodes past its window with the kernel forced, against the
reference forced and against DynamicCache.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from kernel_helpers import DEVICE  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels are imported)
from transformers import DynamicCache

from hf_kvgov import PagedCache, QuantizedCache, paged_attention
from hf_kvgov.kernels import dispatch
from tests.conftest import tiny_gemma3

WINDOW, BLOCK, PROMPT, NEW_TOKENS = 8, 4, 13, 5  # decode steps at 13..16: sliding layers hold 2-3 blocks


pytestmark = pytest.mark.usefixtures("clean_dispatch")  # tests/kernels/conftest.py


class OneGroupQuantizedCache(QuantizedCache):
    groups_layers = False  # one table for every layer: sliding layers keep every block


MODEL = tiny_gemma3(window=WINDOW)
IDS = torch.randint(3, 96, (2, PROMPT), generator=torch.Generator().manual_seed(0))
OPTIONS = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}


def generate(cache: Any) -> Any:
    with paged_attention(MODEL), torch.no_grad():
        return MODEL.generate(input_ids=IDS, cache=cache, **OPTIONS)


@pytest.mark.parametrize(
    ("cache_type", "path", "reference"),
    [
        (PagedCache, "paged", lambda: DynamicCache(config=MODEL.config)),
        # QuantizedCache's sliding groups free sealed blocks and the sink; the kernel reads codes in place from
        # the group's first kept block. Against a cache of one group, which frees nothing.
        (QuantizedCache, "quantized", lambda: OneGroupQuantizedCache(MODEL, block_size=BLOCK, attention="paged")),
    ],
    ids=["paged", "quantized"],
)
def test_sliding_groups_decode_through_the_kernel_as_through_the_reference(
    cache_type: type, path: str, reference: Callable[[], Any]
) -> None:
    expected = generate(reference())
    results = {}
    for backend in ("torch", "triton"):
        dispatch.set_backend(backend)
        dispatch.reset_backend_counts()
        cache = cache_type(MODEL, block_size=BLOCK, attention="paged")
        results[backend] = generate(cache)
        assert cache.all_tables[0].first_block > 0  # the sliding group did free blocks while decoding
        if backend == "triton":  # 3 layers x 4 decode steps on the kernel, the prefill on the reference
            assert dispatch.backend_counts() == {f"{path}/torch": 3, f"{path}/triton": 12}
    for out in results.values():
        assert torch.equal(out.sequences, expected.sequences)
    for got, want in zip(results["triton"].scores, results["torch"].scores, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
