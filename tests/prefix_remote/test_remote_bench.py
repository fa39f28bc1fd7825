"""`kvgov bench prefix --remote`'s scenario on a pool of worker processes sharing one Redis (timings are not
asserted): request 0 computes the document on worker 0; worker 1's first request loads it from the store."""

from __future__ import annotations

from transformers import DynamicCache

from hf_kvgov.bench import prefix_remote
from hf_kvgov.tiers.local_redis import LocalRedis
from tests.prefix_remote.serving import tiny_worker


def test_workers_share_the_document_through_the_store(redis_server: LocalRedis) -> None:
    document = "Netherfield Park is let at last. " * 6  # 198 characters, 1 token each
    asks = [f"Question {i}: who?" for i in range(4)]
    report = prefix_remote.run_remote(tiny_worker, redis_server.url, document, asks, workers=2, new_tokens=3)
    assert [(r.worker, r.kind) for r in report.requests] == [
        (0, "miss"), (1, "remote hit"), (0, "local hit"), (1, "local hit"),
    ]  # fmt: skip
    common = (len(document) + len("\n\nQuestion ")) // 16 * 16  # whole blocks every prompt shares
    remote = report.requests[1]
    assert remote.reused_tokens == common
    assert (remote.prompt_tokens - remote.reused_tokens) / remote.prompt_tokens <= 0.15  # fed of its prompt
    model, tokenizer = tiny_worker()
    for served, ask in zip(report.requests, asks, strict=True):  # the tokens of a run without sharing
        ids = tokenizer(f"{document}\n\n{ask}\nAnswer:", return_tensors="pt")["input_ids"]
        out = model.generate(ids, cache=DynamicCache(), max_new_tokens=3, do_sample=False)
        assert served.tokens == tuple(out[0, -3:].tolist())
    stats = report.remote
    assert stats["blocks_written"] > 0 and stats["blocks_read"] == common // 16
    assert stats["dropped_writes"] == stats["damaged_values"] == stats["connection_failures"] == 0
    assert "remote hit" in prefix_remote.render(report)
