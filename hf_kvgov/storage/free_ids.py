"""The order in which a pool hands out its free block ids.

FIFO (a freed id is reused last) unless the pool has a byte cap. Under a byte cap the bytes of free blocks come back
only from the end of the tensors (ids are stable), where a charge beside the blocks or a quantized pool's sealed store
takes them: handing out the lowest free id first keeps the live blocks low and the free ones at the end.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable
from typing import Protocol


class FreeIds(Protocol):
    """A pool's free ids: ``take`` hands one out, ``put`` takes one back."""

    def __len__(self) -> int: ...
    def take(self) -> int: ...
    def put(self, block_id: int) -> None: ...
    def extend(self, ids: Iterable[int]) -> None: ...
    def keep_below(self, end: int) -> None:
        """Drop the ids from ``end`` on (the tensors shrank to ``end`` blocks)."""

    def in_order(self) -> tuple[int, ...]:
        """The ids in the order they will be handed out."""


class FifoIds:
    """Free ids in the order they were freed: the oldest is handed out first."""

    def __init__(self) -> None:
        self._ids: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._ids)

    def take(self) -> int:
        return self._ids.popleft()

    def put(self, block_id: int) -> None:
        self._ids.append(block_id)

    def extend(self, ids: Iterable[int]) -> None:
        self._ids.extend(ids)

    def keep_below(self, end: int) -> None:
        self._ids = deque(block_id for block_id in self._ids if block_id < end)

    def in_order(self) -> tuple[int, ...]:
        return tuple(self._ids)


class LowestIds:
    """Free ids handed out lowest first (a heap)."""

    def __init__(self) -> None:
        self._heap: list[int] = []

    def __len__(self) -> int:
        return len(self._heap)

    def take(self) -> int:
        return heapq.heappop(self._heap)

    def put(self, block_id: int) -> None:
        heapq.heappush(self._heap, block_id)

    def extend(self, ids: Iterable[int]) -> None:
        self._heap.extend(ids)
        heapq.heapify(self._heap)

    def keep_below(self, end: int) -> None:
        self._heap = [block_id for block_id in self._heap if block_id < end]
        heapq.heapify(self._heap)

    def in_order(self) -> tuple[int, ...]:
        return tuple(sorted(self._heap))
