"""The passes a check makes, known before it runs: the work to bound, and a cost for the progress bar's ETA.

A pass feeds the text to `rows` caches at once (see `lockstep`): the reference and up to `max_rows`
candidates, `chunk` tokens per step. Its *work* is the tokens through the model, counted over the rows
(row-tokens), which is what the defaults' budget bounds. Its *cost* estimates time: each step also reads the
whole cache of every row (gathered, and decoded where quantized), so a step that feeds `new` tokens after
`context` cached ones costs about ``rows * (new + context / CONTEXT_READ_PER_TOKEN)``. Over 2,048 tokens in
steps of 16, those reads are more than half of the time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# Cached tokens that one step reads in the time it takes to compute one new token: fitted to the two passes of a
# full SmolLM2 check on a CPU (one thread); on other models and devices it only shapes the ETA.
CONTEXT_READ_PER_TOKEN = 48


@dataclass(frozen=True)
class Pass:
    """One batched pass over the first `tokens` tokens of the text (the last one is only a target)."""

    label: str
    rows: int  # caches fed at once, the reference included
    tokens: int
    chunk: int  # tokens fed per step

    @property
    def starts(self) -> range:
        """The first position fed by each step."""
        return range(0, self.tokens - 1, self.chunk)

    @property
    def row_tokens(self) -> int:
        """Tokens through the model, over all rows."""
        return self.rows * (self.tokens - 1)

    def step_cost(self, start: int) -> float:
        """Estimated cost of the step that feeds the tokens from `start` on (`start` of them are cached)."""
        new = min(self.chunk, self.tokens - 1 - start)
        return self.rows * (new + start / CONTEXT_READ_PER_TOKEN)

    @property
    def cost(self) -> float:
        return sum(self.step_cost(start) for start in self.starts)


def lockstep_passes(candidates: int, tokens: int, chunk: int, max_rows: int, label: str) -> tuple[Pass, ...]:
    """The passes that score `candidates` caches, `max_rows` of them per pass, each pass with its reference."""
    sizes = [min(max_rows, candidates - first) for first in range(0, max(candidates, 1), max_rows)]
    count = len(sizes)
    return tuple(
        Pass(f"{label} ({number}/{count})" if count > 1 else label, size + 1, tokens, chunk)
        for number, size in enumerate(sizes, start=1)
    )


@dataclass(frozen=True)
class CheckPlan:
    """What a check computes: `formats` always; `scan` unless it is off, or only when the lowest-bit format
    exceeds the tolerance (`scan_always` False); `protected` when layers must stay in full precision."""

    formats: tuple[Pass, ...]
    scan: tuple[Pass, ...]  # empty: no scan
    scan_always: bool
    protected: Pass

    @property
    def certain(self) -> tuple[Pass, ...]:
        """The passes that run whatever the measurements say."""
        return (*self.formats, *(self.scan if self.scan_always else ()))

    @property
    def worst_case(self) -> tuple[Pass, ...]:
        """Every pass that may run."""
        return (*self.formats, *self.scan, self.protected)


def row_tokens(passes: Iterable[Pass]) -> int:
    return sum(p.row_tokens for p in passes)


def cost(passes: Iterable[Pass]) -> float:
    return sum(p.cost for p in passes)
