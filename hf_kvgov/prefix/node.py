"""Nodes of the prefix tree: a compressed run of full blocks, plus the metadata eviction needs.

A node holds ints only (token-id tuples as keys, block ids), never tensors. One node may hold a run of
several consecutive blocks (a compressed edge, as in SGLang's radix cache); the run is split wherever an
operation would treat its blocks differently, so every block of a node shares one lock count, one
recency and one access count::

    root("tenant-a")
     └── [k0 k1 k2]  ids [7 3 9]        three blocks, one node
          ├── [k3]      ids [4]
          └── [k3' k4'] ids [12 5]     a prompt that diverged after block 2 split [k0..k4']
"""

from __future__ import annotations

BlockKey = tuple[int, ...]


class RadixNode:
    """One node of a :class:`~hf_kvgov.prefix.radix_tree.RadixTree`; a root when ``keys`` is empty.

    Attributes:
        namespace: the namespace (cache salt) of the tree the node belongs to.
        parent: the parent node; ``None`` for a root and for a node that was evicted.
        start: position, in blocks from the root, of the node's first block.
        keys: the token ids of each block, ``keys[i]`` a tuple of ``block_size`` ints.
        block_ids: the KV block id of each block, parallel to ``keys``.
        children: child nodes, by the key of their first block.
        lock_count: in-use references shared by all blocks of the node.
        pinned_children: how many children are pinned (locked, or with a locked descendant).
        last_access: logical time of the latest match/insert that touched the node.
        access_count: how many matches/inserts touched the node.
    """

    __slots__ = (
        "access_count",
        "block_ids",
        "children",
        "keys",
        "last_access",
        "lock_count",
        "namespace",
        "parent",
        "pinned_children",
        "start",
    )

    def __init__(
        self,
        namespace: str,
        parent: RadixNode | None,
        start: int,
        keys: list[BlockKey],
        block_ids: list[int],
    ) -> None:
        self.namespace = namespace
        self.parent = parent
        self.start = start
        self.keys = keys
        self.block_ids = block_ids
        self.children: dict[BlockKey, RadixNode] = {}
        self.lock_count = 0
        self.pinned_children = 0
        self.last_access = 0
        self.access_count = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def depth(self) -> int:
        return self.start + len(self.block_ids)

    @property
    def is_root(self) -> bool:
        return not self.keys and self.parent is None

    @property
    def pinned(self) -> bool:
        """True when eviction can never reach this node: it or a descendant is locked."""
        return self.lock_count > 0 or self.pinned_children > 0

    @property
    def is_evictable_leaf(self) -> bool:
        """True when the node's last block may be evicted now: attached, childless and unlocked."""
        return self.parent is not None and not self.children and self.lock_count == 0

    def common_prefix(self, keys: list[BlockKey], offset: int) -> int:
        """Number of leading blocks of this node equal to ``keys[offset:]``."""
        limit = min(len(self.keys), len(keys) - offset)
        matched = 0
        while matched < limit and self.keys[matched] == keys[offset + matched]:
            matched += 1
        return matched

    def split(self, at: int) -> RadixNode:
        """Cut the run after ``at`` blocks; return the new head node, this node becomes its only child.

        The head inherits lock count and recency, so the split changes no block's state and neither
        node's pinned status. The caller re-points its block-id index at the head's blocks.
        """
        parent = self.parent
        if parent is None or not 0 < at < len(self.keys):
            raise AssertionError(f"cannot split a {len(self.keys)}-block node after {at} blocks")
        head = RadixNode(self.namespace, parent, self.start, self.keys[:at], self.block_ids[:at])
        head.lock_count = self.lock_count
        head.last_access = self.last_access
        head.access_count = self.access_count
        head.children = {self.keys[at]: self}
        head.pinned_children = int(self.pinned)
        parent.children[head.keys[0]] = head
        del self.keys[:at]
        del self.block_ids[:at]
        self.start += at
        self.parent = head
        return head

    def __repr__(self) -> str:
        return (
            f"RadixNode(namespace={self.namespace!r}, start={self.start}, block_ids={self.block_ids}, "
            f"lock_count={self.lock_count}, last_access={self.last_access}, children={len(self.children)})"
        )
