"""The flash-attn paged path without flash-attn: its selection and the arguments it prepares.

flash-attn cannot be built without CUDA, so a fake `flash_attn_with_kvcache` stands in for it on CPU
tensors (the fixture lets CPU tensors through `DEVICE_TYPES`). The fake checks the call against
flash-attn 2's documented contract (q `(batch, seqlen_q, nheads, headdim)`, the paged k_cache
`(num_blocks, page_block_size, nheads_k, headdim)` with page_block_size % 256 == 0, int32 block_table
and cache_seqlens, no new k/v, no leftpad) and answers as flash-attn does (causal aligned to the bottom
right, per-row lengths) by calling the torch reference. The tests compare the result with dense float64
attention computed from the case's contiguous K/V, and check the recorded arguments themselves: the
pool's own tensors (no copy), the table's ids, the lengths, scale, softcap and causal flag.

The `cuda`-marked test runs the real flash-attn against the reference when both are available.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kernel_helpers import DEVICE, assert_matches

from hf_kvgov.engine.paged_view import PagedView
from hf_kvgov.kernels import dispatch, flash_paged
from hf_kvgov.kernels.reference import paged_attention_reference
from hf_kvgov.kernels.synthetic import PagedCase, make_case
from hf_kvgov.serving import SamplingParams, ServingEngine
from tests.conftest import tiny_gemma3


@dataclasses.dataclass
class FakeFlash:
    """`flash_attn_with_kvcache` on the CPU: checks flash-attn's contract, records the call, runs the reference."""

    calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Any = None, v: Any = None,
        rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None, cache_batch_idx: Any = None,
        cache_leftpad: Any = None, block_table: Any = None, softmax_scale: Any = None, causal: bool = False,
        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
        alibi_slopes: Any = None, num_splits: int = 0, return_softmax_lse: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        self.calls.append(dict(locals()))
        batch, q_len, heads, head_dim = q.shape
        assert k_cache.shape[1] % 256 == 0 and k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape
        assert k is None and v is None and cache_leftpad is None and cache_batch_idx is None
        assert block_table.dtype == torch.int32 and block_table.shape[0] == batch
        assert cache_seqlens.dtype == torch.int32 and tuple(cache_seqlens.shape) == (batch,)
        lengths = cache_seqlens.long()
        kv_length = int(lengths.max())
        key = torch.arange(kv_length)[None, None, :]
        last = lengths[:, None] - q_len + torch.arange(q_len)[None, :]  # bottom-right causal, per row
        mask = (key <= last[:, :, None]) & (key < lengths[:, None, None]) if causal else key < lengths[:, None, None]
        if window_size[0] >= 0:  # a sliding window: the query and the window_size[0] keys before it
            mask &= key >= last[:, :, None] - window_size[0]
        # flash-attn's masked keys contribute nothing; the reference reads them, so zero NaN slots first.
        out = paged_attention_reference(
            q.transpose(1, 2), k_cache.nan_to_num(), v_cache.nan_to_num(), block_table.long(), kv_length,
            softmax_scale, mask=mask[:, None], softcap=softcap or None,
        )  # fmt: skip
        return out


@pytest.fixture
def fake_flash(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeFlash]:
    """The fake as flash-attn, the flash backend registered (and allowed to be picked) for CPU tensors."""
    fake = FakeFlash()
    monkeypatch.setattr(flash_paged, "load_kernel", lambda: fake)
    monkeypatch.setattr(flash_paged, "DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    everywhere = frozenset({"cuda", "cpu"})
    dispatch.register_backend(dispatch.PAGED, dataclasses.replace(dispatch.FLASH_ATTN, auto_devices=everywhere))
    dispatch.set_backend(None)
    dispatch.reset_backend_counts()
    yield fake
    dispatch.set_backend(None)
    dispatch.unregister_backend(dispatch.PAGED, "flash_attn")
    if flash_paged.is_installed():
        dispatch.register_backend(dispatch.PAGED, dispatch.FLASH_ATTN)


def flash_case(
    lengths: list[int], q_len: int = 1, dtype: torch.dtype = torch.float16, block_size: int = 256
) -> PagedCase:
    return make_case(lengths, q_heads=8, kv_heads=2, head_dim=64, block_size=block_size, dtype=dtype, q_len=q_len,
                     device=DEVICE, seed=sum(lengths) + q_len)  # fmt: skip


def test_decode_hands_flash_the_pool_the_table_and_ragged_lengths(fake_flash: FakeFlash) -> None:
    case = flash_case([300, 129])
    out = flash_paged.paged_attention_flash(
        case.query, case.key_cache, case.value_cache, case.block_table, 300, 0.125, softcap=10.0,
        seq_lens=case.seq_lens,
    )  # fmt: skip

    assert_matches(out, case.dense_attention(0.125, softcap=10.0), torch.float16)
    (call,) = fake_flash.calls
    assert call["k_cache"] is case.key_cache and call["v_cache"] is case.value_cache  # in place, no gather
    assert torch.equal(call["q"], case.query.transpose(1, 2)) and call["q"].shape == (2, 1, 8, 64)
    assert torch.equal(call["block_table"], case.block_table.to(torch.int32))
    assert call["cache_seqlens"].tolist() == [300, 129]
    assert (call["softmax_scale"], call["causal"], call["softcap"]) == (0.125, True, 10.0)
    assert call["window_size"] == (-1, -1) and call["alibi_slopes"] is None


def test_prefill_through_the_paged_view_is_causal_from_the_bottom_right(fake_flash: FakeFlash) -> None:
    """A chunk of 5 queries at the end of 270 cached tokens: flash-attn is picked for prefill as well."""
    case = flash_case([270, 270], q_len=5, dtype=torch.bfloat16)
    view = PagedView(case.key_cache, case.value_cache, case.block_table, 270)

    out = view.attend(case.query, None, 0.125, None)

    assert dispatch.last_backend() == "flash_attn"
    (call,) = fake_flash.calls
    assert call["q"].shape == (2, 5, 8, 64) and call["cache_seqlens"].tolist() == [270, 270]
    assert call["softcap"] == 0.0 and call["causal"] is True  # 0.0 is flash-attn's "no softcap"
    assert_matches(out, case.dense_attention(0.125), torch.bfloat16)


def test_a_ragged_call_reaches_flash_as_lengths_and_a_window(fake_flash: FakeFlash) -> None:
    """A mask that is only per-row lengths and a sliding window, given as `seq_lens` and `window` too (the serving
    engine's decode rows): flash-attn, which refuses any other mask, serves it from those, and the fake's own
    mask from `cache_seqlens` and `window_size` gives what the explicit mask gives the reference."""
    case = flash_case([300, 129])
    keys, window = torch.arange(300), 100
    mask = ((keys < case.seq_lens[:, None]) & (keys >= case.seq_lens[:, None] - window))[:, None, None, :]
    args = (case.query, case.key_cache, case.value_cache, case.block_table, 300, 0.125)
    out = dispatch.paged_attention(*args, mask=mask, seq_lens=case.seq_lens, window=window)
    assert dispatch.last_backend() == "flash_attn"
    (call,) = fake_flash.calls
    assert call["cache_seqlens"].tolist() == [300, 129] and call["window_size"] == (window - 1, 0)
    clean = case.key_cache.nan_to_num(), case.value_cache.nan_to_num()
    expected = paged_attention_reference(case.query, *clean, case.block_table, 300, 0.125, mask=mask)
    assert_matches(out, expected, torch.float16)
    dispatch.paged_attention(*args, mask=mask)  # the same mask alone: flash cannot read it
    assert dispatch.last_backend() != "flash_attn" and len(fake_flash.calls) == 1


def test_the_serving_engine_decodes_through_flash(fake_flash: FakeFlash) -> None:
    """Tiny Gemma-3 in fp16, 256-token blocks, requests of unequal lengths past the sliding window: every decode and
    prefill call goes to flash-attn as lengths and windows (the sliding rows from their first kept block), and the
    tokens equal the torch reference's."""
    model = tiny_gemma3(window=8).half()
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 9, 40)]
    outputs = {}
    for backend in ("torch", None):
        dispatch.set_backend(backend)
        dispatch.reset_backend_counts()
        fake_flash.calls.clear()
        with ServingEngine(model, block_size=256, prefix_sharing=False) as engine:
            outputs[backend] = engine.generate(prompts, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert set(dispatch.backend_counts()) == {"paged/flash_attn"}
    decode = [call for call in fake_flash.calls if call["q"].shape[1] == 1 and call["q"].shape[0] == 3]
    assert {tuple(call["window_size"]) for call in decode} == {(7, 0), (-1, -1)}  # the sliding and full layers
    full = [call for call in decode if call["window_size"] == (-1, -1)]
    assert full[0]["cache_seqlens"].tolist() == [301, 10, 41]  # each row's own length, nothing padded
    sliding = [call for call in decode if call["window_size"] == (7, 0)]
    assert sliding[0]["cache_seqlens"].tolist() == [301 - 256, 10, 41]  # the long row starts at its second block
    assert outputs[None] == outputs["torch"]


def test_what_flash_attn_refuses(fake_flash: FakeFlash, monkeypatch: pytest.MonkeyPatch) -> None:
    ok = flash_case([20])
    assert flash_paged.unsupported_reason(ok.query, ok.key_cache, None) is None
    small = flash_case([20], block_size=16)
    assert "multiple of 256 tokens; got block_size=16" in str(
        flash_paged.unsupported_reason(small.query, small.key_cache, None)
    )
    fp32 = flash_case([20], dtype=torch.float32)
    assert "fp16 or bf16" in str(flash_paged.unsupported_reason(fp32.query, fp32.key_cache, None))
    mask = torch.ones(1, 1, 1, 20, dtype=torch.bool)
    assert "takes no mask" in str(flash_paged.unsupported_reason(ok.query, ok.key_cache, mask))
    wide = torch.zeros(1, 8, 1, 264, dtype=torch.float16)
    assert "head_dim a multiple of 8 up to 256; got 264" in str(
        flash_paged.unsupported_reason(wide, torch.zeros(2, 256, 2, 264, dtype=torch.float16), None)
    )
    odd_heads = torch.zeros(1, 3, 1, 64, dtype=torch.float16)
    assert "multiple of kv_heads" in str(flash_paged.unsupported_reason(odd_heads, ok.key_cache, None))
    monkeypatch.setattr(flash_paged, "DEVICE_TYPES", frozenset({"cuda"}))
    assert "runs on CUDA tensors; got cpu" in str(flash_paged.unsupported_reason(ok.query, ok.key_cache, None))
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        flash_paged.paged_attention_flash(ok.query, ok.key_cache, ok.value_cache, ok.block_table, 20, 0.125)
    assert fake_flash.calls == []


def test_automatic_choice_prefers_flash_and_falls_back(fake_flash: FakeFlash, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=dispatch.__name__)
    big, small = flash_case([40]), flash_case([40], block_size=16)
    padded = torch.ones(1, 1, 1, 40, dtype=torch.bool)
    padded[..., :3] = False

    dispatch.paged_attention(big.query, big.key_cache, big.value_cache, big.block_table, 40, 0.125)
    assert dispatch.last_backend() == "flash_attn"
    out = dispatch.paged_attention(big.query, big.key_cache, big.value_cache, big.block_table, 40, 0.125, mask=padded)
    assert dispatch.last_backend() == "sdpa"  # on the CPU triton is never picked by itself
    dispatch.paged_attention(small.query, small.key_cache, small.value_cache, small.block_table, 40, 0.125)

    assert dispatch.backend_counts() == {"paged/flash_attn": 1, "paged/sdpa": 2}
    assert len(fake_flash.calls) == 1
    expected = big.query.double() @ big.keys.double().repeat_interleave(4, dim=1)[..., 3:, :].transpose(-1, -2) * 0.125
    weights = torch.softmax(expected, dim=-1)
    dense = (weights @ big.values.double().repeat_interleave(4, dim=1)[..., 3:, :]).transpose(1, 2)
    assert_matches(out, dense, torch.float16)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "paged attention is now served by 'flash_attn' (automatic choice)."
    assert messages[1].startswith("paged attention is now served by 'sdpa' (automatic choice; flash_attn refused: ")
    assert len(messages) == 2  # the third call changed nothing, so it logged nothing


def test_forced_flash_runs_torch_where_it_cannot_serve(fake_flash: FakeFlash) -> None:
    small = flash_case([40], block_size=16)
    dispatch.set_backend("flash_attn")
    assert dispatch.choose_backend(small.query, small.key_cache) == "torch"
    reasons = dispatch.refusals(small.query, small.key_cache)
    assert reasons["torch"] is None and "multiple of 256" in str(reasons["flash_attn"])
    big = flash_case([40])
    assert dispatch.choose_backend(big.query, big.key_cache) == "flash_attn"


@pytest.mark.skipif(flash_paged.is_installed(), reason="flash-attn is installed here")
def test_a_missing_flash_attn_is_explained() -> None:
    flash_paged.load_kernel.cache_clear()
    with pytest.raises(ImportError, match=r"pip install flash-attn"):
        flash_paged.load_kernel()
    assert "flash_attn" not in dispatch.available_backends()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not flash_paged.is_installed(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("q_len", [1, 7])
def test_real_flash_attn_matches_the_reference(q_len: int) -> None:
    case = make_case([1500, 1500], q_heads=32, kv_heads=8, head_dim=128, block_size=256, dtype=torch.bfloat16,
                     q_len=q_len, device="cuda", seed=q_len)  # fmt: skip
    scale = 128**-0.5
    out = flash_paged.paged_attention_flash(case.query, case.key_cache, case.value_cache, case.block_table, 1500, scale)
    assert_matches(out, case.reference(scale), torch.bfloat16)
