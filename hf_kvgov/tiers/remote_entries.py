"""Entries of a pool with layer groups in the remote tier: one value per block position, a block per group.

With layer groups (hybrid sliding-window models) the prefix tree caches one entry per block position holding
one pool block per group, a sliding group's possibly missing (`hf_kvgov.prefix.grouped_blocks`). Its value
(kind GROUPED of `remote_values`) stores them all under the position's key::

    payload = one byte per group: 0 raw, 1 sealed, 255 absent        (group order of `pool.groups`)
              then each present block's payload, in group order      (as a RAW or SEALED value's payload)

so a remote hit can tell, as the local tree does, which groups can serve it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_kvgov.storage.pool import BlockPool
from hf_kvgov.tiers.remote_values import ABSENT, GROUPED, BlockSnapshot, block_bytes, framed, host_bytes, load, snapshot

# Per group, (kind, payload) of its block, or None where the entry has none.
EntryBlocks = list[tuple[int, memoryview] | None]


@dataclass(frozen=True)
class EntrySnapshot:
    """Copies of entries' blocks taken at publish time: `slots[i][g]` is (kind, row of `snaps[kind]`) of entry
    i's group-g block, or None."""

    slots: list[list[tuple[int, int] | None]]
    snaps: dict[int, BlockSnapshot]

    def head(self, n: int) -> EntrySnapshot:
        return EntrySnapshot(self.slots[:n], self.snaps)

    def encode(self, keys: Sequence[bytes]) -> list[bytes]:
        host = {kind: [part.cpu().contiguous() for part in snap.parts] for kind, snap in self.snaps.items()}
        values = []
        for key, slots in zip(keys, self.slots, strict=True):
            kinds = bytes(ABSENT if slot is None else slot[0] for slot in slots)
            blocks = b"".join(host_bytes(host[slot[0]], slot[1]) for slot in slots if slot is not None)
            values.append(framed(key, GROUPED, kinds + blocks))
        return values


def snapshot_entries(pool: BlockPool, entries: Sequence[Sequence[int | None]]) -> EntrySnapshot:
    """Snapshots of entries given as their pool blocks per group (None: absent); see `EntrySnapshot`."""
    flat = [block for blocks in entries for block in blocks if block is not None]
    slots: list[list[tuple[int, int] | None]] = [[None] * len(blocks) for blocks in entries]
    snaps: dict[int, BlockSnapshot] = {}
    where = [(i, g) for i, blocks in enumerate(entries) for g, block in enumerate(blocks) if block is not None]
    for positions, snap in snapshot(pool, flat):
        snaps[snap.kind] = snap
        for row, position in enumerate(positions):
            i, g = where[position]
            slots[i][g] = (snap.kind, row)
    return EntrySnapshot(slots, snaps)


def split_entry(pool: BlockPool, payload: memoryview) -> EntryBlocks:
    """The per-group blocks of a verified GROUPED payload."""
    n = len(pool.groups)
    out: EntryBlocks = []
    offset = n
    for kind in bytes(payload[:n]):
        if kind == ABSENT:
            out.append(None)
            continue
        size = block_bytes(pool, kind)
        out.append((kind, payload[offset : offset + size]))
        offset += size
    return out


def load_entries(pool: BlockPool, entries: Sequence[EntryBlocks]) -> list[list[int | None]]:
    """Write entries' blocks into fresh pool blocks (one reference each); per entry, per group, the block or None.

    Raises `PoolExhausted` (nothing allocated then) when the pool has no room for them.
    """
    flat = [block for blocks in entries for block in blocks if block is not None]
    fresh = iter(load(pool, flat))
    return [[None if block is None else next(fresh) for block in blocks] for blocks in entries]
