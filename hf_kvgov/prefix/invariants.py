"""An O(n) audit of a prefix tree's structure, for tests and debugging.

It re-derives from the nodes everything the tree keeps incrementally and raises ``AssertionError`` (also
under ``python -O``) on the first disagreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hf_kvgov.prefix.node import RadixNode

if TYPE_CHECKING:
    from hf_kvgov.prefix.eviction_queue import EvictionQueue


@dataclass(frozen=True)
class TreeAudit:
    """Counts re-derived from the nodes of a tree."""

    nodes: int
    cached_blocks: int
    locked_blocks: int
    evictable_blocks: int


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _check_root(namespace: str, root: RadixNode) -> None:
    _expect(root.is_root and root.namespace == namespace, f"bad root for namespace {namespace!r}: {root}")
    _expect(bool(root.children), f"the root of namespace {namespace!r} is empty but was kept")
    _expect(root.lock_count == 0 and root.pinned_children == 0, f"a root carries lock state: {root}")


def _check_node(
    node: RadixNode,
    key: tuple[int, ...],
    parent: RadixNode,
    owner: dict[int, RadixNode],
    position: dict[int, int],
    block_size: int,
) -> None:
    _expect(node.parent is parent and node.namespace == parent.namespace, f"{node} has a wrong parent")
    _expect(bool(node.keys) and node.keys[0] == key, f"{node} is filed under the wrong key")
    _expect(len(node.keys) == len(node.block_ids), f"{node} has keys and block ids of different lengths")
    _expect(all(len(k) == block_size for k in node.keys), f"{node} holds a key that is not one full block")
    _expect(node.start == parent.depth, f"{node} starts at {node.start}, its parent ends at {parent.depth}")
    _expect(node.lock_count >= 0, f"{node} has a negative lock count")
    pinned = sum(child.pinned for child in node.children.values())
    _expect(node.pinned_children == pinned, f"{node} counts {node.pinned_children} pinned children, not {pinned}")
    if not parent.is_root:
        # Every touch of a node also touched its ancestors, and splits copy these fields.
        _expect(parent.last_access >= node.last_access, f"{node} is more recent than its parent")
        _expect(parent.access_count >= node.access_count, f"{node} is accessed more than its parent")
    for offset, block_id in enumerate(node.block_ids):
        _expect(owner.get(block_id) is node, f"block {block_id} of {node} is indexed to another node")
        _expect(position.get(block_id) == node.start + offset, f"block {block_id} has a wrong position")


def audit_tree(
    roots: dict[str, RadixNode],
    owner: dict[int, RadixNode],
    position: dict[int, int],
    queue: EvictionQueue,
    block_size: int,
) -> TreeAudit:
    """Check every node, the block-id index and the eviction queue; return the re-derived counts."""
    nodes = cached = locked = evictable = leaves = 0
    for namespace, root in roots.items():
        _check_root(namespace, root)
        stack = [root]
        while stack:
            parent = stack.pop()
            for key, node in parent.children.items():
                _check_node(node, key, parent, owner, position, block_size)
                _expect(queue.is_queued(node) == node.is_evictable_leaf, f"{node} is wrongly (un)queued")
                nodes += 1
                cached += node.num_blocks
                locked += node.num_blocks if node.lock_count else 0
                evictable += 0 if node.pinned else node.num_blocks
                leaves += node.is_evictable_leaf
                stack.append(node)
    _expect(cached == len(owner) == len(position), f"{cached} blocks in nodes, {len(owner)} indexed")
    _expect(leaves == len(queue), f"{leaves} evictable leaves but {len(queue)} queued")
    return TreeAudit(nodes, cached, locked, evictable)
