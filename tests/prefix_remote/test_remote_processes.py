"""Two processes share prefixes through one Redis: B's request on A's document computes only its question."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hf_kvgov.tiers.local_redis import LocalRedis
from tests.prefix_remote.serving import DOCUMENT, model, question, reference, remote_prefix, serve

ROOT = Path(__file__).resolve().parents[2]
NET = model()


def publish_in_another_process(url: str, namespace: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.prefix_remote.publisher", url, namespace],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_process_b_computes_only_its_question_on_process_a_document(redis_server: LocalRedis) -> None:
    a = publish_in_another_process(redis_server.url, "tenant")
    assert a["reused"] == 0 and a["remote"]["blocks_written"] == (len(DOCUMENT) + 6 + 7) // 8
    assert a["remote"]["dropped_writes"] == a["remote"]["write_errors"] == 0
    assert a["tokens"] == reference(NET, DOCUMENT + question(0))

    prefix = remote_prefix(NET, redis_server.url, "tenant")
    prompt = DOCUMENT + question(1)
    served = serve(NET, prefix, prompt)
    assert served.fed_share <= 0.15
    assert served.reused == len(DOCUMENT) // 8 * 8
    assert served.new_tokens == reference(NET, prompt)
    stats = prefix.stats().remote
    assert stats is not None and stats.hits == 1 and stats.round_trips == 1
    assert stats.blocks_read == len(DOCUMENT) // 8 and stats.damaged_values == 0
    # The tokens the store served count as hits: their KV was not computed in this process.
    assert prefix.stats().hit_tokens == served.reused and prefix.stats().tree.hit_tokens == 0
    again = serve(NET, prefix, DOCUMENT + question(2))  # now a local hit: the store is not asked for it
    assert again.reused == served.reused and prefix.stats().remote.blocks_read == stats.blocks_read  # type: ignore[union-attr]
    lookups = len(DOCUMENT + question(1)) + len(DOCUMENT + question(2))
    assert prefix.stats().hit_tokens == 2 * served.reused
    assert prefix.stats().hit_rate == 2 * served.reused / lookups
    prefix.close()
