"""`kvgov bench speed`: time to first token, time per output token, tokens/s, KV bytes and peak memory.

For every (batch size, context length), each cache of the registry generates `new_tokens` greedy tokens after a
prompt of exactly `context` tokens, under the attention context its `CacheSpec` asks for. Caches are measured in
interleaved rounds and the medians reported; ratios are against `dynamic` (transformers' DynamicCache) measured
in the same rounds, so they hold on a noisy machine where absolute figures do not.

TTFT: from the call to generate until the first new token reaches the host; TPOT: the mean gap between new tokens
(one decode step); tokens/s: batch x new tokens / generate's wall time, decode tokens/s: batch / TPOT; KV bytes:
what the cache holds once generate returns (its `stats().bytes_used` when it has one); peak memory: the process's
peak RSS on CPU, the allocator's peak on CUDA (see `memory`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from hf_kvgov.bench.allocation import release
from hf_kvgov.bench.memory import PeakMemory, peak_memory_for
from hf_kvgov.bench.prompts import prompt_ids, text_token_ids
from hf_kvgov.bench.timing import TokenClock, interleaved, machine_description
from hf_kvgov.partial import Interrupted, Progress, on_interrupt
from hf_kvgov.registry import CacheSpec, get_cache_spec, kv_bytes

BASELINE = "dynamic"


def _positive_ints(name: str, values: tuple[int, ...]) -> None:
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a non-empty list of positive ints; got {list(values)!r}.")


@dataclass(frozen=True)
class SpeedConfig:
    """What `run_speed` measures. `dynamic` is added first when missing: every ratio is against it.

    Args:
        caches: registry names (`hf_kvgov.registry`), e.g. ("dynamic", "paged", "int8", "h2o", "disk").
        contexts: prompt lengths in tokens.
        batches: batch sizes (rows of one generate call).
        new_tokens: tokens generated per row (at least 2: time per output token needs two).
        rounds: interleaved rounds; each figure is the median over them.
    """

    caches: tuple[str, ...]
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    new_tokens: int = 32
    rounds: int = 3

    def __post_init__(self) -> None:
        if not self.caches:
            raise ValueError("caches must name at least one cache of the registry, e.g. ('dynamic', 'paged').")
        for name in self.caches:
            get_cache_spec(name)  # raises ValueError naming the registered caches
        _positive_ints("contexts", self.contexts)
        _positive_ints("batches", self.batches)
        if isinstance(self.new_tokens, bool) or not isinstance(self.new_tokens, int) or self.new_tokens < 2:
            raise ValueError(
                f"new_tokens must be an int >= 2 (time per output token is the gap between two tokens); "
                f"got {self.new_tokens!r}."
            )
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be a positive int; got {self.rounds!r}.")
        names = tuple(dict.fromkeys(self.caches))  # keep the order, drop repeats
        object.__setattr__(self, "caches", names if BASELINE in names else (BASELINE, *names))


@dataclass(frozen=True)
class Sample:
    """One generate call of one cache."""

    ttft_s: float
    tpot_s: float
    seconds: float
    kv_bytes: int
    peak_memory_bytes: int


@dataclass(frozen=True)
class SpeedRow:
    """Medians over the rounds for one (cache, context, batch); `*_vs_dynamic` are ratios to DynamicCache."""

    cache: str
    context: int
    batch: int
    new_tokens: int
    rounds: int
    ttft_s: float
    tpot_s: float
    tokens_per_s: float
    decode_tokens_per_s: float
    kv_bytes: int
    kv_bytes_per_token: float  # per token stored: batch x (context + new_tokens - 1)
    peak_memory_bytes: int
    memory_kind: str
    tokens_per_s_vs_dynamic: float
    decode_tokens_per_s_vs_dynamic: float
    ttft_vs_dynamic: float
    kv_bytes_vs_dynamic: float


@dataclass(frozen=True)
class SpeedReport:
    model: str
    machine: str
    config: SpeedConfig
    rows: tuple[SpeedRow, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "machine": self.machine, "config": asdict(self.config)} | {
            "rows": [asdict(row) for row in self.rows]
        }


def generate_once(
    model: Any, spec: CacheSpec, inputs: dict[str, torch.Tensor], new_tokens: int, peak: PeakMemory
) -> tuple[Sample, Any]:
    """Greedy-generate exactly `new_tokens` per row with a fresh cache of `spec`.

    Args:
        inputs: `input_ids` and `attention_mask`, long `[batch, context]`.
    Returns:
        the sample, and the cache still holding the K/V (the caller releases it).
    """
    cache = spec.build(model)
    clock = TokenClock()
    peak.reset()
    try:
        with spec.attention(model), torch.inference_mode():
            clock.start()
            model.generate(
                **inputs,
                cache=cache,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # no early EOS: every cache generates the same number of tokens
                do_sample=False,
                streamer=clock,
            )
            seconds = clock.elapsed_s()
    except BaseException:
        release(cache)  # a failed run must not keep its blocks or spill file
        raise
    sample = Sample(clock.first_token_s, clock.per_output_token_s, seconds, kv_bytes(cache), peak.peak_bytes())
    return sample, cache


def _median(samples: list[Sample], pick: Callable[[Sample], float]) -> float:
    return float(statistics.median(pick(s) for s in samples))


def _summary(samples: list[Sample], batch: int, new_tokens: int) -> dict[str, float]:
    return {
        "ttft_s": _median(samples, lambda s: s.ttft_s),
        "tpot_s": _median(samples, lambda s: s.tpot_s),
        "tokens_per_s": _median(samples, lambda s: batch * new_tokens / s.seconds),
        "decode_tokens_per_s": _median(samples, lambda s: batch / s.tpot_s),
        "peak_memory_bytes": _median(samples, lambda s: s.peak_memory_bytes),
    }


def _rows(
    samples: dict[str, list[Sample]], config: SpeedConfig, batch: int, context: int, memory_kind: str
) -> list[SpeedRow]:
    summaries = {name: _summary(runs, batch, config.new_tokens) for name, runs in samples.items()}
    base, base_bytes = summaries[BASELINE], samples[BASELINE][-1].kv_bytes
    stored = batch * (context + config.new_tokens - 1)  # the last new token is never fed back
    rows = []
    for name, s in summaries.items():
        held = samples[name][-1].kv_bytes  # deterministic: every round holds the same K/V
        rows.append(
            SpeedRow(
                cache=name,
                context=context,
                batch=batch,
                new_tokens=config.new_tokens,
                rounds=config.rounds,
                ttft_s=s["ttft_s"],
                tpot_s=s["tpot_s"],
                tokens_per_s=s["tokens_per_s"],
                decode_tokens_per_s=s["decode_tokens_per_s"],
                kv_bytes=held,
                kv_bytes_per_token=held / stored,
                peak_memory_bytes=int(s["peak_memory_bytes"]),
                memory_kind=memory_kind,
                tokens_per_s_vs_dynamic=s["tokens_per_s"] / base["tokens_per_s"],
                decode_tokens_per_s_vs_dynamic=s["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                ttft_vs_dynamic=s["ttft_s"] / base["ttft_s"],
                kv_bytes_vs_dynamic=held / base_bytes if base_bytes else float("nan"),
            )
        )
    return rows


def _measure_point(
    model: Any, config: SpeedConfig, inputs: dict[str, torch.Tensor], peak: PeakMemory, bar: Any
) -> dict[str, list[Sample]]:
    """Every cache of `config`, in interleaved rounds, on one batch of prompts."""

    def measure(name: str) -> Sample:
        sample, cache = generate_once(model, get_cache_spec(name), inputs, config.new_tokens, peak)
        release(cache)
        bar.update(1)
        return sample

    return interleaved(config.caches, config.rounds, measure)


def run_speed(
    model: Any, tokenizer: Any, config: SpeedConfig, model_name: str = "", progress: bool = True
) -> SpeedReport:
    """Measure every cache of `config` at every (batch, context); rows ordered by batch, context, cache.

    On Ctrl-C raises `hf_kvgov.partial.Interrupted` with the report of the (batch, context) points measured.
    """
    device = next(model.parameters()).device
    stream = text_token_ids(tokenizer)
    peak = peak_memory_for(device)
    points = [(batch, context) for batch in config.batches for context in config.contexts]
    rows: list[SpeedRow] = []

    def interrupted() -> Interrupted:
        report = SpeedReport(model_name, machine_description(), config, tuple(rows))
        return Interrupted(report, Progress(len(rows) // len(config.caches), len(points), "(batch, context) points"))

    total = len(points) * config.rounds * len(config.caches)
    with on_interrupt(interrupted), tqdm(total=total, desc="bench speed", disable=not progress) as bar:
        for index, (batch, context) in enumerate(points):
            ids = prompt_ids(stream, batch, context).to(device)
            inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            if index == 0:  # the first generate of a process pays one-off set-up costs: keep them out of the figures
                release(generate_once(model, get_cache_spec(BASELINE), inputs, 2, peak)[1])
            samples = _measure_point(model, config, inputs, peak, bar)
            rows += _rows(samples, config, batch, context, peak.kind)
    return SpeedReport(model_name, machine_description(), config, tuple(rows))


def speed_markdown(report: SpeedReport) -> str:
    """The rows as a Markdown table, with a line naming the model, machine and settings."""
    c = report.config
    kind = report.rows[0].memory_kind if report.rows else "peak memory"
    lines = [
        f"{report.model or 'model'}: {c.new_tokens} new tokens, median of {c.rounds} interleaved round(s) "
        f"({report.machine}); ratios vs DynamicCache from the same rounds",
        "",
        f"| batch | context | cache | TTFT s | TPOT ms | tok/s | decode tok/s | decode vs dynamic | KV bytes "
        f"| KV B/token | KV vs dynamic | {kind} MB |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in report.rows:
        lines.append(
            f"| {r.batch} | {r.context} | {r.cache} | {r.ttft_s:.3f} | {1000 * r.tpot_s:.1f} | {r.tokens_per_s:.1f} "
            f"| {r.decode_tokens_per_s:.1f} | {r.decode_tokens_per_s_vs_dynamic:.2f} | {r.kv_bytes:,} "
            f"| {r.kv_bytes_per_token:,.0f} | {r.kv_bytes_vs_dynamic:.2f} | {r.peak_memory_bytes / 1e6:,.0f} |"
        )
    return "\n".join(lines)
