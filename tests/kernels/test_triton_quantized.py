"""The Triton kernel over sealed (int8 / int4 / fp8 / raw) blocks against the torch reference, the spec.

Without CUDA the kernel runs in Triton's interpreter on CPU tensors (see kernel_helpers). Each case comes
from `kernels.synthetic.make_case`: ragged rows in randomly permuted blocks, the whole blocks past the sink
sealed by the real sealed formats at random sealed ids, and NaN in every slot the kernel must not read (the
full-precision copy of a sealed block, tokens past a row's length, spare blocks, the statistics of spare
sealed ids). Expected results: `quantized_paged_attention_reference` and, independently, dense float64
attention over the decoded K/V. Tolerances per dtype: see kernel_helpers.

The matrix is a hand-picked sample, not the full product (the interpreter is slow): every format, dtype,
GQA ratio (1, 3, 8), head_dim (64, 128, 256), block size (16, 64, 256) and batch size (1-3) appears at
least once, with split counts 1-3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kernel_helpers import DEVICE, assert_matches

from hf_kvgov.codecs.numerics import LOG_SCALE
from hf_kvgov.kernels import triton_launch
from hf_kvgov.kernels.quantized_reference import quantized_paged_attention_reference
from hf_kvgov.kernels.sealed_blocks import SealedBlocks
from hf_kvgov.kernels.synthetic import PagedCase, make_case
from hf_kvgov.kernels.triton_quantized import quantized_paged_attention_triton, supports, unsupported_reason

assert DEVICE.type == "cuda" or triton_launch.INTERPRETED, "triton kernels were imported before TRITON_INTERPRET=1"

KV_HEADS = 2

# (format, dtype, gqa, head_dim, block_size, lengths, sink_blocks, num_splits)
MATRIX = [
    ("int8", torch.float32, 1, 64, 16, [150, 61, 17], 1, 2),
    ("int4", torch.bfloat16, 3, 128, 64, [200, 131], 1, 1),
    ("fp8_e4m3", torch.float16, 8, 64, 256, [300, 270], 0, 2),
    ("fp8_e5m2", torch.float32, 3, 256, 16, [90, 37, 55], 1, 3),
    ("full", torch.bfloat16, 8, 128, 16, [130, 64], 1, 2),
    ("int4", torch.float32, 8, 256, 64, [260], 1, 1),
    ("int8", torch.float16, 3, 128, 256, [520, 300], 1, 2),
    ("fp8_e4m3", torch.bfloat16, 1, 256, 64, [190, 129, 70], 1, 1),
    ("int2", torch.float32, 3, 64, 16, [150, 61], 1, 2),
    ("int2", torch.bfloat16, 8, 128, 64, [200, 90], 0, 1),
]


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread() -> Iterator[None]:
    """Small tensors: a second thread per op costs more than it saves on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_kernel(case: PagedCase, scale: float, **kwargs: object) -> torch.Tensor:
    assert case.sealed is not None
    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.kv_length, scale, case.sealed)
    return quantized_paged_attention_triton(*args, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(("fmt", "dtype", "gqa", "head_dim", "block_size", "lengths", "sink", "splits"), MATRIX)
def test_matches_the_reference_and_dense_attention(
    fmt: str, dtype: torch.dtype, gqa: int, head_dim: int, block_size: int, lengths: list[int], sink: int, splits: int
) -> None:
    case = make_case(
        lengths, q_heads=KV_HEADS * gqa, kv_heads=KV_HEADS, head_dim=head_dim, block_size=block_size,
        dtype=dtype, device=DEVICE, sealed_format=fmt, sink_blocks=sink, seed=head_dim + block_size + gqa,
    )  # fmt: skip
    table = case.block_table
    assert bool((table < 0).any()) and bool((table >= 0).any()), "the case must mix sealed and full blocks"
    scale = head_dim**-0.5

    out = run_kernel(case, scale, seq_lens=case.seq_lens, num_splits=splits)

    assert out.shape == (len(lengths), 1, KV_HEADS * gqa, head_dim)
    assert_matches(out, case.reference(scale), dtype)
    assert_matches(out, case.dense_attention(scale), dtype)


def test_learned_sinks_match_the_reference() -> None:
    case = make_case(
        [70, 33], q_heads=KV_HEADS * 2, kv_heads=KV_HEADS, head_dim=64, block_size=16, dtype=torch.float32,
        device=DEVICE, sealed_format="int8", sink_blocks=1, seed=21,
    )  # fmt: skip
    sinks = torch.linspace(-1.0, 3.0, KV_HEADS * 2, device=DEVICE)
    out = run_kernel(case, 0.125, seq_lens=case.seq_lens, num_splits=3, sinks=sinks)
    key_cache, value_cache = case.key_cache.nan_to_num(), case.value_cache.nan_to_num()
    expected = quantized_paged_attention_reference(
        case.query, key_cache, value_cache, case.block_table, case.kv_length, 0.125, case.read_sealed,
        mask=case.attention_mask(), sinks=sinks,
    )  # fmt: skip
    assert_matches(out, expected, torch.float32)
    assert (out - run_kernel(case, 0.125, seq_lens=case.seq_lens)).abs().max() > 0.05  # the sinks count


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_scale_dtype_and_value_groups_are_read_from_the_stored_tensors(fmt: str) -> None:
    """fp32 scales and zero points, values in groups of 16 channels: nothing about them is hard-coded."""
    options = {"scale_dtype": torch.float32, "group_size": 16}
    case = make_case(
        [100, 77], q_heads=6, kv_heads=KV_HEADS, head_dim=64, block_size=16, device=DEVICE,
        sealed_format=fmt, codec_options=options, seed=21,
    )  # fmt: skip
    assert case.sealed is not None
    value_scale = case.sealed.piece("value_scale")
    assert value_scale.dtype == torch.float32 and value_scale.shape[-1] == 4  # 64 channels / 16
    out = run_kernel(case, 0.125, seq_lens=case.seq_lens, num_splits=2)
    assert_matches(out, case.reference(0.125), torch.float32)


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp8_e4m3"])
def test_one_byte_statistics_are_decoded_in_the_kernel(fmt: str) -> None:
    """Logarithmic scale bytes and e4m3 zero bytes (`numerics.LOG_SCALE`): decoded as the codec decodes them."""
    case = make_case(
        [100, 77], q_heads=6, kv_heads=KV_HEADS, head_dim=64, block_size=16, device=DEVICE,
        sealed_format=fmt, codec_options={"scale_dtype": LOG_SCALE, "group_size": 32}, seed=23,
    )  # fmt: skip
    assert case.sealed is not None
    assert case.sealed.piece("key_scale").dtype == case.sealed.piece("value_scale").dtype == torch.uint8
    assert case.sealed.piece("key_zero").dtype == torch.float8_e4m3fn
    out = run_kernel(case, 0.125, seq_lens=case.seq_lens, num_splits=2)
    assert_matches(out, case.reference(0.125), torch.float32)


def test_left_padding_mask_with_softcap() -> None:
    """A bool mask hiding the first keys of a row (they span a sealed block) and logit soft-capping."""
    case = make_case([140, 140], q_heads=6, kv_heads=KV_HEADS, head_dim=64, block_size=16, device=DEVICE,
                     sealed_format="int4", seed=3)  # fmt: skip
    allowed = torch.ones(2, 140, dtype=torch.bool, device=DEVICE)
    allowed[1, :37] = False
    mask = allowed[:, None, None, :]
    scale, softcap = 0.5, 5.0  # logits of size ~4: the cap matters

    out = run_kernel(case, scale, mask=mask, softcap=softcap, num_splits=3)

    reference = quantized_paged_attention_reference(
        case.query, case.key_cache.nan_to_num(), case.value_cache.nan_to_num(), case.block_table, 140, scale,
        case.read_sealed, mask=mask, softcap=softcap,
    )  # fmt: skip
    assert_matches(out, reference, torch.float32)
    uncapped = run_kernel(case, scale, mask=mask, num_splits=3)
    assert not torch.allclose(out, uncapped, atol=1e-3)


def test_additive_mask() -> None:
    case = make_case([100, 100], q_heads=6, kv_heads=KV_HEADS, head_dim=64, block_size=16, device=DEVICE,
                     sealed_format="fp8_e5m2", seed=4)  # fmt: skip
    bias = torch.linspace(-1.0, 1.0, 100, device=DEVICE)
    additive = bias.masked_fill(torch.arange(100, device=DEVICE) < 20, torch.finfo(torch.float32).min)
    mask = additive[None, None, None, :]
    out = run_kernel(case, 0.125, mask=mask, num_splits=2)
    reference = quantized_paged_attention_reference(
        case.query, case.key_cache.nan_to_num(), case.value_cache.nan_to_num(), case.block_table, 100, 0.125,
        case.read_sealed, mask=mask,
    )  # fmt: skip
    assert_matches(out, reference, torch.float32)


def test_store_without_sealed_blocks() -> None:
    """A cache that sealed nothing yet hands over 0-row pieces: the kernel must not need a row to exist."""
    case = make_case([40, 25], q_heads=2, kv_heads=KV_HEADS, head_dim=64, block_size=16, device=DEVICE,
                     sealed_format="int8", sink_blocks=4, seed=5)  # fmt: skip
    assert case.sealed is not None and not bool((case.block_table < 0).any())
    empty = SealedBlocks("int8", {name: t[:0] for name, t in case.sealed.pieces.items()})
    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.kv_length, 0.125, empty)
    out = quantized_paged_attention_triton(*args, seq_lens=case.seq_lens)
    assert_matches(out, case.dense_attention(0.125), torch.float32)


def test_what_it_refuses_and_rejects() -> None:
    case = make_case([40], q_heads=2, kv_heads=KV_HEADS, head_dim=64, block_size=16, device=DEVICE,
                     sealed_format="int4", seed=6)  # fmt: skip
    sealed = case.sealed
    assert sealed is not None
    assert supports(case.query, case.key_cache, None, sealed)
    assert "needs the layer's SealedBlocks" in str(unsupported_reason(case.query, case.key_cache, None, None))
    nf4 = SealedBlocks("nf4", sealed.pieces)
    assert "sealed format 'nf4' has no Triton decoder" in str(unsupported_reason(case.query, case.key_cache, None, nf4))
    prefill = case.query.expand(-1, -1, 3, -1)
    assert "q_len == 1" in str(unsupported_reason(prefill, case.key_cache, None, sealed))

    def call(pieces: dict[str, torch.Tensor], fmt: str = "int4") -> None:
        blocks = SealedBlocks(fmt, pieces)
        quantized_paged_attention_triton(
            case.query, case.key_cache, case.value_cache, case.block_table, 40, 0.125, blocks
        )

    with pytest.raises(ValueError, match=r"int4 sealed piece 'key_codes' must have shape \(4, 16, 2, 32\)"):
        call({**sealed.pieces, "key_codes": sealed.pieces["key_codes"][..., :16]})
    with pytest.raises(ValueError, match="have no 'key_zero' piece"):
        call({k: v for k, v in sealed.pieces.items() if k != "key_zero"})
    with pytest.raises(ValueError, match=r"int4 key_codes must be torch.uint8; got torch.int8"):
        call({k: (v.view(torch.int8) if k.endswith("codes") else v) for k, v in sealed.pieces.items()})


# The interpreter skips Triton's compiler: compile the kernel for a CUDA target (triton ships ptxas, no GPU
# needed) in a process without TRITON_INTERPRET, for the decodings the compiler is most likely to refuse:
# fp8 e4m3 (integer truncation and a bitcast through fp16) and int2 with one-byte statistics (exp2 of a
# scale byte, e4m3 zero bytes). Two builds only, to keep CI fast (~15 s each); every format compiled when
# this kernel was written.
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_kvgov.kernels import triton_quantized_kernel as k

fn = k.paged_decode_sealed_split_kernel
names = [p.name for p in fn.params]
for fmt, log_scales in ((k.SEALED_FP8_E4M3.value, False), (k.SEALED_INT2.value, True)):
    stat = "*u8" if log_scales else "*fp16"
    pointers = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", kc_ptr="*u8", vc_ptr="*u8", ks_ptr=stat,
                    kz_ptr="*u8", vs_ptr=stat, vz_ptr="*u8" if log_scales else stat, table_ptr="*i64",
                    lens_ptr="*i64", mask_ptr="*i8", m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32")
    constants = dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, PAGE=16, BLOCK_N=64, MASK_MODE=1, USE_SOFTCAP=True,
                     SEALED_FORMAT=fmt, KEY_ZERO=True, VALUE_ZERO=log_scales, VALUE_GROUP=32,
                     LOG_SCALES=log_scales, BYTE_ZEROS=True, DOT_PRECISION="tf32", WIDEN_BF16=False)
    signature = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n in ("scale", "softcap") else "i32")
                 for n in names}
    used = {n: constants[n] for n in names if n in constants}
    compiled = triton.compile(ASTSource(fn, signature, used), target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], fmt
print("compiled")
"""


@pytest.mark.slow
def test_kernel_compiles_for_a_cuda_target(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("compiled")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["int8", "int4", "int2", "fp8_e4m3"])
def test_compiled_kernel_long_context(fmt: str) -> None:
    """Long ragged rows in bf16 with the automatic split count, on the GPU."""
    case = make_case([4099, 2500, 17], q_heads=32, kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                     device=DEVICE, sealed_format=fmt, seed=13)  # fmt: skip
    scale = 128**-0.5
    out = run_kernel(case, scale, seq_lens=case.seq_lens)
    assert_matches(out, case.reference(scale), torch.bfloat16)
