"""Per-sequence block tables.

A `BlockTable` is the ordered list of block ids holding one sequence's tokens: token t lives in block
`block_ids[t // block_size]` at offset `t % block_size`. Tables only grow while generating; they shrink
only on `truncate` (rollback of speculative tokens) and `release`.

Invariant that makes sharing safe: a block referenced by more than one table (or by the prefix cache) is
never written. Before a write touches an existing block, `prepare_write` replaces a shared block by a
private copy (copy-on-write). Beam search and `num_return_sequences` fork tables, sharing every block.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_kvgov.storage.pool import BlockPool


class BlockTable:
    """Block ids of one sequence, in token order."""

    def __init__(self, pool: BlockPool, block_ids: Sequence[int] = ()) -> None:
        self.pool = pool
        self.block_ids: list[int] = list(block_ids)

    def __len__(self) -> int:
        return len(self.block_ids)

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (one more reference each)."""
        self.pool.incref(self.block_ids)
        return BlockTable(self.pool, self.block_ids)

    def prepare_write(self, start: int, end: int) -> bool:
        """Make token positions [start, end) writable: allocate missing blocks, copy shared ones.

        Returns True when the block ids changed (callers cache a tensor copy of the table).
        """
        bs = self.pool.block_size
        needed = -(-end // bs)
        first_touched = start // bs
        changed = False
        with self.pool._lock:
            for index in range(first_touched, min(needed, len(self.block_ids))):
                private = self.pool.copy_on_write(self.block_ids[index])
                if private != self.block_ids[index]:
                    self.block_ids[index] = private
                    changed = True
            if needed > len(self.block_ids):
                self.block_ids.extend(self.pool.allocate(needed - len(self.block_ids)))
                changed = True
        return changed

    def truncate(self, num_tokens: int) -> None:
        """Keep only the blocks that hold the first `num_tokens` tokens."""
        keep = -(-num_tokens // self.pool.block_size)
        dropped = self.block_ids[keep:]
        del self.block_ids[keep:]
        self.pool.decref(dropped)

    def release(self) -> None:
        self.pool.decref(self.block_ids)
        self.block_ids = []


class BlockTables:
    """The block tables of a batch whose rows all hold the same number of tokens.

    Rows stay aligned because left padding is stored like any other token (the attention mask hides
    it), exactly as transformers' DynamicCache does; this keeps slot arithmetic one tensor expression.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.rows: list[BlockTable] = []
        self.num_tokens = 0
        self._tensor: torch.Tensor | None = None
        self._slots_key: tuple[int, int] | None = None
        self._slots: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def _changed(self) -> None:
        self._tensor = None
        self._slots_key = None

    def tensor(self) -> torch.Tensor:
        """Block ids as long `[batch, max_blocks]` on the pool's device (cached until tables change)."""
        if self._tensor is None:
            width = max((len(row) for row in self.rows), default=0)
            ids = [row.block_ids + [0] * (width - len(row)) for row in self.rows]
            self._tensor = torch.tensor(ids, dtype=torch.long, device=self.pool.geometry.device)
        return self._tensor

    def slots_for(self, batch: int, start: int, count: int) -> torch.Tensor:
        """Slots for token positions [start, start + count) of every row, allocating as needed.

        Returns:
            long `[batch * count]`, row-major (row 0's tokens first), ready for `BlockPool.write`.
        """
        if not self.rows:
            self.rows = [BlockTable(self.pool) for _ in range(batch)]
            self._changed()
        if batch != len(self.rows):
            raise ValueError(
                f"The cache holds {len(self.rows)} sequences but received a batch of {batch}; "
                "use one cache per batch, or reset() it first."
            )
        end = start + count
        if self._slots_key == (start, count) and self._slots is not None:
            return self._slots
        if any([row.prepare_write(start, end) for row in self.rows]):
            self._changed()
        self.num_tokens = max(self.num_tokens, end)
        bs = self.pool.block_size
        positions = torch.arange(start, end, device=self.pool.geometry.device)
        table = self.tensor()
        slots = table[:, positions // bs] * bs + positions % bs
        self._slots_key, self._slots = (start, count), slots.reshape(-1)
        return self._slots

    def reorder(self, indices: Sequence[int]) -> None:
        """Rows become `rows[i] for i in indices` (beam search, repeat, select), sharing blocks."""
        new_rows = [self.rows[i].fork() for i in indices]
        self.release_rows()
        self.rows = new_rows
        self._changed()

    def truncate(self, num_tokens: int) -> None:
        for row in self.rows:
            row.truncate(num_tokens)
        self.num_tokens = min(self.num_tokens, num_tokens)
        self._changed()

    def release_rows(self) -> None:
        for row in self.rows:
            row.release()
        self.rows = []

    def release(self) -> None:
        self.release_rows()
        self.num_tokens = 0
        self._changed()

    def blocks_held(self) -> int:
        """Distinct blocks referenced by this batch (shared blocks count once)."""
        return len({block for row in self.rows for block in row.block_ids})
