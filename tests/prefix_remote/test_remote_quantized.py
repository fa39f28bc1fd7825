"""The remote tier under a QuantizedCache: sealed blocks travel as their codes and scales, bit for bit, so a
request served from the store reads exactly what a request served from the local tree reads."""

from __future__ import annotations

from typing import Any

import pytest
import redis
import torch

from hf_kvgov.hf.quantized_cache import QuantizedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool
from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.redis_tier import RedisTier
from hf_kvgov.tiers.remote_values import SEALED
from tests.prefix_remote.serving import BLOCK, DOCUMENT, NEW, model, question

NET = model()
CODECS: dict[str, dict[str, Any]] = {"int8": {"bits": 8}, "int4": {"bits": 4}, "fp8": {"bits": 8, "fmt": "fp8"}}


def quantized_prefix(url: str | None, codec: str) -> PrefixCache:
    owner = QuantizedCache(NET, block_size=BLOCK, **CODECS[codec])
    assert isinstance(owner.pool, QuantizedBlockPool)
    return PrefixCache(owner.pool, remote=None if url is None else RedisTier(url, NET))


def serve(prefix: PrefixCache, prompt: list[int], codec: str) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(tokens reused, new tokens, logits) of one request through a QuantizedCache on `prefix`."""
    cache = QuantizedCache(NET, block_size=BLOCK, prefix=prefix, **CODECS[codec])
    inputs = cache.match(torch.tensor([prompt]))
    reused = cache.get_seq_length()
    out: Any = NET.generate(
        **inputs, cache=cache, max_new_tokens=NEW, do_sample=False,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    cache.publish(out.sequences)
    cache.release()
    prefix.check_invariants()
    return reused, out.sequences[0, -NEW:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_codes_travel_and_serve_as_the_local_tree_does(redis_server: LocalRedis, codec: str) -> None:
    local = quantized_prefix(None, codec)  # the reference: the same request served by a warm local tree
    serve(local, DOCUMENT + question(0), codec)
    writer = quantized_prefix(redis_server.url, codec)
    serve(writer, DOCUMENT + question(0), codec)
    assert writer.remote is not None and writer.remote.flush(10)

    client = redis.Redis.from_url(redis_server.url)
    kinds = [client.getrange(key, 5, 5)[0] for key in client.scan_iter(match=b"kvgov:*")]
    assert kinds.count(SEALED) >= len(DOCUMENT) // BLOCK - 1  # every block but the full-precision sink
    stats = writer.stats().remote
    assert stats is not None
    raw_block = 2 * NET.config.num_hidden_layers * BLOCK * 2 * 16 * 4  # K and V, fp32
    assert stats.bytes_written < stats.blocks_written * raw_block / 2  # codes, not decoded floats

    reader = quantized_prefix(redis_server.url, codec)
    prompt = DOCUMENT + question(1)
    remote_hit = serve(reader, prompt, codec)
    local_hit = serve(local, prompt, codec)
    assert remote_hit[0] == local_hit[0] == len(DOCUMENT) // BLOCK * BLOCK
    assert torch.equal(remote_hit[1], local_hit[1])
    torch.testing.assert_close(remote_hit[2], local_hit[2], atol=1e-6, rtol=1e-6)
    pool = reader.pool
    assert isinstance(pool, QuantizedBlockPool) and pool.sealed_stats().used_blocks >= len(DOCUMENT) // BLOCK - 1
