"""A lazy min-heap of evictable leaves, ordered by an eviction priority.

Instead of scanning the tree for leaves on every eviction (SGLang collects all leaves, O(n) per call),
the tree calls :meth:`EvictionQueue.mark` whenever it changes a node. Each push gets a sequence number,
and the queue remembers the number of each node's one current entry; an entry whose number is not the
current one is stale and is skipped when popped. So, with h heap entries:

- ``mark``: O(log h), called once per node an operation changes;
- ``pop``: O(log h) amortised (each stale entry is popped once, paid for by the push that made it);
- the heap is rebuilt from the current entries when stale ones outnumber them, keeping h = O(nodes).
"""

from __future__ import annotations

import heapq
import itertools

from hf_kvgov.prefix.node import RadixNode
from hf_kvgov.prefix.priority import EvictionPriority, Priority

# Below this many entries the heap is never rebuilt: rebuilding tiny heaps buys nothing.
_MIN_COMPACT_SIZE = 64

_Entry = tuple[Priority, int, RadixNode]


class EvictionQueue:
    """Evictable leaves by ascending ``policy.priority(node)``; ties go to the earlier-marked node."""

    def __init__(self, policy: EvictionPriority) -> None:
        self._policy = policy
        self._heap: list[_Entry] = []
        # Unique per entry, so ties in priority never fall through to comparing nodes.
        self._sequence = itertools.count()
        self._current: dict[RadixNode, int] = {}

    @property
    def policy(self) -> EvictionPriority:
        return self._policy

    def mark(self, node: RadixNode) -> None:
        """Record that ``node`` changed: its old entry goes stale; a new one is queued if it is evictable."""
        self._current.pop(node, None)
        if not node.is_evictable_leaf:
            return
        sequence = next(self._sequence)
        self._current[node] = sequence
        heapq.heappush(self._heap, (self._policy.priority(node), sequence, node))
        if len(self._heap) > max(_MIN_COMPACT_SIZE, 2 * len(self._current)):
            self._compact()

    def pop(self) -> RadixNode | None:
        """Remove and return the evictable leaf of smallest priority, or ``None`` when there is none."""
        while self._heap:
            _, sequence, node = heapq.heappop(self._heap)
            if self._current.get(node) == sequence:
                del self._current[node]
                return node
        return None

    def is_queued(self, node: RadixNode) -> bool:
        """True when ``node`` has an up-to-date entry (for invariant checks)."""
        return node in self._current

    def __len__(self) -> int:
        """Number of queued (up-to-date) entries, i.e. of evictable leaves."""
        return len(self._current)

    def _compact(self) -> None:
        self._heap = [entry for entry in self._heap if self._current.get(entry[2]) == entry[1]]
        heapq.heapify(self._heap)
