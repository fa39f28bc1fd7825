"""PagedCache's and QuantizedCache's sliding layer groups through the Triton decode kernels (the interpreter on
the CPU).

A sliding group hands attention its table from the first block it still holds and the kv length from that
block on; the first kept block still holds tokens outside the window, which only the mask hides. A kernel
that read the table from block 0, or ignored the sliding mask, would still pass the hybrid tests that run
the torch reference; here a tiny Gemma-3 layout decodes past its window with the kernel forced, against the
reference forced and against DynamicCache.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from kernel_helpers import DEVICE  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels are imported)
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

from hf_kvgov import PagedCache, QuantizedCache, paged_attention
from hf_kvgov.kernels import dispatch

WINDOW, BLOCK, PROMPT, NEW_TOKENS = 8, 4, 13, 5  # decode steps at 13..16: sliding layers hold 2-3 blocks


@pytest.fixture(autouse=True)
def clean_dispatch() -> Iterator[None]:
    dispatch.set_backend(None)
    dispatch.reset_backend_counts()
    yield
    dispatch.set_backend(None)


class OneGroupQuantizedCache(QuantizedCache):
    groups_layers = False  # one table for every layer: sliding layers keep every block


def tiny_gemma3() -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, max_position_embeddings=256, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    model = Gemma3ForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def test_sliding_groups_decode_through_the_kernel_as_through_the_reference() -> None:
    model = tiny_gemma3()
    ids = torch.randint(3, 96, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    reference = model.generate(input_ids=ids, cache=DynamicCache(config=model.config), **options)
    results = {}
    for backend in ("torch", "triton"):
        dispatch.set_backend(backend)
        dispatch.reset_backend_counts()
        cache = PagedCache(model, block_size=BLOCK, attention="paged")
        with paged_attention(model), torch.no_grad():
            results[backend] = model.generate(input_ids=ids, cache=cache, **options)
        assert cache.all_tables[0].first_block > 0  # the sliding group did free blocks while decoding
        if backend == "triton":  # 3 layers x 4 decode steps on the kernel, the prefill on the reference
            assert dispatch.backend_counts() == {"paged/torch": 3, "paged/triton": 12}
    for out in results.values():
        assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(results["triton"].scores, results["torch"].scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_quantized_sliding_groups_decode_through_the_kernel_as_through_the_reference() -> None:
    # The same for QuantizedCache: its sliding groups free sealed blocks and the sink; the kernel reads codes
    # in place from the group's first kept block. Against a cache of one group, which frees nothing.
    model = tiny_gemma3()
    ids = torch.randint(3, 96, (2, PROMPT), generator=torch.Generator().manual_seed(0))
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    one_group = OneGroupQuantizedCache(model, block_size=BLOCK, attention="paged")
    with paged_attention(model), torch.no_grad():
        reference = model.generate(input_ids=ids, cache=one_group, **options)
    results = {}
    for backend in ("torch", "triton"):
        dispatch.set_backend(backend)
        dispatch.reset_backend_counts()
        cache = QuantizedCache(model, block_size=BLOCK, attention="paged")
        with paged_attention(model), torch.no_grad():
            results[backend] = model.generate(input_ids=ids, cache=cache, **options)
        assert cache.all_tables[0].first_block > 0
        if backend == "triton":
            assert dispatch.backend_counts() == {"quantized/torch": 3, "quantized/triton": 12}
    for out in results.values():
        assert torch.equal(out.sequences, reference.sequences)
    for got, expected in zip(results["triton"].scores, results["torch"].scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
