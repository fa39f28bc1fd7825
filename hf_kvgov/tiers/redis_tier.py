"""`RedisTier`: a prefix tier shared by every process (and machine) that reaches one Redis (or Valkey) server.

    prefix = PrefixCache(pool, remote=RedisTier("redis://127.0.0.1:6379/0", model, namespace="tenant-a"))

A block is visible only once fully written: one value (every layer, a checksum) per SET, a publish's blocks in one
MULTI/EXEC, in chain order. A read is one pipelined round trip: GET of every block the local tree lacks (the hit is
the leading run present and verified) and EXISTS of the local hit's, so a store that lost a prefix gets it back
from the next process that holds it. A damaged value is counted, deleted and recomputed. A lost connection is a
miss: one warning per outage, every failure counted, and no retry for `retry_s` seconds, so a dead server costs
one timeout, not one per request; nothing raises into generate. Keys (`remote_keys`) mix the model, the pool
layout and the tenant, so tiers of other models, dtypes, codecs or tenants never read each other's blocks.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.remote_keys import chain_keys, model_identity, tier_salt
from hf_kvgov.tiers.remote_stats import RemoteCounters, RemoteStats
from hf_kvgov.tiers.remote_values import verify
from hf_kvgov.tiers.remote_writer import RemoteWriter, Snapshot

DEFAULT_MAX_PENDING = 1024
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_RETRY_S = 2.0


@dataclass(frozen=True)
class Fetched:
    """What one lookup found: the leading blocks asked for, verified, as (kind, payload); and whether the store
    still holds every block of the caller's local hit (False: it lost some, the caller writes them again)."""

    blocks: list[tuple[int, memoryview]]
    held_intact: bool


class StoreUnavailable(RuntimeError):
    """The store is marked down after a connection failure (it is tried again after `retry_s`)."""


def _redis() -> Any:  # the redis module, imported when a tier is built (an optional dependency)
    try:
        import redis
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("RedisTier needs the redis client: pip install 'hf_kvgov[remote]' (or redis).") from error
    return redis


class RedisTier:
    """A remote prefix tier on Redis; give it to `PrefixCache(pool, remote=...)`.

    Args:
        url: a redis-py URL (`redis://host:port/db`, `rediss://` for TLS, `unix:///path`).
        model: the model whose K/V are shared (its identity is fingerprinted, see `model_identity`), or an
            identity string that every process serving that model passes alike.
        namespace: the tenant: tiers with different namespaces never share a block (vLLM's `cache_salt`).
        ttl_s: expire stored blocks after this many seconds (None: keep until the server evicts them).
        max_pending: the most blocks queued for the writer; more are dropped (publishing never waits).
        timeout_s: socket connect/read timeout of each command.
        retry_s: after a connection failure, how long lookups and writes skip the store.
    """

    def __init__(
        self,
        url: str,
        model: torch.nn.Module | str,
        namespace: str = "",
        ttl_s: int | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        retry_s: float = DEFAULT_RETRY_S,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be a positive number of seconds or None; got {ttl_s}.")
        redis = _redis()
        self.url = url
        self.model_id = model if isinstance(model, str) else model_identity(model)
        self.namespace = namespace
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0),
        )
        self._prefix = b"kvgov:" + namespace.encode() + b":"
        self._salt: bytes | None = None
        self._pool: BlockPool | None = None
        self._down_until = 0.0
        self._warned = False
        self._health = threading.Lock()
        self.counters = RemoteCounters()
        self.writer = RemoteWriter(self._store, self.counters, max_pending)

    def bind(self, pool: BlockPool) -> None:
        """Tie the tier to the pool whose blocks it stores (its layout is part of every key)."""
        if self._pool is not None and self._pool is not pool:
            raise ValueError("This RedisTier already serves another pool; build one RedisTier per PrefixCache.")
        self._pool = pool
        self._salt = tier_salt(self.model_id, pool, self.namespace)

    @property
    def pool(self) -> BlockPool:
        if self._pool is None:
            raise ValueError("The RedisTier is not bound to a pool yet: pass it to PrefixCache(pool, remote=...).")
        return self._pool

    def keys(self, tokens: Sequence[int], namespace: str = "") -> list[bytes]:
        """The chain key of every full block of `tokens` under the tree namespace `namespace`."""
        assert self._salt is not None, "bind() first"
        return chain_keys(self._salt, namespace, tokens, self.pool.block_size)

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    # ------------------------------------------------------------------ reads

    def fetch(self, keys: Sequence[bytes], held: Sequence[bytes] = ()) -> Fetched:
        """The leading blocks of `keys` the store holds, verified, as (kind, payload), and whether it still has
        every block of `held` (the keys of the caller's local hit); one round trip.

        Never raises for the store's sake: an unreachable store, a missing or a damaged value ends the hit.
        """
        if not keys:
            return Fetched([], True)
        if not self._available():
            self.counters.add(skipped_lookups=1)
            return Fetched([], True)
        self.counters.add(lookups=1)
        try:
            values, present = self._get_all(keys, held)
        except self._errors as error:
            self._failed(error)
            return Fetched([], True)
        blocks, damaged = self._leading(keys, values)
        if damaged is not None:
            self._drop_damaged(damaged)
        if blocks:
            self.counters.add(hits=1, blocks_read=len(blocks), bytes_read=sum(len(p) for _, p in blocks))
        return Fetched(blocks, present == len(held))

    def _get_all(self, keys: Sequence[bytes], held: Sequence[bytes]) -> tuple[list[bytes | None], int]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._name(key))
        if held:
            pipe.exists(*(self._name(key) for key in held))
        start = time.perf_counter()
        replies = pipe.execute()
        self.counters.round_trip(time.perf_counter() - start)
        self._recovered()
        return replies[: len(keys)], int(replies[-1]) if held else 0

    def _leading(
        self, keys: Sequence[bytes], values: Sequence[bytes | None]
    ) -> tuple[list[tuple[int, memoryview]], bytes | None]:
        """The leading verified blocks, and the key of the damaged value that ended them (None: a miss did)."""
        blocks: list[tuple[int, memoryview]] = []
        for key, value in zip(keys, values, strict=True):
            if value is None:
                return blocks, None
            block = verify(self.pool, key, value)
            if block is None:
                return blocks, key
            blocks.append(block)
        return blocks, None

    def _drop_damaged(self, key: bytes) -> None:
        self.counters.error(f"damaged value under {self._name(key).decode()}", damaged_values=1)
        try:
            self._client.delete(self._name(key))  # so that the next publish stores it again
        except self._errors as error:
            self._failed(error)

    # ------------------------------------------------------------------ writes

    def put(self, keys: Sequence[bytes], snap: Snapshot) -> None:
        """Queue blocks for the writer (never waits; what does not fit, or finds the store down, is dropped)."""
        if not self._available():
            self.counters.add(dropped_writes=len(keys))
            return
        self.writer.offer(keys, snap)

    def _store(self, keys: list[bytes], values: list[bytes]) -> int:
        """The writer's store: one MULTI/EXEC of SETs, in chain order."""
        if not self._available():
            raise StoreUnavailable("the store is marked down after a connection failure")
        pipe = self._client.pipeline(transaction=True)
        for key, value in zip(keys, values, strict=True):
            pipe.set(self._name(key), value, ex=self.ttl_s)
        try:
            pipe.execute()
        except self._errors as error:
            self._failed(error)
            raise
        self._recovered()
        return sum(len(v) for v in values)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written or dropped; False if `timeout` seconds passed first."""
        return self.writer.flush(timeout)

    # ------------------------------------------------------------------ health

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: BaseException) -> None:
        with self._health:
            self._down_until = time.monotonic() + self.retry_s
            first = not self._warned
            self._warned = True
        self.counters.error(f"connection: {type(error).__name__}: {error}", connection_failures=1)
        if first:
            warnings.warn(
                f"The remote prefix tier at {self.url} is unreachable ({type(error).__name__}: {error}); "
                f"prefixes are computed locally, and the store is tried again every {self.retry_s:g} s.",
                RuntimeWarning,
                stacklevel=3,
            )

    def _recovered(self) -> None:
        with self._health:
            self._warned = False  # the next outage warns again

    def stats(self) -> RemoteStats:
        return self.counters.snapshot(self.writer.pending, self.writer.alive)

    def close(self) -> None:
        """Write what is queued (a few seconds at most), stop the writer, close the connections."""
        self.writer.close()
        self._client.close()
