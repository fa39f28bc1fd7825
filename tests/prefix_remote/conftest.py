"""A real Redis server on loopback for the remote tier's tests: a free port, nothing saved, stopped after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hf_kvgov.tiers.local_redis import LocalRedis


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    """A fresh, empty `redis-server` (`--save '' --appendonly no`) on 127.0.0.1; `stop()` / `start()` kill and
    restart it on the same port, as a crash and a restart would."""
    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.stop()
