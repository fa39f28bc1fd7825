"""The chain benchmark's workload, probes and fills (`hf_kvgov.bench.chain`; the rows are `chain_rows.STEPS`).

Each step is one cache built by ``GovernedCache(model, **parts)``, and its probe is the sequence its bytes and
decode speed are read from. The prefix steps serve requests sharing one document (`SharedDocument`): request 0 is
stored and published, request 1 matches the document and the model runs on its own part only. Other probes get
one reference prefill's K/V through `update`, except the eviction cache, which must run the model (its attention
decides what it keeps). A step's capacity is counted by allocation (`allocation.py`); a step the rules refuse
raises `ChainRefused` from its probe.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from hf_kvgov.bench import allocation as alloc
from hf_kvgov.bench.capacity import fit_in_order
from hf_kvgov.bench.prefix_qa import questions
from hf_kvgov.chain.build import GovernedCache, prefix_tree
from hf_kvgov.engine.block_stats import live_entries
from hf_kvgov.engine.parts import Disk, HeavyHitter, Paging
from hf_kvgov.hf.eviction import eviction_attention
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.progress import nested_bar
from hf_kvgov.registry import kv_bytes
from hf_kvgov.tiers.recall_pages import DEFAULT_BUFFER

AttentionContext = Callable[[Any], contextlib.AbstractContextManager[Any]]
Parts = dict[str, Any]


@dataclass(frozen=True)
class ChainBenchConfig:
    """What `run_chain` measures. Sizes are in tokens; `budget_bytes` is the KV memory every step fills.

    ``ppl_tokens`` / ``passkey_samples`` of 0 leave that run out.
    """

    budget_bytes: int
    shared_tokens: int
    length: int = 2048
    decode_steps: int = 16
    block_size: int = 16
    h2o_budget: float = 0.2
    spill_hot_tokens: int = 512
    # The prefix + disk row's hot window: a request's own part is `length - shared_tokens` tokens (512 in the
    # RESULTS runs), so a 512-token window would keep all of it and spill nothing.
    spill_hot_tokens_shared: int = 128
    spill_buffer_bytes: int | None = None  # the disk cache's read-ahead cap (None: its default)
    recall_buffer: str = DEFAULT_BUFFER  # the recall step's `Recall.buffer`: "layer" or "shared"
    chunk: int = 512  # tokens a request writes per step when a shared pool is filled (a prefill chunk)
    ppl_tokens: int = 2048
    ppl_chunk: int = 16
    passkey_samples: int = 0
    passkey_length: int = 4096
    passkey_new_tokens: int | None = None  # caps the task's answer budget (None: RULER's)
    steps: tuple[str, ...] | None = None  # the steps to run, by name (None: all); `run_chain` checks the names

    def __post_init__(self) -> None:
        positive: tuple[str, ...] = (
            "budget_bytes",
            "length",
            "decode_steps",
            "block_size",
            "spill_hot_tokens",
            "spill_hot_tokens_shared",
            "chunk",
        )
        positive += ("ppl_chunk",) if self.passkey_new_tokens is None else ("ppl_chunk", "passkey_new_tokens")
        for name in (*positive, "shared_tokens", "ppl_tokens", "passkey_samples", "passkey_length"):
            value, lowest = getattr(self, name), 1 if name in positive else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"ChainBenchConfig.{name} must be an int >= {lowest}; got {value!r}.")
        if self.shared_tokens >= self.length:
            raise ValueError(
                f"shared_tokens is the document every request starts with, so it must be below length={self.length} "
                f"(a request has at least one token of its own); got {self.shared_tokens}."
            )
        HeavyHitter(self.h2o_budget)  # the chain's own check of a budget
        Disk(recall_buffer=self.recall_buffer)  # and of a recall buffer
        self._check_shared_spill()

    def _check_shared_spill(self) -> None:
        # The spill at a request's last step moves its own full blocks that end before its hot window.
        own_cold = (self.length - 1 - self.spill_hot_tokens_shared) // self.block_size
        if own_cold <= max(1, self.shared_tokens // self.block_size):
            raise ValueError(
                f"spill_hot_tokens_shared={self.spill_hot_tokens_shared} keeps every full block of a request's own "
                f"{self.length - self.shared_tokens} tokens resident, so the prefix + disk spill row would spill "
                f"nothing; give fewer hot tokens than length - shared_tokens - block_size = "
                f"{self.length - self.shared_tokens - self.block_size}."
            )


@dataclass(frozen=True)
class SharedDocument:
    """Requests of `length` tokens: one document, then a part of each request's own.

    Request i is the document, a marker token of its own (``markers[i]``), question i and text. The marker
    makes every request's first own token differ, so requests share exactly the document's whole blocks,
    as the planner assumes (a partly filled block is never shared).
    """

    document: tuple[int, ...]
    asks: tuple[tuple[int, ...], ...]  # the questions' token ids, taken in turn
    text: tuple[int, ...]  # what follows a question, cut to the request's length
    markers: tuple[int, ...]
    length: int

    def tokens(self, index: int) -> list[int]:
        if index >= len(self.markers):
            raise ValueError(
                f"Request {index} needs a marker token of its own, but the vocabulary has only {len(self.markers)} "
                "ordinary ids; give a smaller budget."
            )
        own = [self.markers[index], *self.asks[index % len(self.asks)], *self.text]
        return [*self.document, *own][: self.length]


def shared_document(tokenizer: Any, stream: list[int], shared: int, length: int) -> SharedDocument:
    """Requests cut from `stream`, token ids of a text (repeated as needed); its first `shared` are the document."""
    if not stream:
        raise ValueError("Cannot cut requests from an empty token stream; give the token ids of some text.")
    tiled = stream * -(-(shared + length) // len(stream))
    specials = set(getattr(tokenizer, "all_special_ids", None) or ())
    markers = tuple(i for i in range(len(tokenizer)) if i not in specials)
    asks = tuple(tuple(tokenizer(f"\n\n{q}\nAnswer:", add_special_tokens=False)["input_ids"]) for q in questions(10))
    return SharedDocument(tuple(tiled[:shared]), asks, tuple(tiled[shared : shared + length]), markers, length)


def forward(model: Any, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """Run `ids` (long `[1, n]`) through the model into `cache`; returns the greedy next token, long `[1, 1]`."""
    with torch.inference_mode():
        logits = model(ids, cache=cache, logits_to_keep=1).logits
    return logits[:, -1:].argmax(-1)


def _plain(model: Any) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass
class Probe:
    """One sequence of a step, held after its tokens and decoded in the timed rounds."""

    cache: Any
    next_token: torch.Tensor  # long [1, 1]
    attention: AttentionContext = _plain
    companions: tuple[Any, ...] = ()  # caches it shares blocks with (the request that published them)
    matched: frozenset[int] = frozenset()  # the blocks its `match` took from the tree (the shared document)
    shared_bytes: int = 0  # the tree's blocks it reads that its own stats leave out (an eviction cache's prefix)

    def step(self, model: Any) -> float:
        """One decode step; returns its seconds."""
        with self.attention(model):
            start = time.perf_counter()
            self.next_token = forward(model, self.cache, self.next_token)
            return time.perf_counter() - start

    def release(self) -> None:
        for cache in (self.cache, *self.companions):
            alloc.release(cache)


@dataclass
class Context:
    """What every step reads: the model, the settings, the workload and request 0's reference K/V."""

    model: Any
    config: ChainBenchConfig
    requests: SharedDocument
    kv: alloc.LayerKV
    spill_dir: str
    progress: bool = True

    def counter(self, what: str) -> Any:
        """A progress bar of sequences allocated (silent unless `progress`)."""
        return nested_bar(desc=f"  {what}", unit="seq", disable=not self.progress)

    def ids(self, index: int) -> torch.Tensor:
        """Long `[1, length]`: the tokens of request `index`."""
        return torch.tensor([self.requests.tokens(index)], device=next(self.model.parameters()).device)

    def build(self, **parts: Any) -> Any:
        return GovernedCache(self.model, **parts)

    def sharing(self, codec: str | None, attention: str = "contiguous", **parts: Any) -> Callable[[PrefixCache], Any]:
        """Caches drawing from a tree's pool, with `codec` and further `parts` (a disk tier)."""
        return lambda prefix: self.build(prefix=prefix, codec=codec, attention=attention, **parts)


# ------------------------------------------------------------------ probes: one sequence of each step


def written(parts: Callable[[Context], Parts]) -> Callable[[Context], Probe]:
    """A probe holding request 0's reference K/V of all tokens but the last, written through `update`."""

    def probe(ctx: Context) -> Probe:
        cache = ctx.build(**parts(ctx))
        alloc.write_tokens(cache, ctx.kv, 0, ctx.config.length - 1)
        return Probe(cache, ctx.ids(0)[:, -1:])

    return probe


def shared(codec: str | None, parts: Callable[[Context], Parts] = lambda ctx: {}) -> Callable[[Context], Probe]:
    """Request 1 of the shared document, once request 0 was stored and published on the same pool.

    Request 1's cache adds `parts` (a disk tier); request 0 is the plain sharing cache that publishes the document.
    """

    def probe(ctx: Context) -> Probe:
        prefix = prefix_tree(ctx.model, pool=Paging(ctx.config.block_size), codec=codec)
        first = ctx.sharing(codec, "paged")(prefix)  # stored through `update` only: no gather needed
        alloc.write_tokens(first, ctx.kv, 0, ctx.config.length)
        first.publish(ctx.ids(0))
        second, ids = ctx.sharing(codec, **parts(ctx))(prefix), ctx.ids(1)
        second.match(ids)
        # What the tree served; its own prompt's sliding blocks join the tree as computed (layer groups).
        matched = frozenset(live_entries(second))
        forward(ctx.model, second, ids[:, second.get_seq_length() : -1])  # the model runs on its own part only
        return Probe(second, ids[:, -1:], companions=(first,), matched=matched)

    return probe


def evicting(parts: Callable[[Context, int], Parts]) -> Callable[[Context], Probe]:
    """Request 1 of the shared document through an eviction chain (`parts(ctx, own_tokens)`) that reads the
    document from a full-precision tree, once a PagedCache stored and published request 0 there. Over layer
    groups the document's cost is the blocks it reads: every full-attention block, a sliding group's window."""

    def probe(ctx: Context) -> Probe:
        c = ctx.config
        prefix = prefix_tree(ctx.model, pool=Paging(c.block_size))
        first = ctx.sharing(None, "paged")(prefix)  # stored through `update` only: no gather needed
        alloc.write_tokens(first, ctx.kv, 0, c.length)
        first.publish(ctx.ids(0))
        ids = ctx.ids(1)
        # Its own prompt is what follows the document but the last token, fed to the model directly.
        cache = ctx.build(**parts(ctx, c.length - c.shared_tokens - 1), prefix=prefix)
        cache.match(ids)
        with eviction_attention(ctx.model):
            forward(ctx.model, cache, ids[:, cache.get_seq_length() : -1])
        document = cache.shared_prefix_blocks[0] * prefix.pool.bytes_per_block
        return Probe(cache, ids[:, -1:], eviction_attention, companions=(first,), shared_bytes=document)

    return probe


def h2o_parts(ctx: Context, own_tokens: int) -> Parts:
    """int8 slots kept by H2O in an eviction pool's blocks; its fraction is of the `own_tokens` fed to the
    model directly (a prompt under generate would say so itself)."""
    policy = HeavyHitter(ctx.config.h2o_budget, budget_of=own_tokens)
    return {"pool": Paging(ctx.config.block_size), "policy": policy, "codec": "int8"}


def recall_parts(ctx: Context, own_tokens: int) -> Parts:
    """H2O's parts, with what it evicts spilled to disk pages and recalled (the tier's default pages)."""
    return h2o_parts(ctx, own_tokens) | {"spill": Disk(path=ctx.spill_dir, recall_buffer=ctx.config.recall_buffer)}


def disk_parts(ctx: Context) -> Parts:
    """A disk tier keeping the last `spill_hot_tokens` resident."""
    c = ctx.config
    return {"spill": Disk(path=ctx.spill_dir, hot_tokens=c.spill_hot_tokens, read_buffer_bytes=c.spill_buffer_bytes)}


def shared_disk_parts(ctx: Context) -> Parts:
    """A disk tier under a prefix tree: the `spill_hot_tokens_shared` window, so a request's own blocks spill."""
    c = ctx.config
    hot = c.spill_hot_tokens_shared
    return {"spill": Disk(path=ctx.spill_dir, hot_tokens=hot, read_buffer_bytes=c.spill_buffer_bytes)}


# ------------------------------------------------------------------ capacity, by allocation

Capacity = Callable[[Context, Probe], alloc.Fit]


def pool_refused(ctx: Context, probe: Probe) -> alloc.Fit:
    pool = alloc.capped_pool(probe.cache.pool, ctx.config.budget_bytes)
    # The paged attention path holds the same blocks and is filled without gathering them (`write_tokens`).
    twin = lambda p: ctx.build(pool=p, attention="paged")  # noqa: E731
    with ctx.counter("sequences written") as bar:
        return alloc.fill_until_refused(twin, pool, ctx.kv, (ctx.config.length,), bar)


def shared_pool_refused(codec: str | None) -> Capacity:
    def capacity(ctx: Context, probe: Probe) -> alloc.Fit:
        prefix = PrefixCache(alloc.capped_pool(probe.cache.pool, ctx.config.budget_bytes))
        c = ctx.config
        try:
            twin = ctx.sharing(codec, "paged")  # the same blocks as the contiguous path, filled without gathers
            with ctx.counter("requests written") as bar:
                return alloc.fill_shared(
                    twin, prefix, ctx.kv, ctx.requests.tokens, c.chunk, bar, published=c.shared_tokens
                )
        finally:
            prefix.close()

    return capacity


def shared_eviction_bytes(ctx: Context, probe: Probe) -> alloc.Fit:
    """(budget - the document's tree blocks) // one request's own bytes (its stats leave the prefix out)."""
    own = kv_bytes(probe.cache)
    count = max(0, (ctx.config.budget_bytes - probe.shared_bytes) // own)
    return count, probe.shared_bytes + count * own, ctx.config.length


def measured_bytes(ctx: Context, probe: Probe) -> alloc.Fit:
    length = ctx.config.length
    return fit_in_order((length,), {length: kv_bytes(probe.cache)}, ctx.config.budget_bytes)
