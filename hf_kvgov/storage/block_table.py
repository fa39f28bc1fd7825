"""Per-sequence block tables.

A `BlockTable` lists the block ids of one sequence's tokens: token t lives in block `block_ids[t // block_size]` at
offset `t % block_size`. Tables grow while generating and shrink only on `truncate` (rollback of speculative
tokens), `drop` (an eviction policy's whole blocks) and `release`. Sharing is safe because a block referenced by more
than one table (or by the prefix cache) is never written: `prepare_write` first replaces it by a private copy
(copy-on-write), so beams and `num_return_sequences` fork tables sharing every block. A sliding group's `BlockTables`
(`hf_kvgov.storage.layer_groups`) free, before each step, every block no query of the step can see; rows keep
their length, and their first `freed` entries (`first_block`, the same for every row) are never read. Ids are the
same for every layer, so with layers on several devices the table is copied once per device when it changes.
`SequenceTables` is one sequence's table per layer group, as the serving engine keeps each request's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_kvgov.storage.layer_groups import LayerGroup, full_group
from hf_kvgov.storage.pool import BlockPool


class BlockTable:
    """Block ids of one sequence, in token order."""

    def __init__(self, pool: BlockPool, block_ids: Sequence[int] = ()) -> None:
        self.pool = pool
        self.block_ids: list[int] = list(block_ids)
        self.freed = 0  # leading entries whose blocks left a sliding window (stale ids, never read)

    def __len__(self) -> int:
        return len(self.block_ids)

    @property
    def live_ids(self) -> list[int]:
        """The ids this table holds a reference on (all but the freed leading entries)."""
        return self.block_ids[self.freed :]

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (one more reference each)."""
        self.pool.incref(self.live_ids)
        fork = BlockTable(self.pool, self.block_ids)
        fork.freed = self.freed
        return fork

    def free_before(self, index: int) -> None:
        """Give the blocks at indices below `index` back to the pool (they left a sliding window)."""
        index = min(index, len(self.block_ids))
        if index > self.freed:
            dropped = self.block_ids[self.freed : index]
            self.freed = index
            self.pool.decref(dropped)

    def prepare_write(self, start: int, end: int) -> bool:
        """Make token positions [start, end) writable: allocate missing blocks, copy shared ones.

        All-or-nothing: if the pool cannot supply the blocks, `PoolExhausted` is raised and the table is
        unchanged. Returns True when the block ids changed (callers cache a tensor copy of the table).
        """
        return prepare_writes([self], start, end)

    def write_plan(self, start: int, end: int, copied_away: dict[int, int]) -> tuple[list[int], int]:
        """(indices of shared blocks that [start, end) would write, number of blocks to append).

        `copied_away` counts references that earlier tables of the same batch will drop by copying a
        block; the last holder of a block then writes it in place instead of copying it too.
        """
        if end <= start:
            return [], 0
        bs = self.pool.block_size
        needed = -(-end // bs)
        shared = []
        for index in range(start // bs, min(needed, len(self.block_ids))):
            assert index >= self.freed, f"token {index * bs} is written after its block left the window"
            block = self.block_ids[index]
            if self.pool.ref_count(block) - copied_away.get(block, 0) > 1:
                shared.append(index)
                copied_away[block] = copied_away.get(block, 0) + 1
        return shared, max(0, needed - len(self.block_ids))

    def drop(self, columns: Sequence[int]) -> None:
        """Give back the blocks at `columns` and close the gaps: later tokens move up (eviction of whole blocks)."""
        assert self.freed == 0, "a sliding group's table drops its leading blocks with free_before"
        gone = set(columns)
        self.pool.decref([self.block_ids[c] for c in gone])
        self.block_ids = [block for c, block in enumerate(self.block_ids) if c not in gone]

    def truncate(self, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens."""
        keep = -(-num_tokens // self.pool.block_size)
        dropped = self.block_ids[max(keep, self.freed) :]
        del self.block_ids[keep:]
        self.freed = min(self.freed, keep)
        self.pool.decref(dropped)

    def release(self) -> None:
        self.pool.decref(self.live_ids)
        self.block_ids = []
        self.freed = 0


def prepare_writes(tables: Sequence[BlockTable], start: int | Sequence[int], end: int | Sequence[int]) -> bool:
    """`BlockTable.prepare_write` for several tables with one allocation: all succeed or none changes. `start` and
    `end` are one for every table, or one per table."""
    if not tables:
        return False
    pool = tables[0].pool
    starts = [start] * len(tables) if isinstance(start, int) else list(start)
    ends = [end] * len(tables) if isinstance(end, int) else list(end)
    with pool.lock:
        copied_away: dict[int, int] = {}
        plans = [table.write_plan(a, b, copied_away) for table, a, b in zip(tables, starts, ends, strict=True)]
        total = sum(len(shared) + appended for shared, appended in plans)
        if total == 0:
            return False
        fresh = iter(pool.allocate(total))  # raises PoolExhausted before anything changes
        for table, (shared, appended) in zip(tables, plans, strict=True):
            for index in shared:
                private = next(fresh)
                pool.copy_block(table.block_ids[index], private)
                pool.decref([table.block_ids[index]])
                table.block_ids[index] = private
            table.block_ids.extend(next(fresh) for _ in range(appended))
        return True


class SequenceTables:
    """One sequence's block tables, one per layer group of its pool: a full-attention group's holds every block
    it keeps, a sliding group's gives back the blocks its window left (`slide`; their leading entries stay, stale).
    A pool without groups gives one table. An eviction policy drops blocks of the full-attention tables only
    (`drop`), so there a token's index is its position less the tokens evicted before it; a sliding table's index
    is the position.

    Args:
        hit: per group, the blocks of a matched prefix (`PrefixCache.match_tables`; None before a sliding group's
            window); the sequence holds one reference on each.
    """

    def __init__(self, pool: BlockPool, hit: Sequence[Sequence[int | None]] = ()) -> None:
        self.pool = pool
        self.groups = pool.groups
        self.tables = [BlockTable(pool) for _ in self.groups]
        self.sealed = [0] * len(self.groups)  # per group, leading blocks past which nothing is sealed yet
        for table, blocks in zip(self.tables, hit, strict=False):
            first = next((i for i, block in enumerate(blocks) if block is not None), len(blocks))
            table.block_ids = [0] * first + [int(block) for block in blocks[first:]]  # type: ignore[arg-type]
            table.freed = first

    def __len__(self) -> int:
        """Block columns of the full-attention tables (of the first table when all slide)."""
        full = full_group(self.groups)
        return len(self.tables[0 if full is None else full])

    @property
    def block_ids(self) -> list[list[int]]:
        """Per group, its table's ids (a sliding group's freed leading entries are stale: never read them)."""
        return [table.block_ids for table in self.tables]

    def indices(self, position: int, evicted: int = 0) -> list[int]:
        """Per group, the table index of the token at `position` once `evicted` tokens before it were dropped."""
        return [position if group.window is not None else position - evicted for group in self.groups]

    def live_ids(self) -> list[int]:
        """Every block the sequence holds a reference on, group after group."""
        return [block for table in self.tables for block in table.live_ids]

    def shape(self) -> tuple[tuple[int, int, int], ...]:
        """Per group, (positions listed, leading positions freed, blocks sealed): with `live_ids`, what
        `from_live` rebuilds."""
        return tuple((len(t), t.freed, sealed) for t, sealed in zip(self.tables, self.sealed, strict=True))

    @classmethod
    def from_live(cls, pool: BlockPool, shape: Sequence[tuple[int, int, int]], live: Sequence[int]) -> SequenceTables:
        """Tables of `shape` over `live` (the order `live_ids` gives; their references pass to the tables)."""
        tables = cls(pool)
        blocks = iter(live)
        for g, (table, (length, freed, sealed)) in enumerate(zip(tables.tables, shape, strict=True)):
            table.block_ids = [0] * freed + [next(blocks) for _ in range(length - freed)]
            table.freed = freed
            tables.sealed[g] = sealed
        return tables

    def prepare_write(self, start: int, end: int, evicted: int = 0, sliding_end: int | None = None) -> bool:
        """Make positions [start, end) writable in every group (sliding groups only up to `sliding_end`: they
        allocate the rest as they go), all or nothing (`PoolExhausted`)."""
        stop = end if sliding_end is None else min(end, sliding_end)
        ends = [stop if g.window is not None else end - evicted for g in self.groups]
        return prepare_writes(self.tables, self.indices(start, evicted), ends)

    def slide(self, position: int) -> None:
        """Queries start at `position`: sliding groups give back the blocks no such query can see."""
        size = self.pool.block_size
        for table, group in zip(self.tables, self.groups, strict=True):
            if group.window is not None:
                table.free_before(group.first_kept(position, size) // size)

    def published(self, count: int) -> list[list[int | None]]:
        """Per group, its first `count` blocks, None where freed: what `PrefixCache.publish_tables` is offered."""
        return [[None if i < t.freed else t.block_ids[i] for i in range(count)] for t in self.tables]

    def adopt(self, blocks: Sequence[Sequence[int | None]]) -> None:
        """Take the tree's blocks for the leading positions (`publish_tables`' swap): None keeps the entry."""
        for table, ids in zip(self.tables, blocks, strict=True):
            for i, block in enumerate(ids):
                if block is not None:
                    table.block_ids[i] = block

    def drop(self, columns: Sequence[int]) -> None:
        """Give back the blocks at `columns` of the full-attention tables (an eviction policy's); later columns
        move up, the sealed ones with them."""
        for g, (table, group) in enumerate(zip(self.tables, self.groups, strict=True)):
            if group.window is None:
                table.drop(columns)
                self.sealed[g] -= sum(1 for column in columns if column < self.sealed[g])

    def release(self) -> None:
        for table in self.tables:
            table.release()


class BlockTables:
    """The block tables of a batch whose rows all hold the same number of tokens.

    Rows stay aligned because left padding is stored like any other token (the attention mask hides
    it), exactly as transformers' DynamicCache does; this keeps slot arithmetic one tensor expression.

    Args:
        group: the layers that read these tables; a sliding group frees what left its window (None: keep all).
    """

    def __init__(self, pool: BlockPool, group: LayerGroup | None = None) -> None:
        self.pool = pool
        self.group = group
        self.rows: list[BlockTable] = []
        self.num_tokens = 0
        self.first_block = 0  # blocks below it left the window in every row
        self._tensors: dict[torch.device, torch.Tensor] = {}  # the table, per device it was asked on
        self._slots_key: tuple[int, int, int] | None = None
        self._slots: torch.Tensor | None = None
        self._slot_copies: dict[torch.device, torch.Tensor] = {}  # `_slots` on other devices

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def invalidate_views(self) -> None:
        """Forget the cached table tensors and slots: the rows changed outside `slots_for` (a match, a seal)."""
        self._tensors.clear()
        self._slots_key = None

    def tensor(self, device: torch.device | None = None) -> torch.Tensor:
        """Block ids as long `[batch, max_blocks]` on `device` (default: the pool's), cached until tables change.

        Pass the device of the layer that reads the table (`pool.layer_device(layer)`): each device gets one
        copy per change of the tables, however many layers read it. Freed entries hold stale ids: readers
        start at `first_block` (see `live_tensor`).
        """
        device = self.pool.geometry.device if device is None else torch.device(device)
        table = self._tensors.get(device)
        if table is None:
            width = max((len(row) for row in self.rows), default=0)
            ids = [row.block_ids + [0] * (width - len(row)) for row in self.rows]
            table = self._tensors[device] = torch.tensor(ids, dtype=torch.long, device=device)
        return table

    def live_tensor(self, device: torch.device | None = None) -> tuple[torch.Tensor, int]:
        """(the table from `first_block` on, the position of its first token): what attention reads."""
        return self.tensor(device)[:, self.first_block :], self.first_block * self.pool.block_size

    def first_kept_token(self, position: int) -> int:
        """The first token a sliding group keeps while queries start at `position`: the start of the block
        holding the first token those queries can see (0 for full attention)."""
        return 0 if self.group is None else self.group.first_kept(position, self.pool.block_size)

    def _free_out_of_window(self, start: int) -> None:
        first = self.first_kept_token(start) // self.pool.block_size
        if first > self.first_block:
            for row in self.rows:
                row.free_before(first)
            self.first_block = first
            self.invalidate_views()

    def slots_for(self, batch: int, start: int, count: int) -> torch.Tensor:
        """Slots for token positions [start, start + count) of every row, allocating as needed.

        Returns:
            long `[batch * count]`, row-major (row 0's tokens first), ready for `BlockPool.write`.
        """
        if not self.rows:
            self.rows = [BlockTable(self.pool) for _ in range(batch)]
            self.invalidate_views()
        if batch != len(self.rows):
            raise ValueError(
                f"The cache holds {len(self.rows)} sequences but received a batch of {batch}; "
                "use one cache per batch, or reset() it first."
            )
        end = start + count
        # Every layer of one forward step asks for the same slots; the pool's version guards against a
        # block becoming shared (fork, prefix cache) between two of those calls.
        key = (start, count, self.pool.version)
        if self._slots_key == key and self._slots is not None:
            return self._slots
        self._free_out_of_window(start)
        if prepare_writes(self.rows, start, end):
            self.invalidate_views()
        self.num_tokens = max(self.num_tokens, end)
        bs = self.pool.block_size
        positions = torch.arange(start, end, device=self.pool.geometry.device)
        table = self.tensor()
        slots = table[:, positions // bs] * bs + positions % bs
        self._slots_key, self._slots = (start, count, self.pool.version), slots.reshape(-1)
        self._slot_copies.clear()
        return self._slots

    def slots_on(self, device: torch.device) -> torch.Tensor:
        """The slots of the latest `slots_for` call on `device` (one copy per device, shared by its layers)."""
        assert self._slots is not None, "slots_on follows a slots_for call"
        device = torch.device(device)
        if device == self._slots.device:
            return self._slots
        copy = self._slot_copies.get(device)
        if copy is None:
            copy = self._slot_copies[device] = self._slots.to(device)
        return copy

    def reorder(self, indices: Sequence[int]) -> None:
        """Rows become `rows[i] for i in indices` (beam search, repeat, select), sharing blocks."""
        indices = [int(i) for i in indices]
        if any(not 0 <= i < len(self.rows) for i in indices):
            raise ValueError(f"Row indices must be in [0, {len(self.rows)}); got {indices}.")
        new_rows = [self.rows[i].fork() for i in indices]
        self.release_rows()
        self.rows = new_rows
        self.invalidate_views()

    def fork(self) -> BlockTables:
        """New tables of the same rows, sharing every block (one more reference each, copied only when written)."""
        fork = BlockTables(self.pool, self.group)
        fork.rows = [row.fork() for row in self.rows]
        fork.num_tokens, fork.first_block = self.num_tokens, self.first_block
        return fork

    def check_truncate(self, num_tokens: int) -> None:
        """Raise a `ValueError` if `truncate(num_tokens)` would need tokens this sliding group already freed.

        A sliding group can go back only as far as the tokens it kept (e.g. the candidates of the last step, as
        assisted decoding does).
        """
        if num_tokens < self.num_tokens and self.first_kept_token(num_tokens) < self.first_block * self.pool.block_size:
            raise ValueError(
                f"Cannot crop to {num_tokens} tokens: this sliding-window layer group already freed the tokens "
                f"before {self.first_block * self.pool.block_size} that queries at position {num_tokens} would "
                "see again. Crop only tokens of the latest forward steps, or build the cache without freeing."
            )

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (see `check_truncate`)."""
        self.check_truncate(num_tokens)
        for row in self.rows:
            row.truncate(num_tokens)
        self.num_tokens = min(self.num_tokens, num_tokens)
        self.invalidate_views()

    def release_rows(self) -> None:
        for row in self.rows:
            row.release()
        self.rows = []

    def release(self) -> None:
        self.release_rows()
        self.num_tokens = 0
        self.first_block = 0
        self.invalidate_views()

    def blocks_held(self) -> int:
        """Distinct blocks referenced by this batch (shared blocks count once)."""
        return len({block for row in self.rows for block in row.live_ids})
