"""A shared prefix under an eviction cache: the tree's blocks kept as computed, the budget for the rest.

Blocks a request takes from a prefix tree (`match`) are attended in full at every step and never evicted: they are
shared, so their cost is paid once for every request that reads them, and they are not counted in the request's
bytes. The policy's budget governs the request's own tokens after the prefix. Eviction caches only read the tree; a
block cache on it publishes the document (`PagedCache(model, prefix=tree)`), since what a policy keeps is no
longer the prefix as computed; a tree of codes is read as they decode, each step. Rows are laid out as in
`hf_kvgov.engine.prefix_layout`, so positions are each row's own; the tree's blocks stay locked until `release()`
or `reset()`, and beams share them without new references. With layer groups (`match_groups`) a sliding layer
reads its group's blocks from the one holding the first token the next query sees, since earlier ones are in no
query's window; the window mask keeps later queries off prefix tokens that leave it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hf_kvgov.engine.prefix_layout import layouts, middle_padded, real_tokens
from hf_kvgov.engine.quant_config import QuantConfig
from hf_kvgov.engine.slots.recall import RecalledSlots
from hf_kvgov.prefix.grouped_blocks import Blocks
from hf_kvgov.prefix.sharing import PrefixCache
from hf_kvgov.storage.quantized_pool import QuantizedBlockPool


@dataclass(frozen=True)
class _Gather:
    """How one matched row's hit in one layer group is read: pool ids (0 where the hit lacks a block), which
    tokens it holds (bool ``[tokens]``), and whether it holds them all."""

    index: Tensor
    held: Tensor
    complete: bool


class SharedPrefix:
    """The blocks each matched row took from ``prefix``, read by every layer.

    ``hits[i][g]`` is row i's hit in layer group g, one pool id per block position (None: a sliding group's
    block before its window); a pool without groups has the one group of every layer. ``locks`` is what the
    tree gives back on `release`: the hit's blocks, or with layer groups its entries.
    """

    def __init__(self, prefix: PrefixCache, hits: list[list[Blocks]], locks: list[int]) -> None:
        self.prefix = prefix
        self.hits = hits
        self.locks = locks
        self.rows = list(range(len(hits)))  # batch row -> matched row (beam search reorders and repeats)
        self.longest = max((len(hit[0]) for hit in hits), default=0) * prefix.block_size
        # (matched row, layer group, device) -> its gather: built once, since every layer step reads it again.
        self._gathers: dict[tuple[int, int, torch.device], _Gather] = {}

    @property
    def tokens(self) -> list[int]:
        """Tokens each batch row reads from the tree."""
        return [len(self.hits[row][0]) * self.prefix.block_size for row in self.rows]

    @property
    def blocks(self) -> list[int]:
        """Pool blocks each batch row reads from the tree, over every layer group (a sliding group's window)."""
        return [sum(block is not None for blocks in self.hits[row] for block in blocks) for row in self.rows]

    def slots(self, layer: int) -> RecalledSlots:
        """The prefix as attention reads it: ``[batch, kv_heads, M, head_dim]``, masked past each row's hit
        (and, in a sliding layer, before its group's first block).

        Gathered from the tree's blocks at every step and dropped after it: a copy kept per request would
        undo the sharing.
        """
        pool = self.prefix.pool
        keys = pool.keys[layer]
        size, longest, group = pool.block_size, self.longest, pool.group_of(layer)
        rows_k, rows_v, valid = [], [], []
        for row in self.rows:
            gather = self._gather(row, group, keys.device)
            tokens = gather.index.shape[0] * size
            blocks_k, blocks_v = pool.gather_blocks(layer, gather.index)  # a sealed tree's codes decoded here
            k = blocks_k.reshape(tokens, *keys.shape[2:])  # [tokens, hk, d]
            v = blocks_v.reshape(tokens, *keys.shape[2:])
            if not gather.complete:
                # A block the hit lacks is read as zeros, not as whatever the pool's block 0 holds: masked slots
                # still multiply their values, and a stale non-finite value would poison the output.
                k, v = k.where(gather.held[:, None, None], 0), v.where(gather.held[:, None, None], 0)
            missing = longest - k.shape[0]
            rows_k.append(torch.cat((k, k.new_zeros(missing, *k.shape[1:]))))
            rows_v.append(torch.cat((v, v.new_zeros(missing, *v.shape[1:]))))
            valid.append(torch.cat((gather.held, gather.held.new_zeros(missing))))
        batch, heads = len(self.rows), keys.shape[2]
        positions = torch.arange(longest, device=keys.device).expand(batch, heads, longest)
        mask = torch.stack(valid)[:, None, :].expand(batch, heads, longest)
        return RecalledSlots(torch.stack(rows_k).transpose(1, 2), torch.stack(rows_v).transpose(1, 2), positions, mask)

    def _gather(self, row: int, group: int, device: torch.device) -> _Gather:
        key = (row, group, device)
        if key not in self._gathers:
            blocks = self.hits[row][group]
            present = torch.tensor([block is not None for block in blocks], dtype=torch.bool)
            index = torch.tensor([0 if block is None else block for block in blocks], dtype=torch.long)
            held = present.repeat_interleave(self.prefix.block_size)
            self._gathers[key] = _Gather(index.to(device), held.to(device), bool(present.all()))
        return self._gathers[key]

    def expand_to(self, batch: int, owner: str) -> None:
        """Follow generate's expansion of the matched rows (beams, several sequences per prompt), which it does
        before the first forward, while the cache holds no slot to expand yet."""
        if batch == len(self.rows):
            return
        if batch % len(self.rows):
            raise ValueError(
                f"{owner} matched {len(self.rows)} rows but got a batch of {batch}; match the inputs you generate from."
            )
        repeats = batch // len(self.rows)
        self.rows = [row for row in self.rows for _ in range(repeats)]

    def select_rows(self, rows: Tensor) -> None:
        self.rows = [self.rows[int(r)] for r in rows.tolist()]

    def _pool_blocks(self) -> list[int]:
        """Every pool block the matched rows hold a reference on (a sliding group's blocks before its window none)."""
        return [block for hit in self.hits for blocks in hit for block in blocks if block is not None]

    def copy(self) -> SharedPrefix:
        """The same matched blocks held once more (a pool reference each, and the tree's locks again), for a copy of
        the cache that matched them."""
        held = self._pool_blocks()
        if held:
            self.prefix.pool.incref(held)
        if self.locks:
            self.prefix.lock(self.locks)
        copied = SharedPrefix(self.prefix, [[list(blocks) for blocks in hit] for hit in self.hits], list(self.locks))
        copied.rows = list(self.rows)
        return copied

    def release(self) -> None:
        """Give the tree's blocks back: one pool reference per matched block, and the tree's locks."""
        held = self._pool_blocks()
        locks = self.locks
        self.hits, self.rows, self.locks, self._gathers = [], [], [], {}
        if held:
            self.prefix.pool.decref(held)
        if locks:
            self.prefix.unlock(locks)


def check_prefix(prefix: Any, owner: str) -> PrefixCache:
    """``prefix`` if an eviction cache can read it, else an error naming why."""
    if not isinstance(prefix, PrefixCache):
        raise TypeError(f"{owner}: prefix must be a PrefixCache (hf_kvgov.prefix_tree(model)); got {prefix!r}.")
    return prefix


def check_prefix_geometry(
    prefix: PrefixCache, windows: Sequence[int | None], heads: int, head_dim: int, owner: str
) -> None:
    """Refuse a tree whose blocks are not this model's K/V, or whose layer groups are not its windows."""
    geometry = prefix.pool.geometry
    layers = len(windows)
    if (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) != (layers, heads, head_dim):
        raise ValueError(
            f"{owner}: the prefix tree's pool holds {geometry.num_layers} layers x {geometry.num_kv_heads} KV heads "
            f"x {geometry.head_dim}, but the model has {layers} x {heads} x {head_dim}; build the tree with "
            "prefix_tree(model) for this model."
        )
    pool = prefix.pool
    tree_windows = [pool.groups[pool.group_of(layer)].window for layer in range(layers)]
    if prefix.grouped is not None and tree_windows != list(windows):
        raise ValueError(
            f"{owner}: the prefix tree's layer groups keep windows {tree_windows} per layer, but the model's "
            f"layers have {list(windows)}; build the tree with prefix_tree(model) for this model."
        )


def codes_namespace(prefix: PrefixCache, namespace: str) -> str:
    """Where a tree's blocks are published: a tree of codes keys them by how they were sealed (`QuantConfig.namespace`,
    as the block caches that publish them do), which its pool's formats tell."""
    pool = prefix.pool
    if not isinstance(pool, QuantizedBlockPool):
        return namespace
    return QuantConfig.of_formats(pool.sealed.formats).namespace(namespace)


def match_rows(
    prefix: PrefixCache, input_ids: Tensor, attention_mask: Tensor | None, namespace: str, pad_token_id: int
) -> tuple[SharedPrefix, dict[str, Tensor]]:
    """Each row's longest cached prefix (whole blocks, at least one token left to compute) and generate's
    inputs laid out around the hits (the inputs unchanged when no row hits)."""
    rows = real_tokens(input_ids, attention_mask)
    if prefix.grouped is None:
        found = [prefix.match(tokens, namespace, max_tokens=len(tokens) - 1) for tokens in rows]
        hits: list[list[Blocks]] = [[[*blocks]] for blocks in found]  # the one group of every layer
        shared = SharedPrefix(prefix, hits, [block for blocks in found for block in blocks])
    else:
        matched = [prefix.match_groups(tokens, namespace, max_tokens=len(tokens) - 1) for tokens in rows]
        locks = [entry for entries, _ in matched for entry in entries]
        shared = SharedPrefix(prefix, [tables for _, tables in matched], locks)
    if not shared.longest:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return shared, {"input_ids": input_ids, "attention_mask": mask}
    plan = layouts(rows, shared.tokens)
    ids, mask = middle_padded(plan, pad_token_id)
    return shared, {"input_ids": ids.to(input_ids.device), "attention_mask": mask.to(input_ids.device)}
