"""The serving engine's ragged decode rows through the Triton decode kernels (the interpreter on the CPU).

A packed step hands each decode row its own table and length in one masked call; on a hybrid model a sliding
group's rows start at the first block it still holds, with lengths counted from there. A kernel that read a row
past its length, or the table from block 0, would still pass the engine tests that run sdpa or the reference; here
tiny Gemma-3 requests of unequal lengths decode past the window with the kernel forced, against the reference
forced and against each request run alone with `DynamicCache`.
"""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEVICE  # noqa: F401  (sets TRITON_INTERPRET=1 before the kernels are imported)

from hf_kvgov.kernels import dispatch
from hf_kvgov.serving import SamplingParams, ServingEngine
from tests.conftest import tiny_gemma3
from tests.serving.test_engine import alone

pytestmark = pytest.mark.usefixtures("clean_dispatch")  # tests/kernels/conftest.py

MODEL = tiny_gemma3(window=8)
PROMPTS = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (13, 6, 18)]
NEW = 5


@pytest.mark.parametrize(("codec", "path"), [(None, "paged"), ("int8", "quantized")])
def test_ragged_decode_rows_through_the_kernel_as_through_the_reference(codec: str | None, path: str) -> None:
    outputs = {}
    for backend in ("torch", "triton"):
        dispatch.set_backend(backend)
        dispatch.reset_backend_counts()
        with ServingEngine(MODEL, block_size=4, codec=codec, prefix_sharing=False) as engine:
            outputs[backend] = engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        counts = dispatch.backend_counts()
        if backend == "triton":  # every decode call on the kernel; prefill chunks (several queries) on the reference
            assert counts.get(f"{path}/triton", 0) > 0
            assert counts.get(f"{path}/torch", 0) == 3 * len(PROMPTS)  # 3 layers x one prefill chunk each
    assert outputs["triton"] == outputs["torch"]
    if codec is None:
        assert outputs["torch"] == [alone(MODEL, p, NEW) for p in PROMPTS]
