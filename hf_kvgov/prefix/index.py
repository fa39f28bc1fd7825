"""The unsynchronised core of the prefix tree: node structure, lock bookkeeping and leaf eviction.

:class:`~hf_kvgov.prefix.radix_tree.RadixTree` validates arguments, holds the lock and counts lookups; this class,
assuming valid arguments, only keeps the structure and its counters exact. ``locked_blocks`` (blocks of locked
nodes) and ``evictable_blocks`` (blocks of unpinned nodes, with no lock on or below them: exactly what evicting
leaves over and over would free) are kept incrementally, so size queries are O(1). A node's pinned status changes
only when its own lock count crosses zero or its first/last pinned child appears/goes, so updates walk up only
while the status keeps flipping.
"""

from __future__ import annotations

from collections.abc import Mapping

from hf_kvgov.prefix.eviction_queue import EvictionQueue
from hf_kvgov.prefix.invariants import TreeAudit, audit_tree
from hf_kvgov.prefix.node import BlockKey, RadixNode
from hf_kvgov.prefix.priority import EvictionPriority


class RadixIndex:
    """Nodes, the block-id index and the eviction queue of one prefix tree (not thread-safe)."""

    def __init__(self, block_size: int, policy: EvictionPriority) -> None:
        self.block_size = block_size
        self.queue = EvictionQueue(policy)
        self.roots: dict[str, RadixNode] = {}
        self.owner: dict[int, RadixNode] = {}  # block id -> node holding it
        self.position: dict[int, int] = {}  # block id -> index of its block in the prompt (never changes)
        self.clock = 0
        self.num_nodes = 0
        self.locked_blocks = 0
        self.evictable_blocks = 0

    def keys(self, tokens: list[int], num_blocks: int) -> list[BlockKey]:
        """The key (tuple of token ids) of each of the first ``num_blocks`` full blocks of ``tokens``."""
        size = self.block_size
        return [tuple(tokens[i * size : (i + 1) * size]) for i in range(num_blocks)]

    def descend(self, namespace: str, keys: list[BlockKey]) -> tuple[list[RadixNode], int]:
        """Nodes along the longest cached prefix of ``keys``, and how many blocks of the last one matched."""
        node = self.roots.get(namespace)
        path: list[RadixNode] = []
        depth = used = 0
        while node is not None and depth < len(keys):
            child = node.children.get(keys[depth])
            if child is None:
                break
            used = child.common_prefix(keys, depth)
            path.append(child)
            depth += used
            node = child if used == child.num_blocks else None
        return path, used

    @staticmethod
    def path_ids(path: list[RadixNode], used: int) -> list[int]:
        """Block ids of a :meth:`descend` result, only the matched ones of its last node."""
        ids = [block_id for node in path[:-1] for block_id in node.block_ids]
        if path:
            ids.extend(path[-1].block_ids[:used])
        return ids

    def claim(self, path: list[RadixNode], used: int) -> list[RadixNode]:
        """Split the last node of a :meth:`descend` result so that the path covers whole nodes only."""
        if path and used < path[-1].num_blocks:
            path[-1] = self._split(path[-1], used)
        return path

    def touch(self, path: list[RadixNode]) -> None:
        """Mark the nodes of ``path`` as used now (one logical tick per operation)."""
        self.clock += 1
        for node in path:
            node.last_access = self.clock
            node.access_count += 1
            self.queue.mark(node)

    def attach(self, namespace: str, parent: RadixNode | None, keys: list[BlockKey], ids: list[int]) -> RadixNode:
        """Add a leaf holding ``keys``/``ids`` below ``parent`` (the namespace's root when ``None``)."""
        if parent is None:
            parent = self.roots.setdefault(namespace, RadixNode(namespace, None, 0, [], []))
        node = RadixNode(namespace, parent, parent.depth, keys, ids)
        parent.children[keys[0]] = node
        for offset, block_id in enumerate(ids):
            self.owner[block_id] = node
            self.position[block_id] = node.start + offset
        self.num_nodes += 1
        self.evictable_blocks += len(ids)
        self.queue.mark(parent)  # the parent stopped being a leaf
        self.queue.mark(node)
        return node

    def change_locks(self, deltas: Mapping[int, int]) -> None:
        """Add ``deltas[block_id]`` to each block's lock count, splitting runs the change covers in part."""
        by_node: dict[RadixNode, dict[int, int]] = {}
        for block_id, delta in deltas.items():
            node = self.owner[block_id]
            by_node.setdefault(node, {})[self.position[block_id] - node.start] = delta
        for node, at in by_node.items():
            self._change_run(node, [at.get(offset, 0) for offset in range(node.num_blocks)])

    def evict(self, wanted: int) -> list[int]:
        """Remove up to ``wanted`` blocks from evictable leaves in queue order; return their ids."""
        evicted: list[int] = []
        while len(evicted) < wanted:
            node = self.queue.pop()
            if node is None:
                break
            evicted.extend(self._evict_tail(node, min(wanted - len(evicted), node.num_blocks)))
        return evicted

    def audit(self) -> TreeAudit:
        """Re-derive the structure's counters and check its indexes (raises AssertionError on a mismatch)."""
        audit = audit_tree(self.roots, self.owner, self.position, self.queue, self.block_size)
        expected = TreeAudit(self.num_nodes, len(self.owner), self.locked_blocks, self.evictable_blocks)
        if audit != expected:
            raise AssertionError(f"kept counters {expected} disagree with the nodes {audit}")
        return audit

    # ------------------------------------------------------------------ internals

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        head = node.split(at)
        for block_id in head.block_ids:
            self.owner[block_id] = head
        self.num_nodes += 1
        self.queue.mark(head)
        self.queue.mark(node)
        return head

    def _change_run(self, node: RadixNode, deltas: list[int]) -> None:
        """Apply per-block ``deltas`` to one node, cutting it into runs of equal delta first."""
        start = 0
        for end in range(1, len(deltas) + 1):
            if end < len(deltas) and deltas[end] == deltas[start]:
                continue
            piece = node if end == len(deltas) else self._split(node, end - start)
            if deltas[start]:
                self._set_lock(piece, piece.lock_count + deltas[start])
            start = end

    def _set_lock(self, node: RadixNode, count: int) -> None:
        was_locked, was_pinned = node.lock_count > 0, node.pinned
        node.lock_count = count
        if was_locked != (count > 0):
            self.locked_blocks += node.num_blocks if count > 0 else -node.num_blocks
        if was_pinned != node.pinned:
            self._propagate_pin(node)
        self.queue.mark(node)

    def _propagate_pin(self, node: RadixNode) -> None:
        """Carry a flip of ``node.pinned`` into the evictable count and up through the ancestors."""
        while True:
            pinned = node.pinned
            self.evictable_blocks += -node.num_blocks if pinned else node.num_blocks
            parent = node.parent
            if parent is None or parent.is_root:
                return
            parent_was = parent.pinned
            parent.pinned_children += 1 if pinned else -1
            if parent.pinned == parent_was:
                return
            node = parent

    def _evict_tail(self, node: RadixNode, take: int) -> list[int]:
        """Remove the last ``take`` blocks of an evictable leaf (deepest first); detach it when emptied."""
        gone = node.block_ids[-take:][::-1]
        for block_id in gone:
            del self.owner[block_id]
            del self.position[block_id]
        self.evictable_blocks -= take
        if take < node.num_blocks:
            del node.keys[-take:]
            del node.block_ids[-take:]
            self.queue.mark(node)
            return gone
        parent = node.parent
        assert parent is not None, "the eviction queue only holds attached nodes"
        del parent.children[node.keys[0]]
        node.parent = None
        self.num_nodes -= 1
        self.queue.mark(node)
        if parent.is_root and not parent.children:
            del self.roots[parent.namespace]  # many one-off salts must not leave empty roots behind
        else:
            self.queue.mark(parent)
        return gone
