"""Document QA across worker processes that share prefixes through a remote tier (`kvgov bench prefix --remote`).

Each of N worker processes builds its own pool and `PrefixCache` over one `RedisTier` (a fresh tenant namespace
per run, so earlier runs' blocks never count). The first request, served alone, computes and publishes the
document; the others are served by all workers at once, each classified by where its prefix came from::

    miss        nothing cached: the whole prompt was computed
    remote hit  the worker's tree lacked the document and loaded it from the store
    local hit   the worker's own tree already held it (an earlier request of the same worker)

The report gives TTFT, tokens computed and reused per kind, and the tier's counters summed over workers.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from hf_kvgov.bench.prefix_qa import _FirstTokenTimer
from hf_kvgov.hf.paged_cache import PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.redis_tier import RedisTier
from hf_kvgov.tiers.remote_stats import COUNTED

# Builds (model, tokenizer) in a worker process; must be picklable (a module-level function, or a partial of one).
Loader = Callable[[], tuple[Any, Any]]


@dataclass(frozen=True)
class Served:
    request: int
    worker: int
    kind: str  # "miss", "remote hit" or "local hit"
    ttft_s: float
    prompt_tokens: int
    reused_tokens: int
    tokens: tuple[int, ...]  # what generate produced after the prompt


@dataclass(frozen=True)
class RemoteReport:
    model: str
    workers: int
    document_chars: int
    requests: tuple[Served, ...]
    remote: dict[str, int]  # the tiers' counters, summed over workers

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "requests": [asdict(r) for r in self.requests]}


class _Worker:
    """One process's model, pool and tree over the shared store."""

    def __init__(self, load: Loader, url: str, namespace: str, block_size: int, threads: int) -> None:
        torch.set_num_threads(threads)
        self.model, self.tokenizer = load()
        geometry = PagedCache(self.model).pool.geometry  # type: ignore[union-attr]
        self.tier = RedisTier(url, self.model, namespace=namespace)
        self.prefix = PrefixCache(BlockPool(geometry, block_size=block_size), remote=self.tier)
        self._warm_up()

    def _warm_up(self) -> None:
        """One short request outside the tree: a process's first forward pays one-off costs no request should."""
        ids = self.tokenizer("Warm-up.", return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            self.model.generate(ids, cache=PagedCache(self.model), max_new_tokens=2, do_sample=False)

    def serve(self, request: int, worker: int, prompt: str, new_tokens: int) -> Served:
        ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        cache = PagedCache(self.model, pool=self.prefix.pool, prefix=self.prefix)
        read_before = self.tier.stats().blocks_read
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        inputs = cache.match(ids)
        reused = cache.get_seq_length()
        with torch.inference_mode():
            out = self.model.generate(**inputs, cache=cache, max_new_tokens=new_tokens, do_sample=False, streamer=timer)
        assert timer.first_token_at is not None
        ttft = timer.first_token_at - start
        cache.publish(out)
        cache.release()
        self.tier.flush(30)  # the next request, in any process, may look for these blocks
        from_store = self.tier.stats().blocks_read > read_before
        kind = "remote hit" if from_store else "local hit" if reused else "miss"
        new = tuple(out[0, -new_tokens:].tolist())
        return Served(request, worker, kind, ttft, int(ids.shape[1]), reused, new)


def _work(load: Loader, url: str, namespace: str, block_size: int, threads: int, tasks: Any, results: Any) -> None:
    """A worker process: build the worker, say so (None), then serve each task until it gets None."""
    worker = _Worker(load, url, namespace, block_size, threads)
    results.put(None)
    for request, index, prompt, new_tokens in iter(tasks.get, None):
        served = worker.serve(request, index, prompt, new_tokens)
        stats = worker.tier.stats().as_dict()
        results.put((served, {name: int(stats[name]) for name in COUNTED}))  # type: ignore[call-overload]
    worker.prefix.close()


class _Workers:
    """N worker processes, each with its own task queue, so which worker serves which request is fixed."""

    def __init__(self, count: int, load: Loader, url: str, namespace: str, block_size: int) -> None:
        context = multiprocessing.get_context("spawn")  # a fresh interpreter per worker, as separate servers are
        threads = max(1, (os.cpu_count() or 1) // count)
        self.results = context.Queue()
        self.tasks = [context.Queue() for _ in range(count)]
        self.processes = [
            context.Process(target=_work, args=(load, url, namespace, block_size, threads, tasks, self.results))
            for tasks in self.tasks
        ]
        for process in self.processes:
            process.start()
        for _ in self.processes:
            self._get()  # every worker is ready: no start-up is timed

    def _get(self) -> Any:
        while True:
            try:
                return self.results.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in self.processes):
                    raise RuntimeError("A benchmark worker process died; run with --workers 1 to see why.") from None

    def serve(self, requests: list[tuple[int, str]], new_tokens: int) -> list[tuple[Served, dict[str, int]]]:
        """Serve (request index, prompt) pairs, request i on worker i % N, all workers at once."""
        for request, prompt in requests:
            worker = request % len(self.tasks)
            self.tasks[worker].put((request, worker, prompt, new_tokens))
        return [self._get() for _ in requests]

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


def run_remote(
    load: Loader,
    url: str,
    document: str,
    asks: list[str],
    workers: int,
    new_tokens: int,
    block_size: int = 16,
    model_name: str = "",
    namespace: str | None = None,
) -> RemoteReport:
    """Serve `asks` about `document` on `workers` processes sharing the store at `url` (see the module docstring)."""
    if workers < 1:
        raise ValueError(f"--workers must be at least 1; got {workers}.")
    if len(asks) < 2:
        raise ValueError(f"A remote run needs at least 2 requests (one publishes, the rest hit); got {len(asks)}.")
    space = namespace if namespace is not None else f"bench-{uuid.uuid4().hex[:12]}"
    prompts = list(enumerate(f"{document}\n\n{ask}\nAnswer:" for ask in asks))
    pool = _Workers(workers, load, url, space, block_size)
    try:
        results = pool.serve(prompts[:1], new_tokens)  # request 0 computes the document and publishes it
        results += pool.serve(prompts[1:], new_tokens)
    finally:
        pool.close()
    final: dict[int, dict[str, int]] = {}  # counters only grow: a worker's final ones are the largest it reported
    for served, stats in results:
        mine = final.setdefault(served.worker, dict.fromkeys(COUNTED, 0))
        mine.update({name: max(mine[name], stats[name]) for name in COUNTED})
    summed = {name: sum(stats[name] for stats in final.values()) for name in COUNTED}
    requests = tuple(sorted((s for s, _ in results), key=lambda s: s.request))
    return RemoteReport(model_name, workers, len(document), requests, summed)


def render(report: RemoteReport) -> str:
    lines = [
        f"document: {report.document_chars:,} characters, {len(report.requests)} requests on {report.workers} "
        "worker processes sharing one Redis",
        f"{'kind':<11} {'requests':>8} {'TTFT mean':>10} {'TTFT p50':>9} {'computed':>9} {'reused':>8}",
    ]
    for kind in ("miss", "remote hit", "local hit"):
        rows = [r for r in report.requests if r.kind == kind]
        if not rows:
            continue
        ttfts = [r.ttft_s for r in rows]
        computed = sum(r.prompt_tokens - r.reused_tokens for r in rows)
        lines.append(
            f"{kind:<11} {len(rows):>8} {statistics.fmean(ttfts):>9.3f}s {statistics.median(ttfts):>8.3f}s "
            f"{computed:>9,} {sum(r.reused_tokens for r in rows):>8,}"
        )
    r = report.remote
    lines.append(
        f"store: {r['blocks_written']} blocks written ({r['bytes_written']:,} B), {r['blocks_read']} read "
        f"({r['bytes_read']:,} B), {r['dropped_writes']} dropped, {r['damaged_values']} damaged, "
        f"{r['connection_failures']} connection failures"
    )
    return "\n".join(lines)
