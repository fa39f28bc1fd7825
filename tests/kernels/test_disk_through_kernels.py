"""The disk caches' paged attention path through the Triton kernels (the interpreter on the CPU).

Blocks read back from disk are appended to what attention reads: full-precision blocks after the pool's
(`DiskOffloadCache`), sealed codes after the store's (`QuantizedDiskCache`). A kernel indexing those
appended blocks wrongly would still pass the disk caches' own tests, which run the torch reference; here
each cache generates with the kernel forced and with the reference forced, while blocks are spilled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kernel_helpers import DEVICE  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels are imported)

from hf_kvgov import paged_attention
from hf_kvgov.hf.disk_cache import DiskOffloadCache
from hf_kvgov.hf.quantized_disk_cache import QuantizedDiskCache
from hf_kvgov.kernels import dispatch
from tests.conftest import tiny_llama

NEW_TOKENS = 5  # 1 prefill step + 4 decode steps, 2 layers each


pytestmark = pytest.mark.usefixtures("clean_dispatch")  # tests/kernels/conftest.py


def generate_with(backend: str, build: Callable[[], Any]) -> tuple[Any, Any, dict[str, int]]:
    """(generate's output, the cache, backend counts) with `backend` forced for every attention call."""
    model = tiny_llama(num_kv_heads=2)
    ids = torch.randint(3, 96, (1, 21), generator=torch.Generator().manual_seed(0))
    dispatch.set_backend(backend)
    dispatch.reset_backend_counts()
    cache = build()
    with paged_attention(model), torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=NEW_TOKENS,
            do_sample=False, return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
    return out, cache, dispatch.backend_counts()


def assert_same_generation(got: Any, expected: Any) -> None:
    assert torch.equal(got.sequences, expected.sequences)
    for step, reference in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(step, reference, atol=1e-4, rtol=1e-4)


def test_disk_offload_cache_reads_spilled_blocks_through_the_paged_kernel(tmp_path: Path) -> None:
    # 21 + 5 tokens in blocks of 4, hot window 4: by the last step blocks 1..4 have spilled.
    def build() -> DiskOffloadCache:
        return DiskOffloadCache(tiny_llama(num_kv_heads=2).config, tmp_path, hot_tokens=4, block_size=4,
                                attention="paged")  # fmt: skip

    reference, _, reference_counts = generate_with("torch", build)
    kernel, cache, counts = generate_with("triton", build)
    assert reference_counts == {"paged/torch": 2 * (1 + NEW_TOKENS - 1)}
    assert counts.get("paged/triton", 0) >= 2 * (NEW_TOKENS - 1)  # every decode step, both layers
    assert cache.stats().spilled_blocks == 4
    assert_same_generation(kernel, reference)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_disk_cache_reads_spilled_codes_through_the_quantized_kernel(tmp_path: Path, bits: int) -> None:
    def build() -> QuantizedDiskCache:
        return QuantizedDiskCache(tiny_llama(num_kv_heads=2), tmp_path, hot_tokens=4, bits=bits, block_size=4,
                                  attention="paged")  # fmt: skip

    reference, _, reference_counts = generate_with("torch", build)
    kernel, cache, counts = generate_with("triton", build)
    assert reference_counts == {"quantized/torch": 2 * NEW_TOKENS}
    assert counts == {"quantized/torch": 2, "quantized/triton": 2 * (NEW_TOKENS - 1)}  # prefill on the reference
    assert cache.stats().spilled_blocks > 0
    assert_same_generation(kernel, reference)
