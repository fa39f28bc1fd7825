"""The sanity check's report: what was measured, the verdict, the recommendation, text and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from hf_kvgov.quality.lockstep import CacheScore
from hf_kvgov.quality.outliers import DEFAULT_OUTLIER_RATIO
from hf_kvgov.quality.recommendation import TOP1_AGREEMENT_FLOOR, Recommendation

TOP_LAYERS_SHOWN = 5


@dataclass(frozen=True)
class SensitivityScan:
    """Per-layer loss with only that layer quantized (all others in full precision)."""

    format: str
    tokens: int
    layers: tuple[CacheScore, ...]  # index = layer

    def most_sensitive(self, n: int = TOP_LAYERS_SHOWN) -> list[tuple[int, CacheScore]]:
        ranked = sorted(enumerate(self.layers), key=lambda item: item[1].ppl_increase_pct, reverse=True)
        return ranked[:n]


@dataclass(frozen=True)
class QuantCheckReport:
    model: str
    tokens: int
    block_size: int
    chunk_tokens: int
    reference_perplexity: float
    formats: tuple[CacheScore, ...]
    key_outlier_ratios: tuple[float, ...]  # per layer, max / median channel magnitude of the cached keys
    sensitivity: SensitivityScan | None
    protected: CacheScore | None  # the scanned format with its most sensitive layers in full precision
    recommendation: Recommendation
    tolerance_pct: float  # what the recommendation accepts
    threshold_pct: float | None  # the gate; None: report only
    gate_failures: tuple[str, ...]  # formats above the gate
    flagged: tuple[str, ...] = ()  # low-bit formats not recommended as they are: they quantize outlier layers

    @property
    def passed(self) -> bool:
        """False when a gate was given and a listed format exceeds it (the CLI then exits with 1)."""
        return not self.gate_failures

    def outlier_layers(self, ratio: float = DEFAULT_OUTLIER_RATIO) -> list[int]:
        return [layer for layer, r in enumerate(self.key_outlier_ratios) if r >= ratio]

    def verdict(self) -> list[str]:
        """Plain sentences: which formats are within the tolerance, outliers, the gate."""
        ok = [s.name for s in self.formats if s.ppl_increase_pct <= self.tolerance_pct]
        bad = [f"{s.name} ({s.ppl_increase_pct:+.2f}%)" for s in self.formats if s.name not in ok]
        lines = [f"within +{self.tolerance_pct:g}% perplexity: {', '.join(ok) or 'none'}"]
        if bad:
            lines.append(f"above it: {', '.join(bad)}")
        shifted = [s for s in self.formats if s.name in ok and s.top1_agreement < TOP1_AGREEMENT_FLOOR]
        for s in shifted:
            lines.append(
                f"{s.name} keeps perplexity but changes the most likely next token at "
                f"{100 * (1 - s.top1_agreement):.1f}% of positions (KL {s.kl_mean:.3g} nats), so it is not "
                "recommended: check generations on your task before relying on it"
            )
        outliers = self.outlier_layers()
        if outliers:
            worst = max(self.key_outlier_ratios)
            lines.append(
                f"keys of layers {', '.join(map(str, outliers))} have outlier channels (up to {worst:.1f}x the median "
                "channel): per-channel key scales are essential here, and the sink block must stay in full precision"
            )
        for name in self.flagged:
            lines.append(
                f"{name} is flagged: on layers {', '.join(map(str, outliers))} its step is coarser than a median "
                "key channel's values, a loss this text need not expose; it is recommended only with those layers "
                "in full precision"
            )
        if self.threshold_pct is not None:
            gate = "FAIL: " + ", ".join(self.gate_failures) if self.gate_failures else "pass"
            lines.append(f"gate (every listed format within +{self.threshold_pct:g}%): {gate}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["passed"] = self.passed
        data["verdict"] = self.verdict()
        data["recommendation"]["code"] = self.recommendation.code
        return _finite(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def render(self) -> str:
        lines = [
            f"KV quantization check: {self.model}, {self.tokens:,} tokens, blocks of {self.block_size}, "
            f"{self.chunk_tokens} tokens per step",
            f"full-precision perplexity: {self.reference_perplexity:.4f}",
            "",
            _score_header(),
            *(_score_row(s) for s in self.formats),
        ]
        if self.protected is not None:
            lines.append(_score_row(self.protected))
        lines += ["", _outlier_line(self.key_outlier_ratios)]
        if self.sensitivity is not None:
            scan = self.sensitivity
            top = ", ".join(f"layer {i} {s.ppl_increase_pct:+.2f}%" for i, s in scan.most_sensitive())
            lines.append(f"per-layer sensitivity ({scan.format}, one layer at a time, {scan.tokens:,} tokens): {top}")
        lines += ["", *(f"verdict: {line}" for line in self.verdict())]
        lines.append(f"recommended: {self.recommendation.code}")
        lines.append(f"  because {self.recommendation.reason}")
        return "\n".join(lines)


def _score_header() -> str:
    return (
        f"{'configuration':<34} {'ppl':>9} {'Δppl':>8} {'KL nats':>9} {'top-1':>7} {'bytes/token':>12} {'smaller':>8}"
    )


def _score_row(s: CacheScore) -> str:
    return (
        f"{s.name:<34} {s.perplexity:>9.4f} {s.ppl_increase_pct:>+7.2f}% {s.kl_mean:>9.3g} "
        f"{100 * s.top1_agreement:>6.1f}% {s.bytes_per_token:>12,.0f} {s.compression:>7.2f}x"
    )


def _outlier_line(ratios: tuple[float, ...]) -> str:
    ranked = sorted(enumerate(ratios), key=lambda item: item[1], reverse=True)[:TOP_LAYERS_SHOWN]
    shown = ", ".join(f"layer {i} {r:.1f}x" for i, r in ranked)
    return f"key outlier channels (max / median channel magnitude), highest: {shown}"


def _finite(value: Any) -> Any:
    """JSON has no NaN or inf: non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
