"""TTFT of a document-QA request whose document comes from the Redis prefix tier, against a miss and a local hit.

Each round, on SmolLM2 (fp32) and a throwaway `redis-server` on loopback (or `--url`), with a fresh tenant
namespace so nothing earlier counts:

    miss         a fresh pool and tree, an empty store: the whole prompt is computed (the lookup finds nothing)
    no tier      the same miss without any remote tier: what the lookup's round trip costs a miss
    remote hit   a fresh pool and tree (a new process, as far as sharing goes) after the miss published: the
                 document's blocks come from the store in one round trip, the question is computed
    local hit    the same tree again, another question: the document is already in the pool

TTFT is from `match` to the first generated token (prefill of what is not cached + the first decode step);
every pool is preallocated beforehand, as a serving process's is.
Medians over `--rounds`; the remote hit's round trip and bytes read are the tier's own counters.

    OMP_NUM_THREADS=1 python eval/bench_remote_prefix.py --document-chars 4000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from hf_kvgov import BlockPool, PagedCache
from hf_kvgov.bench.prefix_qa import QUESTIONS, _FirstTokenTimer
from hf_kvgov.bench.timing import machine_description
from hf_kvgov.data_text import demo_text
from hf_kvgov.models import load_model
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.redis_tier import RedisTier


def ttft(model: Any, prefix: PrefixCache | None, ids: torch.Tensor, pool: BlockPool) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens served from the cache) of one request, then publish it."""
    cache = PagedCache(model, pool=pool, prefix=prefix)
    timer = _FirstTokenTimer()
    start = time.perf_counter()
    inputs = cache.match(ids) if prefix is not None else {"input_ids": ids}
    reused = cache.get_seq_length()
    with torch.inference_mode():
        out = model.generate(**inputs, cache=cache, max_new_tokens=2, do_sample=False, streamer=timer)
    assert timer.first_token_at is not None
    if prefix is not None:
        cache.publish(out)
    cache.release()
    return timer.first_token_at - start, reused


def one_round(model: Any, tokenizer: Any, document: str, url: str, geometry: Any, block_size: int) -> dict[str, Any]:
    space = uuid.uuid4().hex
    prompts = [tokenizer(f"{document}\n\n{q}\nAnswer:", return_tensors="pt")["input_ids"] for q in QUESTIONS[:3]]
    room = 4 * int(prompts[0].shape[1]) + 4 * block_size

    def pool() -> BlockPool:  # preallocated, as a serving process's pool is: no request pays for its growth
        return BlockPool(geometry, block_size=block_size, max_tokens=room, preallocate=True)

    def fresh() -> PrefixCache:
        return PrefixCache(pool(), remote=RedisTier(url, model, namespace=space))

    no_tier, _ = ttft(model, None, prompts[0], pool())
    writer = fresh()
    miss, _ = ttft(model, writer, prompts[0], writer.pool)
    assert writer.remote is not None and writer.remote.flush(60)
    reader = fresh()
    remote_hit, remote_reused = ttft(model, reader, prompts[1], reader.pool)
    local_hit, local_reused = ttft(model, reader, prompts[2], reader.pool)
    stats = reader.stats().remote
    assert stats is not None and stats.hits == 1
    for prefix in (writer, reader):
        prefix.close()
    return {
        "prompt_tokens": int(prompts[1].shape[1]),
        "no_tier_s": no_tier,
        "miss_s": miss,
        "remote_hit_s": remote_hit,
        "local_hit_s": local_hit,
        "remote_reused": remote_reused,
        "local_reused": local_reused,
        "remote_rtt_ms": stats.rtt_mean_ms,
        "remote_bytes": stats.bytes_read,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--document-chars", type=int, default=4000)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--url", help="a Redis to use (default: start a throwaway redis-server on loopback)")
    parser.add_argument("--json", help="also write the rounds and medians here")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    geometry = PagedCache(model).pool.geometry  # type: ignore[union-attr]
    document = demo_text(max_chars=args.document_chars)
    print(f"{args.model}, {model.dtype}; {machine_description()}")
    server = None if args.url else LocalRedis().start()
    url = args.url or server.url  # type: ignore[union-attr]
    try:
        ttft(model, None, tokenizer("Warm-up.", return_tensors="pt")["input_ids"], BlockPool(geometry))
        rounds = [one_round(model, tokenizer, document, url, geometry, args.block_size) for _ in range(args.rounds)]
    finally:
        if server is not None:
            server.stop()
    medians = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    m = medians
    print(f"prompt {m['prompt_tokens']:.0f} tokens ({args.document_chars:,}-character document), {len(rounds)} rounds")
    print(f"{'request':<12} {'TTFT':>9} {'reused':>7}")
    for name, key, reused in (
        ("no tier", "no_tier_s", 0), ("miss", "miss_s", 0),
        ("remote hit", "remote_hit_s", m["remote_reused"]), ("local hit", "local_hit_s", m["local_reused"]),
    ):  # fmt: skip
        print(f"{name:<12} {1000 * m[key]:>7.1f}ms {reused:>7.0f}")
    print(
        f"remote hit: {m['miss_s'] / m['remote_hit_s']:.1f}x faster than a miss; its read: one round trip of "
        f"{m['remote_rtt_ms']:.1f} ms for {m['remote_bytes'] / 2**20:.1f} MiB"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "medians": medians}, indent=2) + "\n")


if __name__ == "__main__":
    main()
