"""Document QA: many requests ask different questions about one document (the brief's §3 scenario).

Each request is `document + question`. Without prefix sharing every request computes and stores the
document's KV; with it, the document's blocks are computed by the first request and shared by the rest.

Measured per mode, requests served one after another (as a server's worker would):
- time to first token (prefill of what is not cached + the first decode step), mean and p50;
- prompt tokens computed vs served from the cache (hit rate);
and, with every request's cache held at once (N concurrent users), the KV bytes held in the pool.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.partial import Interrupted, Progress, on_interrupt
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool

QUESTIONS = (
    "Who is the new tenant of Netherfield Park?",
    "What does Mrs. Bennet want her husband to do?",
    "How many daughters do the Bennets have?",
    "What is Mr. Bingley's yearly income said to be?",
    "Which daughter does Mr. Bennet favour, and why?",
    "Where does Mr. Bingley come from?",
    "What is Mrs. Bennet's temper like?",
    "When is Mr. Bingley expected to take possession?",
    "Who tells Mrs. Bennet the news about Netherfield?",
    "What is the business of Mrs. Bennet's life?",
)


@dataclass(frozen=True)
class ModeResult:
    mode: str
    requests: int
    ttft_first_s: float  # the first request: always a miss
    ttft_rest_mean_s: float  # the others: hits when sharing
    ttft_p50_s: float
    seconds_total: float
    prompt_tokens: int
    tokens_computed: int
    tokens_reused: int
    kv_bytes_concurrent: int
    kv_bytes_ideal: int  # one document + every request's question and answer, no rounding

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds_total


class _FirstTokenTimer(BaseStreamer):
    """generate calls put() with the prompt first, then with each new token: the 2nd call is the first token."""

    def __init__(self) -> None:
        self.calls = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class PrefixReport:
    """Both modes (or, after Ctrl-C, those finished) on one document."""

    model: str
    document_chars: int
    rows: tuple[ModeResult, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "document_chars": self.document_chars, "rows": [asdict(r) for r in self.rows]}


def run_prefix(
    model: Any, tokenizer: Any, document: str, asks: list[str], new_tokens: int, block_size: int, model_name: str = ""
) -> PrefixReport:
    """Serve ``asks`` without, then with prefix sharing.

    On Ctrl-C raises `hf_kvgov.partial.Interrupted` with the report of the modes finished.
    """
    rows: list[ModeResult] = []

    def report() -> PrefixReport:
        return PrefixReport(model_name, len(document), tuple(rows))

    with on_interrupt(lambda: Interrupted(report(), Progress(len(rows), 2, "modes"))):
        for share in (False, True):
            rows.append(run_mode(model, tokenizer, document, asks, share, new_tokens, block_size))
    return report()


def questions(count: int) -> list[str]:
    return [f"Question {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(count)]


def run_mode(
    model: Any, tokenizer: Any, document: str, asks: list[str], share: bool, new_tokens: int, block_size: int = 16
) -> ModeResult:
    probe = PagedCache(model)
    assert probe.pool is not None
    pool = BlockPool(probe.pool.geometry, block_size=block_size)
    prefix = PrefixCache(pool) if share else None
    ttfts, computed, reused, held, prompt_tokens = [], 0, 0, [], 0
    document_tokens = len(tokenizer(f"{document}\n\n")["input_ids"])
    ideal_tokens = document_tokens
    began = time.perf_counter()
    for ask in asks:
        ids = tokenizer(f"{document}\n\n{ask}\nAnswer:", return_tensors="pt")["input_ids"]
        cache = PagedCache(model, pool=pool, prefix=prefix)
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        inputs = cache.match(ids) if prefix is not None else {"input_ids": ids}
        hit = cache.get_seq_length()
        with torch.inference_mode():
            out = model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False, streamer=timer)
        assert timer.first_token_at is not None
        ttfts.append(timer.first_token_at - start)
        if prefix is not None:
            cache.publish(out)
        prompt_tokens += ids.shape[1]
        computed += ids.shape[1] - hit
        reused += hit
        ideal_tokens += cache.get_seq_length() - document_tokens
        held.append(cache)  # every request stays resident: N concurrent users
    seconds = time.perf_counter() - began
    kv_bytes = pool.num_used * pool.bytes_per_block
    for cache in held:
        cache.release()
    return ModeResult(
        mode="prefix sharing" if share else "no sharing",
        requests=len(asks),
        ttft_first_s=ttfts[0],
        ttft_rest_mean_s=statistics.fmean(ttfts[1:] or ttfts),
        ttft_p50_s=statistics.median(ttfts),
        seconds_total=seconds,
        prompt_tokens=prompt_tokens,
        tokens_computed=computed,
        tokens_reused=reused,
        kv_bytes_concurrent=kv_bytes,
        kv_bytes_ideal=ideal_tokens * pool.bytes_per_block // pool.block_size,
    )


def render(results: list[ModeResult], document_chars: int) -> str:
    lines = [
        f"document: {document_chars:,} characters, {results[0].requests} requests (all held at once for KV bytes)",
        f"{'mode':<15} {'TTFT 1st':>9} {'TTFT rest':>10} {'req/s':>6} {'computed':>9} {'reused':>8} {'hit rate':>9} "
        f"{'KV held':>13} {'vs ideal':>9}",
    ]
    for r in results:
        lines.append(
            f"{r.mode:<15} {r.ttft_first_s:>8.3f}s {r.ttft_rest_mean_s:>9.3f}s {r.requests_per_s:>6.2f} "
            f"{r.tokens_computed:>9,} {r.tokens_reused:>8,} {r.tokens_reused / r.prompt_tokens:>9.1%} "
            f"{r.kv_bytes_concurrent:>13,} {r.kv_bytes_concurrent / r.kv_bytes_ideal:>8.2f}x"
        )
    if len(results) == 2:
        base, shared = results
        lines.append(
            f"sharing: TTFT of a hit = {shared.ttft_rest_mean_s / base.ttft_rest_mean_s:.2f}x a miss's, "
            f"throughput x{shared.requests_per_s / base.requests_per_s:.2f}, "
            f"KV held x{shared.kv_bytes_concurrent / base.kv_bytes_concurrent:.2f}"
        )
    return "\n".join(lines)
