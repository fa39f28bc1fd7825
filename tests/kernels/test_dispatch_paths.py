"""The dispatch registry, the quantized path, and QuantizedCache's decode routed through it.

Fake backends (plain functions with a `refuses` rule) test the choice itself: priority order, fallbacks,
forced names, counts and the debug log. The quantized path is then checked with the real Triton kernel
(the interpreter on the CPU): decode goes to the kernel when it is forced, prefill stays on the
reference, and a QuantizedCache generating with the kernel gives the tokens and scores it gives with the
reference.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from kernel_helpers import DEVICE, assert_matches

from hf_kvgov import paged_attention
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.kernels import dispatch
from hf_kvgov.kernels.dispatch import PAGED, QUANTIZED, Backend, Probe
from hf_kvgov.kernels.synthetic import make_case
from tests.conftest import tiny_llama


@pytest.fixture(autouse=True)
def clean_dispatch() -> Iterator[None]:
    # The fakes below are the only automatic candidates: the built-in CPU sdpa backend steps aside.
    sdpa = dispatch._registry(PAGED).get("sdpa")
    dispatch.unregister_backend(PAGED, "sdpa")
    dispatch.set_backend(None)
    dispatch.reset_backend_counts()
    yield
    dispatch.set_backend(None)
    for name in ("fast", "faster"):
        dispatch.unregister_backend(PAGED, name)
    if sdpa is not None:
        dispatch.register_backend(PAGED, sdpa)


def constant(value: float):  # type: ignore[no-untyped-def]
    """An attention 'kernel' answering `value` everywhere, so the test sees which one ran."""

    def attend(query: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return torch.full_like(query.transpose(1, 2), value)

    return attend


def refuse_unless(rule: str):  # type: ignore[no-untyped-def]
    def refuses(probe: Probe) -> str | None:
        ok = probe.query.shape[2] == 1 if rule == "decode" else probe.key_cache.shape[1] == 8
        return None if ok else f"not {rule}"

    return refuses


def register_fakes() -> None:
    cpu = frozenset({"cpu"})
    dispatch.register_backend(PAGED, Backend("fast", constant(1.0), refuse_unless("decode"), cpu, priority=5))
    dispatch.register_backend(PAGED, Backend("faster", constant(2.0), refuse_unless("blocks of 8"), cpu, priority=9))


def test_priority_order_and_fallbacks(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=dispatch.__name__)
    register_fakes()
    cache8, cache16 = torch.zeros(4, 8, 1, 16), torch.zeros(4, 16, 1, 16)
    decode, prefill = torch.zeros(1, 1, 1, 16), torch.zeros(1, 1, 3, 16)
    table = torch.zeros(1, 1, dtype=torch.long)

    served = [
        float(dispatch.paged_attention(q, cache, cache, table, 3, 1.0).flatten()[0])
        for q, cache in ((decode, cache8), (decode, cache16), (prefill, cache8), (prefill, cache16))
    ]

    assert served[:3] == [2.0, 1.0, 2.0]  # faster (priority 9), else fast (5), else ...
    assert dispatch.last_backend() == "torch"  # ... the reference: neither serves a prefill with blocks of 16
    assert dispatch.backend_counts() == {"paged/faster": 2, "paged/fast": 1, "paged/torch": 1}
    reasons = dispatch.refusals(prefill, cache16)
    assert (reasons["fast"], reasons["faster"], reasons["torch"]) == ("not decode", "not blocks of 8", None)
    assert [r.getMessage() for r in caplog.records] == [
        "paged attention is now served by 'faster' (automatic choice).",
        "paged attention is now served by 'fast' (automatic choice; faster refused: not blocks of 8).",
        "paged attention is now served by 'faster' (automatic choice).",
        "paged attention is now served by 'torch' (automatic choice; faster refused: not blocks of 8; fast refused: "
        "not decode).",
    ]


def test_forcing_a_backend() -> None:
    register_fakes()
    decode = torch.zeros(1, 1, 1, 16)
    dispatch.set_backend("fast")
    assert dispatch.forced_backend() == "fast"
    assert dispatch.choose_backend(decode, torch.zeros(4, 8, 1, 16)) == "fast"  # though "faster" ranks higher
    assert dispatch.choose_backend(decode) == "torch"  # without the cache nothing but the reference is sure
    # Forced names apply to every path that has them; the quantized path has no "fast".
    assert dispatch.choose_backend(decode, torch.zeros(4, 8, 1, 16), path=QUANTIZED) == "torch"
    with pytest.raises(ValueError, match=r"Unknown paged attention backend 'fastest'; available: \['fast', 'faster'"):
        dispatch.set_backend("fastest")


def test_registry_guards() -> None:
    with pytest.raises(ValueError, match="'torch' backend is the reference"):
        dispatch.register_backend(PAGED, Backend("torch", constant(0.0)))
    with pytest.raises(ValueError, match="'torch' backend is the reference"):
        dispatch.unregister_backend(QUANTIZED, "torch")
    with pytest.raises(ValueError, match=r"Unknown attention path 'dense'; the paths are \['paged', 'quantized'\]"):
        dispatch.available_backends("dense")
    assert "torch" in dispatch.available_backends(QUANTIZED)


def test_quantized_path_decode_on_the_kernel_prefill_on_the_reference() -> None:
    decode = make_case([90, 50], q_heads=6, kv_heads=2, head_dim=64, block_size=16, device=DEVICE,
                       sealed_format="int8", seed=1)  # fmt: skip
    prefill = make_case([90, 90], q_heads=6, kv_heads=2, head_dim=64, block_size=16, device=DEVICE, q_len=4,
                        sealed_format="int8", seed=2)  # fmt: skip
    dispatch.set_backend("triton")

    for case in (decode, prefill):
        mask = case.attention_mask()
        args = (case.query, case.key_cache.nan_to_num(), case.value_cache.nan_to_num(), case.block_table)
        out = dispatch.quantized_paged_attention(*args, 90, 0.125, case.read_sealed, case.sealed, mask=mask)
        assert_matches(out, case.dense_attention(0.125), torch.float32)

    assert dispatch.backend_counts() == {"quantized/triton": 1, "quantized/torch": 1}


def test_quantized_cache_decodes_through_the_kernel() -> None:
    """int4 layer 0 and a full-precision ("full" format) layer 1, blocks of 4, GQA: forced Triton against
    the forced reference. 6 new tokens = 1 prefill step + 5 decode steps, 2 layers each; 13 + 5 tokens
    fill 4 blocks, the last 3 sealed. (One row: every interpreted launch costs ~0.3 s.)"""
    model = tiny_llama(num_kv_heads=2)
    ids = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(0))
    results = {}
    for backend in ("torch", "triton"):
        dispatch.set_backend(backend)
        dispatch.reset_backend_counts()
        cache = QuantizedCache(model, bits=4, block_size=4, full_precision_layers=(1,), attention="paged")
        with paged_attention(model), torch.no_grad():
            results[backend] = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=6,
                do_sample=False, return_dict_in_generate=True, output_scores=True,
            )  # fmt: skip
        assert cache.stats().sealed_blocks == 3
        counts = dispatch.backend_counts()
        assert counts == (
            {"quantized/torch": 12} if backend == "torch" else {"quantized/torch": 2, "quantized/triton": 10}
        )

    assert torch.equal(results["triton"].sequences, results["torch"].sequences)
    for got, expected in zip(results["triton"].scores, results["torch"].scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
