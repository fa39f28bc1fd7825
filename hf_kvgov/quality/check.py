"""The quantization sanity check: measure what int8 / int4 / fp8 KV costs on *this* model and text.

Against a lossless `PagedCache` on the same tokens (`lockstep`): (1) every format with the cache in the loop
(perplexity, KL, top-1 agreement, bytes per token); (2) the keys' outlier-channel ratio per layer (`outliers`);
(3) one layer at a time in the lowest-bit format, always (`scan="always"`) or only when that format fails
(`QUICK`), the only case where the recommendation uses it; (4) on failure, its most sensitive layers kept in full
precision, as are flagged outlier layers for formats of at most 4 bits (a flagged format is never recommended);
(5) a verdict and the cheapest configuration within the tolerance. `QUICK` keeps every token of (1), because a
format's loss grows with the context it reads and fewer tokens would pass what the gate must fail
(eval/RESULTS.md); it drops the scan when unused, most of the full check's time (`CheckOptions.plan`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import torch
from tqdm import tqdm

from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.quality.builtin_text import BUILTIN_TEXT
from hf_kvgov.quality.check_defaults import (
    DEFAULT_MAX_ROWS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SCAN_TOKENS,
    DEFAULT_TOLERANCE_PCT,
    FORMAT_OPTIONS,
)
from hf_kvgov.quality.grouped_attention import grouped_sdpa_on_cpu
from hf_kvgov.quality.lockstep import CacheBuilder, CacheScore, LockstepResult, progress_bar, score_in_lockstep
from hf_kvgov.quality.outliers import flagged_by_outliers, key_outlier_ratios
from hf_kvgov.quality.plan import CheckPlan, Pass, cost, lockstep_passes
from hf_kvgov.quality.recommendation import MAX_PROTECTED_FRACTION, layers_to_protect, recommend
from hf_kvgov.quality.report import QuantCheckReport, SensitivityScan

ScanWhen = Literal["always", "if-failing", "never"]


@dataclass(frozen=True)
class CheckOptions:
    """What the check measures.

    Attributes:
        formats: names from `FORMAT_OPTIONS`.
        max_tokens: tokens of the text used (the text is cut there).
        block_size, residual, sink_blocks: the QuantizedCache settings under test.
        chunk_tokens: tokens per forward step; None = block_size, which reproduces generation exactly.
        max_ppl_increase: the gate, in percent: `passed` is False when a listed format exceeds it.
        scan: when to run the per-layer scan: "always", "if-failing" (when the lowest-bit format exceeds the
            tolerance, the one case where the recommendation uses it) or "never".
        scan_format, scan_tokens: the scan's format (None: the format with fewest bits) and tokens.
        max_rows: caches scored per batched pass: memory grows with it, and on a CPU so does the speed (one pass
            of 31 rows scans SmolLM2 24% faster than four of at most 9).
    """

    formats: tuple[str, ...] = ("int8", "fp8", "int4")
    max_tokens: int = DEFAULT_MAX_TOKENS
    block_size: int = 16
    residual: int = 0
    sink_blocks: int = 1
    chunk_tokens: int | None = None
    max_ppl_increase: float | None = None
    scan: ScanWhen = "always"
    scan_format: str | None = None
    scan_tokens: int = DEFAULT_SCAN_TOKENS
    max_rows: int = DEFAULT_MAX_ROWS

    def __post_init__(self) -> None:
        unknown = [f for f in (*self.formats, self.scan_format) if f is not None and f not in FORMAT_OPTIONS]
        if unknown or not self.formats:
            raise ValueError(f"Unknown or no formats {unknown or '()'}; accepted: {', '.join(FORMAT_OPTIONS)}.")
        for name in ("max_tokens", "block_size", "scan_tokens", "max_rows"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be at least 2; got {getattr(self, name)}.")
        if self.chunk_tokens is not None and self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive (or None for block_size); got {self.chunk_tokens}.")
        if self.scan not in get_args(ScanWhen):
            raise ValueError(f"scan must be one of {', '.join(get_args(ScanWhen))}; got {self.scan!r}.")
        if self.max_ppl_increase is not None and self.max_ppl_increase < 0:
            raise ValueError(f"max_ppl_increase is a percentage >= 0; got {self.max_ppl_increase}.")
        self.config("int8")  # validates residual and sink_blocks

    @property
    def tolerance_pct(self) -> float:
        return DEFAULT_TOLERANCE_PCT if self.max_ppl_increase is None else self.max_ppl_increase

    @property
    def chunk(self) -> int:
        return self.chunk_tokens or self.block_size

    @property
    def lowest_bit_format(self) -> str:
        return self.scan_format or min(self.formats, key=lambda f: FORMAT_OPTIONS[f]["bits"])

    def scan_length(self, tokens: int) -> int:
        """Tokens of a `tokens`-token text that the scan feeds (it needs more than two blocks)."""
        return min(tokens, max(self.scan_tokens, 2 * self.block_size + 1))

    def plan(self, tokens: int, num_layers: int) -> CheckPlan:
        """The passes a check with these options makes on a `tokens`-token text and a `num_layers`-layer model."""
        fmt = self.lowest_bit_format
        scan = lockstep_passes(num_layers, self.scan_length(tokens), self.chunk, self.max_rows, _scan_label(fmt))
        return CheckPlan(
            formats=lockstep_passes(len(self.formats), tokens, self.chunk, self.max_rows, ", ".join(self.formats)),
            scan=() if self.scan == "never" else scan,
            scan_always=self.scan == "always",
            protected=Pass(f"{fmt} + full-precision layers", 2, tokens, self.chunk),
        )

    def config(self, fmt: str, full_precision_layers: tuple[int, ...] = ()) -> QuantConfig:
        return QuantConfig(
            residual=self.residual,
            sink_blocks=self.sink_blocks,
            full_precision_layers=full_precision_layers,
            **FORMAT_OPTIONS[fmt],
        )


# The two settings of `kvgov check-quant`; CheckOptions() itself is the full check.
FULL = CheckOptions()
QUICK = CheckOptions(scan="if-failing")


def check_quantization(
    model: Any,
    tokenizer: Any,
    text: str | None = None,
    options: CheckOptions | None = None,
    model_name: str | None = None,
    progress: bool = False,
) -> QuantCheckReport:
    """Run the sanity check of the module docstring; `text` defaults to the built-in passage.

    `progress` shows one progress bar on stderr for the whole check, with an ETA for the passes known so far
    (a scan or a protected run adds its own when the measurements call for it).
    """
    options = options or CheckOptions()
    ids = tokenize(tokenizer, BUILTIN_TEXT if text is None else text, options.max_tokens, options.block_size)
    plan = options.plan(int(ids.shape[1]), _num_layers(model))
    with contextlib.ExitStack() as stack:
        bar = stack.enter_context(progress_bar(cost(plan.certain), "check-quant")) if progress else None
        stack.enter_context(grouped_sdpa_on_cpu(model))
        runner = ConfigRunner(model, options, bar)
        return _check(runner, ids, plan, model_name or type(model).__name__)


def _check(runner: ConfigRunner, ids: torch.Tensor, plan: CheckPlan, model_name: str) -> QuantCheckReport:
    options = runner.options
    scores, outliers = _measure_formats(runner, ids)
    flagged = tuple(f for f in options.formats if flagged_by_outliers(FORMAT_OPTIONS[f]["bits"], outliers))
    scan = None
    if plan.scan and (plan.scan_always or not _passes_tolerance(options.lowest_bit_format, scores, options)):
        runner.expect(plan.scan, already_counted=plan.scan_always)
        scan = _scan(runner, ids)
    protected = _protected_run(runner, ids, scan, scores, outliers, plan.protected)
    configs = {fmt: options.config(fmt) for fmt in options.formats}
    candidates = [s for s in scores if s.name not in flagged]
    if protected is not None:
        configs[protected[0].name] = protected[1]
        candidates.append(protected[0])
    kwargs = {name: _kwargs(config, options) for name, config in configs.items()}
    threshold = options.max_ppl_increase
    return QuantCheckReport(
        model=model_name,
        tokens=int(ids.shape[1]),
        block_size=options.block_size,
        chunk_tokens=options.chunk,
        reference_perplexity=scores[0].reference_perplexity,
        formats=tuple(scores),
        key_outlier_ratios=outliers,
        sensitivity=scan,
        protected=protected[0] if protected is not None else None,
        recommendation=recommend(candidates, kwargs, options.tolerance_pct),
        tolerance_pct=options.tolerance_pct,
        threshold_pct=threshold,
        gate_failures=tuple(s.name for s in scores if threshold is not None and s.ppl_increase_pct > threshold),
        flagged=flagged,
    )


def tokenize(tokenizer: Any, text: str, max_tokens: int, block_size: int) -> torch.Tensor:
    """The first `max_tokens` tokens of `text` as long `[1, n]`; the text must span two blocks at least."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, :max_tokens]
    if ids.shape[1] < 2 * block_size + 1:
        raise ValueError(
            f"The text has {ids.shape[1]} tokens; the check needs more than two blocks ({2 * block_size + 1} "
            "tokens) for any block to be quantized. Pass a longer text (a few thousand tokens is best)."
        )
    return ids


@dataclass(frozen=True)
class ConfigRunner:
    """Scores QuantConfigs of one model against the full cache, with the check's options."""

    model: Any
    options: CheckOptions
    bar: tqdm | None

    def score(self, ids: torch.Tensor, configs: dict[str, QuantConfig], label: str) -> LockstepResult:
        o = self.options
        builders: dict[str, CacheBuilder] = {
            name: functools.partial(QuantizedCache, self.model, block_size=o.block_size, **asdict(config))
            for name, config in configs.items()
        }
        shown = label if self.bar is not None else None
        return score_in_lockstep(self.model, ids, builders, o.chunk, o.block_size, o.max_rows, shown, self.bar)

    def expect(self, passes: Sequence[Pass], already_counted: bool = False) -> None:
        """Add `passes` to the progress bar's total (its ETA), unless the plan counted them from the start."""
        if self.bar is not None and not already_counted:
            self.bar.total += cost(passes)
            self.bar.refresh()


def _num_layers(model: Any) -> int:
    return int(model.config.get_text_config(decoder=True).num_hidden_layers)


def _scan_label(fmt: str) -> str:
    return f"{fmt} one layer at a time"


def _passes_tolerance(fmt: str, scores: Sequence[CacheScore], options: CheckOptions) -> bool:
    """Whether `fmt` was measured and stayed within the tolerance (a format not listed has not)."""
    return any(s.name == fmt and s.ppl_increase_pct <= options.tolerance_pct for s in scores)


def _kwargs(config: QuantConfig, options: CheckOptions) -> dict[str, Any]:
    """The QuantizedCache keyword arguments that differ from the defaults, plus the block size."""
    defaults = asdict(QuantConfig())
    chosen = {key: value for key, value in asdict(config).items() if value != defaults[key] or key in ("bits", "fmt")}
    return {**chosen, "block_size": options.block_size}


def _measure_formats(runner: ConfigRunner, ids: torch.Tensor) -> tuple[list[CacheScore], tuple[float, ...]]:
    """Every listed format against the full cache, and the full cache's key outlier ratios per layer."""
    formats = runner.options.formats
    result = runner.score(ids, {fmt: runner.options.config(fmt) for fmt in formats}, ", ".join(formats))
    return [result.scores[fmt] for fmt in formats], tuple(key_outlier_ratios(result.reference))


def _scan(runner: ConfigRunner, ids: torch.Tensor) -> SensitivityScan:
    """Quantize one layer at a time (all others full precision) with the lowest-bit format."""
    options = runner.options
    fmt = options.lowest_bit_format
    every = tuple(range(_num_layers(runner.model)))
    configs = {f"layer {layer}": options.config(fmt, tuple(i for i in every if i != layer)) for layer in every}
    scan_ids = ids[:, : options.scan_length(int(ids.shape[1]))]
    result = runner.score(scan_ids, configs, _scan_label(fmt))
    return SensitivityScan(fmt, int(scan_ids.shape[1]), tuple(result.scores[name] for name in configs))


def _protected_run(
    runner: ConfigRunner,
    ids: torch.Tensor,
    scan: SensitivityScan | None,
    scores: list[CacheScore],
    outliers: Sequence[float],
    planned: Pass,
) -> tuple[CacheScore, QuantConfig] | None:
    """The lowest-bit format with some layers in full precision, measured on the whole text, when needed.

    Kept in full precision: the layers where that format is flagged for key outliers, then, unless the format
    passed the tolerance, the scan's most sensitive layers; at most a quarter of the layers in all.
    """
    options = runner.options
    fmt = scan.format if scan is not None else options.lowest_bit_format
    flagged = flagged_by_outliers(FORMAT_OPTIONS[fmt]["bits"], outliers)
    passed = _passes_tolerance(fmt, scores, options)
    increases = [s.ppl_increase_pct for s in scan.layers] if scan is not None and not passed else []
    chosen = list(dict.fromkeys([*flagged, *layers_to_protect(increases, options.tolerance_pct)]))
    protect = tuple(sorted(chosen[: max(1, int(len(outliers) * MAX_PROTECTED_FRACTION))]))
    if not protect:
        return None
    config = options.config(fmt, protect)
    name = f"{planned.label} {', '.join(map(str, protect))}"
    runner.expect([planned])
    return runner.score(ids, {name: config}, name).scores[name], config
