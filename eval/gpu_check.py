"""GPU check of every attention kernel: agreement with the torch references, then decode speed.

    python eval/gpu_check.py              # CUDA: a few minutes on one H200 -> eval/out/gpu_check.{md,json}
    python eval/gpu_check.py --allow-cpu  # no CUDA: a tiny smoke run of this script through the Triton
                                          # interpreter (< 2 minutes) -> eval/out/gpu_check_cpu_smoke.{md,json}

1. Correctness. Random ragged batches in randomly permuted blocks (`kernels.synthetic`; NaN in every slot
   a kernel must not read) are attended by: the torch reference (against dense float64 attention), the
   Triton paged kernel in fp32/bf16/fp16 (and with a mask and soft-capping), the Triton kernel over sealed
   int8 / int4 / fp8_e4m3 / fp8_e5m2 / raw blocks, the quantized torch reference, and flash-attn (decode
   and a prefill chunk, blocks of 256) when it is installed. Each output is compared with its reference
   at the tolerance the unit tests use for its dtype (tests/kernels/kernel_helpers.py).
2. Speed. One layer's decode at batch 32 x 4,096 tokens, 32 query / 8 KV heads, head_dim 128 (Llama-3-8B's
   attention): sdpa over a contiguous bf16 cache (the baseline), the paged kernels in bf16, and the sealed
   kernel with int8 / fp8 / int4 KV (sink block in bf16). Each timed kernel's output is checked against
   the reference as well. Achieved bandwidth = bytes the call must read (K/V in full precision, or codes +
   scales + zero points) / median time, compared with the device's copy bandwidth, measured with a large
   device-to-device copy (bytes read + written).

Any kernel that disagrees with its reference, or fails, makes the exit status 1 (after the report is
written). Without CUDA and without --allow-cpu the script says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_kvgov.kernels.selfcheck import Check, compare, run_checks

OUT = Path(__file__).resolve().parent / "out"


@dataclass(frozen=True)
class Plan:
    """Sizes of one run."""

    name: str
    check_lengths: tuple[int, ...]  # ragged rows of the correctness cases
    heads: tuple[int, int]  # (query heads, KV heads)
    head_dim: int
    timing_batch: int
    timing_context: int
    copy_bytes: int
    repeats: int


GPU_PLAN = Plan("gpu", (4099, 2053, 1100, 17), (32, 8), 128, 32, 4096, 2 << 30, 50)
CPU_PLAN = Plan("cpu_smoke", (70, 41, 17), (4, 2), 64, 2, 256, 64 << 20, 3)


@dataclass
class Timing:
    kernel: str
    kv_format: str
    block_size: int | None
    microseconds: float
    bytes_read: int
    gb_per_s: float
    fraction_of_copy: float
    speedup_vs_sdpa: float | None = None


@dataclass
class Report:
    plan: str
    machine: dict[str, Any]
    copy_gb_per_s: float
    checks: list[Check] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]


# ---------------------------------------------------------------- timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """Median seconds per call over 5 rounds of `repeats // 5` back-to-back calls (one sync per round, so
    a short kernel's time is not the host's synchronization latency), after warm-up calls."""
    for _ in range(2):  # compilation, autotuning, allocator
        fn()
    calls = max(1, repeats // 5)
    rounds = []
    for _ in range(5 if repeats >= 5 else 1):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def copy_bandwidth(plan: Plan, device: torch.device) -> float:
    """Bytes per second of a large same-device copy (each byte is read once and written once)."""
    source = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), plan.repeats // 2, device)
    return 2 * plan.copy_bytes / seconds


def kv_bytes(case: Any) -> int:
    """Bytes one decode call must read: every block its table names (full-precision or sealed), once."""
    table = case.block_table
    full_block = 2 * case.key_cache[0].numel() * case.key_cache.element_size()
    total = int((table >= 0).sum()) * full_block + table.numel() * table.element_size()
    if case.sealed is not None:
        sealed_block = sum(t[0].numel() * t.element_size() for t in case.sealed.pieces.values())
        total += int((table < 0).sum()) * sealed_block
    return total


@dataclass
class Timer:
    """Times decode calls at the plan's timing size, checking each output against the reference first."""

    plan: Plan
    device: torch.device
    copy_bps: float
    timings: list[Timing] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return float(self.plan.head_dim**-0.5)

    def case(self, block: int, sealed_format: str | None = None) -> Any:
        from hf_kvgov.kernels.synthetic import make_case

        plan = self.plan
        return make_case([plan.timing_context] * plan.timing_batch, q_heads=plan.heads[0], kv_heads=plan.heads[1],
                         head_dim=plan.head_dim, block_size=block, dtype=torch.bfloat16, device=self.device,
                         sealed_format=sealed_format, seed=block)  # fmt: skip

    def measure(
        self, kernel: str, fmt: str, block: int | None, case: Any, fn: Callable[[], torch.Tensor], nbytes: int
    ) -> None:
        label = f"{fmt}, block {block or '-'}, batch {self.plan.timing_batch} x {self.plan.timing_context}"
        check = compare(Check(kernel, label, "bfloat16"), fn, lambda: case.reference(self.scale), torch.bfloat16)
        self.checks.append(check)
        if check.error is None:
            seconds = median_seconds(fn, self.plan.repeats, self.device)
            bps = nbytes / seconds
            self.timings.append(Timing(kernel, fmt, block, seconds * 1e6, nbytes, bps / 1e9, bps / self.copy_bps))

    def full_precision(self) -> None:
        from hf_kvgov.kernels.triton_paged import paged_attention_triton

        c = self.case(16)
        keys = c.keys.to(torch.bfloat16).contiguous()  # [batch, kv_heads, context, head_dim]
        values = c.values.to(torch.bfloat16).contiguous()
        sdpa = _sdpa_decode(c.query, keys, values, self.scale)
        self.measure("sdpa (contiguous)", "bf16", None, c, sdpa, 2 * keys.numel() * keys.element_size())
        args = (c.query, c.key_cache, c.value_cache, c.block_table, c.kv_length, self.scale)
        self.measure("torch reference", "bf16", 16, c, lambda: c.reference(self.scale), kv_bytes(c))
        self.measure("triton paged", "bf16", 16, c, lambda: paged_attention_triton(*args), kv_bytes(c))

    def flash(self) -> None:
        from hf_kvgov.kernels.flash_paged import paged_attention_flash

        c = self.case(256)
        args = (c.query, c.key_cache, c.value_cache, c.block_table, c.kv_length, self.scale)
        self.measure("flash-attn paged", "bf16", 256, c, lambda: paged_attention_flash(*args), kv_bytes(c))

    def sealed(self, fmt: str, with_reference: bool) -> None:
        from hf_kvgov.kernels.triton_quantized import quantized_paged_attention_triton

        c = self.case(16, fmt)
        args = (c.query, c.key_cache, c.value_cache, c.block_table, c.kv_length, self.scale, c.sealed)
        self.measure("triton sealed", fmt, 16, c, lambda: quantized_paged_attention_triton(*args), kv_bytes(c))
        if with_reference:
            self.measure("torch quantized reference", fmt, 16, c, lambda: c.reference(self.scale), kv_bytes(c))


def timing_runs(plan: Plan, device: torch.device, copy_bps: float) -> tuple[list[Timing], list[Check]]:
    from hf_kvgov.kernels import flash_paged

    timer = Timer(plan, device, copy_bps)
    timer.full_precision()
    if device.type == "cuda" and flash_paged.is_installed():
        timer.flash()
    for fmt in ("int8", "fp8_e4m3", "int4"):
        timer.sealed(fmt, with_reference=fmt == "int8")
    baseline = next((t.microseconds for t in timer.timings if t.kernel.startswith("sdpa")), None)
    for t in timer.timings:
        t.speedup_vs_sdpa = baseline / t.microseconds if baseline else None
    return timer.timings, timer.checks


def _sdpa_decode(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> Callable[[], torch.Tensor]:
    """sdpa over a contiguous cache; GQA through `enable_gqa` (torch >= 2.5) so K/V are read once."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    try:
        sdpa(query[:1], keys[:1], values[:1], scale=scale, enable_gqa=True)
    except TypeError:  # older torch: expand per query head once, outside the timed call
        group = query.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        return lambda: sdpa(query, keys, values, scale=scale).transpose(1, 2)
    return lambda: sdpa(query, keys, values, scale=scale, enable_gqa=True).transpose(1, 2)


# ---------------------------------------------------------------- report


def machine(device: torch.device) -> dict[str, Any]:
    import importlib.metadata as metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU (interpreter)"
    return {
        "device": name,
        "torch": torch.__version__,
        "triton": version("triton"),
        "flash_attn": version("flash-attn"),
    }


def markdown(report: Report, plan: Plan) -> str:
    m = report.machine
    lines = [
        f"# Kernel check ({report.plan}): {m['device']}",
        "",
        f"torch {m['torch']}, triton {m['triton']}, flash-attn {m['flash_attn'] or 'not installed'}. "
        f"Copy bandwidth (same-device copy of {plan.copy_bytes >> 20} MiB, read + write): "
        f"{report.copy_gb_per_s:,.0f} GB/s.",
        "",
        "## Agreement with the torch references",
        "",
        "| kernel | case | dtype | max abs error | tolerance (atol, rtol) | result |",
        "| --- | --- | --- | ---: | --- | --- |",
    ]
    for c in report.checks:
        error = "-" if c.max_abs_error is None else f"{c.max_abs_error:.2e}"
        result = "pass" if c.passed else f"**FAIL** {c.error or ''}".strip()
        lines.append(f"| {c.kernel} | {c.case} | {c.dtype} | {error} | {c.tolerance} | {result} |")
    q_heads, kv_heads = plan.heads
    lines += [
        "",
        f"## Decode, one layer: batch {plan.timing_batch} x {plan.timing_context} tokens, {q_heads} query / "
        f"{kv_heads} KV heads, head_dim {plan.head_dim}",
        "",
        "| kernel | KV | block | us / call | MB read | GB/s | of copy bandwidth | speed vs sdpa |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for t in report.timings:
        speedup = "-" if t.speedup_vs_sdpa is None else f"{t.speedup_vs_sdpa:.2f}x"
        lines.append(
            f"| {t.kernel} | {t.kv_format} | {t.block_size or '-'} | {t.microseconds:,.1f} | {t.bytes_read / 1e6:,.1f} "
            f"| {t.gb_per_s:,.1f} | {t.fraction_of_copy:.0%} | {speedup} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--allow-cpu", action="store_true", help="without CUDA, run a tiny smoke version on the CPU")
    parser.add_argument("--out", type=Path, default=OUT, help="where the markdown and JSON reports go")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.allow_cpu:
            print("gpu_check: no CUDA device here, so there are no GPU kernels to check. Run it on a CUDA machine, "
                  "or pass --allow-cpu for a tiny smoke run of this script through the Triton interpreter.",
                  file=sys.stderr)  # fmt: skip
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported (they read it then)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    plan = GPU_PLAN if device.type == "cuda" else CPU_PLAN
    started = time.perf_counter()
    copy_bps = copy_bandwidth(plan, device)
    report = Report(plan.name, machine(device), copy_bps / 1e9)
    report.checks = run_checks(device, plan.check_lengths, plan.heads, plan.head_dim)
    report.timings, timed_checks = timing_runs(plan, device, copy_bps)
    report.checks += timed_checks
    report.machine["seconds"] = round(time.perf_counter() - started, 1)
    stem = "gpu_check" if device.type == "cuda" else "gpu_check_cpu_smoke"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(markdown(report, plan))
    (args.out / f"{stem}.json").write_text(json.dumps({**asdict(report), "plan": asdict(plan)}, indent=2))
    print(markdown(report, plan))
    for failure in report.failures:
        why = failure.error or f"max abs error {failure.max_abs_error}, tolerance {failure.tolerance}"
        print(f"FAIL: {failure.kernel} ({failure.case}): {why}", file=sys.stderr)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
