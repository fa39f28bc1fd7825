"""From measured scores to a recommended configuration: pure functions, no model.

The rule: among the configurations whose perplexity increase is within the tolerance and that keep the most likely
next token where full precision has it (`TOP1_AGREEMENT_FLOOR`), take the one that holds the fewest bytes per token
(ties: the smaller loss). When the cheapest format fails, the per-layer
scan says which layers carry the loss; keeping those few in full precision is often enough.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hf_kvgov.quality.lockstep import CacheScore

# A configuration that changes the most likely next token at more than 2% of positions is not recommended, whatever
# its perplexity: the report's verdict warns about it, and a recommendation must not contradict the verdict.
TOP1_AGREEMENT_FLOOR = 0.98
MAX_PROTECTED_FRACTION = 0.25  # keeping more layers than this in full precision gives up most of the saving


@dataclass(frozen=True)
class Recommendation:
    """The configuration to deploy, or None when nothing stays within the tolerance."""

    name: str | None
    options: dict[str, Any] | None  # keyword arguments of QuantizedCache
    reason: str

    @property
    def code(self) -> str:
        """The constructor call, e.g. ``QuantizedCache(model, bits=8, fmt="int")``."""
        if self.options is None:
            return "PagedCache(model)  # full precision"
        args = ", ".join(f"{key}={value!r}" for key, value in self.options.items())
        return f"QuantizedCache(model, {args})"


def layers_to_protect(increases: Sequence[float], tolerance_pct: float) -> tuple[int, ...]:
    """Layers to keep in full precision, most sensitive first, until the rest is well inside the tolerance.

    `increases[l]`: perplexity increase (percent) when only layer l is quantized. Single-layer losses add
    up roughly; the choice is verified by a full run afterwards. At most a quarter of the layers (and at
    least one) are protected, and never a layer whose quantization costs nothing.
    """
    remaining = sum(max(0.0, x) for x in increases)
    limit = max(1, int(len(increases) * MAX_PROTECTED_FRACTION))
    protected: list[int] = []
    for layer in sorted(range(len(increases)), key=lambda i: increases[i], reverse=True):
        if remaining <= tolerance_pct / 2 or len(protected) >= limit or increases[layer] <= 0:
            break
        protected.append(layer)
        remaining -= increases[layer]
    return tuple(sorted(protected))


def recommend(
    scores: Sequence[CacheScore], options: Mapping[str, dict[str, Any]], tolerance_pct: float
) -> Recommendation:
    """The cheapest configuration within `tolerance_pct` that keeps the most likely next token at
    `TOP1_AGREEMENT_FLOOR` of positions at least; `options` maps a score's name to its kwargs."""
    passing = [s for s in scores if s.ppl_increase_pct <= tolerance_pct and s.top1_agreement >= TOP1_AGREEMENT_FLOOR]
    if not passing:
        worst = ", ".join(f"{s.name} {s.ppl_increase_pct:+.2f}% (top-1 {100 * s.top1_agreement:.1f}%)" for s in scores)
        return Recommendation(
            None,
            None,
            f"no configuration stays within +{tolerance_pct:g}% perplexity with the top token kept at "
            f"{100 * TOP1_AGREEMENT_FLOOR:g}% of positions ({worst}); keep the full-precision cache, or accept a "
            "larger loss",
        )
    best = min(passing, key=lambda s: (s.bytes_per_token, s.ppl_increase_pct))
    return Recommendation(
        best.name,
        dict(options[best.name]),
        f"{best.name} is the smallest configuration within +{tolerance_pct:g}% perplexity "
        f"({best.ppl_increase_pct:+.2f}%, {best.compression:.2f}x smaller than full precision)",
    )
