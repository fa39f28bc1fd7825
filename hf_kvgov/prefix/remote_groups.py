"""The remote tier under a `PrefixCache` whose pool has layer groups: entries travel with each group's block.

A publish queues the entries new to the tree, each with its groups' blocks (a sliding block the cache had freed is
absent, `hf_kvgov.tiers.remote_entries`). A hit the store extends must be one the local tree would serve
(`GroupedBlocks.servable`), from local entries or the store, so the extension is cut back to the longest such
point. Reference counts are as without groups (`remote_fill`): a loaded block starts with one reference, the
tree's once its entry is adopted, and the caller's tables take one more. Loading, registering and inserting hold
the pool's lock (order pool -> tree, `hf_kvgov.prefix.sharing`), so the reclaimer never sees a half-registered
entry; the round trip does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.prefix.grouped_blocks import Blocks, GroupedBlocks
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.remote_entries import EntryBlocks, load_entries, snapshot_entries, split_entry

if TYPE_CHECKING:
    from hf_kvgov.prefix.remote_tier import RemoteTier
    from hf_kvgov.prefix.sharing import PrefixCache


def write_positions(
    pool: BlockPool,
    grouped: GroupedBlocks,
    remote: RemoteTier,
    tokens: Sequence[int],
    namespace: str,
    entries: Sequence[int],
    positions: Sequence[int],
) -> None:
    """Queue the entries at `positions` (of `entries`, one per full block of `tokens`) with their blocks: new
    entries, and entries that gained blocks (a prompt's full-attention blocks arrive at `publish`, after its
    sliding ones); under the pool's lock."""
    if positions:
        keys = remote.keys(tokens, namespace)
        blocks = [grouped.blocks(entries[i]) for i in positions]
        remote.put([keys[i] for i in positions], snapshot_entries(pool, blocks))


def extend(
    prefix: PrefixCache,
    remote: RemoteTier,
    tokens: Sequence[int],
    namespace: str,
    hit: tuple[list[int], list[Blocks]],
    max_blocks: int,
) -> tuple[list[int], list[Blocks]]:
    """`hit` (entries the caller locked, per group the blocks it holds) extended by what the store has after it."""
    entries, tables = hit
    grouped, pool, bs = prefix.grouped, prefix.pool, prefix.block_size
    assert grouped is not None
    if len(entries) >= max_blocks:
        return hit
    keys = remote.keys(tokens[: max_blocks * bs], namespace)
    found = remote.fetch(keys[len(entries) :], held=keys[: len(entries)])
    with pool.lock:  # see the module docstring
        if not found.held_intact:
            held = tokens[: len(entries) * bs]  # the local hit's entries, lost by the store: written again
            write_positions(pool, grouped, remote, held, namespace, entries, range(len(entries)))
        fetched = [split_entry(pool, payload) for _, payload in found.blocks]
        reach = _servable(grouped, entries, fetched)
        if reach <= len(entries):
            return hit
        try:
            loaded = load_entries(pool, fetched[: reach - len(entries)])
        except PoolExhausted:
            return hit  # no room for the remote blocks: compute them
        path = _insert(prefix, grouped, list(tokens[: reach * bs]), namespace, entries, loaded)
        usable = grouped.servable(path)  # a racing request's entries may lack sliding blocks we loaded
        prefix.tree.unlock(path[usable:])
        path = path[:usable]
        extended = prefix.hit_tables(grouped, path)
        pool.incref([b for table in extended for b in table if b is not None])
        pool.decref([b for table in tables for b in table if b is not None])
        grouped.touch(path)
    return path, extended


def _servable(grouped: GroupedBlocks, entries: list[int], fetched: list[EntryBlocks]) -> int:
    """The longest hit (in blocks) the local entries followed by the fetched ones can serve exactly."""
    local = len(entries)

    def present(i: int, g: int) -> bool:
        return grouped.blocks(entries[i])[g] is not None if i < local else fetched[i - local][g] is not None

    for reach in range(local + len(fetched), local, -1):
        start = reach * grouped.block_size
        if all(
            present(i, g)
            for g, group in enumerate(grouped.groups)
            for i in range(group.first_kept(start, grouped.block_size) // grouped.block_size, reach)
            if i >= local or group.window is not None
        ):
            return reach
    return local


def _insert(
    prefix: PrefixCache,
    grouped: GroupedBlocks,
    tokens: list[int],
    namespace: str,
    entries: list[int],
    loaded: list[list[int | None]],
) -> list[int]:
    """Cache the loaded positions after `entries` as new entries; returns the path, each entry locked once."""
    fresh = [grouped.new_entry() for _ in loaded]
    result = prefix.tree.insert(tokens, entries + fresh, namespace, lock=True)
    prefix.tree.unlock(entries)  # the insert locked the local hit a second time
    theirs = dict(result.duplicates)
    for entry, blocks in zip(fresh, loaded, strict=True):
        if entry in theirs:  # another thread cached this position first: fill what its entry lacks
            kept = [b for g, b in enumerate(blocks) if b is not None and grouped.fill(theirs[entry], g, b)]
        else:
            kept = grouped.add(entry, blocks)  # allocate's references become the tree's
        prefix.pool.decref([b for b in blocks if b is not None and b not in kept])
    return list(result.block_ids)
