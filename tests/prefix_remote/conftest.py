"""A real Redis server on loopback for the remote tier's tests: a free port, nothing saved, stopped after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hf_kvgov.tiers.local_redis import LocalRedis
from hf_kvgov.tiers.redis_tier import RedisTier


@pytest.fixture
def redis_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalRedis]:
    """A fresh, empty `redis-server` (`--save '' --appendonly no`) on 127.0.0.1; `stop()` / `start()` kill and
    restart it on the same port, as a crash and a restart would. Every tier the test opened is closed before the
    server stops, so no writer is left retrying a dead port into a later test."""
    opened: list[RedisTier] = []
    original = RedisTier.__init__

    def recording(self: RedisTier, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)

    monkeypatch.setattr(RedisTier, "__init__", recording)
    server = LocalRedis().start()
    try:
        yield server
    finally:
        if server.process is not None and server.process.poll() is None:  # a test may leave it killed
            for tier in opened:
                tier.close()
        server.stop()
