"""Engines in two processes' place sharing a document through a real Redis on loopback: the second engine's request
finds the first one's blocks in the store, computes only its question, and answers as it would alone."""

from __future__ import annotations

import pytest
import redis as redis_client

from hf_kvgov.serving import SamplingParams, ServingEngine, install, uninstall
from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.redis_tier import RedisTier
from tests.conftest import tiny_llama
from tests.prefix_remote.conftest import redis_server  # noqa: F401 - the fixture
from tests.serving.test_engine import alone, prompts_with_shared_prefix


def test_a_second_engine_reads_the_document_from_the_remote_tier(redis_server: LocalRedis) -> None:  # noqa: F811
    first, second = prompts_with_shared_prefix(96, (5, 9), shared=37)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    writer_model = tiny_llama()
    with ServingEngine(writer_model, block_size=4, remote=RedisTier(redis_server.url, writer_model)) as engine:
        engine.generate([first], params)
        assert engine.prefix is not None and engine.prefix.remote is not None and engine.prefix.remote.flush(10)
    reader_model = tiny_llama()  # another process's copy of the same weights
    expected = alone(reader_model, second, 12)
    with ServingEngine(reader_model, block_size=4, remote=RedisTier(redis_server.url, reader_model)) as engine:
        assert engine.generate([second], params) == [expected]
        stats = engine.stats()
        assert stats.prefix_hit_tokens == 36  # the document's nine whole blocks, none computed here
        assert engine.prefix is not None and engine.prefix.stats().remote.hits > 0  # type: ignore[union-attr]


def test_a_remote_tier_needs_prefix_sharing(redis_server: LocalRedis) -> None:  # noqa: F811
    model = tiny_llama()
    tier = RedisTier(redis_server.url, model)
    with pytest.raises(ValueError, match="needs prefix_sharing=True"):
        ServingEngine(model, prefix_sharing=False, remote=tier)
    tier.close()


def test_install_opens_a_tier_per_engine_from_a_redis_url(redis_server: LocalRedis) -> None:  # noqa: F811
    """generate_batch builds an engine per call, and each engine closes its tier when it stops: install takes the URL
    and each engine opens its own tier, so a second call reads what the first published."""
    first, second = prompts_with_shared_prefix(96, (5, 9), shared=37)
    model = tiny_llama()
    with pytest.raises(ValueError, match=r"takes redis_url=.* instead of remote="):
        install(model, remote=RedisTier(redis_server.url, model))
    install(model, block_size=4, redis_url=redis_server.url)
    try:
        model.generate_batch([first], max_new_tokens=6)
        expected = alone(model, second, 6)
        out = model.generate_batch([second], max_new_tokens=6)
        (result,) = out.values()
        assert list(result.generated_tokens) == expected
        store = redis_client.Redis.from_url(redis_server.url)
        assert len(store.keys(b"kvgov:*")) >= 9  # the document's nine whole blocks, published through the tier
        store.close()
    finally:
        uninstall(model)
