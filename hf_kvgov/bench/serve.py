"""`kvgov bench serve`: one trace served by several configurations under one KV byte cap, in one run.

The configurations (`ServeConfig`) range from static batching with `DynamicCache` to hf_kvgov's `ServingEngine` with
prefix sharing, codes, eviction and swapping; each row (`ServeRow`) has vLLM's latency and throughput metrics,
governance figures sampled every step, and the configuration's agreement with the full cache.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from tqdm import tqdm
from transformers import ContinuousBatchingConfig, DynamicCache, GenerationConfig

from hf_kvgov.bench.serve_workload import TraceConfig, TraceRequest, build_trace
from hf_kvgov.bench.timing import TokenClock, machine_description
from hf_kvgov.engine.parts import Disk, HeavyHitter
from hf_kvgov.hf.compat import RequestStatus, decoder_config, kv_heads_and_head_dim
from hf_kvgov.partial import Interrupted, Progress, on_interrupt
from hf_kvgov.serving import SamplingParams, ServingEngine
from hf_kvgov.serving.scheduler import common_prefix

SERVE_CONFIGS = {
    "static": "static batches with DynamicCache (padded, a batch at a time)",
    "transformers": "transformers' continuous batching with its own paged cache",
    "paged": "hf_kvgov ServingEngine, paged blocks",
    "prefix": "hf_kvgov ServingEngine, paged blocks + prefix sharing",
    "int8": "hf_kvgov ServingEngine, paged blocks + prefix sharing + int8 codes",
    "h2o": "hf_kvgov ServingEngine, paged blocks + prefix sharing + int8 codes + H2O 20% (whole blocks)",
    "h2o-stream": "hf_kvgov ServingEngine, paged blocks + int8 codes + H2O 20%, prompts streamed (no prefix tree)",
    "swap": "hf_kvgov ServingEngine, paged blocks + prefix sharing + int8 codes, preempted requests swapped to disk",
}
LOSSLESS_CONFIGS = ("paged", "prefix", "static", "transformers")  # the first of these a run has: the full answers
H2O_BUDGET = 0.2


@dataclass(frozen=True)
class ServeConfig:
    """What one run serves: the configurations, the trace, the KV byte cap and the SLOs goodput counts.

    The configurations (`SERVE_CONFIGS`): static batching with `DynamicCache` (requests that have arrived are
    batched, padded, while their padded KV fits the cap, and the next batch waits for the whole batch to end);
    transformers' continuous batching with its own paged cache (`num_blocks` from the cap); hf_kvgov's
    `ServingEngine`, without and with prefix sharing, with int8 codes too, with H2O eviction on top (each request
    keeps 20% of its prompt in blocks; `h2o-stream` without the prefix tree, so prompts stream instead of being
    held whole), and with preempted requests swapped to disk instead of computed again.
    """

    configs: tuple[str, ...] = ("static", "transformers", "paged", "prefix", "int8", "h2o")
    trace: TraceConfig = field(default_factory=TraceConfig)
    kv_bytes: int = 64 << 20
    block_size: int = 16
    max_batched_tokens: int = 512
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.5

    def __post_init__(self) -> None:
        unknown = [name for name in self.configs if name not in SERVE_CONFIGS]
        if unknown or not self.configs:
            raise ValueError(f"Unknown serving configuration(s) {unknown}; accepted: {sorted(SERVE_CONFIGS)}.")
        if self.kv_bytes <= 0:
            raise ValueError(f"The KV byte cap must be positive; got {self.kv_bytes}.")
        for name, count in (("block_size", self.block_size), ("max_batched_tokens", self.max_batched_tokens)):
            if count < 1:
                raise ValueError(f"{name} must be at least 1; got {count}.")
        for name, seconds in (("slo_ttft_s", self.slo_ttft_s), ("slo_tpot_s", self.slo_tpot_s)):
            if not seconds > 0:
                raise ValueError(f"{name} must be a positive number of seconds; got {seconds}.")


@dataclass
class Served:
    """One request as a configuration served it (times are seconds after the trace started)."""

    arrival: float
    admitted: float | None = None
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    failed: str | None = None


@dataclass(frozen=True)
class Sample:
    """One step's state. ``running``: each configuration's own count of requests taken in (transformers' includes
    requests whose prompt it is still chunking or whose pages it dropped); ``decoding``: requests past their first
    token whose KV is held, the count every configuration measures the same way."""

    t: float
    running: int
    kv_bytes: int
    decoding: int


@dataclass(frozen=True)
class Latency:
    mean: float
    p50: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        """Mean, median and 99th percentile (linear between the order statistics, as numpy's default)."""
        if len(values) < 2:
            only = values[0] if values else float("nan")
            return cls(only, only, only)
        p99 = statistics.quantiles(values, n=100, method="inclusive")[98]
        return cls(statistics.fmean(values), statistics.median(values), p99)


@dataclass(frozen=True)
class ServeRow:
    """One configuration's figures.

    Each request's tokens are timed as they come (a streamer for static batches, the engines' own timestamps), and
    vLLM's metrics follow: completed and failed, request and output throughput, TTFT, TPOT, ITL and end-to-end
    latency (mean, p50, p99), goodput under an SLO; plus governance figures sampled every step (requests running,
    KV bytes in use, preemptions, recomputed tokens, swapped blocks, prefix hit rate, queue time), and the
    configuration's agreement with the full cache: the share of every request's greedy tokens that equal, from
    the start, those of the first lossless configuration run.
    """

    config: str
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    ttft: Latency
    tpot: Latency
    itl: Latency
    e2e: Latency
    queue: Latency
    goodput: float  # requests per second that met both SLOs
    running_max: int
    running_mean: float
    decoding_max: int  # requests decoding at once, counted alike for every configuration (see `Sample`)
    decoding_mean: float
    kv_bytes_max: int
    kv_bytes_mean: float
    preemptions: int | None  # None: the configuration does not say (transformers' own manager)
    recomputed_tokens: int | None
    prefix_hit_rate: float | None
    swapped_blocks: int | None  # blocks preemptions wrote to disk (None: the configuration does not swap)
    samples: tuple[Sample, ...]
    ttfts: tuple[float, ...]
    outputs: tuple[tuple[int, ...], ...]  # each request's tokens, in trace order
    # Against the run's first lossless configuration (None: it is that one, or none ran): the mean share of each
    # request's reference tokens it matched from the start, and the share of requests matched exactly.
    agreement: float | None = None
    exact_match: float | None = None
    reference: bool = False  # the row the others are compared with


@dataclass(frozen=True)
class ServeReport:
    model: str
    machine: str
    config: ServeConfig
    rows: tuple[ServeRow, ...]

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for row in self.rows:
            data = asdict(row)
            data.pop("outputs")
            rows.append(data)
        return {"model": self.model, "machine": self.machine, "config": asdict(self.config), "rows": rows}


# ------------------------------------------------------------------ the configurations


def kv_bytes_per_token(model: Any) -> int:
    config = decoder_config(model)
    kv_heads, head_dim = kv_heads_and_head_dim(config)
    element = next(model.parameters()).element_size()
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * element


def _run_engine(
    model: Any,
    trace: Sequence[TraceRequest],
    config: ServeConfig,
    prefix: bool,
    codec: str | None,
    bar: Any,
    swap: bool = False,
    policy: HeavyHitter | None = None,
) -> tuple:
    engine = ServingEngine(
        model,
        max_bytes=config.kv_bytes,
        block_size=config.block_size,
        prefix_sharing=prefix,
        max_batched_tokens=config.max_batched_tokens,
        codec=codec,
        spill=Disk() if swap else None,  # a private temporary directory, deleted when the engine closes
        policy=policy,
    )
    served = [Served(r.arrival) for r in trace]
    requests: dict[int, Any] = {}
    samples: list[Sample] = []
    pending = deque(trace)
    with engine:
        start = time.perf_counter()
        while pending or engine.has_work:
            now = time.perf_counter() - start
            while pending and pending[0].arrival <= now:
                item = pending.popleft()
                try:
                    request_id = engine.add_request(
                        item.prompt, SamplingParams(max_new_tokens=item.new_tokens, ignore_eos=True)
                    )
                except ValueError as error:  # larger than the whole pool: refused, counted as failed
                    served[item.index].failed = str(error)
                    bar.update()
                    continue
                request = engine.request(request_id)
                assert request is not None
                request.arrival = start + item.arrival  # the trace's arrival, not when the loop saw it
                requests[item.index] = request
            if not engine.has_work:
                if pending:
                    time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - start)))
                continue
            events = engine.step()
            stats = engine.stats()
            decoding = sum(1 for request in engine.scheduler.running if request.output)
            samples.append(Sample(time.perf_counter() - start, stats.running, stats.kv_bytes_used, decoding))
            bar.update(sum(event.finished for event in events))
        stats = engine.stats()
    for index, request in requests.items():
        record = served[index]
        record.admitted = None if request.admitted_at is None else request.admitted_at - start
        record.token_times = [t - start for t in request.token_times]
        record.tokens = list(request.output)
    swapped = stats.swapped_blocks if swap else None
    return served, samples, stats.preemptions, stats.recomputed_tokens, stats.prefix_hit_rate, swapped


def _run_static(model: Any, trace: Sequence[TraceRequest], config: ServeConfig, bar: Any) -> tuple:
    per_token = kv_bytes_per_token(model)
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else int(pad)
    served = [Served(r.arrival) for r in trace]
    samples: list[Sample] = []
    queue = deque(trace)
    start = time.perf_counter()
    while queue:
        now = time.perf_counter() - start
        if queue[0].arrival > now:
            time.sleep(queue[0].arrival - now)
            continue
        batch: list[TraceRequest] = []
        for item in queue:  # the longest run of arrived requests, in order, whose padded KV fits the cap
            if item.arrival > now:
                break
            candidate = [*batch, item]
            longest = max(len(r.prompt) for r in candidate) + max(r.new_tokens for r in candidate)
            if len(candidate) * longest * per_token > config.kv_bytes:
                break
            batch = candidate
        if not batch:  # the first request alone exceeds the cap
            item = queue.popleft()
            served[item.index].failed = "its KV alone exceeds the cap"
            bar.update()
            continue
        for _ in batch:
            queue.popleft()
        width = max(len(r.prompt) for r in batch)
        new = max(r.new_tokens for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        clock = TokenClock()
        admitted = time.perf_counter() - start
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache=DynamicCache(config=model.config),
            streamer=clock,
            eos_token_id=None,
            pad_token_id=pad,
        )
        steps = [t - start for t in clock.token_times]
        for step, t in enumerate(steps):
            samples.append(Sample(t, len(batch), len(batch) * (width + step + 1) * per_token, len(batch)))
        for row, item in enumerate(batch):
            record = served[item.index]
            record.admitted = admitted
            record.token_times = steps[: item.new_tokens]
            record.tokens = out[row, width : width + item.new_tokens].tolist()
        bar.update(len(batch))
    return served, samples, 0, 0, 0.0, None


def _run_transformers(model: Any, trace: Sequence[TraceRequest], config: ServeConfig, bar: Any) -> tuple:
    per_token = kv_bytes_per_token(model)
    num_blocks = config.kv_bytes // (config.block_size * per_token)
    batching = ContinuousBatchingConfig(
        page_size=config.block_size, num_blocks=num_blocks, max_batch_tokens=config.max_batched_tokens
    )
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.new_tokens for r in trace))
    served = [Served(r.arrival) for r in trace]
    samples: list[Sample] = []
    ids: dict[str, int] = {}
    pending = deque(trace)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
    manager.start()
    done = 0
    start = time.perf_counter()
    try:
        while done < len(trace):
            now = time.perf_counter() - start
            while pending and pending[0].arrival <= now:
                item = pending.popleft()
                request_id = manager.add_request(
                    item.prompt, max_new_tokens=item.new_tokens, record_timestamps=True, streaming=True
                )
                ids[request_id] = item.index
            wait = pending[0].arrival - now if pending else 1.0
            result = manager.get_result(timeout=max(0.001, min(wait, 1.0)))
            if result is None:
                continue
            processor = manager.batch_processor
            running = decoding = used = 0
            if processor is not None:
                active = list(processor.scheduler.active_requests.values())
                running = len(active)
                decoding = sum(1 for state in active if state.status == RequestStatus.DECODING)
                used = int((1 - processor.cache.compute_free_capacity()) * num_blocks * config.block_size * per_token)
            samples.append(Sample(time.perf_counter() - start, running, used, decoding))
            record = served[ids[result.request_id]]  # its queue time is the manager's own: not measured here
            if result.is_finished():
                record.tokens = list(result.generated_tokens)
                record.token_times = [t - start for t in (result.timestamps or [])]
                if result.error is not None:
                    record.failed = str(result.error)
                done += 1
                bar.update()
    finally:
        manager.stop(block=True)
    return served, samples, None, None, None, None  # what its cache did is not exposed


# ------------------------------------------------------------------ metrics


def summarize(
    name: str, served: Sequence[Served], samples: Sequence[Sample], extra: tuple, config: ServeConfig
) -> ServeRow:
    preemptions, recomputed, hit_rate, swapped = extra
    done = [s for s in served if s.failed is None and s.token_times]
    ttft = [s.token_times[0] - s.arrival for s in done]
    tpot = [(s.token_times[-1] - s.token_times[0]) / (len(s.token_times) - 1) for s in done if len(s.token_times) > 1]
    itl = [b - a for s in done for a, b in zip(s.token_times, s.token_times[1:], strict=False)]
    e2e = [s.token_times[-1] - s.arrival for s in done]
    queue = [s.admitted - s.arrival for s in done if s.admitted is not None]
    duration = max((s.token_times[-1] for s in done), default=0.0)
    per_token = [(s.token_times[-1] - s.token_times[0]) / max(1, len(s.token_times) - 1) for s in done]
    good = sum(
        1
        for first, each in zip(ttft, per_token, strict=True)
        if first <= config.slo_ttft_s and each <= config.slo_tpot_s
    )
    per_second = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return ServeRow(
        config=name,
        completed=len(done),
        failed=len(served) - len(done),
        duration_s=duration,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(sum(len(s.tokens) for s in done)),
        ttft=Latency.of(ttft),
        tpot=Latency.of(tpot),
        itl=Latency.of(itl),
        e2e=Latency.of(e2e),
        queue=Latency.of(queue),
        goodput=per_second(good),
        running_max=max((s.running for s in samples), default=0),
        running_mean=statistics.fmean(s.running for s in samples) if samples else 0.0,
        decoding_max=max((s.decoding for s in samples), default=0),
        decoding_mean=statistics.fmean(s.decoding for s in samples) if samples else 0.0,
        kv_bytes_max=max((s.kv_bytes for s in samples), default=0),
        kv_bytes_mean=statistics.fmean(s.kv_bytes for s in samples) if samples else 0.0,
        preemptions=preemptions,
        recomputed_tokens=recomputed,
        prefix_hit_rate=hit_rate,
        swapped_blocks=swapped,
        samples=tuple(samples),
        ttfts=tuple(ttft),
        outputs=tuple(tuple(s.tokens) for s in served),
    )


def run_serve(
    model: Any, tokenizer: Any, config: ServeConfig, model_name: str = "", progress: bool = True
) -> ServeReport:
    """Serve the trace with every configuration in `config.configs`, one after another, on the same model."""
    trace = build_trace(tokenizer, config.trace)
    rows: list[ServeRow] = []
    runners: dict[str, Callable[[Any], tuple]] = {
        "static": lambda bar: _run_static(model, trace, config, bar),
        "transformers": lambda bar: _run_transformers(model, trace, config, bar),
        "paged": lambda bar: _run_engine(model, trace, config, False, None, bar),
        "prefix": lambda bar: _run_engine(model, trace, config, True, None, bar),
        "int8": lambda bar: _run_engine(model, trace, config, True, "int8", bar),
        "h2o": lambda bar: _run_engine(model, trace, config, True, "int8", bar, policy=HeavyHitter(H2O_BUDGET)),
        "h2o-stream": lambda bar: _run_engine(model, trace, config, False, "int8", bar, policy=HeavyHitter(H2O_BUDGET)),
        "swap": lambda bar: _run_engine(model, trace, config, True, "int8", bar, swap=True),
    }

    def report() -> ServeReport:
        return ServeReport(model_name, machine_description(), config, with_agreement(rows))

    with on_interrupt(lambda: Interrupted(report(), Progress(len(rows), len(config.configs), "configurations"))):
        for name in config.configs:
            with tqdm(total=len(trace), desc=f"bench serve: {name}", unit="request", disable=not progress) as bar:
                served, samples, *extra = runners[name](bar)
            rows.append(summarize(name, served, samples, tuple(extra), config))
    return report()


def with_agreement(rows: Sequence[ServeRow]) -> tuple[ServeRow, ...]:
    """`rows` with each one's agreement with the first lossless configuration among them (see `ServeRow`)."""
    reference = next((row for name in LOSSLESS_CONFIGS for row in rows if row.config == name), None)
    if reference is None:
        return tuple(rows)
    agreed = []
    for row in rows:
        pairs = [(ours, full) for ours, full in zip(row.outputs, reference.outputs, strict=True) if ours and full]
        if row is reference or not pairs:
            agreed.append(replace(row, reference=row is reference))
            continue
        shares = [common_prefix(ours, full) / len(full) for ours, full in pairs]
        exact = sum(ours == full for ours, full in pairs) / len(pairs)
        agreed.append(replace(row, agreement=statistics.fmean(shares), exact_match=exact))
    return tuple(agreed)


def serve_markdown(report: ServeReport) -> str:
    c = report.config
    head = (
        f"Serving {c.trace.requests} requests ({c.trace.documents} documents of {c.trace.document_tokens} tokens, "
        f"Zipf {c.trace.zipf}; rate {c.trace.rate}/s, burstiness {c.trace.burstiness}; "
        f"{c.trace.min_new_tokens}-{c.trace.max_new_tokens} new tokens) under a KV cap of {c.kv_bytes / 2**20:.1f} "
        f"MiB on {report.model or 'the model'}; {report.machine}.\n\n"
    )
    lines = [
        "| config | done | failed | req/s | out tok/s | TTFT p50 / p99 s | TPOT p50 / p99 s | ITL p99 s | E2E p50 s "
        "| queue mean s | goodput req/s | running max / mean | decoding max / mean | KV MiB max | preempted "
        "| recomputed | swapped blocks | prefix hits | agrees with full |",
        "| --- |" + " ---: |" * 18,
    ]
    for r in report.rows:
        lines.append(
            f"| {r.config} | {r.completed} | {r.failed} | {r.request_throughput:.2f} | {r.output_throughput:.1f} "
            f"| {r.ttft.p50:.2f} / {r.ttft.p99:.2f} | {r.tpot.p50:.3f} / {r.tpot.p99:.3f} | {r.itl.p99:.3f} "
            f"| {r.e2e.p50:.2f} | {_or_na(r.queue.mean, '{:.2f}')} | {r.goodput:.2f} "
            f"| {r.running_max} / {r.running_mean:.1f} "
            f"| {r.decoding_max} / {r.decoding_mean:.1f} | {r.kv_bytes_max / 2**20:.1f} | {_or_na(r.preemptions)} "
            f"| {_or_na(r.recomputed_tokens)} "
            f"| {_or_na(r.swapped_blocks)} | {_or_na(r.prefix_hit_rate, '{:.0%}')} "
            f"| {_agreement(r)} |"
        )
    return head + "\n".join(lines) + "\n"


def _agreement(row: ServeRow) -> str:
    if row.reference:
        return "reference"
    return f"{_or_na(row.agreement, '{:.0%}')} ({_or_na(row.exact_match, '{:.0%}')} exact)"


def _or_na(value: float | None, form: str = "{}") -> str:
    """`value` in `form`, or n/a where there is none (None, or NaN: no request gave a figure)."""
    return "n/a" if value is None or math.isnan(value) else form.format(value)
