"""What the remote tier's tests share: the tiny model, its prompts, one request through a cache, a reference.

Every process that builds `model(seed)` gets the same weights, hence the same identity in the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from hf_kvgov import BlockPool, PagedCache
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.tiers.redis_tier import RedisTier
from tests.conftest import tiny_llama

BLOCK = 8
NEW = 8
SEED = 3
DOCUMENT = torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(7)).tolist()


def model(seed: int = SEED) -> Any:
    return tiny_llama(num_kv_heads=2, seed=seed)


def question(seed: int, length: int = 6) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(100 + seed)).tolist()


def remote_prefix(net: Any, url: str, namespace: str = "", **options: Any) -> PrefixCache:
    """A fresh pool and tree (a new process, as far as sharing goes) over the store at `url`."""
    geometry = PagedCache(net).pool.geometry  # type: ignore[union-attr]
    pool = BlockPool(geometry, block_size=BLOCK)
    return PrefixCache(pool, remote=RedisTier(url, net, namespace=namespace, **options))


@dataclass
class Served:
    new_tokens: list[int]
    reused: int  # prompt tokens the cache held before generate: not computed
    prompt: int

    @property
    def fed_share(self) -> float:
        return (self.prompt - self.reused) / self.prompt


def serve(net: Any, prefix: PrefixCache, prompt: list[int], cache_type: Any = PagedCache, **options: Any) -> Served:
    """match -> generate -> publish -> release, as a server's worker does for one request; then wait for the
    writer, so what a test does next (read, kill the server) sees every write done."""
    cache = cache_type(net, prefix=prefix, **options)
    inputs = cache.match(torch.tensor([prompt]))
    reused = cache.get_seq_length()
    out = net.generate(**inputs, cache=cache, max_new_tokens=NEW, do_sample=False)
    cache.publish(out)
    cache.release()
    prefix.check_invariants()
    if prefix.remote is not None:
        assert prefix.remote.flush(10)
    return Served(out[0, -NEW:].tolist(), reused, len(prompt))


def reference(net: Any, prompt: list[int]) -> list[int]:
    """The tokens generate gives without any sharing."""
    out = net.generate(torch.tensor([prompt]), cache=DynamicCache(), max_new_tokens=NEW, do_sample=False)
    return out[0, -NEW:].tolist()


def tiny_worker() -> tuple[Any, Any]:
    """(model, tokenizer) for a benchmark worker process: the tiny model and a one-token-per-character tokenizer."""
    from tests.hf.test_prefix_bench import CharTokenizer

    return model(), CharTokenizer()
