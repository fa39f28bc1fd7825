"""Keys that cannot collide: tenants, models, dtypes and layouts never share a block; the chain is deterministic."""

from __future__ import annotations

import redis
import torch

from hf_kvgov import BlockPool
from hf_kvgov.storage.geometry import KVGeometry
from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.remote_keys import chain_keys, model_identity, tier_salt
from tests.prefix_remote.serving import BLOCK, DOCUMENT, model, question, reference, remote_prefix, serve

NET = model()
FULL = len(DOCUMENT) // BLOCK * BLOCK  # what a question's request reuses when the whole document is shared


def test_two_tenants_never_read_each_other(redis_server: LocalRedis) -> None:
    serve(NET, writer := remote_prefix(NET, redis_server.url, "tenant-a"), DOCUMENT + question(0))
    assert writer.remote is not None and writer.remote.flush(10)
    other = remote_prefix(NET, redis_server.url, "tenant-b")
    prompt = DOCUMENT + question(1)
    served = serve(NET, other, prompt)
    assert served.reused == 0 and served.new_tokens == reference(NET, prompt)
    stats = other.stats().remote
    assert stats is not None and stats.lookups == 1 and stats.hits == 0
    assert serve(NET, remote_prefix(NET, redis_server.url, "tenant-a"), prompt).reused == FULL


def test_tree_namespaces_are_kept_apart_in_the_store(redis_server: LocalRedis) -> None:
    writer = remote_prefix(NET, redis_server.url)
    serve(NET, writer, DOCUMENT + question(0), namespace="chat")
    assert writer.remote is not None and writer.remote.flush(10)
    assert serve(NET, remote_prefix(NET, redis_server.url), DOCUMENT + question(1), namespace="code").reused == 0
    assert serve(NET, remote_prefix(NET, redis_server.url), DOCUMENT + question(1), namespace="chat").reused == FULL


def test_two_models_never_share_keys(redis_server: LocalRedis) -> None:
    writer = remote_prefix(NET, redis_server.url)
    serve(NET, writer, DOCUMENT + question(0))
    assert writer.remote is not None and writer.remote.flush(10)
    other_net = model(seed=4)  # the same config, other weights
    assert model_identity(other_net) != model_identity(NET) == model_identity(model())
    prompt = DOCUMENT + question(1)
    served = serve(other_net, remote_prefix(other_net, redis_server.url), prompt)
    assert served.reused == 0 and served.new_tokens == reference(other_net, prompt)


def test_dtype_block_size_and_layout_change_every_key() -> None:
    geometry = KVGeometry(2, 2, 16)
    salts = {
        tier_salt("m", BlockPool(geometry, block_size=8), ""),
        tier_salt("m", BlockPool(KVGeometry(2, 2, 16, dtype=torch.float16), block_size=8), ""),
        tier_salt("m", BlockPool(geometry, block_size=16), ""),
        tier_salt("m", BlockPool(KVGeometry(2, 1, 16), block_size=8), ""),
        tier_salt("other", BlockPool(geometry, block_size=8), ""),
        tier_salt("m", BlockPool(geometry, block_size=8), "tenant"),
    }
    assert len(salts) == 6


def test_chain_keys_are_fixed_sha256_chains() -> None:
    keys = chain_keys(b"\x00" * 32, "", list(range(8)), 4)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert keys == chain_keys(b"\x00" * 32, "", [*range(8), 1, 2], 4)  # a partial tail has no key
    assert keys[0] == chain_keys(b"\x00" * 32, "", list(range(4)), 4)[0]
    assert chain_keys(b"\x00" * 32, "", [9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != keys[1]  # the parent is in the key
    assert keys[1].hex()[:16] == "8715954dfb61e1ae"  # never Python's hash(): the same in every process


def test_a_block_deleted_by_another_client_ends_the_hit(redis_server: LocalRedis) -> None:
    writer = remote_prefix(NET, redis_server.url)
    serve(NET, writer, DOCUMENT + question(0))
    assert writer.remote is not None and writer.remote.flush(10)
    redis.Redis.from_url(redis_server.url).delete(b"kvgov::" + writer.remote.keys(DOCUMENT)[9].hex().encode())
    prompt = DOCUMENT + question(1)
    served = serve(NET, remote_prefix(NET, redis_server.url), prompt)
    assert served.reused == 9 * BLOCK and served.new_tokens == reference(NET, prompt)


def test_ttl_is_set_on_every_block(redis_server: LocalRedis) -> None:
    writer = remote_prefix(NET, redis_server.url, ttl_s=60)
    serve(NET, writer, DOCUMENT + question(0))
    assert writer.remote is not None and writer.remote.flush(10)
    client = redis.Redis.from_url(redis_server.url)
    keys = list(client.scan_iter(match=b"kvgov:*"))
    assert keys and all(0 < client.ttl(key) <= 60 for key in keys)
