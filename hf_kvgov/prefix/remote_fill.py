"""A remote tier under `PrefixCache`: a local miss is extended from the store, a publish writes what is new.

Reference counts of blocks loaded from the store follow the tree's rules (see `hf_kvgov.prefix.sharing`):
a loaded block is allocated with one reference, which becomes the tree's own when the tree adopts it; the
caller gets one more, and one tree lock, exactly as for a local hit. If another thread inserted the same
blocks meanwhile, the loaded copy is given back and the cached one is used.

The tier stores bytes, never decides: anything it cannot serve (a miss, a damaged value, no connection, no
room in the pool) leaves the hit where the local tree left it, and generate computes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from hf_kvgov.errors import PoolExhausted
from hf_kvgov.prefix.remote_tier import RemoteTier
from hf_kvgov.prefix.tree_ids import pool_id, tree_id
from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.remote_values import load, snapshot

if TYPE_CHECKING:
    from hf_kvgov.prefix.sharing import PrefixCache


def extend(
    prefix: PrefixCache, remote: RemoteTier, tokens: Sequence[int], namespace: str, hit: list[int], max_blocks: int
) -> list[int]:
    """`hit` (pool ids the caller holds and has locked) extended by the blocks the store has after it; blocks of
    `hit` the store lost are queued to be written again."""
    bs = prefix.block_size
    if len(hit) >= max_blocks:
        return hit
    keys = remote.keys(tokens[: max_blocks * bs], namespace)
    found = remote.fetch(keys[len(hit) :], held=keys[: len(hit)])
    if not found.held_intact:
        write_new(prefix.pool, remote, tokens[: len(hit) * bs], namespace, hit)
    blocks = found.blocks
    if not blocks:
        return hit
    try:
        fresh = load(prefix.pool, blocks)
    except PoolExhausted:
        return hit  # no room for the remote blocks: compute them
    offered = [tree_id(b) for b in hit + fresh]
    result = prefix.tree.insert(list(tokens[: len(offered) * bs]), offered, namespace, lock=True)
    prefix.tree.unlock([tree_id(b) for b in hit])  # the insert locked the local hit a second time
    prefix.pool.incref([pool_id(b) for b in result.adopted])  # the caller's; allocate's is the tree's
    for mine, cached in result.duplicates:  # another thread cached these blocks meanwhile: use its copies
        prefix.pool.decref([pool_id(mine)])
        prefix.pool.incref([pool_id(cached)])
    return [pool_id(b) for b in result.block_ids]


def write_new(
    pool: BlockPool, remote: RemoteTier, tokens: Sequence[int], namespace: str, new_blocks: Sequence[int]
) -> None:
    """Queue the blocks a publish added to the tree (pool ids: the last `len(new_blocks)` full blocks)."""
    if not new_blocks:
        return
    keys = remote.keys(tokens, namespace)[-len(new_blocks) :]
    for where, snap in snapshot(pool, list(new_blocks)):
        remote.put([keys[i] for i in where], snap)
