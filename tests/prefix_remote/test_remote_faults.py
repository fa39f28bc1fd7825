"""The remote tier under failure: every request completes with the tokens of a run without sharing, and the
counters say what happened. Two trees over two pools stand for two processes (see test_remote_processes)."""

from __future__ import annotations

import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis
import torch

from hf_kvgov import BlockPool, PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.redis_tier import Fetched, RedisTier
from hf_kvgov.tiers.remote_stats import RemoteCounters
from hf_kvgov.tiers.remote_values import BlockSnapshot, snapshot
from hf_kvgov.tiers.remote_writer import RemoteWriter
from tests.prefix_remote.serving import BLOCK, DOCUMENT, model, question, reference, remote_prefix, serve

NET = model()
BLOCKS = len(DOCUMENT) // BLOCK  # full blocks of the document: the most a question's request can reuse


def published(url: str, **options: object) -> None:
    """Process A: serve the document once and wait until its blocks are in the store."""
    prefix = remote_prefix(NET, url, **options)  # type: ignore[arg-type]
    serve(NET, prefix, DOCUMENT + question(0))
    assert prefix.remote is not None and prefix.remote.flush(10)
    prefix.close()


def stored_keys(url: str) -> list[bytes]:
    return sorted(redis.Redis.from_url(url).scan_iter(match=b"kvgov:*"))


def test_a_damaged_value_is_dropped_counted_and_recomputed(redis_server: LocalRedis) -> None:
    published(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    prefix = remote_prefix(NET, redis_server.url)
    keys = prefix.remote.keys(DOCUMENT)  # type: ignore[union-attr]
    damaged = b"kvgov::" + keys[5].hex().encode()
    client.setrange(damaged, 100, b"\xff\x00\xff")  # flip bytes inside the payload
    prompt = DOCUMENT + question(1)
    served = serve(NET, prefix, prompt)
    assert served.reused == 5 * BLOCK  # the chain ends before the damaged block
    assert served.new_tokens == reference(NET, prompt)
    stats = prefix.stats().remote
    assert stats is not None and stats.damaged_values == 1 and stats.blocks_read == 5 and "damaged" in stats.last_error
    assert prefix.remote.flush(10)  # type: ignore[union-attr]
    assert client.exists(damaged)  # deleted on detection, then stored again by this request's publish
    fresh = remote_prefix(NET, redis_server.url)
    assert serve(NET, fresh, prompt).reused == BLOCKS * BLOCK


def test_a_value_stored_under_another_key_is_damaged(redis_server: LocalRedis) -> None:
    published(redis_server.url)
    client = redis.Redis.from_url(redis_server.url)
    prefix = remote_prefix(NET, redis_server.url)
    names = [b"kvgov::" + key.hex().encode() for key in prefix.remote.keys(DOCUMENT)]  # type: ignore[union-attr]
    other = client.get(names[3])
    assert isinstance(other, bytes)
    client.set(names[4], other)  # well-formed, checksummed, but another block's
    prompt = DOCUMENT + question(1)
    served = serve(NET, prefix, prompt)
    assert served.reused == 4 * BLOCK and served.new_tokens == reference(NET, prompt)
    assert prefix.stats().remote.damaged_values == 1  # type: ignore[union-attr]


def test_server_killed_mid_run_then_restarted(redis_server: LocalRedis) -> None:
    published(redis_server.url)
    prefix = remote_prefix(NET, redis_server.url, retry_s=0.2, timeout_s=0.5)
    redis_server.stop()
    prompt = DOCUMENT + question(1)
    with pytest.warns(RuntimeWarning, match="unreachable"):
        served = serve(NET, prefix, prompt)  # the lookup fails, then the publish finds the store down
    assert served.reused == 0 and served.new_tokens == reference(NET, prompt)
    stats = prefix.stats().remote
    # At least the lookup's failure: the store is retried every 0.2 s, so a slow machine counts more attempts.
    assert stats is not None and stats.connection_failures >= 1 and stats.dropped_writes > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # one warning per outage, not one per request
        assert serve(NET, prefix, DOCUMENT + question(2)).reused == BLOCKS * BLOCK  # the local tree still serves
    redis_server.start()  # same port, empty: what it held is gone
    time.sleep(0.25)
    other = DOCUMENT[:64] + question(3, length=40)
    assert serve(NET, prefix, other).reused == 64  # local hit; the store is asked for the rest, and written
    assert prefix.remote.flush(10)  # type: ignore[union-attr]
    stats = prefix.stats().remote
    assert stats is not None and stats.blocks_written > 0 and stats.writer_alive
    fresh = remote_prefix(NET, redis_server.url)
    assert serve(NET, fresh, other + question(4)).reused == len(other) // BLOCK * BLOCK


def test_a_write_queued_when_the_server_dies_is_counted_not_lost_silently(redis_server: LocalRedis) -> None:
    prefix = remote_prefix(NET, redis_server.url, retry_s=0.2, timeout_s=0.5)
    assert prefix.remote is not None
    redis_server.stop()
    with pytest.warns(RuntimeWarning, match="unreachable"):
        prefix.remote.put(prefix.remote.keys(DOCUMENT)[:1], _snapshot_of_one_block(prefix))
        assert prefix.remote.flush(10)
    stats = prefix.stats().remote
    assert stats is not None and stats.write_errors == 1 and stats.dropped_writes == 1 and stats.writer_alive
    assert "ConnectionError" in stats.last_error


def _snapshot_of_one_block(prefix: PrefixCache) -> BlockSnapshot:
    (block,) = prefix.pool.allocate(1)
    ((_, snap),) = snapshot(prefix.pool, [block])
    prefix.pool.decref([block])
    return snap


def test_maxmemory_eviction_is_a_miss(redis_server: LocalRedis) -> None:
    client = redis.Redis.from_url(redis_server.url)
    base = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory-samples", 10)
    client.config_set("maxmemory", base + 60 * 6500)  # about 60 of this model's blocks (4 KiB + Redis's own)
    documents = [question(50 + i, length=120) for i in range(6)]  # 6 x 16 blocks: more than fits
    writer = remote_prefix(NET, redis_server.url)
    for document in documents:
        serve(NET, writer, document + question(0))
        assert writer.remote is not None and writer.remote.flush(10)
    assert int(client.info("stats")["evicted_keys"]) > 0
    reader = remote_prefix(NET, redis_server.url)
    reused = []
    for document in reversed(documents):  # the most recently written first (this reader's writes evict too)
        prompt = document + question(1)
        served = serve(NET, reader, prompt)
        assert served.new_tokens == reference(NET, prompt)
        reused.append(served.reused)
    # Redis's LRU clock ticks once a second, so which of these keys went is the server's choice; what holds is
    # that a chain is served up to its first evicted block and computed from there.
    assert sum(reused) < len(documents) * 15 * BLOCK
    assert all(r % BLOCK == 0 for r in reused)
    stats = reader.stats().remote
    assert stats is not None and stats.damaged_values == 0 and stats.connection_failures == 0


def test_a_full_writer_queue_drops_and_counts(redis_server: LocalRedis) -> None:
    prefix = remote_prefix(NET, redis_server.url, max_pending=2)
    serve(NET, prefix, DOCUMENT + question(0))  # 16 new blocks offered at once
    assert prefix.remote is not None and prefix.remote.flush(10)
    stats = prefix.stats().remote
    assert stats is not None and stats.blocks_written == 2 and stats.dropped_writes == 14
    reader = remote_prefix(NET, redis_server.url)
    prompt = DOCUMENT + question(1)
    served = serve(NET, reader, prompt)
    assert served.reused == 2 * BLOCK and served.new_tokens == reference(NET, prompt)


def test_the_writer_survives_a_failing_store_and_says_so() -> None:
    counters = RemoteCounters()
    calls: list[int] = []

    def store(keys: list[bytes], values: list[bytes]) -> int:
        calls.append(len(keys))
        if len(calls) == 1:
            raise ValueError("a bug in the store")
        return sum(map(len, values))

    writer = RemoteWriter(store, counters, max_pending=8)
    snap = BlockSnapshot(0, [torch.zeros(2, 4)])
    writer.offer([b"a", b"b"], snap)
    assert writer.flush(10)
    writer.offer([b"c", b"d"], snap)
    assert writer.flush(10) and writer.alive
    stats = counters.snapshot(writer.pending, writer.alive)
    assert stats.write_errors == 1 and stats.dropped_writes == 2 and stats.blocks_written == 2
    assert "ValueError: a bug in the store" in stats.last_error
    writer.close()
    assert not writer.alive


class RacingTier(RedisTier):
    """A tier whose first lookup lets `race` run between the read and the caller's insert (another thread)."""

    race: Callable[[], object] | None = None

    def fetch(self, keys: Sequence[bytes], held: Sequence[bytes] = ()) -> Fetched:
        found = super().fetch(keys, held)
        race, self.race = self.race, None
        if race is not None:
            race()
        return found


def test_a_request_racing_another_for_the_same_blocks_uses_the_cached_ones(redis_server: LocalRedis) -> None:
    published(redis_server.url)
    pool = BlockPool(PagedCache(NET).pool.geometry, block_size=BLOCK)  # type: ignore[union-attr]
    tier = RacingTier(redis_server.url, NET)
    prefix = PrefixCache(pool, remote=tier)
    prompt = DOCUMENT + question(1)
    inner: list[int] = []
    tier.race = lambda: inner.append(serve(NET, prefix, DOCUMENT + question(2)).reused)
    served = serve(NET, prefix, prompt)  # its loaded copies are duplicates of what the racing request cached
    assert inner == [BLOCKS * BLOCK] and served.reused == BLOCKS * BLOCK
    assert served.new_tokens == reference(NET, prompt)
    assert pool.num_used == len(prefix.tree)  # the loaded copies went back: only the tree's blocks are held
    assert tier.flush(10)


# A process that offers blocks to a slow store and exits without close(): the exit must write them first.
_EXITING_WITHOUT_CLOSE = """
import sys, time
import torch
from hf_kvgov.tiers.remote_stats import RemoteCounters
from hf_kvgov.tiers.remote_values import BlockSnapshot
from hf_kvgov.tiers.remote_writer import RemoteWriter

def store(keys, values):
    time.sleep(0.3)  # slower than the process's exit
    with open(sys.argv[1], "a") as out:
        out.write("".join(key.decode() + "\\n" for key in keys))
    return sum(map(len, values))

writer = RemoteWriter(store, RemoteCounters(), max_pending=8)
for batch in ("a", "b", "c"):
    writer.offer([f"{batch}1".encode(), f"{batch}2".encode()], BlockSnapshot(0, [torch.zeros(2, 4)]))
"""


def test_a_process_that_exits_without_close_still_writes_what_it_queued(tmp_path: Path) -> None:
    written = tmp_path / "written.txt"
    subprocess.run([sys.executable, "-c", _EXITING_WITHOUT_CLOSE, str(written)], check=True, timeout=60)
    assert sorted(written.read_text().split()) == ["a1", "a2", "b1", "b2", "c1", "c2"]
