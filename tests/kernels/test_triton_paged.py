"""The Triton paged decode kernel against dense float64 attention and the torch reference.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors: `TRITON_INTERPRET=1` is set below
before the kernel module is imported (the decorator reads it). With CUDA the same tests run the compiled
kernel on the GPU, and the `cuda`-marked test adds long contexts.

Each case scatters contiguous K/V into blocks with randomly permuted ids (a kernel that ignores the table
fails) and fills every slot a row must not read with NaN: the tail past its length, spare blocks, and in
the mask tests the padded keys (a bool mask promises they are never loaded). Expected outputs are
`softmax(Q Kᵀ · scale) V` in float64 over the allowed keys, K/V repeated per query head; rows with no
allowed key must be 0, as in the reference.

Tolerances: fp32 to 1e-5 (IEEE fp32 dot products, no TF32; measured ~3e-7). bf16/fp16: both sides read
the same rounded Q/K/V; the kernel rounds the softmax weights to the input dtype before the product with
V (as FlashAttention does) and rounds its output once, so one output ulp plus a fraction: bf16 atol 2e-2,
rtol 1.6e-2; fp16 atol 2e-3, rtol 1e-3. The interpreter multiplies bf16 by widening it to fp32, which
is exact and equals a tensor core's products.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from hf_kvgov.kernels import dispatch, triton_paged  # after TRITON_INTERPRET on purpose
from hf_kvgov.kernels.reference import paged_attention_reference
from hf_kvgov.kernels.triton_paged import paged_attention_triton, supports

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
assert DEVICE.type == "cuda" or triton_paged.INTERPRETED, (
    "hf_kvgov.kernels.triton_paged was imported before TRITON_INTERPRET=1 was set, so its kernels are "
    "compiled and cannot run on CPU tensors."
)

TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 1e-3),
}


@dataclass(frozen=True)
class Case:
    query: torch.Tensor  # [batch, q_heads, 1, dim]
    keys: torch.Tensor  # [batch, kv_heads, kv_length, dim], dense
    values: torch.Tensor
    key_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, dim]
    value_cache: torch.Tensor
    table: torch.Tensor  # [batch, blocks]
    seq_lens: torch.Tensor  # [batch]

    @property
    def kv_length(self) -> int:
        return self.keys.shape[2]

    def within_length(self) -> torch.Tensor:
        """bool `[batch, kv_length]`: the keys inside each row's length."""
        return torch.arange(self.kv_length)[None, :] < self.seq_lens.cpu()[:, None]


def make_case(
    lengths: list[int],
    gqa: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    kv_heads: int = 2,
    seed: int = 0,
) -> Case:
    """Row b holds `lengths[b]` tokens; `kv_length = max(lengths)`; every other slot holds NaN."""
    generator = torch.Generator().manual_seed(seed)
    batch, kv_length = len(lengths), max(lengths)
    query = torch.randn(batch, kv_heads * gqa, 1, head_dim, generator=generator).to(dtype)
    keys = torch.randn(batch, kv_heads, kv_length, head_dim, generator=generator).to(dtype)
    values = torch.randn(batch, kv_heads, kv_length, head_dim, generator=generator).to(dtype)
    blocks_per_row = -(-kv_length // block_size)
    num_blocks = batch * blocks_per_row + 3
    table = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_row].reshape(batch, blocks_per_row)
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    for row, length in enumerate(lengths):
        for token in range(length):
            block, slot = int(table[row, token // block_size]), token % block_size
            key_cache[block, slot] = keys[row, :, token]
            value_cache[block, slot] = values[row, :, token]
    seq_lens = torch.tensor(lengths)
    tensors = (query, keys, values, key_cache, value_cache, table, seq_lens)
    return Case(*(t.to(DEVICE) for t in tensors))


def naive_attention(case: Case, scale: float, allowed: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Dense float64 attention, `[batch, 1, q_heads, dim]`; `allowed` bool `[batch, kv_length]`.

    Disallowed keys are zeroed before the product, so their NaN slots never reach the result; rows with
    no allowed key are 0.
    """
    group = case.query.shape[1] // case.keys.shape[1]
    allowed = allowed.to(DEVICE)
    keys = case.keys.double().nan_to_num().repeat_interleave(group, dim=1)
    values = case.values.double().masked_fill(~allowed[:, None, :, None], 0.0).repeat_interleave(group, dim=1)
    scores = case.query.double() @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num()  # all -inf rows -> 0
    return (weights @ values).transpose(1, 2)


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """Tiny tensors: a second thread per op costs more than it saves on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def automatic_backend() -> Iterator[None]:
    dispatch.set_backend(None)
    yield
    dispatch.set_backend(None)


# ---------------------------------------------------------------- the matrix


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
def test_ragged_rows_match_dense_attention_and_the_reference(gqa: int, head_dim: int, block_size: int) -> None:
    seed = gqa * 1000 + head_dim + block_size
    generator = torch.Generator().manual_seed(seed)
    batch = 1 + seed % 3
    longest = int(torch.randint(block_size + 1, block_size + 140, (1,), generator=generator))
    lengths = [longest, *torch.randint(1, longest + 1, (batch - 1,), generator=generator).tolist()]
    case = make_case(lengths, gqa, head_dim, block_size, seed=seed)
    scale = 1 / math.sqrt(head_dim)
    splits = 1 + seed % 3

    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, case.kv_length, scale,
        seq_lens=case.seq_lens, num_splits=splits,
    )  # fmt: skip

    assert out.shape == (batch, 1, 2 * gqa, head_dim)
    assert_matches(out, naive_attention(case, scale, case.within_length()))
    # The reference sees the same rows through a mask; it reads NaN past the lengths, so fill those.
    mask = case.within_length()[:, None, None, :].to(DEVICE)
    reference = paged_attention_reference(
        case.query, case.key_cache.nan_to_num(), case.value_cache.nan_to_num(), case.table, case.kv_length, scale,
        mask=mask,
    )  # fmt: skip
    assert_matches(out, reference)


def test_head_dim_256() -> None:
    case = make_case([90, 37], gqa=3, head_dim=256, block_size=16, seed=3)
    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 90, 0.0625, seq_lens=case.seq_lens, num_splits=2
    )
    assert_matches(out, naive_attention(case, 0.0625, case.within_length()))


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7])
def test_split_count_does_not_change_the_result(num_splits: int) -> None:
    """3 tiles of 64 per row: 7 splits leave empty splits, which must contribute nothing."""
    case = make_case([150, 150], gqa=3, head_dim=64, block_size=16, seed=4)
    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 150, 0.125, num_splits=num_splits
    )
    assert_matches(out, naive_attention(case, 0.125, case.within_length()))


def test_padding_mask_keys_are_never_read() -> None:
    """Left padding as transformers builds it; the padded keys hold NaN in the cache."""
    case = make_case([140, 140, 140], gqa=8, head_dim=64, block_size=16, seed=5)
    allowed = torch.ones(3, 140, dtype=torch.bool)
    allowed[1, :37] = False  # left padding
    allowed[2, :130] = False  # the only keys sit in the last split
    for row, slots in enumerate(allowed.logical_not()):
        for token in slots.nonzero().flatten().tolist():
            case.key_cache[case.table[row, token // 16], token % 16] = float("nan")
            case.value_cache[case.table[row, token // 16], token % 16] = float("nan")

    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 140, 0.125,
        mask=allowed[:, None, None, :].to(DEVICE), num_splits=3,
    )  # fmt: skip

    assert torch.isfinite(out).all()
    assert_matches(out, naive_attention(case, 0.125, allowed))


def test_additive_mask_with_bias_and_one_mask_row_for_the_batch() -> None:
    case = make_case([100, 100], gqa=3, head_dim=64, block_size=64, seed=6)
    allowed = torch.arange(100) >= 20
    bias = torch.linspace(-1.0, 1.0, 100)
    additive = bias.masked_fill(~allowed, torch.finfo(torch.float32).min)

    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 100, 0.125,
        mask=additive[None, None, None, :].to(DEVICE), num_splits=2,
    )  # fmt: skip

    group = 3
    keys = case.keys.double().repeat_interleave(group, dim=1)
    values = case.values.double().repeat_interleave(group, dim=1)
    scores = case.query.double() @ keys.transpose(-1, -2) * 0.125 + bias.double().to(DEVICE)
    scores = scores.masked_fill(~allowed.to(DEVICE), float("-inf"))
    assert_matches(out, (torch.softmax(scores, dim=-1) @ values).transpose(1, 2))


@pytest.mark.parametrize("softcap", [2.0, 30.0])
def test_softcap(softcap: float) -> None:
    case = make_case([120, 75], gqa=3, head_dim=64, block_size=16, seed=7)
    scale = 1.0  # logits of size ~8: capping at 2 changes them a lot, at 30 a little
    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 120, scale,
        softcap=softcap, seq_lens=case.seq_lens, num_splits=2,
    )  # fmt: skip
    assert_matches(out, naive_attention(case, scale, case.within_length(), softcap=softcap))
    uncapped = naive_attention(case, scale, case.within_length())
    assert not torch.allclose(out.double(), uncapped, atol=1e-3)


def test_empty_and_fully_masked_rows_are_zero() -> None:
    case = make_case([50, 50, 50], gqa=1, head_dim=64, block_size=16, seed=8)
    seq_lens = torch.tensor([50, 0, 50], device=DEVICE)
    allowed = torch.ones(3, 50, dtype=torch.bool)
    allowed[2] = False
    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 50, 0.125,
        mask=allowed[:, None, None, :].to(DEVICE), seq_lens=seq_lens, num_splits=2,
    )  # fmt: skip
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))
    assert_matches(out[:1], naive_attention(case, 0.125, allowed)[:1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    case = make_case([130, 61], gqa=3, head_dim=128, block_size=16, dtype=dtype, seed=9)
    scale = 1 / math.sqrt(128)
    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 130, scale, seq_lens=case.seq_lens, num_splits=2
    )
    assert_matches(out, naive_attention(case, scale, case.within_length()), dtype)


def test_layouts_transformers_passes() -> None:
    """A strided query view, an int32 table and a mask and table wider than kv_length needs."""
    case = make_case([70, 70], gqa=3, head_dim=64, block_size=16, seed=10)
    wide = torch.zeros(2, 6, 1, 128, device=DEVICE)
    wide[..., ::2] = case.query
    query = wide[..., ::2]  # every other element of a wider buffer: head_dim stride 2
    spare = torch.full((2, 3), case.key_cache.shape[0] - 1, device=DEVICE)
    table = torch.cat([case.table, spare], dim=1).to(torch.int32)
    wider_mask = torch.ones(1, 1, 1, 75, dtype=torch.bool, device=DEVICE)
    wider_mask[..., 70:] = False  # keys past kv_length, as a mask built for a longer cache: ignored
    wider_mask[..., :4] = False
    out = paged_attention_triton(query, case.key_cache, case.value_cache, table, 70, 0.125, mask=wider_mask)
    allowed = case.within_length() & wider_mask[0, 0, :, :70].cpu()
    assert_matches(out, naive_attention(case, 0.125, allowed))


# ---------------------------------------------------------------- what it refuses


def test_unsupported_inputs_are_refused_with_a_reason() -> None:
    case = make_case([20], gqa=1, head_dim=64, block_size=16)
    prefill = torch.randn(1, 2, 3, 64, device=DEVICE)
    odd_dim = torch.randn(1, 2, 1, 80, device=DEVICE)
    per_head_mask = torch.ones(1, 2, 1, 20, dtype=torch.bool, device=DEVICE)
    assert supports(case.query, case.key_cache)
    assert not supports(prefill, case.key_cache)
    assert not supports(odd_dim, torch.zeros(4, 16, 2, 80, device=DEVICE))
    assert not supports(case.query, case.key_cache, per_head_mask)
    assert not supports(case.query.double(), case.key_cache.double())
    args = (case.key_cache, case.value_cache, case.table, 20, 0.125)
    with pytest.raises(ValueError, match=r"decode \(q_len == 1\) only; got q_len=3"):
        paged_attention_triton(prefill, *args)
    with pytest.raises(ValueError, match="power of two from 16 to 256; got 80"):
        paged_attention_triton(odd_dim, torch.zeros(4, 16, 2, 80, device=DEVICE), *args[1:])
    with pytest.raises(ValueError, match=r"kv_length must be in \[0, 16\]"):
        paged_attention_triton(case.query, case.key_cache, case.value_cache, case.table[:, :1], 20, 0.125)
    with pytest.raises(ValueError, match=r"seq_lens must be an int32/int64 tensor of shape \[1\]"):
        paged_attention_triton(case.query, *args, seq_lens=torch.tensor([1.0], device=DEVICE))
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        paged_attention_triton(case.query, *args, num_splits=0)
    with pytest.raises(ValueError, match="softcap must be a positive number"):
        paged_attention_triton(case.query, *args, softcap=-1.0)


# ---------------------------------------------------------------- dispatch


def test_dispatch_forced_triton_runs_the_kernel() -> None:
    case = make_case([150, 150], gqa=3, head_dim=64, block_size=16, seed=11)
    dispatch.set_backend("triton")
    out = dispatch.paged_attention(case.query, case.key_cache, case.value_cache, case.table, 150, 0.125)
    assert dispatch.last_backend() == "triton"
    assert out.shape == (2, 1, 6, 64)
    assert_matches(out, naive_attention(case, 0.125, case.within_length()))


@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_learned_sinks_join_every_denominator(num_splits: int) -> None:
    """GPT-OSS's sink logits (one per query head) merged with the splits, empty splits included; through dispatch,
    Triton keeps a decode call that has them (the sdpa backend would not take it)."""
    case = make_case([150, 90, 1], gqa=3, head_dim=64, block_size=16, seed=14)
    sinks = torch.linspace(-1.0, 3.0, 6, device=DEVICE)
    args = (case.query, case.key_cache, case.value_cache, case.table, 150, 0.125)
    out = paged_attention_triton(*args, seq_lens=case.seq_lens, num_splits=num_splits, sinks=sinks)
    group, allowed = 3, case.within_length().to(DEVICE)
    keys = case.keys.double().nan_to_num().repeat_interleave(group, dim=1)
    values = case.values.double().nan_to_num().repeat_interleave(group, dim=1)
    scores = (case.query.double() @ keys.transpose(-1, -2) * 0.125).masked_fill(~allowed[:, None, None], -math.inf)
    column = sinks.double().view(1, -1, 1, 1).expand(3, -1, 1, 1)
    weights = torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]
    expected = (weights @ values).transpose(1, 2)
    assert_matches(out, expected)
    assert (out - paged_attention_triton(*args, seq_lens=case.seq_lens)).abs().max() > 0.05  # the sinks count
    dispatch.set_backend("triton")
    via = dispatch.paged_attention(*args, mask=allowed[:, None, None], sinks=sinks)
    assert dispatch.last_backend() == "triton"
    assert_matches(via, expected)


def test_dispatch_falls_back_to_torch_for_prefill() -> None:
    generator = torch.Generator().manual_seed(12)
    keys = torch.randn(1, 2, 40, 64, generator=generator)
    cache = keys.permute(0, 2, 1, 3).reshape(40, 1, 2, 64).contiguous()  # block size 1
    table = torch.arange(40)[None, :]
    query = torch.randn(1, 2, 4, 64, generator=generator)
    dispatch.set_backend("triton")
    assert dispatch.choose_backend(query.to(DEVICE), cache.to(DEVICE)) == "torch"

    out = dispatch.paged_attention(query.to(DEVICE), cache.to(DEVICE), cache.to(DEVICE), table.to(DEVICE), 40, 0.125)

    assert dispatch.last_backend() == "torch"
    causal = torch.arange(40)[None, :] <= torch.arange(36, 40)[:, None]
    scores = (query.double() @ keys.double().transpose(-1, -2) * 0.125).masked_fill(~causal, float("-inf"))
    expected = (torch.softmax(scores, dim=-1) @ keys.double()).transpose(1, 2)
    assert_matches(out.cpu(), expected)


def test_dispatch_automatic_choice() -> None:
    case = make_case([20], gqa=1, head_dim=64, block_size=16)
    expected = "triton" if DEVICE.type == "cuda" else "sdpa"  # the interpreter is never chosen by itself
    assert dispatch.choose_backend(case.query, case.key_cache) == expected
    dispatch.paged_attention(case.query, case.key_cache, case.value_cache, case.table, 20, 0.125)
    assert dispatch.last_backend() == expected


def test_environment_variable_forces_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([20], gqa=1, head_dim=64, block_size=16)
    try:
        monkeypatch.setenv(dispatch.ENV_VAR, "Triton")
        importlib.reload(dispatch)
        assert dispatch.choose_backend(case.query, case.key_cache) == "triton"
        monkeypatch.setenv(dispatch.ENV_VAR, "cuda")
        with pytest.raises(ValueError, match=r"KVGOV_ATTENTION_BACKEND='cuda' is not an available .*'triton'"):
            importlib.reload(dispatch)
    finally:
        monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
        importlib.reload(dispatch)
    assert dispatch.choose_backend(case.query, case.key_cache) == ("triton" if DEVICE.type == "cuda" else "sdpa")


# The interpreter skips Triton's compiler, so this compiles both kernels for a CUDA target (no GPU needed,
# triton ships ptxas) in a fresh process where TRITON_INTERPRET is unset: type or constexpr errors that
# only the compiler sees fail here, on every CI run.
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_kvgov.kernels import triton_paged_kernel as k

pointers = dict(q_ptr="*fp16", k_ptr="*fp16", v_ptr="*fp16", table_ptr="*i64", lens_ptr="*i64", mask_ptr="*i8",
                m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", sinks_ptr="*fp32", out_ptr="*fp16")
constants = dict(GROUP=3, BLOCK_H=16, HEAD_DIM=64, PAGE=16, BLOCK_N=64, MASK_MODE=k.MASK_BOOL, USE_SOFTCAP=True,
                 KV_FORMAT=k.KV_FORMAT_NATIVE, DOT_PRECISION="tf32", WIDEN_BF16=False, SPLITS=4, USE_SINKS=True)
for fn in (k.paged_decode_split_kernel, k.paged_decode_combine_kernel):
    names = [p.name for p in fn.params]
    signature = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n in ("scale", "softcap") else "i32")
                 for n in names}
    used = {n: constants[n] for n in names if n in constants}
    compiled = triton.compile(ASTSource(fn, signature, used), target=GPUTarget("cuda", 80, 32))
    assert compiled.asm["cubin"], fn
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_a_cuda_target(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, leave no cache behind
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's notice about a future default
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("compiled")


# ---------------------------------------------------------------- on the GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_long_context(dtype: torch.dtype) -> None:
    """Long ragged rows with the automatic split count, against the reference on the same GPU."""
    case = make_case([4099, 2500, 17], gqa=8, head_dim=128, block_size=16, dtype=dtype, kv_heads=4, seed=13)
    scale = 1 / math.sqrt(128)
    out = paged_attention_triton(
        case.query, case.key_cache, case.value_cache, case.table, 4099, scale, seq_lens=case.seq_lens
    )
    mask = case.within_length()[:, None, None, :].to(DEVICE)
    reference = paged_attention_reference(
        case.query, case.key_cache.nan_to_num(), case.value_cache.nan_to_num(), case.table, 4099, scale, mask=mask
    )
    assert_matches(out, reference.double(), dtype)
    assert_matches(out, naive_attention(case, scale, case.within_length()), dtype)
